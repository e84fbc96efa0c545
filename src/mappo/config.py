"""Typed, documented configuration: dataclasses, YAML presets and ``KEY=VALUE`` overrides.

A run is described by one :class:`TrainConfig`. Presets live in ``mappo/configs/<task>/*.yaml``
and are named by their path without the extension (``mpe/simple_spread``). A preset may start
from another with ``base: <preset name>``. Overrides use dotted keys (``algo.epochs=5``) or, when
unambiguous, the bare field name (``epochs=5``). Every key and value is checked before any work
starts: an unknown key names the nearest valid key, a wrong type or range names the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad configuration key, value or file; the message names the field and the fix."""


PRESET_DIR = Path(__file__).parent / "configs"


def _meta(
    doc: str = "",
    choices: tuple[str, ...] | None = None,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> dict[str, Any]:
    return {"doc": doc, "choices": choices, "low": low, "high": high, "low_open": low_open}


def _field(default: Any, doc: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=_meta(doc, **kw))
    return field(default=default, metadata=_meta(doc, **kw))


@dataclass
class EnvConfig:
    """Which environment to train on and how many copies run in parallel."""

    name: str = _field(
        "mpe/simple_spread",
        "Registered environment name (`mappo list`), or "
        "`pettingzoo:<module>` / `gymnasium:<package>:<id>`.",
    )
    num_envs: int = _field(128, "Parallel environments in a rollout.", low=1)
    kwargs: dict = _field(
        {},
        "Keyword arguments passed to the environment's constructor; `env.kwargs.NAME=VALUE` "
        "sets one and keeps the others, `env.kwargs={...}` replaces them all.",
    )


@dataclass
class ModelConfig:
    """Actor and critic networks (the MAPPO paper's MLP + GRU)."""

    hidden_sizes: list = _field([64, 64], "Hidden layer sizes of the MLP base.")
    critic_hidden_sizes: list | None = _field(
        None,
        "MAPPO's critics' hidden layer sizes where they differ from the actors' "
        "(None = model.hidden_sizes).",
    )
    recurrent_critic: bool = _field(
        True,
        "MAPPO's critics take model.recurrent's layer too (the paper's); False: feed-forward "
        "critics beside recurrent actors (EPyMARL's and CleanMARL's recurrent MAPPO and IPPO).",
    )
    activation: str = _field("relu", "Hidden activation.", choices=("relu", "tanh"))
    encoder: str = _field(
        "mlp",
        "What reads the inputs before the MLP: 'mlp' (nothing; inputs flattened, the paper's "
        "MLPBase) or 'cnn' (convolutions over every input that is an image, i.e. has three "
        "axes, as the paper's CNNBase; the others stay flat).",
        choices=("mlp", "cnn"),
    )
    cnn_channels: list = _field(
        [32], "model.encoder=cnn: output channels of each convolution (the paper: one of 32)."
    )
    cnn_kernels: list = _field([3], "model.encoder=cnn: kernel size of each convolution.")
    cnn_strides: list = _field([1], "model.encoder=cnn: stride of each convolution.")
    image_layout: str = _field(
        "auto",
        "model.encoder=cnn: the images' axes, 'hwc' ([height, width, channels], Gymnasium and "
        "PettingZoo) or 'chw'; 'auto' takes the end axis smaller than the other two as the "
        "channels.",
        choices=("auto", "hwc", "chw"),
    )
    image_scale: float = _field(
        1 / 255,
        "model.encoder=cnn: images are multiplied by this first (1/255 turns 8-bit pixels into "
        "[0, 1], as the paper's CNN does; 1 for images already scaled).",
        low=0.0,
        low_open=True,
    )
    feature_norm: bool = _field(
        True,
        "LayerNorm on the input features (with model.encoder=cnn: on the convolutions' output).",
    )
    layer_norm: bool = _field(True, "LayerNorm after each hidden layer and the recurrent layer.")
    recurrent: str = _field(
        "gru",
        "Recurrent layer after the MLP ('none' = feed-forward).",
        choices=("none", "gru", "lstm"),
    )
    share_params: bool = _field(True, "One set of parameters per group (True) or one per agent.")
    agent_id: bool = _field(False, "Append the agent's one-hot index to actor and critic inputs.")
    policy_gain: float = _field(0.01, "Orthogonal-init gain of the policy head.", low=0.0)
    action_bounds: str = _field(
        "clip",
        "Continuous actions: how a Gaussian sample meets the action box. 'clip' clips it on the "
        "way to the env (log-probabilities of the unclipped sample, as in the MAPPO paper's "
        "code); 'tanh' squashes it into the box, with the log-probability corrected for the "
        "squashing (needs finite bounds).",
        choices=("clip", "tanh"),
    )
    log_std_init: float = _field(
        0.0, "Continuous actions: initial log standard deviation of the Gaussian policy."
    )
    state_dependent_std: bool = _field(
        False,
        "Continuous actions: the policy network outputs the log standard deviation (True) "
        "instead of one learned parameter per action component (False).",
    )
    precision: str = _field(
        "fp32",
        "Arithmetic of the actor and critic networks: 'fp32', or 'bf16' (their matrix products "
        "in bfloat16 under torch.autocast; parameters, optimiser, outputs and losses stay "
        "float32). bf16 is faster where the hardware computes it natively (GPUs since Ampere, "
        "CPUs with AMX or AVX512-BF16) and many times slower elsewhere (a run there warns). "
        "MAPPO/IPPO only.",
        choices=("fp32", "bf16"),
    )


ALGO_NAMES = ("mappo", "iql", "vdn", "qmix", "coma", "maddpg", "facmac")
_NAME_DOC = (
    "Algorithm family: 'mappo' (MAPPO/IPPO and their recurrent forms, on-policy) or a value "
    "decomposition method on an episode replay buffer: 'iql' (independent Q-learning), 'vdn' "
    "(sum of agent Qs), 'qmix' (monotonic mixing network); 'coma' (counterfactual "
    "multi-agent policy gradients on whole episodes); or 'maddpg' (actors trained through a "
    "centralised Q critic of the joint action, by Gumbel-softmax samples of discrete actions "
    "or deterministically in a box, on an episode replay buffer); or 'facmac' (the same "
    "actors, trained together through a critic factored into per-agent utilities mixed by "
    "QMIX's network). Setting it first resets "
    "the other algo.* fields to that family's defaults."
)


@dataclass
class AlgoConfig:
    """The MAPPO update. MAPPO, IPPO and their recurrent forms are options of this one algorithm."""

    name: str = _field("mappo", _NAME_DOC, choices=ALGO_NAMES)
    critic_input: str = _field(
        "state",
        "Critic input: the global state (MAPPO), the "
        "agent-specific state, the agent's own observation (IPPO), or its group's observations "
        "side by side (concat_obs: the MAPPO paper's 'CL').",
        choices=("state", "agent_state", "local", "concat_obs"),
    )
    death_masked_critic: bool = _field(
        False, "Dead agents' critic input is zeros plus their identity (the paper's death masking)."
    )
    gamma: float = _field(0.99, "Discount factor.", low=0.0, high=1.0)
    gae_lambda: float = _field(0.95, "GAE / TD(lambda) lambda.", low=0.0, high=1.0)
    returns: str = _field("gae", "Advantage estimator.", choices=("gae", "td_lambda"))
    value_norm: str = _field(
        "valuenorm", "Value target normalisation.", choices=("valuenorm", "popart", "none")
    )
    bootstrap_truncation: bool = _field(
        False,
        "Bootstrap from the final observation when an "
        "episode is truncated by its time limit (the paper's "
        "code does not).",
    )
    normalize_advantages: bool = _field(
        True,
        "Normalise advantages over alive agents, per group (per agent where "
        "model.share_params=false), as the paper's code normalises each policy's buffer.",
    )
    clip: float = _field(0.2, "PPO ratio clip.", low=0.0, low_open=True)
    value_clip: float | None = _field(None, "Value-loss clip; None = same as `clip`.", low=0.0)
    entropy_coef: float = _field(0.01, "Entropy bonus coefficient.", low=0.0)
    value_loss: str = _field("huber", "Value loss.", choices=("huber", "mse"))
    huber_delta: float = _field(10.0, "Huber loss delta.", low=0.0, low_open=True)
    clip_value_loss: bool = _field(True, "Clipped value loss (max of clipped and unclipped).")
    value_coef: float = _field(1.0, "Value loss coefficient.", low=0.0)
    max_grad_norm: float | None = _field(
        10.0,
        "Gradient-norm clip per group's actor and critic; None = off. With "
        "model.share_params=false one norm covers the group's per-agent copies (the paper's "
        "separated policies clip each agent's alone).",
        low=0.0,
        low_open=True,
    )
    actor_lr: float = _field(7e-4, "Actor learning rate.", low=0.0, low_open=True)
    critic_lr: float = _field(7e-4, "Critic learning rate.", low=0.0, low_open=True)
    adam_eps: float = _field(1e-5, "Adam epsilon.", low=0.0, low_open=True)
    weight_decay: float = _field(0.0, "Adam weight decay.", low=0.0)
    lr_decay: bool = _field(False, "Linear learning-rate decay to zero over the run.")
    epochs: int = _field(10, "PPO epochs per update.", low=1)
    num_minibatches: int = _field(1, "Mini-batches per epoch.", low=1)
    data_chunk_length: int = _field(10, "Recurrent training chunk length (steps).", low=1)
    policy_active_masks: bool = _field(True, "Exclude dead agents from the policy loss.")
    value_active_masks: bool = _field(True, "Exclude dead agents from the value loss.")


@dataclass
class ValueConfig:
    """Value decomposition (PyMARL's family): IQL, VDN and QMIX on an episode replay buffer.

    Each iteration plays one episode in each of ``env.num_envs`` envs with epsilon-greedy actions,
    stores the episodes and takes ``updates_per_iteration`` gradient steps on ``batch_size``
    episodes sampled uniformly from the buffer (Rashid et al. 2018, "QMIX", and PyMARL).
    """

    name: str = _field("qmix", _NAME_DOC, choices=ALGO_NAMES)
    gamma: float = _field(0.99, "Discount factor.", low=0.0, high=1.0)
    targets: str = _field(
        "one_step",
        "Q targets: one-step (PyMARL), n-step, or TD(lambda) (pymarl2).",
        choices=("one_step", "n_step", "td_lambda"),
    )
    n_step: int = _field(3, "Steps of the n-step target (targets=n_step).", low=1)
    td_lambda: float = _field(0.6, "Lambda of the TD(lambda) target.", low=0.0, high=1.0)
    double_q: bool = _field(True, "Double Q: the online network picks the target's action.")
    lr: float = _field(5e-4, "Learning rate of agents and mixer.", low=0.0, low_open=True)
    optimizer: str = _field("rmsprop", "Optimiser.", choices=("rmsprop", "adam"))
    optim_alpha: float = _field(0.99, "RMSprop smoothing constant.", low=0.0, high=1.0)
    optim_eps: float = _field(1e-5, "RMSprop / Adam epsilon.", low=0.0, low_open=True)
    max_grad_norm: float | None = _field(
        10.0, "Gradient-norm clip; None = off.", low=0.0, low_open=True
    )
    batch_size: int = _field(32, "Episodes per gradient step.", low=1)
    buffer_size: int = _field(5000, "Replay buffer capacity in episodes.", low=1)
    buffer_in_checkpoints: bool = _field(
        True,
        "Save the replay buffer in periodic checkpoints (exact resume); false keeps checkpoints "
        "small and resumes with an empty buffer.",
    )
    updates_per_iteration: int = _field(1, "Gradient steps after each batch of episodes.", low=1)
    target_update_interval: int = _field(
        200, "Copy the online networks to the targets every this many episodes (hard).", low=1
    )
    target_tau: float | None = _field(
        None,
        "Soft target update rate per gradient step (target += tau * (online - target)); "
        "None = hard updates every target_update_interval episodes.",
        low=0.0,
        low_open=True,
        high=1.0,
    )
    epsilon_start: float = _field(1.0, "Exploration epsilon at the start.", low=0.0, high=1.0)
    epsilon_finish: float = _field(0.05, "Exploration epsilon after the anneal.", low=0.0, high=1.0)
    epsilon_anneal_steps: int = _field(
        50_000, "Env steps over which epsilon goes from start to finish.", low=1
    )
    epsilon_schedule: str = _field(
        "linear",
        "Epsilon schedule over env steps: linear, or exponential (reaches finish at the end "
        "of the anneal).",
        choices=("linear", "exponential"),
    )
    last_action: bool = _field(True, "Feed the agent's previous action (one-hot) to its network.")
    standardise_rewards: bool = _field(
        False, "Standardise rewards with running statistics before the targets (EPyMARL)."
    )
    bootstrap_truncation: bool = _field(
        True,
        "Bootstrap the target of a step that a time limit cut from the final observation. "
        "PyMARL on SMAC (continuing_episode: False) and EPyMARL on the particle world and LBF "
        "treat the limit as terminal, and their presets set false.",
    )
    mixing_embed_dim: int = _field(32, "QMIX mixing network width.", low=1)
    hypernet_layers: int = _field(2, "QMIX hypernetwork depth (1 or 2 layers).", low=1, high=2)
    hypernet_embed: int = _field(64, "QMIX hidden width of two-layer hypernetworks.", low=1)


@dataclass
class ComaConfig:
    """COMA (Foerster et al. 2018, "Counterfactual Multi-Agent Policy Gradients"), on-policy.

    Each iteration plays one episode in each of ``env.num_envs`` envs with the actors' policy
    (mixed with epsilon-uniform exploration over the allowed actions), trains the centralised
    critic on them step by step backwards in time against TD(lambda) targets of a target
    critic, then takes one actor step along the counterfactual advantage. As PyMARL's
    ``coma_learner`` with ``critic_train_mode: seq``.
    """

    name: str = _field("coma", _NAME_DOC, choices=ALGO_NAMES)
    gamma: float = _field(0.99, "Discount factor.", low=0.0, high=1.0)
    td_lambda: float = _field(0.8, "Lambda of the critic's TD(lambda) targets.", low=0.0, high=1.0)
    lr: float = _field(5e-4, "Actor learning rate.", low=0.0, low_open=True)
    critic_lr: float = _field(5e-4, "Critic learning rate.", low=0.0, low_open=True)
    optimizer: str = _field(
        "rmsprop", "Optimiser of actor and critic.", choices=("rmsprop", "adam")
    )
    optim_alpha: float = _field(0.99, "RMSprop smoothing constant.", low=0.0, high=1.0)
    optim_eps: float = _field(1e-5, "RMSprop / Adam epsilon.", low=0.0, low_open=True)
    max_grad_norm: float | None = _field(
        10.0, "Gradient-norm clip of each network; None = off.", low=0.0, low_open=True
    )
    target_update_interval: int = _field(
        200, "Copy the critic to its target every this many critic steps.", low=1
    )
    critic_hidden: int = _field(128, "Width of the critic's two hidden layers.", low=1)
    entropy_coef: float = _field(0.0, "Entropy bonus of the actor loss (PyMARL: none).", low=0.0)
    epsilon_start: float = _field(0.5, "Exploration mix at the start.", low=0.0, high=1.0)
    epsilon_finish: float = _field(0.01, "Exploration mix after the anneal.", low=0.0, high=1.0)
    epsilon_anneal_steps: int = _field(
        100_000, "Env steps over which epsilon goes from start to finish.", low=1
    )
    epsilon_schedule: str = _field(
        "linear", "Epsilon schedule over env steps.", choices=("linear", "exponential")
    )
    mask_before_softmax: bool = _field(
        False,
        "Exploration mix: false (PyMARL's COMA) mixes the softmax over all actions with "
        "epsilon / A each and renormalises over the allowed ones; true takes the softmax and "
        "the uniform share over the allowed actions only.",
    )
    last_action: bool = _field(True, "Feed the agent's previous action (one-hot) to its network.")
    bootstrap_truncation: bool = _field(
        False,
        "Bootstrap the critic's target of a step that a time limit cut from the final "
        "observation; false treats the limit as terminal, as PyMARL's COMA does on SMAC "
        "(continuing_episode: False) and EPyMARL's on the particle world and LBF.",
    )


@dataclass
class MaddpgConfig:
    """MADDPG (Lowe et al. 2017, "Multi-Agent Actor-Critic for Mixed Cooperative-Competitive
    Environments"), as the MAPPO paper's off-policy baseline code runs it on the particle world
    (github.com/marlbenchmark/off-policy).

    Each iteration plays one episode in each of ``env.num_envs`` envs (discrete actions sampled
    from the actors and mixed with epsilon-uniform exploration; actions in a box deterministic
    plus Gaussian noise), stores them, and takes ``updates_per_iteration`` steps on
    ``batch_size`` episodes sampled from the buffer: the critic ``Q(s, u_1..u_N)`` (global state
    and every agent's action) regresses on one-step targets of the target networks, then each
    agent's actor climbs the critic through its own action (a straight-through Gumbel-softmax
    sample, or the deterministic action in a box), the others' actions as stored; the targets
    follow by Polyak averaging after every step.

    ``name: facmac`` (Peng et al. 2021, "FACMAC: Factored Multi-Agent Centralised Policy
    Gradients"; github.com/oxwhirl/facmac) keeps the actors, the exploration and the buffer and
    factors the critic: each agent's utility ``Q_a(o_a, u_a)`` (one network per group, shared
    by its agents) mixed with the state by QMIX's network (``mixer``), and every agent's actor
    climbs the mixed value with all agents' actions taken from the current actors at once.
    """

    name: str = _field("maddpg", _NAME_DOC, choices=ALGO_NAMES)
    gamma: float = _field(0.99, "Discount factor.", low=0.0, high=1.0)
    actor_lr: float = _field(7e-4, "Actor learning rate (Adam).", low=0.0, low_open=True)
    critic_lr: float = _field(7e-4, "Critic learning rate (Adam).", low=0.0, low_open=True)
    adam_eps: float = _field(1e-5, "Adam epsilon.", low=0.0, low_open=True)
    max_grad_norm: float | None = _field(
        10.0,
        "Gradient-norm clip of the actors and of the critic; None = off.",
        low=0.0,
        low_open=True,
    )
    batch_size: int = _field(32, "Episodes per gradient step.", low=1)
    buffer_size: int = _field(5000, "Replay buffer capacity in episodes.", low=1)
    buffer_in_checkpoints: bool = _field(
        True,
        "Save the replay buffer in periodic checkpoints (exact resume); false keeps checkpoints "
        "small and resumes with an empty buffer.",
    )
    updates_per_iteration: int = _field(1, "Gradient steps after each batch of episodes.", low=1)
    target_tau: float = _field(
        0.005,
        "Polyak rate of the target actors and critic after every gradient step "
        "(target += tau * (online - target)).",
        low=0.0,
        low_open=True,
        high=1.0,
    )
    gumbel_temperature: float = _field(
        1.0,
        "Temperature of the Gumbel-softmax relaxation through which the actor loss reaches an "
        "agent's logits (its forward value is the sampled one-hot action).",
        low=0.0,
        low_open=True,
    )
    epsilon_start: float = _field(
        1.0, "Exploration epsilon at the start (discrete actions).", low=0.0, high=1.0
    )
    epsilon_finish: float = _field(
        0.05, "Exploration epsilon after the anneal (discrete actions).", low=0.0, high=1.0
    )
    epsilon_anneal_steps: int = _field(
        50_000, "Env steps over which epsilon goes from start to finish.", low=1
    )
    epsilon_schedule: str = _field(
        "linear", "Epsilon schedule over env steps.", choices=("linear", "exponential")
    )
    action_noise: float = _field(
        0.1,
        "Continuous actions: standard deviation of the Gaussian noise added to the actors' "
        "actions while training, in units of half the box's width (the off-policy code's "
        "act_noise_std).",
        low=0.0,
    )
    last_action: bool = _field(
        False, "Feed the agent's previous action (one-hot, or a box's components) to its actor."
    )
    standardise_rewards: bool = _field(
        False,
        "Standardise rewards with running statistics before the targets (the off-policy "
        "code's use_reward_normalization).",
    )
    bootstrap_truncation: bool = _field(
        True,
        "Bootstrap the target of a step that a time limit cut from the final observation; "
        "false treats the time limit as terminal, as the MAPPO paper's off-policy code does "
        "on the particle world.",
    )
    td_lambda: float = _field(
        0.0,
        "Lambda of the critic's TD(lambda) targets over the stored episodes; 0 = one-step "
        "targets (MADDPG's; FACMAC's code uses 0.8 with discrete actions).",
        low=0.0,
        high=1.0,
    )
    actor_reg: float = _field(
        0.0,
        "Weight of the mean squared box action (u in [-1, 1]) added to the actor loss, which "
        "keeps the actors' tanh off its flat ends (FACMAC's continuous code: 1e-3).",
        low=0.0,
    )
    mixer: str = _field(
        "qmix",
        "FACMAC: how the agents' utilities are mixed: qmix (monotonic, as QMIX), "
        "qmix_nonmonotonic (the same network without the weights' absolute values) or vdn "
        "(their sum).",
        choices=("qmix", "qmix_nonmonotonic", "vdn"),
    )
    mixing_embed_dim: int = _field(32, "FACMAC: the mixing network's width.", low=1)
    hypernet_layers: int = _field(
        2, "FACMAC: the mixer's hypernetwork depth (1 or 2 layers).", low=1, high=2
    )
    hypernet_embed: int = _field(64, "FACMAC: the hidden width of two-layer hypernetworks.", low=1)


# Which dataclass holds the algo.* fields of each algorithm name.
ALGO_CLASSES: dict[str, type] = {
    "mappo": AlgoConfig,
    "iql": ValueConfig,
    "vdn": ValueConfig,
    "qmix": ValueConfig,
    "coma": ComaConfig,
    "maddpg": MaddpgConfig,
    "facmac": MaddpgConfig,
}


@dataclass
class TrainConfig:
    """A complete training run."""

    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig | ValueConfig | ComaConfig | MaddpgConfig = field(default_factory=AlgoConfig)
    rollout_length: int = _field(25, "Steps per environment in each rollout (mappo).", low=1)
    total_env_steps: int = _field(
        2_000_000,
        "Environment steps to train for (one step = every agent acts once in one env), rounded "
        "up to whole iterations (env.num_envs x rollout_length steps for MAPPO).",
        low=1,
    )
    max_wall_seconds: float = _field(
        0.0,
        "Stop after the iteration in which this command's training passes this many seconds "
        "of wall time (compiling and evaluations included; 0 = no limit) and end the run as at "
        "total_env_steps: final evaluation, checkpoint, summary.json. `mappo train --resume "
        "RUN_DIR` continues it toward total_env_steps (with this limit again, unless changed).",
        low=0.0,
    )
    # numpy's and Python's seeders take any size, but torch's generators stop at 2**64 and seeds
    # are offset for evaluation and per-iteration streams: 32 bits leave room for both.
    seed: int = _field(
        1, "Random seed (environments, initialisation, sampling).", low=0, high=2**32 - 1
    )
    num_seeds: int = _field(
        1,
        "Train this many seeds (seed, seed + 1, ...) at once in one process, their networks "
        "stacked into shared batched kernels; each seed gets its own run directory (mappo).",
        low=1,
        high=1024,
    )
    device: str = _field(
        "cpu",
        "Torch device: 'cpu', 'cuda' or 'cuda:N'; 'mps' (Apple GPUs) is accepted but untested "
        "(compile=on is CPU and CUDA only).",
    )
    threads: int = _field(
        0,
        "Torch CPU threads; 0 = as many as cores other processes leave free, re-measured "
        "every few seconds (fix it for bit-exact replays).",
        low=0,
        high=1024,
    )
    compile: str = _field(
        "off",
        "torch.compile the rollout step and the loss (mappo; recurrent chunks over 32 steps keep "
        "the loss eager; on CUDA also replayed as CUDA graphs): 'off' (eager, the reference), "
        "'on', or 'auto' (on CUDA, and on the CPU for runs of 1M+ env steps of an env that "
        "offers traced steps, the particle world; eager where compiling fails; the gains are "
        "measured in BENCHMARKS.md).",
        choices=("off", "on", "auto"),
    )
    eval_interval: int = _field(
        25, "Evaluate every this many updates (0 = only at the end).", low=0
    )
    eval_episodes: int = _field(32, "Greedy evaluation episodes (one per evaluation env).", low=1)
    log_interval: int = _field(5, "Write metrics every this many updates.", low=1)
    checkpoint_interval: int = _field(50, "Save a checkpoint every this many updates.", low=1)
    keep_checkpoints: int = _field(3, "How many periodic checkpoints to keep.", low=1)
    run_dir: str = _field("runs", "Parent folder of run directories.")
    tensorboard: bool = _field(True, "Write TensorBoard events.")
    wandb: bool = _field(False, "Log to Weights & Biases (needs `pip install wandb`).")
    wandb_project: str = _field("mappo", "Weights & Biases project.")
    progress: bool = _field(True, "Show a progress bar on the console.")
    name: str = _field(
        "", "Algorithm label for the run directory; empty = derived (rmappo / mappo / ippo ...)."
    )
    preset: str = _field(
        "",
        "The preset this config was loaded from (set by loading one); names the run directory.",
    )

    @property
    def algo_name(self) -> str:
        """``rmappo``/``mappo``/``ippo``/``rippo``... derived from the options."""
        if self.name:
            return self.name
        if self.algo.name != "mappo":
            return self.algo.name
        base = "ippo" if self.algo.critic_input == "local" else "mappo"
        return ("r" + base) if self.model.recurrent != "none" else base

    @property
    def family(self) -> str:
        """``"ppo"`` (mappo), ``"value"`` (iql, vdn, qmix), ``"coma"`` or ``"maddpg"`` (maddpg,
        facmac)."""
        families = {"mappo": "ppo", "coma": "coma", "maddpg": "maddpg", "facmac": "maddpg"}
        return families.get(self.algo.name, "value")

    @property
    def steps_per_update(self) -> int:
        """Environment steps collected per MAPPO update: ``num_envs * rollout_length``."""
        return self.env.num_envs * self.rollout_length

    @property
    def num_updates(self) -> int:
        return max(1, -(-self.total_env_steps // self.steps_per_update))


# -- conversion -------------------------------------------------------------------------------


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict (YAML-ready) of a config dataclass."""
    return dataclasses.asdict(cfg)


def _leaf_keys(cls: type, prefix: str = "", algo_cls: type = AlgoConfig) -> dict[str, Any]:
    """Dotted key -> ``(Field, type hint)`` of every leaf field, with ``algo_cls`` as the
    ``algo`` section."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        hint = algo_cls if key == "algo" else hints[f.name]
        if dataclasses.is_dataclass(hint):
            out.update(_leaf_keys(hint, key + ".", algo_cls))
        else:
            out[key] = (f, hint)
    return out


# The keys of each algorithm family: the algo.* section depends on algo.name.
_KEYS_OF: dict[type, dict[str, Any]] = {
    cls: _leaf_keys(TrainConfig, algo_cls=cls) for cls in dict.fromkeys(ALGO_CLASSES.values())
}
LEAF_KEYS: dict[str, dataclasses.Field] = {k: f for k, (f, _) in _KEYS_OF[AlgoConfig].items()}
"""The keys of the default (mappo) family; :func:`keys_of` gives any family's."""
_SECTIONS = ("env", "model", "algo")
_SECTION_EXAMPLES = {"env": "num_envs: 8", "model": "hidden_sizes: [64, 64]", "algo": "epochs: 5"}


def keys_of(cfg: TrainConfig) -> dict[str, dataclasses.Field]:
    """Dotted key -> field of every leaf key valid for ``cfg``'s algorithm family."""
    return {k: f for k, (f, _) in _KEYS_OF[type(cfg.algo)].items()}


def resolve_key(key: str, cfg: TrainConfig | None = None) -> str:
    """The full dotted key for ``key`` (a dotted key or an unambiguous bare field name), among
    the keys of ``cfg``'s algorithm family (mappo's when ``cfg`` is None)."""
    keys = _KEYS_OF[type(cfg.algo) if cfg is not None else AlgoConfig]
    if key in keys:
        return key
    matches = [k for k in keys if k.rsplit(".", 1)[-1] == key]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ConfigError(f"config key '{key}' is ambiguous; use one of {matches}")
    family = cfg.algo.name if cfg is not None else "mappo"
    for name, cls in ALGO_CLASSES.items():
        other = _KEYS_OF[cls]
        if cls is not type(cfg.algo if cfg is not None else AlgoConfig()) and (
            key in other or f"algo.{key}" in other
        ):
            return _raise_other_family(key, family, name, list(keys))
    close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.5)
    if not close:
        bare = {k.rsplit(".", 1)[-1]: k for k in keys}
        near = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(bare), n=1, cutoff=0.5)
        close = [bare[near[0]]] if near else []
    hint = f"; did you mean '{close[0]}'?" if close else " (see `mappo list --keys`)"
    raise ConfigError(f"unknown config key '{key}'{hint}")


def _raise_other_family(key: str, family: str, other: str, keys: list[str]) -> str:
    bare = key.rsplit(".", 1)[-1]
    names = [
        n for n, c in ALGO_CLASSES.items() if f"algo.{bare}" in _KEYS_OF[c] or key in _KEYS_OF[c]
    ]
    # a learning rate asked for by the other family's name: this family's own rates are meant
    rates = [k for k in keys if k.startswith("algo.") and k.endswith("_lr")] if bare == "lr" else []
    fix = (
        f"{family}'s learning rates are {' and '.join(rates)}"
        if rates
        else f"set algo.name={other} before it"
    )
    raise ConfigError(
        f"config key '{key}' belongs to algo.name={'/'.join(names)}, not '{family}'; {fix}"
    )


def _coerce(key: str, value: Any, cfg: TrainConfig) -> Any:
    """Check ``value`` against the field's type and range; return it in the field's type."""
    f, hint = _KEYS_OF[type(cfg.algo)][key]
    meta = f.metadata
    origin = typing.get_origin(hint)
    optional = origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and type(
        None
    ) in typing.get_args(hint)
    if optional:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))

    def fail(expected: str) -> ConfigError:
        return ConfigError(f"config field '{key}' must be {expected}, got {value!r}")

    value = _plain(value)

    if hint is bool:
        if not isinstance(value, bool):
            raise fail("true or false")
    elif hint is int:
        if isinstance(value, str):
            # YAML 1.1 reads "1e6" (no dot) as a string; a whole number written so is accepted.
            try:
                value = float(value)
            except ValueError:
                raise fail("an integer") from None
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
                value = int(value)
            else:
                raise fail("an integer")
    elif hint is float:
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; accept any float literal.
            try:
                value = float(value)
            except ValueError:
                raise fail("a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail("a number")
        value = float(value)
        if not math.isfinite(value):
            raise fail("a finite number")
    elif hint is str:
        if (
            isinstance(value, bool)
            and meta.get("choices")
            and {"on", "off"} <= set(meta["choices"])
        ):
            # YAML 1.1 reads the words on/off as booleans.
            value = "on" if value else "off"
        if not isinstance(value, str):
            raise fail("a string")
    elif hint is list:
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value
        ):
            raise fail("a list of positive integers, e.g. [64, 64]")
    elif hint is dict:
        if not isinstance(value, dict):
            raise fail("a mapping, e.g. {num_agents: 3}")
    choices = meta.get("choices")
    if choices and value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint_txt = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"config field '{key}' must be one of {list(choices)}, got {value!r}{hint_txt}"
        )
    low, high = meta.get("low"), meta.get("high")
    if low is not None and isinstance(value, (int, float)):
        if value < low or (meta.get("low_open") and value == low):
            rel = ">" if meta.get("low_open") else ">="
            raise ConfigError(f"config field '{key}' must be {rel} {low}, got {value!r}")
    if high is not None and isinstance(value, (int, float)) and value > high:
        raise ConfigError(f"config field '{key}' must be <= {high}, got {value!r}")
    return value


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = prefix + str(k)
        if isinstance(v, dict) and key in _SECTIONS:
            inner = _flatten(v, key + ".")
            twice = next((k for k in inner if k in out), None)
            if twice is not None:  # (`algo: {clip: ...}` beside `algo.clip:`)
                raise ConfigError(f"'{twice}' is set twice; keep one")
            out.update(inner)
        elif key in out:
            raise ConfigError(f"'{key}' is set twice; keep one")
        elif key in _SECTIONS:
            raise ConfigError(
                f"config key '{key}' must be a mapping of {key}.* keys "
                f"(e.g. `{key}: {{{_SECTION_EXAMPLES[key]}}}`), got {v!r}"
            )
        else:
            out[key] = v
    return out


