"""``python:<module>:<class>``: a batched env of the user's own, named by its import path.

``env.name=python:my_envs:GuessTheColor`` imports ``my_envs`` (installed, or on ``PYTHONPATH``,
which includes the current directory for ``mappo``) and calls
``GuessTheColor(num_envs=..., device=..., seed=..., **env.kwargs)``, which must be a
:class:`~mappo.envs.BatchedEnv` subclass (``a.B`` after the colon reaches a class inside a
class). Only such classes are called, never any function a config names. Because the name says
where the code lives, a run trained on it resumes, evaluates and renders from the command line
like a built-in env; a saved run that names it is opened with ``--import <module>``, the user's
word that the module may be imported (:func:`mappo.envs.registry.from_saved`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from mappo.envs.base import BatchedEnv, EnvError
from mappo.envs.importing import one_line, require_module
from mappo.envs.registry import register_scheme

SCHEME = "python"
EXAMPLE = "python:my_envs:MyEnv"


def make_python(
    target: str,
    /,  # (an env keyword argument may be called 'target' too)
    num_envs: int = 1,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **kwargs: Any,
) -> BatchedEnv:
    """Build the env ``python:<target>`` (see the module docstring)."""
    name = f"{SCHEME}:{target}"
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise EnvError(f"'{name}' names no class: write {SCHEME}:<module>:<class>, e.g. {EXAMPLE}")
    obj: Any = require_module(name, module_name)
    reached = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvError(f"{name}: '{reached}' has no attribute '{part}'; check the name")
        obj = getattr(obj, part)
        reached = f"{reached}.{part}"
    if not (isinstance(obj, type) and issubclass(obj, BatchedEnv)):
        # Only env classes are called: a name in a config must not call any function it likes.
        hint = (
            f"; for a PettingZoo ParallelEnv use pettingzoo:{target}"
            if isinstance(obj, type) and hasattr(obj, "possible_agents")
            else ""
        )
        raise EnvError(
            f"{name}: '{reached}' is {_kind(obj)}, not a subclass of mappo.envs.BatchedEnv{hint}"
        )
    try:
        inspect.signature(obj).bind(num_envs=num_envs, device=device, seed=seed, **kwargs)
    except TypeError as err:  # a misspelt keyword argument, or one the class does not take
        raise EnvError(
            f"bad parameter for environment '{name}': {err} (it is called with num_envs=, "
            "device=, seed= and the keys of env.kwargs)"
        ) from err
    try:
        env = obj(num_envs=num_envs, device=device, seed=seed, **kwargs)
    except EnvError:
        raise
    except Exception as err:  # the env refused its arguments (or has a bug): one line
        raise EnvError(f"{name}: {reached}(...) raised {one_line(err)}") from err
    env.name = name  # its errors then name it as the user did (the class's name may be a copy)
    return env


def _kind(obj: Any) -> str:
    """``a class``, ``a function``, ``an int``...: what a name reached, for an error."""
    if isinstance(obj, type):
        return f"the class {obj.__name__}"
    kind = type(obj).__name__
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"


register_scheme(SCHEME, make_python)
