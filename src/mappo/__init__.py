"""mappo: multi-agent PPO with batched tensor environments.

``mappo.train(config)`` trains and returns a :class:`~mappo.trainer.Run`;
``mappo.load_policy(path)`` loads a trained policy whose ``act(observations)`` gives actions.
"""

from mappo.api import Policy, load_policy
from mappo.config import TrainConfig
from mappo.config import load as load_config
from mappo.trainer import Run, resume, resume_seeds, train, train_seeds

__version__ = "0.1.0"

__all__ = [
    "Policy",
    "Run",
    "TrainConfig",
    "load_config",
    "load_policy",
    "resume",
    "resume_seeds",
    "train",
    "train_seeds",
]