_KWARGS_PREFIX = "env.kwargs."


def apply(cfg: TrainConfig, values: dict[str, Any], saved: bool = False) -> TrainConfig:
    """Set dotted keys (or unambiguous bare names) on ``cfg`` after checking them.

    ``env.kwargs.NAME`` sets one keyword argument of the environment and keeps the others (a
    preset's kwargs stay unless replaced as a whole through ``env.kwargs``). ``algo.name`` is
    applied first: a different family replaces the algo section with that family's defaults."""
    flat = _flatten(values)
    _refuse_twice(flat, cfg)
    if "algo.name" in flat:
        name = _coerce("algo.name", flat.pop("algo.name"), cfg)
        if not isinstance(cfg.algo, ALGO_CLASSES[name]):
            cfg.algo = ALGO_CLASSES[name]()
        cfg.algo.name = name
    for raw_key, value in flat.items():
        if raw_key.startswith(_KWARGS_PREFIX):
            name = raw_key[len(_KWARGS_PREFIX) :]
            if not name.isidentifier():
                raise ConfigError(
                    f"config key '{raw_key}' must name one keyword argument of the environment, "
                    "e.g. env.kwargs.num_agents=4"
                )
            cfg.env.kwargs = {**cfg.env.kwargs, name: _plain(value)}
            continue
        key = resolve_key(raw_key, cfg)
        value = _coerce(key, value, cfg)
        target: Any = cfg
        *path, last = key.split(".")
        for part in path:
            target = getattr(target, part)
        setattr(target, last, value)
    check(cfg, saved)
    return cfg


