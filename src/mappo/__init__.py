"""mappo: multi-agent PPO with batched tensor environments."""

__version__ = "0.1.0"
