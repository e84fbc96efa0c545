"""One way to act, for every algorithm family: rollouts, evaluation and the inference API all
call :func:`act`.

A policy that can act (MAPPO's :class:`~mappo.nn.actor_critic.ActorCritic`, the value
family's :class:`~mappo.nn.q_agents.QNetworks`) implements :class:`Acting`: per-group acting
states (recurrent state, and for Q-agents the last action) and one step of one group.

Shapes: ``E`` envs, ``n`` agents of a group, ``k`` action heads, ``S`` acting-state size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass
class GroupAct:
    """One group's step: actions ``[E, n, k]`` int64 (or ``[E, n, d]`` float32 for a
    continuous group), the state after it ``[E, n, S]``, for a stochastic policy sampling the
    log-probabilities of the actions ``[E, n]``, and where the env must receive something else
    than what is stored (a Gaussian sample clipped or squashed into the action box) the env's
    actions."""

    actions: Tensor
    state: Tensor
    log_prob: Tensor | None = None
    env_actions: Tensor | None = None


class Acting(Protocol):
    """What :func:`act` needs of a policy."""

    def acting_states(self, batch: int, device: torch.device) -> dict[str, Tensor]:
        """Zero acting states ``[batch, n, S]`` per group (the state before an episode)."""
        ...

    def act_group(
        self,
        name: str,
        obs: Tensor,
        state: Tensor,
        starts: Tensor,
        mask: Tensor | None,
        greedy: bool,
        generator: torch.Generator | None,
        epsilon: float | None,
    ) -> GroupAct:
        """Act for group ``name``: ``obs [E, n, *obs_shape]``, ``state [E, n, S]``, ``starts
        [E]`` bool (an episode begins: the state is reset first), ``mask [E, n, A]`` bool."""
        ...


@dataclass
class Acted:
    """Every group's step: actions (as stored for learning), states after it, log-probabilities
    where sampled, and the actions to step the env with (``env_actions``)."""

    actions: dict[str, Tensor]
    states: dict[str, Tensor]
    log_probs: dict[str, Tensor]
    env_actions: dict[str, Tensor]


def act(
    policy: Acting,
    obs: dict[str, Tensor],
    masks: dict[str, Tensor],
    states: dict[str, Tensor],
    starts: Tensor,
    greedy: bool,
    generator: torch.Generator | None = None,
    epsilon: float | None = None,
) -> Acted:
    """Every group acts once, in the order of ``states`` (the policy's group order, which is the
    order random numbers are drawn in).

    ``greedy`` takes the most likely action (the highest Q); otherwise MAPPO samples from its
    policy and Q-agents act epsilon-greedily with ``epsilon`` (their configured final epsilon
    when ``None``). Groups without an entry in ``masks`` may take every action.
    """
    actions, new_states, log_probs, env_actions = {}, {}, {}, {}
    for name in states:
        out = policy.act_group(
            name, obs[name], states[name], starts, masks.get(name), greedy, generator, epsilon
        )
        actions[name] = out.actions
        env_actions[name] = out.actions if out.env_actions is None else out.env_actions
        new_states[name] = out.state
        if out.log_prob is not None:
            log_probs[name] = out.log_prob
    return Acted(actions, new_states, log_probs, env_actions)