def _refuse_twice(flat: dict[str, Any], cfg: TrainConfig) -> None:
    """Refuse one key set twice under two spellings in one layer (``algo: {clip: ...}`` and
    ``algo.clip:`` in a file, ``clip=`` and ``algo.clip=`` on a command line): one of the two
    values would be dropped without a word."""
    seen: dict[str, str] = {}
    for raw in flat:
        if raw.startswith(_KWARGS_PREFIX):
            continue
        try:
            key = resolve_key(raw, cfg)
        except ConfigError:
            continue  # (apply names the unknown key)
        if key in seen:
            raise ConfigError(f"'{key}' is set twice (as '{seen[key]}' and '{raw}'); keep one")
        seen[key] = raw


_RUN_OWNED_KWARGS = {"num_envs": "env.num_envs", "seed": "seed", "device": "device"}
"""Env constructor arguments that the run itself passes, and the config keys that set them."""


def non_finite(value: Any, where: str) -> tuple[str, float] | None:
    """The first NaN or inf inside ``value`` (numbers, lists and mappings of them) and where it
    is, as ``("env.kwargs.x[2]", inf)``; None if there is none."""
    if isinstance(value, float) and not math.isfinite(value):
        return where, value
    items = value.items() if isinstance(value, dict) else None
    if items is None and isinstance(value, list | tuple):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    for key, sub in items or ():
        found = non_finite(sub, f"{where}{key}" if str(key).startswith("[") else f"{where}.{key}")
        if found is not None:
            return found
    return None


