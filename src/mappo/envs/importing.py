"""Importing modules that users name (an env's module, a plugin), with one-line errors.

A module named in a config (``pettingzoo:my_envs``, ``python:my_envs:MyEnv``) or on the command
line (``--import my_envs``) is code the user chose to run; what can go wrong is that it is not
importable, or that it raises while it is imported. Both become one :class:`EnvError` line that
says which, instead of a traceback from deep inside the import machinery.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from types import ModuleType

from mappo.envs.base import EnvError, one_line

__all__ = ["one_line", "require_module"]


def require_module(what: str, module: str, extras: Mapping[str, str] | None = None) -> ModuleType:
    """Import ``module`` for ``what`` (an env name, an option) or raise :class:`EnvError` in one
    line saying why it failed.

    ``extras`` maps top-level packages to the ``mappo`` extra that installs them; only those get
    an install command: for any other name, ``pip install <name>`` could fetch an unrelated
    package of the same name from PyPI, while the usual cause is a module of the user's own that
    is not on ``PYTHONPATH``. The current directory is searched last, as ``python -m`` would
    search it first: the ``mappo`` command, started from a folder holding ``my_envs.py``, finds
    it, and an installed package of the same name still wins.
    """
    if module.endswith(".py"):
        raise EnvError(
            f"{what}: '{module}' is a file name; give the module's name, without .py "
            f"('{module[:-3].replace('/', '.')}')"
        )
    if not module or any(not part.isidentifier() for part in module.split(".")):
        raise EnvError(f"{what}: '{module}' is not a module name (such as my_package.my_envs)")
    _search_current_directory_for(module.split(".")[0])
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        missing = err.name or module
        top = missing.split(".")[0]
        extra = (extras or {}).get(top)
        if extra is not None and importlib.util.find_spec(top) is None:
            raise EnvError(
                f"{what} needs the Python package '{top}', which is not installed; "
                f"install it with `pip install 'mappo[{extra}]'`"
            ) from err
        if not _is_part_of(missing, module):
            # The module was found, but something it imports was not.
            raise EnvError(
                f"{what}: importing module '{module}' raised {one_line(err)}; fix that "
                "import in the module or install what it needs"
            ) from err
        if top != missing and importlib.util.find_spec(top) is not None:
            raise EnvError(
                f"{what}: there is no module '{missing}' in package '{top}'; check the name"
            ) from err
        raise EnvError(
            f"{what}: module '{missing}' is not importable; is its folder on PYTHONPATH (or the "
            "current directory), or is it installed?"
        ) from err
    except Exception as err:  # the module exists but raises on import (also SyntaxError)
        raise EnvError(
            f"{what}: importing module '{module}' raised {one_line(err)}; fix the error in "
            "that module"
        ) from err


def _search_current_directory_for(top: str) -> None:
    """Put the current directory on ``sys.path`` (last) where it holds the package or module
    ``top`` and nothing else provides it: only then, so that naming an installed module never
    lets a file of the current directory shadow a package imported later (an optional
    dependency that is not installed)."""
    with contextlib.suppress(OSError):  # a current directory that was deleted
        cwd = os.getcwd()
        if cwd in sys.path or "" in sys.path or importlib.util.find_spec(top) is not None:
            return
        if os.path.isfile(os.path.join(cwd, f"{top}.py")) or os.path.isdir(os.path.join(cwd, top)):
            sys.path.append(cwd)


def _is_part_of(missing: str, module: str) -> bool:
    """Whether ``missing`` is ``module`` or one of its parent packages (``a`` or ``a.b`` for
    ``a.b.c``), i.e. the module itself was not found rather than one of its imports."""
    return module == missing or module.startswith(missing + ".")
