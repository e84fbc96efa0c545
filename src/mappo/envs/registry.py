"""Environment names -> factories.

Built-in environments register a name such as ``mpe/simple_spread`` or ``smac/3m``. Names with a
scheme prefix (``pettingzoo:mpe2.simple_spread_v3``, ``gymnasium:lbforaging:Foraging-8x8-2p-2f-v3``)
are resolved by the adapter registered for that scheme; ``python:my_envs:MyEnv`` builds a
batched env of the user's own from its import path (:mod:`mappo.envs.by_path`).
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mappo.envs.base import BatchedEnv, EnvError, check_spec, is_users_env, one_line

EnvFactory = Callable[..., BatchedEnv]
"""``factory(num_envs=..., device=..., seed=..., **kwargs) -> BatchedEnv``."""


@dataclass(frozen=True)
class EnvEntry:
    name: str
    factory: EnvFactory
    description: str
    workers: bool = False
    """Whether the env steps Python games in worker processes (as the adapters do)."""
    copy_bytes: int = 0
    """Host memory one copy takes in its worker process, for the trainer's memory check."""
    builtin: bool = False
    """Registered by mappo's own env packages (a name no user's registration may replace)."""


_TRUSTED: set[str] = set()
"""Modules the user named to be imported (``--import``), which a saved run may name too."""
_SAVED_SOURCE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "mappo_saved_source", default=None
)
"""The saved run or checkpoint whose config the envs being made now come from, if any."""


def trust_module(module: str) -> None:
    """Let envs made from saved runs (:func:`from_saved`) import ``module`` by name."""
    _TRUSTED.add(module)


@contextlib.contextmanager
def from_saved(source: str) -> Iterator[None]:
    """Within this block envs are made from the config saved in ``source`` (a run directory or
    checkpoint that may come from anyone): a name that imports a module by name
    (``python:<module>:<class>``, ``pettingzoo:<module>[:<callable>]``,
    ``gymnasium:<package>:<id>``) is refused unless the user trusted that module
    (:func:`trust_module`, the CLI's ``--import``), so that opening a file never runs code it
    names: importing a module runs its top-level code, whatever is called next. Built-in names
    and the env packages in :data:`KNOWN_ENV_PACKAGES` are not affected."""
    token = _SAVED_SOURCE.set(source)
    try:
        yield
    finally:
        _SAVED_SOURCE.reset(token)


KNOWN_ENV_PACKAGES = ("pettingzoo", "mpe2", "gymnasium", "lbforaging", "rware")
"""Installed env packages whose modules a saved run may name without ``--import`` (the
presets' own: ``pettingzoo:mpe2.simple_spread_v3``, ``gymnasium:lbforaging:...``). Their code
is what ``pip`` installed, not something a shared file brings along."""


def imported_module(name: str) -> str | None:
    """The module that an env name has imported by name, if any: ``python:<module>:<class>``,
    ``pettingzoo:<module>:<callable>``, and outside :data:`KNOWN_ENV_PACKAGES`
    ``pettingzoo:<module>`` and ``gymnasium:<package>:<id>`` (Gymnasium imports the package to
    register the id). A named callable always counts, whatever its module: a package's own
    functions can import and run other code with the config's arguments (``gymnasium:make``
    imports the module an id names)."""
    scheme, _, target = name.partition(":")
    module, sep, _ = target.partition(":")
    if scheme == "python" or (scheme == "pettingzoo" and sep):
        return module
    if scheme == "pettingzoo" or (scheme == "gymnasium" and sep):
        return None if module.split(".")[0] in KNOWN_ENV_PACKAGES else module
    return None


def _check_trusted(name: str) -> None:
    source = _SAVED_SOURCE.get()
    module = imported_module(name)
    if source is None or module is None or module in _TRUSTED:
        return
    if module == "__main__":
        raise EnvError(
            f"'{source}' names its env in the script that trained it ({name}), which no other "
            "process can import: open it from a script that defines that class (after "
            "mappo.envs.trust_module('__main__')), or move the class into a module and train "
            "with python:<module>:<class>"
        )
    raise EnvError(
        f"'{source}' names its env by import path ({name}); opening a saved run imports no "
        f"module named in it on its own: if you trust the code of '{module}', pass "
        f"--import {module} (from Python: mappo.envs.trust_module('{module}'))"
    )


_ENVS: dict[str, EnvEntry] = {}
_SCHEMES: dict[str, EnvFactory] = {}
"""Scheme prefix (e.g. ``pettingzoo``) -> ``factory(target, num_envs, device, seed, **kwargs)``."""
_WORKER_SCHEMES: set[str] = set()
"""The schemes whose envs step in worker processes (:func:`uses_workers`)."""


