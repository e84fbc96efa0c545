"""The import rules of the package: every part imports downward from the ground floor.

Environments know no networks, losses or loops; networks know no environments, losses or loops;
losses know no environments or loops. Checked on the source, so a new file is held to it too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src" / "mappo"

# part -> modules of the package it must not import (prefixes of dotted names)
FORBIDDEN = {
    "envs": (
        "mappo.nn",
        "mappo.algos",
        "mappo.rollout",
        "mappo.episodes",
        "mappo.learners",
        "mappo.trainer",
        "mappo.evaluation",
        "mappo.api",
        "mappo.cli",
    ),
    "nn": (
        "mappo.envs",
        "mappo.algos",
        "mappo.rollout",
        "mappo.episodes",
        "mappo.learners",
        "mappo.trainer",
        "mappo.evaluation",
        "mappo.api",
        "mappo.cli",
    ),
    "algos": (
        "mappo.envs",
        "mappo.rollout",
        "mappo.episodes",
        "mappo.learners",
        "mappo.trainer",
        "mappo.evaluation",
        "mappo.api",
        "mappo.cli",
    ),
    "data.py": ("mappo.",),
    # Statistics are pure functions of arrays; reading runs back needs no training code.
    "experiments/stats.py": ("mappo.",),
    "experiments/runs.py": ("mappo.trainer", "mappo.learners", "mappo.envs", "mappo.nn"),
    "acting.py": ("mappo.",),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_parts_import_only_downward(part):
    files = [SRC / part] if part.endswith(".py") else sorted((SRC / part).rglob("*.py"))
    assert files
    bad = [
        f"{f.relative_to(SRC)} imports {name}"
        for f in files
        for name in sorted(_imports(f))
        if name.startswith(FORBIDDEN[part])
    ]
    assert not bad, bad


def test_the_package_and_the_commands_help_load_without_torch():
    """``import mappo`` and ``mappo --help`` answer without torch's import (seconds on a laptop);
    the public names are there when asked for."""
    import subprocess
    import sys

    probe = (
        "import sys, contextlib, io\n"
        "import mappo, mappo.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        "    mappo.cli.main(['--help'])\n"
        "assert 'train' in out.getvalue()\n"
        "print('torch' in sys.modules)\n"
        "names = [getattr(mappo, name) for name in mappo.__all__]\n"
        "print('torch' in sys.modules, all(callable(n) for n in names))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True", "True"]
    import mappo

    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        mappo.trian  # noqa: B018
