"""Batched environments: the contract, the registry and the built-in environments."""

from mappo.envs.base import (
    ActionError,
    ActionSpec,
    BatchedEnv,
    EnvError,
    EnvSpec,
    EnvStep,
    GroupSpec,
)
from mappo.envs.registry import list_envs, make, register, register_scheme, trust_module

__all__ = [
    "ActionError",
    "ActionSpec",
    "BatchedEnv",
    "EnvError",
    "EnvSpec",
    "EnvStep",
    "GroupSpec",
    "list_envs",
    "make",
    "register",
    "register_scheme",
    "trust_module",
]
