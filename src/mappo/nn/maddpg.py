"""MADDPG's networks for discrete actions: the actors (the value family's agent network, read as
policy logits) and one centralised critic of the joint action (Lowe et al. 2017, Section 4.1;
the MAPPO paper's off-policy baseline code, ``MADDPG_Actor`` / ``MADDPG_Critic``).

The critic ``Q(s, u_1, ..., u_N)`` reads the global state and every agent's action as a one-hot
block, the groups in the env's order and the agents in their group's order, through an MLP of
``model.hidden_sizes`` (with the model's activation and LayerNorms) to one value: the team's
return, as the cooperative tasks reward the team. Shapes: ``L`` steps, ``B`` episodes, ``n``
agents of a group, ``A`` its actions, ``W`` the joint action's width (``sum n * A``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mappo.config import MaddpgConfig, ModelConfig
from mappo.data import EnvSpec
from mappo.nn.actor_critic import picture_scale
from mappo.nn.coma import SampledActors
from mappo.nn.layers import MLP


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

    def forward(self, state: Tensor, joint: Tensor) -> Tensor:
        x = state.flatten(-self.state_axes) if self.state_axes > 1 else state
        if not x.is_floating_point() or self.state_scale != 1.0:  # byte states, pictures
            x = x.float() * self.state_scale
        x = torch.cat([x.expand(*joint.shape[:-1], -1), joint], -1)
        return self.head(self.mlp(x)).squeeze(-1)


class MaddpgNetworks(SampledActors):
    """Every group's actors and the joint critic: what a MADDPG checkpoint's ``policy`` holds.

    Acting samples from the softmax of the actor's logits mixed with ``epsilon`` of the uniform
    distribution over the allowed actions, as COMA's actors do: the off-policy code's Gumbel
    sample followed by an epsilon-greedy choice has this distribution. Greedy acting takes the
    largest logit.
    """

    def __init__(self, spec: EnvSpec, model: ModelConfig, algo: MaddpgConfig) -> None:
        super().__init__(spec, model, algo.name, algo.last_action)
        self.explore_epsilon = algo.epsilon_finish
        self.critic = JointCritic(spec, model)

    def joint(self, onehots: dict[str, Tensor]) -> Tensor:
        """Every group's one-hot actions ``[..., n, A]`` -> the critic's ``[..., W]``."""
        return torch.cat([onehots[name].flatten(-2) for name in self.agents], -1)

    def onehots(self, actions: dict[str, Tensor]) -> dict[str, Tensor]:
        """Stored actions ``[..., n, 1]`` int64 -> one-hot ``[..., n, A]`` float32 per group."""
        return {
            name: F.one_hot(actions[name][..., 0], agent.num_actions).float()
            for name, agent in self.agents.items()
        }