def register(
    name: str,
    factory: EnvFactory,
    description: str = "",
    workers: bool = False,
    copy_bytes: int = 0,
) -> None:
    """Make ``name`` available to :func:`make` and to configs (``workers`` and ``copy_bytes``:
    see :func:`uses_workers` and :func:`copy_bytes`). A name of one's own may be registered
    again (a module imported twice, a notebook cell run again) but may not replace a built-in
    env: runs save the name alone, so the built-in one would be made when they are opened
    in another process."""
    if not isinstance(name, str) or not name or ":" in name or name != name.strip():
        raise EnvError(
            f"cannot register the env name {name!r}: a name is a non-empty string without ':' "
            "or surrounding spaces (a ':' marks a scheme, as in python:<module>:<class>), e.g. "
            "'my_project/my_env'"
        )
    # (who calls decides, not the factory: a partial of a built-in class is a user's env too)
    own = str(sys._getframe(1).f_globals.get("__name__", "")).startswith("mappo.")
    if not own:
        _load_builtin()
        entry = _ENVS.get(name)
        if entry is not None and entry.builtin:
            raise EnvError(
                f"cannot register '{name}': it is a built-in env of mappo; register yours under "
                f"a name of its own, e.g. 'my_project/{name.rsplit('/', 1)[-1]}'"
            )
        if not callable(factory) or isinstance(factory, BatchedEnv):
            raise EnvError(
                f"cannot register '{name}': give a BatchedEnv subclass, or a function that "
                "returns one when called with num_envs=, device=, seed= and the env's keyword "
                f"arguments, not a {type(factory).__name__} object"
            )
    _ENVS[name] = EnvEntry(name, factory, description, workers, copy_bytes, builtin=own)


