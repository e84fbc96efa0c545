"""VMAS scenarios as batched environments (VMAS: Bettini et al. 2022, "VMAS: A Vectorized
Multi-Agent Simulator for Collective Robot Learning", DARS 2022).

Every scenario that VMAS ships is registered as ``vmas/<scenario>``: its main scenarios
(``vmas/navigation``, ``vmas/balance``, ``vmas/sampling``, ``vmas/transport``, ``vmas/wheel``...),
its ports of the particle environments (``vmas/simple_spread``...) and its debug scenarios
(``vmas/waterfall``...). For example::

    env = make("vmas/navigation", num_envs=4096, device="cuda", n_agents=4)

Parameters: ``continuous_actions`` (default ``True``), ``multidiscrete_actions``, ``max_steps``
(the episode limit; default from BenchMARL's VMAS task configs, :data:`MAX_STEPS`), ``groups``,
``batched_reset``, and any keyword of the scenario itself (``n_agents``, ``shared_rew``...), which
goes to VMAS. See :class:`VmasEnv` and :mod:`mappo.envs.vmas.env` for what the wrapper does.

The names are registered without importing VMAS (they are read from the installed package's
scenario files, or from :data:`KNOWN_SCENARIOS` when VMAS is not installed); creating one without
VMAS raises an :class:`~mappo.envs.EnvError` saying ``pip install 'mappo[vmas]'``.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

from mappo.envs.base import BatchedEnv
from mappo.envs.registry import register
from mappo.envs.vmas.env import (
    BATCHED_RESET_SCENARIOS,
    DEFAULT_MAX_STEPS,
    MAX_STEPS,
    VmasEnv,
    import_vmas,
)

KNOWN_SCENARIOS: dict[str, tuple[str, ...]] = {
    "scenarios": (
        "balance",
        "ball_passage",
        "ball_trajectory",
        "buzz_wire",
        "discovery",
        "dispersion",
        "dropout",
        "flocking",
        "football",
        "give_way",
        "joint_passage",
        "joint_passage_size",
        "multi_give_way",
        "navigation",
        "passage",
        "reverse_transport",
        "road_traffic",
        "sampling",
        "transport",
        "wheel",
        "wind_flocking",
    ),
    "mpe": (
        "simple",
        "simple_adversary",
        "simple_crypto",
        "simple_push",
        "simple_reference",
        "simple_speaker_listener",
        "simple_spread",
        "simple_tag",
        "simple_world_comm",
    ),
    "debug": (
        "asym_joint",
        "circle_trajectory",
        "diff_drive",
        "drone",
        "goal",
        "het_mass",
        "kinematic_bicycle",
        "line_trajectory",
        "pollock",
        "vel_control",
        "waterfall",
    ),
}
"""VMAS 1.5.2's scenarios (``vmas.scenarios``, ``vmas.mpe_scenarios``, ``vmas.debug_scenarios``):
the names registered when VMAS is not installed."""

DESCRIPTIONS = {
    "balance": "agents carry a package balanced on a line to a goal without dropping it",
    "navigation": "agents with lidar reach their own goals without colliding",
    "sampling": "agents collect samples of an unknown density field, each cell once",
    "transport": "agents push a heavy package onto a goal",
    "reverse_transport": "agents inside a package push it onto a goal",
    "wheel": "agents turn a line pinned at its centre at a target angular velocity",
    "give_way": "two agents swap ends of a corridor that only one can pass at a time",
    "football": "a team of agents plays football against scripted opponents",
}
"""One-line descriptions of the best-known scenarios (the others get a generic line)."""

_KIND = {
    "scenarios": "a VMAS scenario",
    "mpe": "VMAS's port of the MPE task",
    "debug": "a debug scenario",
}


def scenario_names() -> dict[str, tuple[str, ...]]:
    """Kind (``scenarios``, ``mpe``, ``debug``) -> scenario names, read from the scenario files
    of the installed VMAS without importing it (:data:`KNOWN_SCENARIOS` when not installed)."""
    try:
        spec = importlib.util.find_spec("vmas")
    except (ImportError, ValueError):  # a broken installation, or sys.modules["vmas"] = None
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return KNOWN_SCENARIOS
    root = Path(next(iter(spec.submodule_search_locations))) / "scenarios"
    found = {
        kind: tuple(sorted(p.stem for p in folder.glob("*.py") if not p.name.startswith("_")))
        for kind, folder in (("scenarios", root), ("mpe", root / "mpe"), ("debug", root / "debug"))
    }
    return found if found["scenarios"] else KNOWN_SCENARIOS


def make_vmas(scenario: str, **kwargs: Any) -> BatchedEnv:
    """Registry factory of ``vmas/<scenario>``: :class:`VmasEnv` ``(scenario, **kwargs)``
    (an :class:`~mappo.envs.EnvError` naming ``pip install 'mappo[vmas]'`` without VMAS)."""
    return VmasEnv(scenario, **kwargs)


for _kind, _names in scenario_names().items():
    for _name in _names:
        _limit = MAX_STEPS.get(_name, DEFAULT_MAX_STEPS)
        _what = DESCRIPTIONS.get(_name, _KIND[_kind])
        register(
            f"vmas/{_name}",
            functools.partial(make_vmas, _name),
            f"VMAS {_name}: {_what} (limit {_limit} steps)",
        )

__all__ = [
    "BATCHED_RESET_SCENARIOS",
    "DEFAULT_MAX_STEPS",
    "DESCRIPTIONS",
    "KNOWN_SCENARIOS",
    "MAX_STEPS",
    "VmasEnv",
    "import_vmas",
    "make_vmas",
    "scenario_names",
]
