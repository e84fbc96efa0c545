"""Checks of scenario parameters that raise :class:`~mappo.envs.EnvError` naming the parameter
and its valid range."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from mappo.envs.base import BatchedEnv, EnvError


def check_int(env: str, name: str, value: Any, low: int = 0) -> int:
    """``value`` as an ``int >= low``; ``EnvError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise EnvError(f"{env}: {name} must be an integer >= {low}, got {value!r}")
    return value


def check_bool(env: str, name: str, value: Any) -> bool:
    """``value`` if it is a ``bool``; ``EnvError`` otherwise (``1`` or ``"true"`` are refused so
    that a config typo cannot switch a mode silently)."""
    if not isinstance(value, bool):
        raise EnvError(f"{env}: {name} must be true or false, got {value!r}")
    return value


def check_unit_interval(env: str, name: str, value: Any) -> float:
    """``value`` as a float in ``[0, 1]``; ``EnvError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise EnvError(f"{env}: {name} must be a number in [0, 1], got {value!r}")
    return float(value)


def check_choice(env: str, name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``; ``EnvError`` otherwise."""
    if value not in choices:
        raise EnvError(f"{env}: {name} must be one of {list(choices)}, got {value!r}")
    return value


def checked_factory(
    env_cls: type[BatchedEnv], name: str | None = None, fixed: dict[str, Any] | None = None
) -> Callable[..., BatchedEnv]:
    """A registry factory for ``env_cls`` that rejects unknown keyword arguments with an
    ``EnvError`` listing the valid ones (instead of a bare ``TypeError``). ``name``: the
    registered name the errors give (default: the class's); ``fixed``: arguments the name
    sets, which are not among its parameters (the caller refuses other values of them)."""
    fixed = dict(fixed or {})
    params = [
        p
        for p in inspect.signature(env_cls.__init__).parameters
        if p not in ("self", "num_envs", "device", "seed") and p not in fixed
    ]

    def factory(**kwargs: Any) -> BatchedEnv:
        unknown = [k for k in kwargs if k not in params + ["num_envs", "device", "seed"]]
        if unknown:
            close = difflib.get_close_matches(unknown[0], params, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise EnvError(
                f"{name or env_cls.name}: unknown parameter '{unknown[0]}'{hint} "
                f"(valid parameters: {', '.join(params)})"
            )
        return env_cls(**kwargs, **fixed)

    return factory
