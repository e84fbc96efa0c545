"""``python:<module>:<callable>``: a batched env of the user's own, named by its import path.

``env.name=python:my_envs:GuessTheColor`` imports ``my_envs`` (installed, or on ``PYTHONPATH``,
which includes the current directory for ``mappo``) and calls
``GuessTheColor(num_envs=..., device=..., seed=..., **env.kwargs)``; the callable may be a
:class:`~mappo.envs.BatchedEnv` subclass or any function returning one (``a.b`` after the colon
reaches an attribute of an attribute). Because the name says where the code lives, a run trained
on it resumes, evaluates and renders from the command line like a built-in env, with no
registration step in the process that reads it.
"""

from __future__ import annotations

from typing import Any

import torch

from mappo.envs.base import BatchedEnv, EnvError
from mappo.envs.importing import require_module
from mappo.envs.registry import register_scheme

SCHEME = "python"
EXAMPLE = "python:my_envs:MyEnv"


def make_python(
    target: str,
    num_envs: int = 1,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **kwargs: Any,
) -> BatchedEnv:
    """Build the env ``python:<target>`` (see the module docstring)."""
    name = f"{SCHEME}:{target}"
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise EnvError(
            f"'{name}' names no callable: write {SCHEME}:<module>:<class or function>, "
            f"e.g. {EXAMPLE}"
        )
    obj: Any = require_module(name, module_name)
    reached = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvError(f"{name}: '{reached}' has no attribute '{part}'; check the name")
        obj = getattr(obj, part)
        reached = f"{reached}.{part}"
    if not callable(obj):
        raise EnvError(
            f"{name}: '{reached}' is a {type(obj).__name__}, not a class or function that "
            "builds the env"
        )
    try:
        env = obj(num_envs=num_envs, device=device, seed=seed, **kwargs)
    except TypeError as err:
        # A misspelt keyword argument, or a callable that takes none of num_envs/device/seed.
        raise EnvError(
            f"bad parameter for environment '{name}': {err} (it is called with num_envs=, "
            "device=, seed= and the keys of env.kwargs)"
        ) from err
    if not isinstance(env, BatchedEnv):
        hint = (
            f"; for a PettingZoo ParallelEnv use pettingzoo:{target}"
            if hasattr(env, "possible_agents")
            else ""
        )
        raise EnvError(
            f"{name}: '{reached}' returned a {type(env).__name__}, not a mappo.envs.BatchedEnv"
            f"{hint}"
        )
    return env


register_scheme(SCHEME, make_python)