def check_logging(cfg: TrainConfig) -> None:
    """What a run that is about to log needs installed (Weights & Biases where ``wandb``)."""
    if cfg.wandb:
        import importlib.metadata
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                "config field 'wandb' is true but Weights & Biases is not installed; "
                "`pip install 'wandb>=0.19.10'` or set wandb=false"
            )
        try:
            version = importlib.metadata.version("wandb")
        except importlib.metadata.PackageNotFoundError:
            return  # (a wandb module without metadata: a stand-in, which says what it takes)
        numbers = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
        if numbers < (0, 19, 10):
            # One W&B run per run folder in one process (stacked seeds) needs reinit="create_new".
            raise ConfigError(
                f"config field 'wandb' is true but wandb {version} is older than 0.19.10, which "
                "the runs need; `pip install -U 'wandb>=0.19.10'` or set wandb=false"
            )


def check(cfg: TrainConfig, saved: bool = False) -> None:
    """Checks that involve more than one field. ``saved``: the config of a run trained before
    (a checkpoint's, or a resume's, whose fixed keys cannot change): the checks added since
    some runs were trained (NaN or inf in env.kwargs, QMIX's mixer sizes on VDN and IQL) are
    left out, so that such runs still open."""
    owned = sorted(set(cfg.env.kwargs or {}) & set(_RUN_OWNED_KWARGS))
    if owned:
        key = owned[0]
        raise ConfigError(
            f"config field 'env.kwargs' sets '{key}', which the run passes to the env itself; "
            f"set {_RUN_OWNED_KWARGS[key]}={cfg.env.kwargs[key]!r} instead"
        )
    bad = None if saved else non_finite(cfg.env.kwargs or {}, "env.kwargs")
    if bad is not None:
        raise ConfigError(
            f"config field '{bad[0]}' is {bad[1]}; env parameters must be finite numbers, as "
            "every config value (an env given inf or NaN computes NaN rewards or positions)"
        )
    if not isinstance(cfg.algo, ALGO_CLASSES[cfg.algo.name]):
        raise ConfigError(
            f"config field 'algo.name' is {cfg.algo.name!r} but the algo section is a "
            f"{type(cfg.algo).__name__}; build it as {ALGO_CLASSES[cfg.algo.name].__name__}()"
        )
    replay = isinstance(cfg.algo, (ValueConfig, MaddpgConfig))
    if replay and cfg.algo.buffer_size < cfg.env.num_envs:
        raise ConfigError(
            f"config field 'algo.buffer_size' ({cfg.algo.buffer_size}) must hold at least one "
            f"iteration's episodes (env.num_envs = {cfg.env.num_envs}); enlarge it"
        )
    schedule = getattr(cfg.algo, "epsilon_schedule", None)
    if schedule == "exponential" and 0.0 in (cfg.algo.epsilon_start, cfg.algo.epsilon_finish):
        which = "epsilon_start" if cfg.algo.epsilon_start == 0.0 else "epsilon_finish"
        raise ConfigError(
            f"config field 'algo.{which}' is 0, which an exponential epsilon schedule never "
            "reaches or leaves; set it above 0 (e.g. 0.01) or algo.epsilon_schedule=linear"
        )
    if isinstance(cfg.algo, ValueConfig):
        if cfg.algo.name != "qmix" and not saved:  # the mixer's sizes would change nothing
            default = ValueConfig()
            for key in ("mixing_embed_dim", "hypernet_layers", "hypernet_embed"):
                if getattr(cfg.algo, key) != getattr(default, key):
                    mixer = "sums the agents' values" if cfg.algo.name == "vdn" else "has no mixer"
                    raise ConfigError(
                        f"config field 'algo.{key}' sizes QMIX's mixer, but {cfg.algo.name} "
                        f"{mixer}; drop it or set algo.name=qmix"
                    )
    if replay and cfg.algo.batch_size > cfg.algo.buffer_size:
        raise ConfigError(
            f"config field 'algo.batch_size' ({cfg.algo.batch_size}) exceeds "
            f"'algo.buffer_size' ({cfg.algo.buffer_size}); lower it or enlarge the buffer"
        )
    if isinstance(cfg.algo, AlgoConfig):
        # What an update splits into mini-batches: steps, or for recurrent networks chunks of
        # data_chunk_length steps (the last one padded).
        steps = cfg.env.num_envs * cfg.rollout_length
        if cfg.model.recurrent != "none":
            units = -(-steps // cfg.algo.data_chunk_length)
            what = f"chunks of algo.data_chunk_length={cfg.algo.data_chunk_length} steps"
        else:
            units, what = steps, "samples"
        if cfg.algo.num_minibatches > units:
            raise ConfigError(
                f"config field 'algo.num_minibatches' ({cfg.algo.num_minibatches}) exceeds the "
                f"{units} {what} per update; lower it"
            )
    if (
        isinstance(cfg.algo, AlgoConfig)
        and cfg.algo.death_masked_critic
        and cfg.algo.critic_input == "local"
    ):
        raise ConfigError(
            "config field 'algo.death_masked_critic' needs a centralised critic; set "
            "algo.critic_input=state or agent_state"
        )
    if cfg.num_seeds > 1 and cfg.family != "ppo":
        raise ConfigError(
            f"config field 'num_seeds' is {cfg.num_seeds} but many seeds in one process cover "
            f"algo.name=mappo only, not {cfg.algo.name!r}; set num_seeds=1 and run the seeds "
            "as separate runs (e.g. `mappo sweep`)"
        )
    if cfg.model.precision != "fp32" and cfg.family != "ppo":
        raise ConfigError(
            f"config field 'model.precision' is {cfg.model.precision!r} but bf16 networks cover "
            f"algo.name=mappo only, not {cfg.algo.name!r}; set model.precision=fp32"
        )
    convs = [cfg.model.cnn_channels, cfg.model.cnn_kernels, cfg.model.cnn_strides]
    if cfg.model.encoder == "cnn" and not convs[0]:
        raise ConfigError(
            "config field 'model.cnn_channels' is empty, so model.encoder=cnn would have no "
            "convolution; give at least one (e.g. model.cnn_channels=[32] model.cnn_kernels=[3] "
            "model.cnn_strides=[1]) or set model.encoder=mlp"
        )
    if len({len(c) for c in convs}) > 1:
        raise ConfigError(
            "config fields 'model.cnn_channels', 'model.cnn_kernels' and 'model.cnn_strides' "
            f"describe one convolution per entry but have {len(convs[0])}, {len(convs[1])} "
            f"and {len(convs[2])} entries; give each the same number"
        )
    if cfg.compile == "on" and cfg.family != "ppo":
        raise ConfigError(
            f"config field 'compile' is 'on' but the compiled path covers algo.name=mappo only, "
            f"not {cfg.algo.name!r}; set compile=off (auto leaves {cfg.algo.name} eager)"
        )
    if cfg.compile == "on" and cfg.device == "mps":
        raise ConfigError(
            "config field 'compile' is 'on' but the compiled path runs on the CPU and on CUDA "
            "devices, not on mps; set compile=off (auto leaves an mps run eager)"
        )
    if not saved:  # reading a saved run (eval, reports, a resume's checkpoint) needs no wandb
        check_logging(cfg)
    if not _DEVICE.fullmatch(cfg.device):
        raise ConfigError(
            f"config field 'device' must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {cfg.device!r}"
        )
    if cfg.preset and not all(_LABEL.fullmatch(part) for part in cfg.preset.split("/")):
        raise ConfigError(
            f"config field 'preset' must be a preset name such as mpe/simple_spread, got "
            f"{cfg.preset!r}; it names folders inside run_dir, so no leading '/' or '..'"
        )
    if cfg.name and not _LABEL.fullmatch(cfg.name):
        raise ConfigError(
            f"config field 'name' must be a plain label (letters, digits, '_', '-', '.', '+'), "
            f"got {cfg.name!r}; it names a folder inside run_dir, so no '/' or '..'"
        )
    if not saved and cfg.name in ALGO_NAMES and cfg.name != cfg.algo.name:
        # 'name' only labels the run directory; a user who wrote name=qmix meant the algorithm.
        raise ConfigError(
            f"config field 'name' labels the run directory, so name={cfg.name} would label a "
            f"{cfg.algo.name} run as {cfg.name}; to train {cfg.name} set algo.name={cfg.name}"
        )


# A run-directory label: one path component that stays inside run_dir.
_LABEL = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.+\-]+")
_DEVICE = re.compile(r"cpu|mps|cuda(:(0|[1-9]\d{0,3}))?")


