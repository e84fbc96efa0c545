"""The value family's networks: recurrent Q-agents per group and the mixers that join them.

An agent maps its observation (+ its previous action, one-hot, + its one-hot id, each optional)
through an MLP and a GRU to one Q-value per action, as PyMARL's RNN agent (Rashid et al. 2018,
"QMIX", Section 6; Samvelyan et al. 2019, "SMAC"). A mixer turns the Q-values of the actions the
agents took into the team's: IQL keeps them apart, VDN sums them (Sunehag et al. 2018), QMIX
mixes them with a network whose weights a hypernetwork computes from the global state and keeps
non-negative, so that the team's Q is monotone in every agent's (Rashid et al. 2018, Eq. 5).

Shapes: ``L`` time steps, ``B`` episodes or envs, ``n`` agents of a group, ``N`` agents of all
groups, ``A`` actions of a group, ``H`` hidden size, ``C`` mixed values (1, or ``N`` for IQL).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mappo.acting import GroupAct
from mappo.config import ConfigError, ModelConfig, ValueConfig
from mappo.data import EnvSpec, GroupSpec
from mappo.nn.actor_critic import Trunk, check_images, picture_scale
from mappo.nn.layers import AgentLinear


class QAgent(nn.Module):
    """Q-values of one group's agents: ``[L, B, n, *obs] -> [L, B, n, A]``."""

    def __init__(
        self,
        group: GroupSpec,
        model: ModelConfig,
        last_action: bool,
        what: str = "the observations",
    ) -> None:
        super().__init__()
        n, A = group.num_agents, group.action.total
        self.num_actions = A
        self.copies = 1 if model.share_params else n
        self.agent_id = model.agent_id
        self.last_action = last_action
        in_features = math.prod(group.obs_shape) + (A if last_action else 0)
        in_features += n if model.agent_id else 0
        self.trunk = Trunk(in_features, model, self.copies, group.obs_shape, what)
        self.head = AgentLinear(self.trunk.out_features, A, self.copies)
        self.register_buffer("eye", torch.eye(n), persistent=False)

    @property
    def hidden_size(self) -> int:
        return self.trunk.state_size

    @property
    def acting_state_size(self) -> int:
        """Recurrent state plus, when it is an input, the previous action (one-hot)."""
        return self.hidden_size + (self.num_actions if self.last_action else 0)

    def forward(
        self,
        obs: Tensor,
        last_action: Tensor | None,
        state: Tensor,
        starts: Tensor,
        whole_episodes: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """``obs [L, B, n, *obs_shape]``, ``last_action [L, B, n, A]`` (one-hot, zeros at an
        episode start), ``state [B, n, H]``, ``starts [L, B]`` -> Q ``[L, B, n, A]``, state.
        ``whole_episodes``: every sequence is one episode from its first step."""
        x = obs.flatten(3) if obs.dim() > 4 else obs
        x = x if x.is_floating_point() else x.float()  # an env's byte observations
        parts = [x]
        if self.last_action:
            parts.append(last_action)
        if self.agent_id:
            parts.append(self.eye.expand(*x.shape[:-1], -1))
        x = torch.cat(parts, -1) if len(parts) > 1 else x
        h, state = self.trunk(x, state, starts, whole_episodes=whole_episodes)
        return self.head(h), state


def masked_argmax(q: Tensor, mask: Tensor | None) -> Tensor:
    """``[..., A] -> [...]`` int64: the allowed action with the highest Q."""
    if mask is None:
        return q.argmax(-1)
    return q.masked_fill(~mask, -torch.inf).argmax(-1)


def epsilon_greedy(
    q: Tensor, mask: Tensor | None, epsilon: float, generator: torch.Generator | None
) -> Tensor:
    """``[E, n, A] -> [E, n]``: with probability ``epsilon`` an allowed action uniformly at
    random, else the greedy one. A masked action is never picked."""
    greedy = masked_argmax(q, mask)
    if epsilon <= 0.0:
        return greedy
    explore = torch.rand(q.shape[:-1], generator=generator, device=q.device) < epsilon
    noise = torch.rand(q.shape, generator=generator, device=q.device)
    # Uniform noise, zeroed on masked actions: its argmax is a uniform draw among the allowed
    # ones (ties have probability zero; +1 keeps an allowed action above every masked one).
    scores = noise + 1.0 if mask is None else (noise + 1.0) * mask
    return torch.where(explore, scores.argmax(-1), greedy)


class VDNMixer(nn.Module):
    """``Q_tot = sum_a Q_a``: ``[..., N] -> [..., 1]`` (Sunehag et al. 2018)."""

    def forward(self, q: Tensor, state: Tensor) -> Tensor:
        return q.sum(-1, keepdim=True)


class QMixer(nn.Module):
    """QMIX's mixing network: ``Q_tot = w2(s) . elu(W1(s) q + b1(s)) + V(s)`` with ``W1`` and
    ``w2`` taken in absolute value (monotone in every ``q_a``); ``[..., N] -> [..., 1]``.

    The hypernetworks producing the weights are one linear layer, or two with a ReLU between
    (``hypernet_layers``); the state-dependent biases are one layer (``b1``) and two (``V``), as
    in the QMIX paper's Section 4. ``monotonic=False`` keeps the weights' signs (FACMAC's
    non-monotonic mixer, whose critic only has to be differentiated, never maximised).
    """

    def __init__(
        self,
        state_dim: int,
        num_agents: int,
        embed: int,
        hypernet_layers: int,
        hyper_embed: int,
        monotonic: bool = True,
    ) -> None:
        super().__init__()
        self.num_agents, self.embed = num_agents, embed
        self.monotonic = monotonic

        def hyper(out: int) -> nn.Module:
            if hypernet_layers == 1:
                return nn.Linear(state_dim, out)
            return nn.Sequential(
                nn.Linear(state_dim, hyper_embed), nn.ReLU(), nn.Linear(hyper_embed, out)
            )

        self.hyper_w1 = hyper(num_agents * embed)
        self.hyper_w2 = hyper(embed)
        self.hyper_b1 = nn.Linear(state_dim, embed)
        self.value = nn.Sequential(nn.Linear(state_dim, embed), nn.ReLU(), nn.Linear(embed, 1))

    def forward(self, q: Tensor, state: Tensor) -> Tensor:
        """``q [..., N]``, ``state [..., state_dim]`` -> ``[..., 1]``."""
        lead = q.shape[:-1]
        w1, w2 = self.hyper_w1(state), self.hyper_w2(state)
        if self.monotonic:
            w1, w2 = w1.abs(), w2.abs()
        w1 = w1.reshape(*lead, self.num_agents, self.embed)
        b1 = self.hyper_b1(state).unsqueeze(-2)  # [..., 1, embed]
        hidden = F.elu(q.unsqueeze(-2) @ w1 + b1)  # [..., 1, embed]
        w2 = w2.unsqueeze(-1)  # [..., embed, 1]
        return (hidden @ w2).squeeze(-1) + self.value(state)


class AgentNetworks(nn.Module):
    """Every group's recurrent agent network (Q-values, or policy logits for COMA), unrolled over
    stored episodes or stepped while acting. The acting state of an agent is its recurrent state
    followed by its previous action (one-hot per head; a continuous group's action as stored),
    both zero when an episode starts. ``continuous``: whether groups that act in a box are
    accepted (one output per component); ``heads``: whether groups of several discrete heads are
    (one output per action of every head): MADDPG's actors take both."""

    def __init__(
        self,
        spec: EnvSpec,
        model: ModelConfig,
        algo_name: str,
        last_action: bool,
        continuous: bool = False,
        heads: bool = False,
    ) -> None:
        super().__init__()
        self.spec = spec
        for name, group in spec.groups.items():
            if group.action.continuous and not continuous:
                raise ConfigError(
                    f"algo.name={algo_name} needs discrete actions, but group '{name}' acts in a "
                    f"continuous box of {group.action.num_heads} components; train this env with "
                    "algo.name=mappo (or use the env's discrete actions, if it has them)"
                )
            if not group.action.continuous and group.action.num_heads != 1 and not heads:
                raise ConfigError(
                    f"algo.name={algo_name} needs one discrete action per agent, but group "
                    f"'{name}' has {group.action.num_heads} action heads {group.action.nvec}; "
                    "train this env with algo.name=mappo"
                )
        self.agents = nn.ModuleDict(
            {
                name: QAgent(g, model, last_action, f"group '{name}'s observations")
                for name, g in spec.groups.items()
            }
        )
        check_images([a.trunk for a in self.agents.values()], spec, model, state=False)

    def unroll(self, obs: dict[str, Tensor], actions: dict[str, Tensor]) -> dict[str, Tensor]:
        """Outputs ``[L, B, n, A]`` per group over whole episodes that start at step 0;
        ``actions [L, B, n, 1]`` are the actions taken (their one-hot, shifted by one step, is
        the previous-action input)."""
        out = {}
        for name, agent in self.agents.items():
            L, B = obs[name].shape[:2]
            last = None
            if agent.last_action:
                taken = self.action_features(name, actions[name])
                last = torch.cat([torch.zeros_like(taken[:1]), taken[:-1]])
            starts = torch.zeros(L, B, dtype=torch.bool, device=obs[name].device)
            starts[0] = True
            state = obs[name].new_zeros(B, obs[name].shape[2], agent.hidden_size)
            out[name], _ = agent(obs[name], last, state, starts, whole_episodes=True)
        return out

    def acting_states(self, batch: int, device: torch.device) -> dict[str, Tensor]:
        return {
            name: torch.zeros(
                batch, g.num_agents, self.agents[name].acting_state_size, device=device
            )
            for name, g in self.spec.groups.items()
        }

    def step_agent(
        self, name: str, obs: Tensor, state: Tensor, starts: Tensor
    ) -> tuple[Tensor, Tensor]:
        """One step of group ``name``'s agents: ``obs [E, n, ...]``, acting ``state``, ``starts
        [E]`` -> outputs ``[E, n, A]`` and the recurrent part of the new state."""
        agent = self.agents[name]
        state = state * (~starts).to(state.dtype)[:, None, None]
        hidden, last = state.split([agent.hidden_size, state.shape[-1] - agent.hidden_size], -1)
        out, hidden = agent(obs.unsqueeze(0), last.unsqueeze(0), hidden, starts.unsqueeze(0))
        return out[0], hidden

    def action_features(self, name: str, actions: Tensor) -> Tensor:
        """Group ``name``'s stored actions ``[..., n, k]`` int64 (or ``[..., n, d]`` float32 in a
        box) as network inputs ``[..., n, A]``: one-hot per head, joined, or the components as
        they are."""
        action = self.spec.groups[name].action
        if action.continuous:
            return actions.float()
        if len(action.nvec) == 1:
            return F.one_hot(actions[..., 0], action.nvec[0]).float()
        return torch.cat(
            [F.one_hot(actions[..., h], size).float() for h, size in enumerate(action.nvec)], -1
        )

    def next_state(self, name: str, hidden: Tensor, stored: Tensor) -> Tensor:
        """The acting state after the actions ``stored`` ``[E, n, k]`` (``[E, n, d]`` in a
        box)."""
        agent = self.agents[name]
        if not agent.last_action:
            return hidden
        return torch.cat([hidden, self.action_features(name, stored).to(hidden.dtype)], -1)


class QNetworks(AgentNetworks):
    """Every group's Q-agent and the mixer: what a value-family checkpoint's ``policy`` holds.

    Implements :class:`mappo.acting.Acting` with epsilon-greedy actions.
    """

    def __init__(self, spec: EnvSpec, model: ModelConfig, algo: ValueConfig) -> None:
        super().__init__(spec, model, algo.name, algo.last_action)
        self.explore_epsilon = algo.epsilon_finish
        self.state_scale = picture_scale(spec.state_shape, model)
        state_dim = math.prod(spec.state_shape)
        self.mixer: nn.Module | None = {
            "iql": lambda: None,
            "vdn": VDNMixer,
            "qmix": lambda: QMixer(
                state_dim,
                spec.num_agents,
                algo.mixing_embed_dim,
                algo.hypernet_layers,
                algo.hypernet_embed,
            ),
        }[algo.name]()

    def mix(self, q: Tensor, state: Tensor) -> Tensor:
        """Agent Q-values of all groups ``[..., N]`` and the state ``[..., *state_shape]`` ->
        ``[..., C]`` (``C = N`` without a mixer)."""
        if self.mixer is None:
            return q
        state = state.flatten(q.dim() - 1)
        if self.state_scale != 1.0:
            state = state.float() * self.state_scale
        return self.mixer(q, state)

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
        """Epsilon-greedy (greedy when ``greedy``; ``epsilon`` None = the final epsilon)."""
        q, hidden = self.step_agent(name, obs, state, starts)
        eps = 0.0 if greedy else (self.explore_epsilon if epsilon is None else epsilon)
        action = epsilon_greedy(q, mask, eps, generator)
        action = action.unsqueeze(-1)
        return GroupAct(action, self.next_state(name, hidden, action))
