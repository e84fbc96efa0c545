"""Each algorithm family's part of a run: what one training iteration does.

A learner owns its networks (``policy``, which acts through :mod:`mappo.acting`), optimisers,
data collection and episode tracker, and saves and restores all of them itself. The trainer
(:mod:`mappo.trainer`) runs the same loop around any learner.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from mappo.config import TrainConfig
from mappo.data import EnvSpec
from mappo.envs.base import BatchedEnv
from mappo.rollout import EpisodeTracker


class Learner(Protocol):
    policy: nn.Module
    collector: Any
    tracker: EpisodeTracker

    def iterate(self, iteration: int, env_steps: int) -> dict[str, float]:
        """Collect and update once; the result holds ``env_steps`` (taken in this iteration),
        ``rollout_seconds``, ``update_seconds`` and the losses."""
        ...

    def schedule_metrics(self) -> dict[str, float]:
        """Scheduled values now (learning rates, exploration)."""
        ...

    def state_dict(self, periodic: bool = True) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], iteration: int) -> None: ...


def make_learner(cfg: TrainConfig, env: BatchedEnv) -> Learner:
    """The learner of ``cfg.algo.name``'s family for ``env``."""
    if cfg.family == "ppo":
        from mappo.learners.ppo import PPOLearner

        return PPOLearner(cfg, env)
    if cfg.family == "coma":
        from mappo.learners.coma import ComaLearner

        return ComaLearner(cfg, env)
    if cfg.family == "maddpg":
        from mappo.learners.maddpg import MaddpgLearner

        return MaddpgLearner(cfg, env)
    from mappo.learners.value import ValueLearner

    return ValueLearner(cfg, env)


def build_networks(spec: EnvSpec, cfg: TrainConfig) -> nn.Module:
    """Untrained networks of ``cfg``'s family for ``spec`` (to load a checkpoint's into)."""
    if cfg.family == "ppo":
        from mappo.nn.actor_critic import ActorCritic

        return ActorCritic(spec, cfg.model, cfg.algo)
    if cfg.family == "coma":
        from mappo.nn.coma import ComaNetworks

        return ComaNetworks(spec, cfg.model, cfg.algo)
    if cfg.family == "maddpg":
        from mappo.nn.maddpg import MaddpgNetworks

        return MaddpgNetworks(spec, cfg.model, cfg.algo)
    from mappo.nn.q_agents import QNetworks

    return QNetworks(spec, cfg.model, cfg.algo)
