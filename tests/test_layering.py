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
