"""mappo: multi-agent PPO with batched tensor environments.

``mappo.train(config)`` trains and returns a :class:`~mappo.trainer.Run`;
``mappo.load_policy(path)`` loads a trained policy whose ``act(observations)`` gives actions.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mappo.api import Policy, load_policy
    from mappo.checkpoint import CheckpointError
    from mappo.config import ConfigError, TrainConfig
    from mappo.config import load as load_config
    from mappo.envs.base import EnvError
    from mappo.trainer import (
        Run,
        RunInterrupted,
        TrainingDiverged,
        resume,
        resume_seeds,
        train,
        train_seeds,
    )

__version__ = "0.1.0"

# The public names and the modules that define them. They are imported on first use, so that
# ``import mappo`` (and the command line's --help) does not wait for torch.
_LAZY = {
    "CheckpointError": ("mappo.checkpoint", "CheckpointError"),
    "ConfigError": ("mappo.config", "ConfigError"),
    "EnvError": ("mappo.envs.base", "EnvError"),
    "RunInterrupted": ("mappo.trainer", "RunInterrupted"),
    "TrainingDiverged": ("mappo.trainer", "TrainingDiverged"),
    "Policy": ("mappo.api", "Policy"),
    "load_policy": ("mappo.api", "load_policy"),
    "TrainConfig": ("mappo.config", "TrainConfig"),
    "load_config": ("mappo.config", "load"),
    "Run": ("mappo.trainer", "Run"),
    "resume": ("mappo.trainer", "resume"),
    "resume_seeds": ("mappo.trainer", "resume_seeds"),
    "train": ("mappo.trainer", "train"),
    "train_seeds": ("mappo.trainer", "train_seeds"),
}

__all__ = [
    "CheckpointError",
    "ConfigError",
    "EnvError",
    "Policy",
    "Run",
    "RunInterrupted",
    "TrainConfig",
    "TrainingDiverged",
    "load_config",
    "load_policy",
    "resume",
    "resume_seeds",
    "train",
    "train_seeds",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
    elif not name.startswith("_"):
        # A subpackage (mappo.envs, mappo.evaluation...), as after an import of it.
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'mappo' has no attribute '{name}'") from None
    else:
        raise AttributeError(f"module 'mappo' has no attribute '{name}'")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(
        {*__all__, "__version__"}
        | {n for n in globals() if not n.startswith("_")}
        - {"Any", "TYPE_CHECKING", "annotations", "importlib"}
    )
