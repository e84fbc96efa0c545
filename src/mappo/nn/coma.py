"""COMA's networks: recurrent actors (the value family's agent network, read as policy logits)
and the centralised counterfactual critic (Foerster et al. 2018, Section 4).

The critic gives, for one agent, the Q-value of each of its actions with the other agents'
actions held fixed: its input is the global state, the agent's observation, the other agents'
actions (one-hot; the agent's own block zeroed), every agent's previous action and the agent's
id, as PyMARL's ``COMACritic``. Shapes: ``L`` steps, ``B`` episodes, ``n`` agents, ``A``
actions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mappo.acting import GroupAct
from mappo.config import ComaConfig, ConfigError, ModelConfig
from mappo.data import EnvSpec
from mappo.nn.actor_critic import picture_scale
from mappo.nn.q_agents import AgentNetworks


def coma_policy(
    logits: Tensor, mask: Tensor | None, epsilon: float, mask_before_softmax: bool = True
) -> Tensor:
    """Action probabilities ``[..., A]`` mixed with ``epsilon`` of the uniform distribution.
    ``mask_before_softmax``: the softmax over the allowed actions, mixed with the uniform
    distribution over them; otherwise (PyMARL's COMA, its ``mask_before_softmax: False``) the
    softmax over all ``A`` actions mixed with ``epsilon / A`` each, then the allowed actions'
    share renormalised. The two agree without epsilon (greedy acting) and where the logits
    are equal; they part where the policy favours actions that are masked."""
    if mask is not None and mask_before_softmax:
        logits = logits.masked_fill(~mask, -torch.inf)
    probs = torch.softmax(logits, -1)
    if epsilon > 0.0:
        if mask is None or not mask_before_softmax:
            uniform = torch.full_like(probs, 1.0 / probs.shape[-1])
        else:
            allowed = mask.to(probs.dtype)
            uniform = allowed / allowed.sum(-1, keepdim=True)
        probs = (1.0 - epsilon) * probs + epsilon * uniform
    if mask is not None and not mask_before_softmax:
        probs = probs * mask
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
    return probs


def sample_allowed(probs: Tensor, mask: Tensor | None, generator: torch.Generator | None) -> Tensor:
    """One action per row of ``probs [..., A]`` -> ``[...]`` int64, never a masked one."""
    # One draw by exponential races, as torch.multinomial's single draw makes it (the same
    # actions from the same generator), without its checks of the probabilities, which read
    # values back to the host: two waits on a GPU in every env step.
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    scores = probs / race
    if mask is not None:  # (probabilities that are NaN still pick an allowed action)
        scores = scores.masked_fill(~mask, -torch.inf)
    return scores.argmax(-1)


class ComaCritic(nn.Module):
    """``Q_a(s, u^-a, .)`` for every agent: ``[L, B] inputs -> [L, B, n, A]``."""

    def __init__(
        self, spec: EnvSpec, hidden: int, state_scale: float = 1.0, obs_scale: float = 1.0
    ) -> None:
        super().__init__()
        (group,) = spec.groups.values()
        # pictures scaled as model.encoder=cnn scales them (actor_critic.picture_scale)
        self.state_scale, self.obs_scale = state_scale, obs_scale
        n, A = group.num_agents, group.action.total
        self.n, self.A = n, A
        width = math.prod(spec.state_shape) + math.prod(group.obs_shape) + 2 * n * A + n
        self.net = nn.Sequential(
            nn.Linear(width, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, A),
        )
        # others[a] zeroes agent a's own block of the joint action.
        others = 1.0 - torch.eye(n).repeat_interleave(A, dim=1)  # [n, n * A]
        self.register_buffer("others", others, persistent=False)
        self.register_buffer("eye", torch.eye(n), persistent=False)

    def inputs(self, state: Tensor, obs: Tensor, actions: Tensor) -> Tensor:
        """``state [L, B, *S]``, ``obs [L, B, n, *O]``, ``actions [L, B, n]`` (int64, what each
        agent takes at step t) -> critic inputs ``[L, B, n, in]``."""
        L, B = obs.shape[:2]
        onehot = F.one_hot(actions, self.A).to(obs.dtype).reshape(L, B, 1, -1)
        last = torch.cat([torch.zeros_like(onehot[:1]), onehot[:-1]])
        if self.state_scale != 1.0:
            state = state.float() * self.state_scale
        if self.obs_scale != 1.0:
            obs = obs.float() * self.obs_scale
        parts = [
            state.reshape(L, B, 1, -1).expand(-1, -1, self.n, -1),
            obs.reshape(L, B, self.n, -1),
            onehot.expand(-1, -1, self.n, -1) * self.others,
            last.expand(-1, -1, self.n, -1),
            self.eye.expand(L, B, -1, -1),
        ]
        return torch.cat(parts, -1)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class ComaNetworks(AgentNetworks):
    """The actors of the (single) group and the critic: what a COMA checkpoint's ``policy``
    holds. Acting samples from :func:`coma_policy` (greedy: its most likely action)."""

    def __init__(self, spec: EnvSpec, model: ModelConfig, algo: ComaConfig) -> None:
        if len(spec.groups) != 1:
            raise ConfigError(
                f"algo.name=coma needs the agents in one group (its critic conditions on the "
                f"joint action); this env has groups {list(spec.groups)}; use algo.name=mappo"
            )
        super().__init__(spec, model, algo.name, algo.last_action)
        self.explore_epsilon = algo.epsilon_finish
        self.mask_before_softmax = algo.mask_before_softmax
        (group,) = spec.groups.values()
        self.critic = ComaCritic(
            spec,
            algo.critic_hidden,
            picture_scale(spec.state_shape, model),
            picture_scale(group.obs_shape, model),
        )

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
        logits, hidden = self.step_agent(name, obs, state, starts)
        if greedy:
            action = coma_policy(logits, mask, 0.0).argmax(-1)
        else:
            eps = self.explore_epsilon if epsilon is None else epsilon
            probs = coma_policy(logits, mask, eps, self.mask_before_softmax)
            action = sample_allowed(probs, mask, generator)
        action = action.unsqueeze(-1)
        return GroupAct(action, self.next_state(name, hidden, action))
