"""Per-group actors and critics, and the container that holds them for a whole environment.

Shapes: ``L`` time steps, ``*B`` batch dims (envs, or chunks), ``n`` agents of the group, ``C``
critic copies (1 when every agent of the group would feed the critic the same input, else ``n``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mappo.acting import GroupAct
from mappo.config import AlgoConfig, ConfigError, ModelConfig
from mappo.data import EnvSpec, EnvStep, GroupSpec, channel_axis
from mappo.nn.distributions import DiagGaussian, MultiCategorical
from mappo.nn.layers import MLP, AgentLinear, ConvEncoder, RecurrentCore, image_layout
from mappo.nn.normalizers import PopArt, ValueNorm


def picture_layout(shape: tuple[int, ...], spec: EnvSpec, cfg: ModelConfig) -> str:
    """The layout an input of ``shape`` is read in: ``model.image_layout``, except that with
    ``auto`` a picture laid over the observations' pixels (a state of the agents' pictures
    stacked along their channels, as the adapters join them, or an env's own state of the same
    size) takes the observations' layout, which the stacked channels may hide from the sizes
    alone (``[5, 10, 6]`` for two ``[5, 10, 3]`` pictures would read as channels first)."""
    if cfg.image_layout != "auto" or len(shape) != 3:
        return cfg.image_layout
    for group in spec.groups.values():
        obs = tuple(group.obs_shape)
        axis = channel_axis(obs) if len(obs) == 3 else None
        if axis is None:
            continue
        pixels = [v for i, v in enumerate(obs) if i != axis]
        if [v for i, v in enumerate(shape) if i != axis] == pixels:
            return "hwc" if axis == 2 else "chw"
    return cfg.image_layout


def image_encoder(
    in_features: int,
    shape: tuple[int, ...],
    cfg: ModelConfig,
    copies: int,
    what: str,
    layout: str | None = None,
) -> ConvEncoder | None:
    """The convolutions of ``model.encoder=cnn`` over an input whose unflattened ``shape`` is
    an image (three axes); ``None`` for other inputs and for ``model.encoder=mlp``.
    ``layout``: the one to read it in (:func:`picture_layout`; default ``model.image_layout``)."""
    if cfg.encoder != "cnn" or len(shape) != 3:
        return None
    layers = list(zip(cfg.cnn_channels, cfg.cnn_kernels, cfg.cnn_strides, strict=True))
    return ConvEncoder(
        in_features,
        image_layout(tuple(shape), layout or cfg.image_layout, what),
        layers,
        cfg.activation,
        copies,
        cfg.image_scale,
        what,
    )


def picture_scale(shape: tuple[int, ...], cfg: ModelConfig) -> float:
    """What an input of ``shape`` is multiplied by where a network reads it flat beside the
    convolutions of ``model.encoder=cnn`` (QMIX's hypernetworks and COMA's critic read the
    state so): ``model.image_scale`` for a picture (three axes), as the convolutions see it,
    else 1. Pixels of 0-255 would otherwise enter those layers unnormalised."""
    return cfg.image_scale if cfg.encoder == "cnn" and len(shape) == 3 else 1.0


def check_images(trunks: list[Trunk], spec: EnvSpec, cfg: ModelConfig, state: bool = True) -> None:
    """Refuse ``model.encoder=cnn`` where no network of the env reads an image: it would train
    the MLP on flat inputs while the user expects convolutions. ``state``: whether a network
    with an encoder reads the global state (MAPPO's critic; not the value family's agents)."""
    if cfg.encoder != "cnn" or any(t.encoder is not None for t in trunks):
        return
    shapes = ", ".join(f"'{n}' {tuple(g.obs_shape)}" for n, g in spec.groups.items())
    inputs = f"observations are {shapes}"
    if state:
        inputs += f" and its state {tuple(spec.state_shape)}"
    raise ConfigError(
        f"model.encoder=cnn convolves inputs that are images (three axes), but this env's "
        f"{inputs}; drop model.encoder=cnn (or give the env image observations)"
    )


class Trunk(nn.Module):
    """Optional convolutions over an image input (``model.encoder=cnn``), the MLP base and an
    optional recurrent layer: ``[L, *B, C, in] -> [L, *B, C, H]``. ``shape``: the input's shape
    before flattening (an agent id appended to it aside); ``what`` names it in errors."""

    def __init__(
        self,
        in_features: int,
        cfg: ModelConfig,
        copies: int,
        shape: tuple[int, ...] = (),
        what: str = "the input",
        layout: str | None = None,
    ) -> None:
        super().__init__()
        self.encoder = image_encoder(in_features, shape, cfg, copies, what, layout)
        if self.encoder is not None:
            in_features = self.encoder.out_features
        self.mlp = MLP(
            in_features,
            list(cfg.hidden_sizes),
            cfg.activation,
            copies,
            cfg.feature_norm,
            cfg.layer_norm,
        )
        self.out_features = self.mlp.out_features
        self.rnn = (
            RecurrentCore(self.out_features, cfg.recurrent, copies, cfg.layer_norm)
            if cfg.recurrent != "none"
            else None
        )

    @property
    def state_size(self) -> int:
        return self.rnn.state_size if self.rnn is not None else 0

    def features(self, x: Tensor) -> Tensor:
        """The encoder and the MLP (no recurrence): ``[..., C, in] -> [..., C, H]``."""
        return self.mlp(x if self.encoder is None else self.encoder(x))

    def forward(
        self,
        x: Tensor,
        state: Tensor,
        starts: Tensor,
        inject: Tensor | None = None,
        whole_episodes: bool = False,
    ) -> tuple[Tensor, Tensor]:
        h = self.features(x)
        if self.rnn is None:
            return h, state
        return self.rnn(h, state, starts, inject, whole_episodes)


def _precision(bf16: bool, x: Tensor) -> contextlib.AbstractContextManager:
    """``model.precision``: the networks' matrix products in bfloat16 (``torch.autocast`` on
    ``x``'s device) or as they are. Only the networks' own computations are inside it: their
    outputs are cast back to float32, so distributions, losses and the env never see bf16."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, dtype=torch.bfloat16)


