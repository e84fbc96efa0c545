"""MADDPG's networks: the actors (the value family's agent network, read as policy logits, or
as a deterministic action in a box) and one centralised critic of the joint action (Lowe et
al. 2017, Section 4.1; the MAPPO paper's off-policy baseline code, ``MADDPG_Actor`` /
``MADDPG_Critic``).

The critic ``Q(s, u_1, ..., u_N)`` reads the global state and every agent's action (a one-hot
block, or a box's components in ``[-1, 1]``), the groups in the env's order and the agents in
their group's order, through an MLP of ``model.hidden_sizes`` (with the model's activation and
LayerNorms) to one value: the team's return, as the cooperative tasks reward the team.
FACMAC's critic (Peng et al. 2021, Section 4; :class:`FactoredCritic`) is factored instead:
each agent's utility ``Q_a(o_a, u_a)`` from its own observation and action, the utilities of
all groups mixed with the state by QMIX's network (monotonic or not) or summed.

Shapes: ``L`` steps, ``B`` episodes, ``n`` agents of a group, ``N`` agents of all groups, ``A``
a group's actions (``d`` components in a box), ``W`` the joint action's width (``sum n * A``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mappo.acting import GroupAct
from mappo.config import ConfigError, MaddpgConfig, ModelConfig
from mappo.data import EnvSpec
from mappo.nn.actor_critic import picture_scale
from mappo.nn.coma import coma_policy, sample_allowed
from mappo.nn.layers import MLP, AgentLayerNorm, AgentLinear
from mappo.nn.q_agents import AgentNetworks, QMixer, VDNMixer, masked_argmax


def _flat_input(x: Tensor, axes: int, scale: float) -> Tensor:
    """An observation or state ``[..., *shape]`` (``axes`` of them) as floats ``[..., prod]``:
    byte inputs as floats, pictures scaled as ``model.encoder=cnn`` scales them."""
    x = x.flatten(-axes) if axes > 1 else x
    if not x.is_floating_point() or scale != 1.0:
        x = x.float() * scale
    return x


class JointCritic(nn.Module):
    """``Q(s, u)``: state ``[..., *state_shape]`` and joint action ``[..., W]`` -> ``[...]``."""

    def __init__(self, spec: EnvSpec, model: ModelConfig) -> None:
        super().__init__()
        # a picture state is read flat, scaled as model.encoder=cnn scales pictures
        self.state_scale = picture_scale(spec.state_shape, model)
        self.state_axes = len(spec.state_shape)
        self.width = sum(g.num_agents * g.action.total for g in spec.groups.values())
        in_features = math.prod(spec.state_shape) + self.width
        self.mlp = MLP(
            in_features,
            list(model.hidden_sizes),
            model.activation,
            1,
            model.feature_norm,
            model.layer_norm,
        )
        self.head = nn.Linear(self.mlp.out_features, 1)
        # orthogonal with gain 1 and a zero bias, as the off-policy code's critic output
        nn.init.orthogonal_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, state: Tensor, joint: Tensor) -> Tensor:
        x = _flat_input(state, self.state_axes, self.state_scale)
        x = torch.cat([x.expand(*joint.shape[:-1], -1), joint], -1)
        return self.head(self.mlp(x)).squeeze(-1)


class AgentUtility(nn.Module):
    """One group's FACMAC utilities ``Q_a(o_a, u_a)``: observations ``[..., n, *obs]`` and
    action features ``[..., n, A]`` -> ``[..., n]``, through an MLP of ``model.hidden_sizes``
    (the agents' one-hot ids beside the inputs where ``model.agent_id``; one network per agent
    where ``model.share_params`` is false).

    ``model.feature_norm`` normalises the observation only: the actor loss differentiates the
    utility at the action's point, and a LayerNorm over the action's one-hot beside a few
    observation values bends that gradient away from the differences between actions (on the
    toy matching task FACMAC's actors then learned against their critic in one seed of six).
    """

    def __init__(self, obs_shape: tuple[int, ...], n: int, width: int, model: ModelConfig) -> None:
        super().__init__()
        self.obs_scale = picture_scale(obs_shape, model)
        self.obs_axes = len(obs_shape)
        self.agent_id = model.agent_id
        obs_features = math.prod(obs_shape)
        in_features = obs_features + width + (n if model.agent_id else 0)
        copies = 1 if model.share_params else n
        self.obs_norm = AgentLayerNorm(obs_features, copies) if model.feature_norm else None
        self.mlp = MLP(
            in_features,
            list(model.hidden_sizes),
            model.activation,
            copies,
            False,
            model.layer_norm,
        )
        self.head = AgentLinear(self.mlp.out_features, 1, copies)
        self.head.reset_parameters(1.0)  # orthogonal with gain 1, as the joint critic's head
        self.register_buffer("eye", torch.eye(n), persistent=False)

    def forward(self, obs: Tensor, features: Tensor) -> Tensor:
        x = _flat_input(obs, self.obs_axes, self.obs_scale)
        if self.obs_norm is not None:
            x = self.obs_norm(x)
        parts = [x.expand(*features.shape[:-1], -1), features]
        if self.agent_id:
            parts.append(self.eye.expand(*features.shape[:-1], -1))
        return self.head(self.mlp(torch.cat(parts, -1))).squeeze(-1)


class FactoredCritic(nn.Module):
    """FACMAC's critic: every group's :class:`AgentUtility`, their values ``[..., N]`` (groups
    in the env's order) mixed with the state ``[..., *state_shape]`` into ``Q_tot [...]``."""

    def __init__(self, spec: EnvSpec, model: ModelConfig, algo: MaddpgConfig) -> None:
        super().__init__()
        self.utilities = nn.ModuleDict(
            {
                name: AgentUtility(g.obs_shape, g.num_agents, g.action.total, model)
                for name, g in spec.groups.items()
            }
        )
        self.state_scale = picture_scale(spec.state_shape, model)
        self.state_axes = len(spec.state_shape)
        self.mixer: nn.Module = (
            VDNMixer()
            if algo.mixer == "vdn"
            else QMixer(
                math.prod(spec.state_shape),
                spec.num_agents,
                algo.mixing_embed_dim,
                algo.hypernet_layers,
                algo.hypernet_embed,
                monotonic=algo.mixer == "qmix",
            )
        )

    def utilities_of(self, obs: dict[str, Tensor], features: dict[str, Tensor]) -> Tensor:
        """Every agent's utility ``[..., N]``."""
        return torch.cat([u(obs[name], features[name]) for name, u in self.utilities.items()], -1)

    def forward(self, obs: dict[str, Tensor], features: dict[str, Tensor], state: Tensor) -> Tensor:
        q = self.utilities_of(obs, features)
        return self.mixer(q, _flat_input(state, self.state_axes, self.state_scale)).squeeze(-1)


class MaddpgNetworks(AgentNetworks):
    """Every group's actors and the critic (MADDPG's joint one, or FACMAC's factored one): what
    a MADDPG or FACMAC checkpoint's ``policy`` holds.

    A discrete group samples each head from the softmax of its actor's logits mixed with
    ``epsilon`` of the uniform distribution over the allowed actions, as COMA's actors do: the
    off-policy code's Gumbel sample followed by an epsilon-greedy choice has this distribution;
    greedy acting takes the largest logit. A group that acts in a box is deterministic (Lowe et
    al.'s continuous MADDPG): ``u = tanh(output)`` in ``[-1, 1]^d`` is what is stored and what
    the critic reads, the env receives ``low + (u + 1) (high - low) / 2``, and while training
    Gaussian noise of ``action_noise`` (in ``u``'s units) is added to ``u`` and clipped to the
    box.
    """

    def __init__(self, spec: EnvSpec, model: ModelConfig, algo: MaddpgConfig) -> None:
        super().__init__(spec, model, algo.name, algo.last_action, continuous=True, heads=True)
        for name, group in spec.groups.items():
            action = group.action
            if action.continuous and not action.bounded:  # (float32 bounds, low < high)
                raise ConfigError(
                    f"algo.name={algo.name} acts in a bounded box, but group '{name}' has "
                    f"unbounded action components (low={action.low}, high={action.high}; "
                    "float32 bounds with low < high are needed); give the env finite bounds, "
                    "or train it with algo.name=mappo"
                )
            if action.continuous:
                bounds = torch.tensor([action.low, action.high], dtype=torch.float32)
                self.register_buffer(f"bounds_{name}", bounds, persistent=False)
        # the actors' output layers start near zero (orthogonal, model.policy_gain: 0.01), as the
        # off-policy code's: near-uniform softmaxes, and a box's actions near its middle
        for agent in self.agents.values():
            agent.head.reset_parameters(gain=model.policy_gain)
        self.explore_epsilon = algo.epsilon_finish
        self.action_noise = algo.action_noise
        self.critic: nn.Module = (
            FactoredCritic(spec, model, algo) if algo.name == "facmac" else JointCritic(spec, model)
        )

    def continuous(self, name: str) -> bool:
        return self.spec.groups[name].action.continuous

    def joint(self, features: dict[str, Tensor]) -> Tensor:
        """Every group's action features ``[..., n, A]`` -> the critic's ``[..., W]``."""
        return torch.cat([features[name].flatten(-2) for name in self.agents], -1)

    def features(self, actions: dict[str, Tensor]) -> dict[str, Tensor]:
        """Stored actions per group -> the critic's features ``[..., n, A]`` (one-hot, or the
        box's components in ``[-1, 1]``)."""
        return {name: self.action_features(name, actions[name]) for name in self.agents}

    def heads(
        self, name: str, logits: Tensor, mask: Tensor | None
    ) -> list[tuple[Tensor, Tensor | None]]:
        """A discrete group's logits ``[..., A]`` and mask, cut into its heads' (one for most)."""
        nvec = list(self.spec.groups[name].action.nvec)
        masks = [None] * len(nvec) if mask is None else list(mask.split(nvec, -1))
        return list(zip(logits.split(nvec, -1), masks, strict=True))

    def greedy_features(
        self, outputs: dict[str, Tensor], masks: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """The actors' greedy actions as critic features: each head's allowed action of the
        largest logit (one-hot), or ``tanh`` of a box's outputs."""
        out = {}
        for name, x in outputs.items():
            if self.continuous(name):
                out[name] = torch.tanh(x)
                continue
            parts = [
                F.one_hot(masked_argmax(h, m), h.shape[-1]).to(x.dtype)
                for h, m in self.heads(name, x, masks.get(name))
            ]
            out[name] = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
        return out

    def to_env(self, name: str, u: Tensor) -> Tensor:
        """A box group's ``u`` in ``[-1, 1]^d`` -> the env's action in ``[low, high]``."""
        low, high = getattr(self, f"bounds_{name}")
        # from the middle, halves first: no overflow for bounds near the float32 maximum
        middle, half = low / 2.0 + high / 2.0, high / 2.0 - low / 2.0
        return torch.minimum(torch.maximum(middle + u * half, low), high)

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
    ) -> GroupAct:
        out, hidden = self.step_agent(name, obs, state, starts)
        if not self.continuous(name):  # each head as COMA's actors act
            eps = 0.0 if greedy else (self.explore_epsilon if epsilon is None else epsilon)
            picks = []
            for logits, allowed in self.heads(name, out, mask):
                probs = coma_policy(logits, allowed, eps)
                pick = probs.argmax(-1) if greedy else sample_allowed(probs, allowed, generator)
                picks.append(pick)
            action = torch.stack(picks, -1)  # [E, n, k]
            return GroupAct(action, self.next_state(name, hidden, action))
        u = torch.tanh(out)
        if not greedy and self.action_noise > 0.0:
            noise = torch.randn(u.shape, generator=generator, device=u.device, dtype=u.dtype)
            u = (u + self.action_noise * noise).clamp(-1.0, 1.0)
        return GroupAct(u, self.next_state(name, hidden, u), env_actions=self.to_env(name, u))