def check_device(name: str) -> Any:
    """The torch device ``name`` if this machine has it, else a :class:`ConfigError` naming the
    fix (the config check accepts any well-formed name: a run may be set up on one machine and
    trained on another)."""
    import torch

    if not _DEVICE.fullmatch(name):
        raise ConfigError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {name!r}")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device '{name}' asked for but no CUDA device is available; use cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device '{name}' does not exist: this machine has {torch.cuda.device_count()} "
                "CUDA device(s), cuda:0 to cuda:N-1"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device '{name}' asked for but MPS is not available here; use cpu")
    return device


# -- presets and files ------------------------------------------------------------------------


def list_presets() -> list[str]:
    """Preset names, e.g. ``mpe/simple_spread`` (files starting with ``_`` are shared bases)."""
    return sorted(
        str(p.relative_to(PRESET_DIR).with_suffix(""))
        for p in PRESET_DIR.rglob("*.yaml")
        if not p.name.startswith("_")
    )


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-3``, ``5e-1`` and ``1.5e3`` as numbers: PyYAML
    follows YAML 1.1, whose floats need a dot and a signed exponent, so those became strings
    (harmless for typed config fields, which convert them, but ``env.kwargs`` reached the env as
    ``'5e-1'``). YAML 1.2 and most YAML readers take them as floats."""


# YAML 1.1's integers include octal (``010`` is 8) and base 60 (``1:00`` is 60): a zero-padded
# seed (``seq -w``) or a hidden size read so was another number without a word. Configs read
# integers as YAML 1.2 does: decimal (leading zeros allowed), or 0x / 0o / 0b prefixed.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:int"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_INT = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+|0b[01_]+)$")
_EXPONENT_FLOAT = re.compile(  # the floats without a dot (see _Loader)
    r"^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+|[-+]?\.[0-9_]+[eE][-+]?[0-9]+)$"
)
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    sign = -1 if text.startswith("-") else 1
    text = text.lstrip("+-")
    for prefix, base in (("0x", 16), ("0o", 8), ("0b", 2)):
        if text.startswith(prefix):
            return sign * int(text[2:], base)
    return sign * int(text, 10)


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def yaml_value(text: str) -> Any:
    """One YAML value, read as configs are (:class:`_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # safe: a SafeLoader constructs plain data only


class _UniqueKeyLoader(_Loader):
    """The configs' safe loader (:class:`_Loader`), refusing a key set twice in one mapping
    (plain YAML keeps the last silently, so an edited config could run with a value its reader
    did not see)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key: the safe loader refuses it itself
                continue
            if first is not None and key != "<<":
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"'{key}' is set twice (lines {first} and {line}); keep one",
                    key_node.start_mark,
                )
            lines[key] = line
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read config file '{path}': {err.strerror}") from err
    except UnicodeDecodeError:
        raise ConfigError(
            f"config file '{path}' is not a text file (not UTF-8); give a YAML file"
        ) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # safe: a config never runs code
    except yaml.YAMLError as err:
        # PyYAML's message spans several lines; keep the problem and where it is.
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file '{path}' is not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys to values")
    return data


def _preset_path(name: str) -> Path:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        from mappo.envs.registry import list_envs  # (only on this error: it imports torch)

        family = name.split("/")[0] + "/"
        kin = [p for p in list_presets() if p.startswith(family)]
        if any(e.name == name for e in list_envs()) and kin:
            # An env without a preset of its own (hanabi/full-3p): its family's preset fits.
            base = (difflib.get_close_matches(name, kin, n=1, cutoff=0.0) or kin)[0]
            raise ConfigError(
                f"'{name}' is an env with no preset of its own; train it with the settings of "
                f"a preset of its family: mappo train {base} env.name={name}"
            )
        close = difflib.get_close_matches(name, list_presets(), n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else " (`mappo list` shows the presets)"
        raise ConfigError(f"no preset or config file named '{name}'{hint}")
    return path


def _load_layers(
    source: str, seen: tuple[str, ...] = (), folder: Path | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """The layers of ``source`` (a preset name or a YAML path), its ``base`` chain first. A
    relative path named by a file's ``base`` is read from that file's ``folder`` (where the
    file is, wherever the command runs), or else from the working folder."""
    path = Path(source)
    if folder is not None and not path.is_absolute() and (folder / path).is_file():
        path = folder / path
    if source.endswith((".yaml", ".yml")) or path.is_file():
        if path.is_dir():
            raise ConfigError(f"config file '{source}' is a directory; name a YAML file")
        if not path.is_file():
            raise ConfigError(f"config file '{source}' does not exist")
    else:
        path = _preset_path(source)
    if str(path.resolve()) in seen:
        raise ConfigError(f"config '{source}' includes itself through 'base'")
    data = _read_yaml(path)
    if not data and not path.resolve().is_relative_to(PRESET_DIR.resolve()):
        # An empty file would train the defaults under the file's name without a word.
        raise ConfigError(
            f"config file '{source}' sets nothing; give it a 'base: <preset>' line (such as "
            "base: mpe/simple_spread) and the keys it changes"
        )
    layers: list[tuple[str, dict[str, Any]]] = []
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"'base' in '{path}' must be a preset name or a YAML path")
        layers += _load_layers(base, seen + (str(path.resolve()),), path.parent)
    layers.append((str(path), data))
    return layers


def load(
    source: str | os.PathLike[str] | None = None,
    overrides: list[str] | dict[str, Any] | None = None,
    refuse_unread: bool = True,
) -> TrainConfig:
    """A config from a preset name or YAML path (or the defaults), then ``KEY=VALUE`` overrides.
    ``refuse_unread``: refuse overrides that the config never reads (:func:`_refuse_unread`);
    a sweep, whose overrides are shared by presets of several algorithms, passes False.

    Overrides that name another env (``env.name=...``) make the preset a template of settings:
    the run is no longer the preset's (``preset`` is cleared). A layer (a YAML file over its
    ``base``, or the overrides) that names an env of another family (:func:`env_family`) gives
    it only the keyword arguments that layer names, not those before it (:func:`_apply_layer`)."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if source is not None and not isinstance(source, str):
        raise TypeError(f"give a preset name or a YAML path, got {type(source).__name__}")
    if source and Path(source).name.startswith("_") and (PRESET_DIR / f"{source}.yaml").is_file():
        # Files starting with '_' hold settings shared by presets; they name no env of their own.
        raise ConfigError(
            f"'{source}' is a base shared by presets, not a preset; name a preset "
            "(`mappo list` shows them) or give it as 'base:' in your own YAML file"
        )
    cfg = TrainConfig()
    named = False  # whether a layer has named the env (the default's name holds no kwargs)
    # The keys each of the user's own files changes (a shipped preset's are the library's).
    changed_by_file: list[tuple[str, set[str]]] = []
    if source:
        presets = PRESET_DIR.resolve()
        for where, data in _load_layers(source):
            data = _kwargs_one_by_one(data)
            before = _flatten(to_dict(cfg))
            env_before = cfg.env.name
            try:
                named = _apply_layer(cfg, data, named)
            except ConfigError as err:
                raise ConfigError(f"{err} (in {where})") from None
            if cfg.env.name != env_before and "preset" not in data:
                cfg.preset = ""  # another env than its base's preset (a saved run's, say)
            if not Path(where).resolve().is_relative_to(presets):
                saved = data.get("preset")  # a run's saved config.yaml names its preset
                if isinstance(saved, str) and saved in list_presets():
                    # Its values that are the preset's are the library's, not the user's: a
                    # preset's setting that the run's overrides made unread is no mistake.
                    before = _flatten(to_dict(load(saved, refuse_unread=False)))
                changed_by_file.append((where, _changed(cfg, before, data)))
        if not source.endswith((".yaml", ".yml")) and not Path(source).is_file():
            cfg.preset = source
    env_name = cfg.env.name
    values = override_values(overrides)
    _apply_layer(cfg, values, named)
    if cfg.env.name != env_name:  # a preset used as a template for another env is not that task
        cfg.preset = ""
    if refuse_unread:
        _refuse_unread(cfg, given_keys(values, cfg))
        for where, keys in changed_by_file:
            _refuse_unread(cfg, keys, where)
    return cfg


def _kwargs_one_by_one(data: dict[str, Any]) -> dict[str, Any]:
    """A file's ``env: {kwargs: {...}}`` as one ``env.kwargs.NAME`` key per argument: each
    replaces its own, and its base's others stay, as the file's other sections merge with
    its base (a derived file dropped the feed-forward preset's time feature). ``env.kwargs:``
    written dotted still replaces them all, as ``env.kwargs={...}`` does on the command line."""
    env = data.get("env")
    if not (isinstance(env, dict) and isinstance(env.get("kwargs"), dict)):
        return data
    kwargs = env["kwargs"]
    out = {**data, "env": {k: v for k, v in env.items() if k != "kwargs"}}
    out.update({f"{_KWARGS_PREFIX}{name}": value for name, value in kwargs.items()})
    return out


def _changed(cfg: TrainConfig, before: dict[str, Any], values: dict[str, Any]) -> set[str]:
    """The keys that a file's ``values``, applied to a config whose flat form was ``before``,
    set to another value than that config held (or, for a key of another algorithm family
    than before, than that family's default). A saved ``config.yaml`` names every key; only
    those it changes are the user's settings."""
    after = _flatten(to_dict(cfg))
    defaults = _flatten({"algo": to_dict(type(cfg.algo)())})
    return {
        key
        for key in given_keys(values, cfg)
        if key in after and after[key] != before.get(key, defaults.get(key))
    }


def given_keys(values: dict[str, Any], cfg: TrainConfig) -> set[str]:
    """The dotted keys that ``values`` (a layer, applied to ``cfg``) set."""
    given = set()
    for key in _flatten(values):
        try:
            given.add(key if key.startswith(_KWARGS_PREFIX) else resolve_key(key, cfg))
        except ConfigError:  # (apply accepted every key; nothing else to resolve)
            given.add(key)
    return given


# Keys that only MAPPO reads: the value family and COMA play whole episodes per iteration and
# act in discrete action spaces with networks of their own (nn.q_agents, nn.coma).
_CNN_KEYS = (
    "model.cnn_channels",
    "model.cnn_kernels",
    "model.cnn_strides",
    "model.image_layout",
    "model.image_scale",
)

_MAPPO_ONLY = {
    "rollout_length": "plays whole episodes, env.num_envs of them an iteration",
    "model.critic_hidden_sizes": "sizes its networks by model.hidden_sizes (COMA's critic by "
    "algo.critic_hidden)",
    "model.recurrent_critic": "builds its critics (or mixers) as its own algorithm does",
    "model.policy_gain": "initialises its networks' heads as PyMARL does",
    "model.action_bounds": "acts in discrete action spaces only",
    "model.log_std_init": "acts in discrete action spaces only",
    "model.state_dependent_std": "acts in discrete action spaces only",
}


def unread(cfg: TrainConfig, given: set[str]) -> list[tuple[str, str]]:
    """The keys of ``given`` that ``cfg`` never reads (QMIX's n-step length with one-step
    targets, RMSprop's alpha with Adam, the Huber loss's delta with another loss), each with a
    sentence saying why and what to do: ``[(key, "config field '<key>' ...")]``."""
    algo = cfg.algo
    out: list[tuple[str, str]] = []
    if cfg.model.encoder != "cnn":
        for key in _CNN_KEYS:
            if key in given:
                out.append(
                    (key, f"is read with model.encoder=cnn only, and model.encoder is "
                     f"{cfg.model.encoder!r}; set model.encoder=cnn or drop it")
                )  # fmt: skip
    if cfg.family != "ppo":
        for key, why in _MAPPO_ONLY.items():
            acting = key not in (
                "rollout_length",
                "model.critic_hidden_sizes",
                "model.recurrent_critic",
            )
            if cfg.family == "maddpg" and acting:
                # MADDPG's actor heads take the policy gain; its box actions are deterministic
                if key == "model.policy_gain":
                    continue
                why = "acts deterministically in a box (algo.action_noise sets its exploration)"
            if key in given:
                out.append((key, f"is read by algo.name=mappo only: {algo.name} {why}; drop it"))
    if isinstance(algo, MaddpgConfig):
        sizes = ("mixing_embed_dim", "hypernet_layers", "hypernet_embed")
        for key in ("mixer", *sizes):
            if f"algo.{key}" in given and algo.name != "facmac":
                out.append(
                    (f"algo.{key}", f"sets FACMAC's mixer, which algo.name={algo.name} does not "
                     "have (its critic reads the joint action); set algo.name=facmac or drop it")
                )  # fmt: skip
            elif f"algo.{key}" in given and key in sizes and algo.mixer == "vdn":
                out.append(
                    (f"algo.{key}", "sizes the mixing network, which algo.mixer=vdn (a sum) "
                     "does not have; set algo.mixer=qmix or drop it")
                )  # fmt: skip
    mixes = isinstance(algo, ValueConfig) or (
        isinstance(algo, MaddpgConfig) and algo.name == "facmac" and algo.mixer != "vdn"
    )
    if mixes and "algo.hypernet_embed" in given and algo.hypernet_layers == 1:
        out.append(
            ("algo.hypernet_embed", "is the hidden width of two-layer hypernetworks, and "
             "algo.hypernet_layers is 1; set algo.hypernet_layers=2 or drop it")
        )  # fmt: skip
    if isinstance(algo, ValueConfig):
        for key in ("n_step", "td_lambda"):
            if f"algo.{key}" in given and algo.targets != key:
                out.append(
                    (f"algo.{key}", f"is read with algo.targets={key} only, and algo.targets is "
                     f"{algo.targets!r}; set algo.targets={key} or drop it")
                )  # fmt: skip
        if "algo.target_update_interval" in given and algo.target_tau is not None:
            out.append(
                ("algo.target_update_interval", f"times hard target copies, which "
                 f"algo.target_tau={algo.target_tau} replaces by soft updates; drop one of them")
            )  # fmt: skip
    if "algo.optim_alpha" in given and getattr(algo, "optimizer", "adam") != "rmsprop":
        out.append(
            ("algo.optim_alpha", f"is RMSprop's smoothing constant, but algo.optimizer is "
             f"{algo.optimizer!r}; set algo.optimizer=rmsprop or drop it")
        )  # fmt: skip
    if isinstance(algo, AlgoConfig):
        if "algo.huber_delta" in given and algo.value_loss != "huber":
            out.append(
                ("algo.huber_delta", f"is the Huber loss's delta, but algo.value_loss is "
                 f"{algo.value_loss!r}; set algo.value_loss=huber or drop it")
            )  # fmt: skip
        if "algo.data_chunk_length" in given and cfg.model.recurrent == "none":
            out.append(
                ("algo.data_chunk_length", "cuts a recurrent network's training sequences, and "
                 "model.recurrent is 'none'; set model.recurrent=gru or drop it")
            )  # fmt: skip
        if "model.recurrent_critic" in given and cfg.model.recurrent == "none":
            out.append(
                ("model.recurrent_critic", "chooses whether the critics have a recurrent "
                 "layer like the actors', and model.recurrent is 'none'; set "
                 "model.recurrent=gru or drop it")
            )  # fmt: skip
        if "algo.value_clip" in given and not algo.clip_value_loss:
            out.append(
                ("algo.value_clip", "clips the value loss, which algo.clip_value_loss=false "
                 "turns off; set algo.clip_value_loss=true or drop it")
            )  # fmt: skip
    return [(key, f"config field '{key}' {why}") for key, why in out]


def _refuse_unread(cfg: TrainConfig, given: set[str], where: str = "") -> None:
    """Refuse a key that the user set (on the command line, or in a YAML file of their own)
    that the config then never reads (:func:`unread`): the run would train as if it were not
    there, while its folder and reports list it as a difference."""
    problems = unread(cfg, given)
    if problems:
        raise ConfigError(problems[0][1] + (f" (in {where})" if where else ""))


# Schemes whose envs run through the worker adapters, which take the adapter's options.
_ADAPTER_SCHEMES = ("pettingzoo:", "gymnasium:")


def _apply_layer(cfg: TrainConfig, values: dict[str, Any], named: bool) -> bool:
    """:func:`apply` ``values`` to ``cfg``; where they name an env of another family than an
    earlier layer named (``named``), the earlier ``env.kwargs`` are arguments of the other kind
    of env (the particle world's time_feature), which the new one would refuse or misread, so
    only those ``values`` name stay (and the adapters' options, such as num_workers, between
    envs that both run through them). Another env of the same family (smac/3s5z -> smac/MMM)
    keeps them: its parameters are the same kind, and one it does not take is its error to
    report. Returns whether an env has been named now."""
    before = cfg.env.name
    apply(cfg, values)
    given = given_keys(values, cfg)
    if not named or env_family(cfg.env.name) == env_family(before) or "env.kwargs" in given:
        return named or "env.name" in given  # ("env.kwargs" given: all are this layer's)
    options: frozenset[str] = frozenset()
    if before.startswith(_ADAPTER_SCHEMES) and cfg.env.name.startswith(_ADAPTER_SCHEMES):
        from mappo.envs.adapters.adapter import ADAPTER_OPTIONS

        options = ADAPTER_OPTIONS - {"env_kwargs", "name", "groups"}
    cfg.env.kwargs = {
        k: v for k, v in cfg.env.kwargs.items() if _KWARGS_PREFIX + k in given or k in options
    }
    return True


def env_family(name: str) -> str:
    """The kind of env a name makes, whose envs take the same parameters: the part before the
    first ``/`` of a registered name (``smac`` of ``smac/3m``), the scheme and module of an
    import path (``gymnasium:lbforaging`` of ``gymnasium:lbforaging:Foraging-8x8-2p-2f-v3``).
    A VMAS scenario is a family of its own: each takes its own parameters, and passes on
    unknown ones without a word."""
    if ":" in name:
        return ":".join(name.split(":")[:2])
    return name if name.startswith("vmas/") else name.split("/", 1)[0]


def _plain(value: Any) -> Any:
    """NumPy's and torch's scalars (``np.int64`` from ``np.arange``, ``np.float32``) as Python's
    numbers, in lists too; other values as they are."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):  # (a namedtuple stays)
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    shape = getattr(value, "shape", None)
    if not isinstance(value, bool | int | float | str) and shape is not None:
        # An array or a tensor: a 0-d one as its number, others as nested lists.
        convert = getattr(value, "item" if tuple(shape) == () else "tolist", None)
        if callable(convert):
            return _plain(convert())
    return value


def override_values(overrides: Sequence[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """Overrides given from Python as the dict of dotted keys they are, or a list (or tuple) of
    ``KEY=VALUE`` words parsed; ``{}`` for None. Anything else is a TypeError naming the forms."""
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        return dict(overrides)
    if isinstance(overrides, list | tuple) and all(isinstance(w, str) for w in overrides):
        return parse_overrides(list(overrides))
    held = ""
    if isinstance(overrides, list | tuple):
        odd = next(w for w in overrides if not isinstance(w, str))
        held = f" holding {type(odd).__name__}"
    raise TypeError(
        "overrides are a dict ({'algo.epochs': 5}) or a list of KEY=VALUE strings "
        f"(['algo.epochs=5']), got {type(overrides).__name__}{held}"
    )


def parse_overrides(items: list[str], example: str = "algo.epochs=5") -> dict[str, Any]:
    """``["algo.epochs=5", "model.hidden_sizes=[128,128]"]`` -> dict, values parsed as YAML.
    ``example``: the kind of setting the caller takes, shown when a word has no ``=``."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like KEY=VALUE (e.g. {example})")
        key, text = item.split("=", 1)
        try:
            value = yaml_value(text) if text != "" else ""
        except yaml.YAMLError:
            value = text
        # (a key given twice: the later value wins, as a script's common settings followed by
        # one run's own expect; the help of `mappo train` says so)
        key = key.strip()
        out[key] = value
    return out


def from_dict(data: dict[str, Any]) -> TrainConfig:
    """A config from a nested dict (a run's ``config.yaml`` or checkpoint), checked as a saved
    one (:func:`check`)."""
    return apply(TrainConfig(), data, saved=True)


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting the strings that :class:`_Loader` reads as numbers
    (``'1e-3'`` or ``'0o17'``, which YAML 1.1 takes for strings and writes bare), so that a
    saved config reads back to the same values."""


_Dumper.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))


def save(cfg: TrainConfig, path: Path) -> None:
    path.write_text(yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False), encoding="utf-8")


def describe_keys() -> str:
    """One line per config key with its default and its documentation; the algo.* keys of the
    value-decomposition family follow mappo's, tagged ``[iql/vdn/qmix]``."""
    lines = []
    for i, cls in enumerate(dict.fromkeys(ALGO_CLASSES.values())):
        cfg = TrainConfig(algo=cls())
        defaults = _flatten(to_dict(cfg))
        names = "/".join(n for n, c in ALGO_CLASSES.items() if c is cls)
        tag = f"[{names}] " if i else ""
        for key, f in keys_of(cfg).items():
            if i and not key.startswith("algo."):
                continue
            doc = f.metadata.get("doc", "")
            choices = f.metadata.get("choices")
            extra = f" (one of {', '.join(choices)})" if choices else ""
            lines.append(f"{tag}{key} = {defaults[key]!r}: {doc}{extra}")
    return "\n".join(lines)