def _as_float(x: Tensor) -> Tensor:
    """Network inputs stored as bytes (a rollout of an env with byte observations) as float32;
    float inputs as they are."""
    return x if x.is_floating_point() else x.float()


Policy = MultiCategorical | DiagGaussian
"""A group's action distribution: categorical heads, or a Gaussian over a box."""


class Actor(nn.Module):
    """The policy of one group: observation (+ agent id) -> a masked multi-head categorical, or
    for a continuous group a diagonal Gaussian (``model.action_bounds``, ``log_std_init``,
    ``state_dependent_std``)."""

    def __init__(self, group: GroupSpec, cfg: ModelConfig, what: str = "the observations") -> None:
        super().__init__()
        n = group.num_agents
        self.nvec = group.action.nvec
        self.continuous = group.action.continuous
        self.copies = 1 if cfg.share_params else n
        self.agent_id = cfg.agent_id
        self.bf16 = cfg.precision == "bf16"
        in_features = math.prod(group.obs_shape) + (n if cfg.agent_id else 0)
        self.trunk = Trunk(in_features, cfg, self.copies, group.obs_shape, what)
        d = group.action.total
        self.state_dependent_std = self.continuous and cfg.state_dependent_std
        out = 2 * d if self.state_dependent_std else d
        self.head = AgentLinear(self.trunk.out_features, out, self.copies)
        self.head.reset_parameters(gain=cfg.policy_gain)
        self.register_buffer("eye", torch.eye(n), persistent=False)
        if self.continuous:
            if cfg.action_bounds == "tanh" and not group.action.bounded:
                raise ConfigError(
                    f"model.action_bounds=tanh needs finite action bounds with high > low, but "
                    f"agents {list(group.agents)} act in the box low={group.action.low} "
                    f"high={group.action.high}; use model.action_bounds=clip"
                )
            if not _LOG_STD_MIN <= cfg.log_std_init <= _LOG_STD_MAX:
                raise ConfigError(
                    f"model.log_std_init={cfg.log_std_init} is outside [{_LOG_STD_MIN}, "
                    f"{_LOG_STD_MAX}] (std {math.exp(_LOG_STD_MIN):.1e} to "
                    f"{math.exp(_LOG_STD_MAX):.1f}); choose a value inside"
                )
            self.bounds = cfg.action_bounds
            self.register_buffer("low", torch.tensor(group.action.low), persistent=False)
            self.register_buffer("high", torch.tensor(group.action.high), persistent=False)
            if self.state_dependent_std:
                # Start at log_std_init: the std half of the head begins at zero weight.
                with torch.no_grad():
                    self.head.weight[:, :, d:].zero_()
                    self.head.bias[:, d:].fill_(cfg.log_std_init)
            else:
                # [copies, d]: one learned log-std per action component (per agent when the
                # parameters are not shared), broadcast over the batch.
                self.log_std = nn.Parameter(torch.full((self.copies, d), cfg.log_std_init))

    @property
    def state_size(self) -> int:
        return self.trunk.state_size

    def forward(
        self,
        obs: Tensor,
        state: Tensor,
        starts: Tensor,
        mask: Tensor | None,
        inject: Tensor | None = None,
    ) -> tuple[Policy, Tensor]:
        """``obs [L, *B, n, *obs_shape]``, ``state [*B, n, S]``, ``starts [L, *B]``,
        ``mask [L, *B, n, sum(nvec)]`` -> distribution over ``[L, *B, n]`` and the final state.
        ``inject [L, *B, n, S]`` is added to the state after the reset at ``starts`` (see
        :class:`~mappo.nn.layers.RecurrentCore`). Continuous groups have no mask."""
        dtype = state.dtype
        with _precision(self.bf16, obs):
            x = _as_float(self._inputs(obs, starts.dim()))
            h, state = self.trunk(x, state, starts, inject)
            out = self.head(h)
        return self._policy(out.float(), mask), state.to(dtype)

    @property
    def rowwise(self) -> bool:
        """Whether every agent row's output depends on that row alone (no recurrence, one set
        of parameters for all agents), so that rows can be evaluated apart
        (:meth:`forward_rows`)."""
        return self.trunk.rnn is None and self.copies == 1

    def forward_rows(self, obs: Tensor, rows: Tensor, mask: Tensor | None) -> Policy:
        """The policy at the agent rows ``rows`` (bool ``[L, *B, n]``) only: ``obs`` and ``mask``
        as in :meth:`forward` -> a distribution over ``[K]``, the ``K`` selected rows in
        row-major order. Only for a :attr:`rowwise` actor (the loss uses it to skip the rows
        its masks leave out, e.g. the players who wait for their turn)."""
        with _precision(self.bf16, obs):
            # the rows picked before a byte rollout's conversion: only they are converted
            x = _as_float(self._inputs(obs, rows.dim() - 1)[rows])  # [K, in]
            out = self.head(self.trunk.features(x))
        return self._policy(out.float(), None if mask is None else mask[rows])

    def _inputs(self, obs: Tensor, lead: int) -> Tensor:
        """``obs [*lead dims, n, *obs_shape]`` flattened to ``[*lead, n, in]``, agent id added."""
        x = obs.flatten(lead + 1) if obs.dim() > lead + 2 else obs
        if self.agent_id:
            x = torch.cat([_as_float(x), self.eye.expand(*x.shape[:-1], -1)], -1)
        return x

    def _policy(self, out: Tensor, mask: Tensor | None) -> Policy:
        """The distribution of the head's output ``out [..., out]`` (``mask [..., sum(nvec)]``)."""
        if not self.continuous:
            return MultiCategorical(out, self.nvec, mask)
        if self.state_dependent_std:
            mean, log_std = out.chunk(2, dim=-1)
        else:
            mean, log_std = out, self.log_std
        # Bounds keep exp() finite and the std from collapsing to 0 (a NaN log-prob), and stop
        # an entropy bonus from widening the std without end once tanh actions saturate.
        log_std = log_std.clamp(_LOG_STD_MIN, _LOG_STD_MAX)
        return DiagGaussian(mean, log_std, self.low, self.high, self.bounds)