def _is_builtin(factory: EnvFactory) -> bool:
    """Whether ``factory`` comes from mappo's own env packages."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return str(getattr(factory, "__module__", "")).startswith("mappo.")


def copy_bytes(name: str) -> int:
    """Host memory that one copy of the registered env ``name`` takes in a worker process (a
    game engine's own memory, which no tensor shows); 0 where nothing is declared."""
    _load_builtin()
    entry = _ENVS.get(name)
    return 0 if entry is None else entry.copy_bytes


def uses_workers(name: str) -> bool:
    """Whether ``name`` is an env of Python games stepped in worker processes: an adapter scheme
    (``pettingzoo:...``) or a registered env built on the adapter (``football/...``). Probing
    such an env starts processes, so the trainer's memory check skips it for small batches.
    A batched env of the user's own (``python:...``) is not one."""
    _load_builtin()
    if ":" in name:
        return name.split(":", 1)[0] in _WORKER_SCHEMES
    return name in _ENVS and _ENVS[name].workers


def register_scheme(scheme: str, factory: EnvFactory, workers: bool = False) -> None:
    """Resolve every name ``scheme:target`` with ``factory(target, num_envs=..., ...)``;
    ``workers``: the scheme's envs step in worker processes (they take the adapter's options,
    ``num_workers=0`` among them)."""
    _SCHEMES[scheme] = factory
    if workers:
        _WORKER_SCHEMES.add(scheme)


def list_envs() -> list[EnvEntry]:
    _load_builtin()
    return sorted(_ENVS.values(), key=lambda e: e.name)


def make(
    name: str,
    num_envs: int = 1,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **kwargs: Any,
) -> BatchedEnv:
    """Create a batched env by name, e.g. ``make("mpe/simple_spread", num_envs=1024)``."""
    _load_builtin()
    if ":" in name:
        _check_trusted(name)
        scheme, target = name.split(":", 1)
        if scheme not in _SCHEMES:
            raise EnvError(
                f"unknown environment scheme '{scheme}' in '{name}'; known schemes: "
                f"{sorted(_SCHEMES)}"
            )
        env = _SCHEMES[scheme](target, num_envs=num_envs, device=device, seed=seed, **kwargs)
    else:
        check_name(name)
        problem = _parameter_problem(name, _ENVS[name].factory, kwargs)
        if problem is not None:
            raise EnvError(problem)
        factory = _ENVS[name].factory
        try:
            env = factory(num_envs=num_envs, device=device, seed=seed, **kwargs)
        except TypeError as err:
            # A misspelt keyword argument surfaces as a TypeError from the constructor; one
            # raised inside a constructor that took its arguments is the env's own.
            if _binds(factory, num_envs=num_envs, device=device, seed=seed, **kwargs):
                raise EnvError(f"environment '{name}' raised {one_line(err)}") from err
            raise EnvError(f"bad parameter for environment '{name}': {err}") from err
        if not isinstance(env, BatchedEnv):
            raise EnvError(
                f"environment '{name}' was made as a {type(env).__name__}, not a BatchedEnv: "
                "register a BatchedEnv subclass, or a function that returns an instance of one"
            )
    inherited = ("num_envs", "device", "generator")  # (what BatchedEnv.__init__ sets)
    if isinstance(env, BatchedEnv) and not all(hasattr(env, a) for a in inherited):
        raise EnvError(
            f"{type(env).__name__}.__init__ did not call BatchedEnv's: start it with "
            "super().__init__(num_envs, device, seed)"
        )
    if isinstance(env, BatchedEnv) and is_users_env(env):
        try:  # before any network is built from it
            check_spec(env)
        except EnvError:
            env.close()
            raise
    return env


def _binds(factory: Callable[..., Any], **kwargs: Any) -> bool:
    """Whether ``factory``'s signature takes ``kwargs`` (False where it cannot be read)."""
    try:
        inspect.signature(factory).bind(**kwargs)
    except (TypeError, ValueError):
        return False
    return True


_CALL_ARGUMENTS = ("num_envs", "device", "seed")


def _parameter_problem(name: str, factory: EnvFactory, kwargs: dict[str, Any]) -> str | None:
    """Why ``kwargs`` cannot go to the env ``name`` made by a ``functools.partial`` of a built-in
    env, or None: a parameter that the name sets (``smac/3m``'s map, ``hanabi/full-2p``'s two
    players; overriding it would train another env under this one's name), or one the env does
    not take (listing those it does, where a bare TypeError named neither)."""
    if not isinstance(factory, functools.partial) or not _is_builtin(factory):
        return None
    try:
        params = inspect.signature(factory.func).parameters
    except (TypeError, ValueError):  # nothing to inspect: the env's own checks answer
        return None
    bound = {**dict(zip(params, factory.args, strict=False)), **factory.keywords}
    for key, value in kwargs.items():
        if key in bound and value != bound[key]:  # (the same value changes nothing)
            return (
                f"{name}: '{key}' is set by the env's name ({key}={bound[key]!r}); name the env "
                f"that has the {key} you want instead (`mappo list` shows them)"
            )
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None  # the env passes its keywords on (a VMAS scenario's): it checks them
    valid = [k for k in params if k not in bound and k not in _CALL_ARGUMENTS]
    for key in kwargs:
        if key not in valid and key not in _CALL_ARGUMENTS and key not in bound:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            return f"{name}: unknown parameter '{key}'{hint} (valid parameters: {', '.join(valid)})"
    return None


def check_name(name: str) -> None:
    """Raise :class:`EnvError` for a registered-style name (no ``scheme:``) that no env has,
    naming the nearest one; scheme names are checked when they are built."""
    _load_builtin()
    if ":" not in name and name not in _ENVS:
        close = difflib.get_close_matches(name, list(_ENVS), n=1)
        if close:
            hint = f"; did you mean '{close[0]}'? (`mappo list` shows the available ones)"
        else:
            # Most often an env of the user's own, registered by code this process never ran.
            hint = (
                " (`mappo list` shows the available ones); an env of your own is named by its "
                "import path, python:<module>:<class>, or registered by a module given to "
                "--import <module> (mappo train, eval, render, list, bench)"
            )
        raise EnvError(f"unknown environment '{name}'{hint}")


def fit_workers(kwargs: dict[str, Any], num_envs: int) -> dict[str, Any]:
    """``kwargs`` of a run's training env, for a batch of ``num_envs`` copies of the same env
    (evaluation, a rendered episode): a ``num_workers`` above ``num_envs`` is cut to it, since a
    worker process needs at least one copy; everything else is kept."""
    workers = kwargs.get("num_workers")
    if isinstance(workers, int) and not isinstance(workers, bool) and workers > num_envs:
        return {**kwargs, "num_workers": num_envs}
    return dict(kwargs)


_LOADED = False


def _load_builtin() -> None:
    """Import the environment packages once, so that they register their names."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import importlib

    for module in (
        "mappo.envs.mpe",
        "mappo.envs.smac",
        "mappo.envs.hanabi",
        "mappo.envs.grid",
        "mappo.envs.vmas",
        "mappo.envs.adapters",
        "mappo.envs.football",
        "mappo.envs.by_path",
    ):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            # Only a missing environment package of our own is skipped; a missing
            # third-party dependency inside it is a real error.
            if err.name != module:
                raise