_LOG_STD_MIN, _LOG_STD_MAX = -20.0, 2.0


class Critic(nn.Module):
    """The value function of one group: ``[L, *B, C, in] -> normalised values [L, *B, C]``."""

    def __init__(
        self,
        in_features: int,
        copies: int,
        cfg: ModelConfig,
        value_norm: str,
        shape: tuple[int, ...] = (),
        what: str = "the critic's input",
        layout: str | None = None,
    ) -> None:
        super().__init__()
        self.copies = copies
        self.in_features = in_features
        self.bf16 = cfg.precision == "bf16"
        if cfg.critic_hidden_sizes is not None:  # (a critic wider than its actors)
            cfg = dataclasses.replace(cfg, hidden_sizes=list(cfg.critic_hidden_sizes))
        if not cfg.recurrent_critic:  # (feed-forward beside recurrent actors)
            cfg = dataclasses.replace(cfg, recurrent="none")
        self.trunk = Trunk(in_features, cfg, copies, shape, what, layout)
        self.head = AgentLinear(self.trunk.out_features, 1, copies)
        self.head.reset_parameters(gain=1.0)
        self.normalizer: ValueNorm | None = {
            "valuenorm": lambda: ValueNorm(1),
            "popart": lambda: PopArt(1),
            "none": lambda: None,
        }[value_norm]()

    @property
    def state_size(self) -> int:
        return self.trunk.state_size

    def forward(
        self, x: Tensor, state: Tensor, starts: Tensor, inject: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        dtype = state.dtype
        x = _as_float(x)
        with _precision(self.bf16, x):
            h, state = self.trunk(x, state, starts, inject)
            v = self.head(h)
        return v.float().squeeze(-1), state.to(dtype)

    @property
    def rowwise(self) -> bool:
        """As :attr:`Actor.rowwise`: no recurrence and one set of parameters for all rows."""
        return self.trunk.rnn is None and self.copies == 1

    def forward_rows(self, x: Tensor, rows: Tensor) -> Tensor:
        """Normalised values ``[K]`` at the rows ``rows`` (bool ``[L, *B, C]``) of ``x [L, *B, C,
        in]`` only, in row-major order; for a :attr:`rowwise` critic."""
        with _precision(self.bf16, x):
            v = self.head(self.trunk.features(_as_float(x[rows])))
        return v.float().squeeze(-1)

    def denormalize(self, v: Tensor) -> Tensor:
        return self.normalizer.denormalize(v.unsqueeze(-1)).squeeze(-1) if self.normalizer else v

    def update_normalizer(self, returns: Tensor) -> None:
        """Feed value targets ``[...]`` to the normaliser (PopArt also rescales the head)."""
        if isinstance(self.normalizer, PopArt):
            self.normalizer.update(returns.reshape(-1, 1), self.head.weight, self.head.bias)
        elif self.normalizer is not None:
            self.normalizer.update(returns.reshape(-1, 1))

    def normalize(self, returns: Tensor) -> Tensor:
        if self.normalizer is None:
            return returns
        return self.normalizer.normalize(returns.unsqueeze(-1)).squeeze(-1)


def critic_input_shape(spec: EnvSpec, name: str, source: str) -> tuple[int, ...]:
    """The unflattened shape of group ``name``'s critic input from ``source`` (an
    ``algo.critic_input``), before any agent id."""
    group = spec.groups[name]
    if source == "concat_obs":
        return (group.num_agents * math.prod(group.obs_shape),)
    shape = {"state": spec.state_shape, "agent_state": group.agent_state_shape or ()}
    return tuple(shape.get(source, group.obs_shape))


@dataclass
class CriticInput:
    """How a group's critic input is built from an :class:`EnvStep`."""

    source: str  # "state" | "agent_state" | "local" | "concat_obs"
    copies: int  # 1 = one value per env, shared by the group's agents; n = one per agent
    agent_id: bool
    death_mask: bool


class ActorCritic(nn.Module):
    """The actors and critics of every group of an environment."""

    def __init__(self, spec: EnvSpec, model: ModelConfig, algo: AlgoConfig) -> None:
        super().__init__()
        self.spec = spec
        self.actors = nn.ModuleDict()
        self.critics = nn.ModuleDict()
        self.critic_inputs: dict[str, CriticInput] = {}
        for name, group in spec.groups.items():
            n = group.num_agents
            self.actors[name] = Actor(group, model, f"group '{name}'s observations")
            source = algo.critic_input
            if source == "agent_state" and group.agent_state_shape is None:
                raise ConfigError(
                    f"config field 'algo.critic_input' is 'agent_state' but this env gives "
                    f"group '{name}' no agent-specific state; set algo.critic_input=state"
                )
            if source == "concat_obs" and model.encoder == "cnn" and len(group.obs_shape) == 3:
                raise ConfigError(
                    f"config field 'algo.critic_input' is 'concat_obs', which lays group "
                    f"'{name}'s pictures end to end as one flat input, but model.encoder=cnn "
                    "reads pictures; set algo.critic_input=state (the adapters stack the "
                    "agents' pictures along their channels) or model.encoder=mlp"
                )
            shape = critic_input_shape(spec, name, source)
            width = math.prod(shape)
            agent_id = model.agent_id or algo.death_masked_critic
            # With the global state as input, shared parameters and nothing agent-specific, every
            # agent's critic sees the same input and returns the same value: compute it once per
            # env. The loss against each agent's target is unchanged (the value is broadcast).
            per_env = source in ("state", "concat_obs") and model.share_params and not agent_id
            copies = 1 if per_env else n
            self.critic_inputs[name] = CriticInput(
                source, copies, agent_id, algo.death_masked_critic
            )
            self.critics[name] = Critic(
                width + (n if agent_id else 0),
                1 if model.share_params else copies,
                model,
                algo.value_norm,
                tuple(shape),
                f"group '{name}'s critic input ({source})",
                picture_layout(tuple(shape), spec, model),
            )
            self.register_buffer(f"eye_{name}", torch.eye(n), persistent=False)
        trunks = [m.trunk for m in (*self.actors.values(), *self.critics.values())]
        check_images(trunks, spec, model)

    def critic_input(self, name: str, step: EnvStep, final: bool = False) -> Tensor:
        """The critic input ``[*B, C, in]`` of group ``name`` at ``step`` (``final``: the
        pre-reset observation the last episode ended on)."""
        ci = self.critic_inputs[name]
        group = self.spec.groups[name]
        if ci.source in ("state", "concat_obs"):
            if ci.source == "state":
                x = (step.final_state if final else step.state).flatten(1).unsqueeze(1)
            else:  # the group's observations side by side, agent by agent
                x = (step.final_obs if final else step.obs)[name].flatten(1).unsqueeze(1)
            if ci.copies > 1:
                x = x.expand(-1, ci.copies, -1)
        elif ci.source == "agent_state":
            x = (step.final_agent_state if final else step.agent_state)[name]
            x = x.flatten(2)
        else:
            obs = (step.final_obs if final else step.obs)[name]
            x = obs.flatten(2)
        if ci.death_mask:
            x = x * step.alive[name].unsqueeze(-1).to(x.dtype)
        if ci.agent_id:
            eye = getattr(self, f"eye_{name}")
            x = torch.cat([x, eye.expand(x.shape[0], group.num_agents, -1)], -1)
        return x

    def initial_states(
        self, batch: int, device: torch.device
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Zero recurrent states ``[batch, n, S]`` (actors) and ``[batch, C, S]`` (critics),
        float32 as the rollout stores them (whatever torch's default dtype)."""
        zeros = functools.partial(torch.zeros, dtype=torch.float32, device=device)
        actor = {
            name: zeros(batch, self.spec.groups[name].num_agents, a.state_size)
            for name, a in self.actors.items()
        }
        critic = {
            name: zeros(batch, self.critic_inputs[name].copies, c.state_size)
            for name, c in self.critics.items()
        }
        return actor, critic

    # -- acting (the protocol of mappo.acting) ------------------------------------------------
    def acting_states(self, batch: int, device: torch.device) -> dict[str, Tensor]:
        """Zero actor recurrent states ``[batch, n, S]`` per group."""
        return self.initial_states(batch, device)[0]

    def act_group(
        self,
        name: str,
        obs: Tensor,
        state: Tensor,
        starts: Tensor,
        mask: Tensor | None,
        greedy: bool,
        generator: torch.Generator | None,
        epsilon: float | None = None,
        noise: Tensor | None = None,
    ) -> GroupAct:
        """One step of group ``name``'s actor: the mode when ``greedy``, else a sample and its
        log-probability (``epsilon`` is for Q-agents and ignored here). ``noise`` replaces the
        sample's draw from ``generator`` (:meth:`draw_noise`)."""
        dist, state = self.actors[name](
            obs.unsqueeze(0),
            state,
            starts.unsqueeze(0),
            None if mask is None else mask.unsqueeze(0),
        )
        if greedy:
            action = dist.mode()[0]
            return GroupAct(action, state, env_actions=_to_env(dist, action))
        action = dist.sample(generator, noise)
        return GroupAct(
            action[0], state, dist.log_prob(action)[0], env_actions=_to_env(dist, action[0])
        )

    def draw_noise(self, batch: int, generator: torch.Generator) -> dict[str, Tensor]:
        """The random numbers that sampling one step of every group for ``batch`` envs draws
        from ``generator``, in the same order and shapes (uniform for categorical heads
        ``[1, batch, n, k, max(nvec)]``, standard normal for a box ``[1, batch, n, d]``): handed
        to :meth:`act_group` as ``noise``, they give exactly the actions of drawing inside it."""
        out: dict[str, Tensor] = {}
        for name, actor in self.actors.items():
            # (the head's device: next(self.parameters()) walks every module, on every step)
            dev = actor.head.weight.device
            n = self.spec.groups[name].num_agents
            if actor.continuous:
                shape = (1, batch, n, self.spec.groups[name].action.total)
                out[name] = torch.randn(shape, generator=generator, device=dev)
            else:
                shape = (1, batch, n, len(actor.nvec), max(actor.nvec))
                out[name] = torch.rand(shape, generator=generator, device=dev)
        return out

    def draw_noises(self, steps: int, batch: int, generator: torch.Generator) -> dict[str, Tensor]:
        """:meth:`draw_noise` for ``steps`` consecutive steps, stacked: ``[steps, 1, batch, ...]``
        per group, the same numbers as ``steps`` calls of it. One group of categorical heads
        (uniform numbers, which torch draws one after another on a CPU as on a GPU's single
        stream) takes them in one call; otherwise step by step (the groups interleave, and
        torch draws normal numbers in blocks)."""
        if len(self.actors) == 1:
            name, actor = next(iter(self.actors.items()))
            if not actor.continuous and actor.head.weight.device.type == "cpu":
                n = self.spec.groups[name].num_agents
                shape = (steps, 1, batch, n, len(actor.nvec), max(actor.nvec))
                dev = actor.head.weight.device
                return {name: torch.rand(shape, generator=generator, device=dev)}
        draws = [self.draw_noise(batch, generator) for _ in range(steps)]
        return {name: torch.stack([d[name] for d in draws]) for name in draws[0]}


def _to_env(dist: Policy, actions: Tensor) -> Tensor | None:
    """What the env receives for ``actions``: clipped or squashed for a Gaussian; ``None`` (the
    actions themselves) for categorical heads."""
    return dist.to_env(actions) if isinstance(dist, DiagGaussian) else None
