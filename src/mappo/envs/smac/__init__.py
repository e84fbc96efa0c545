"""SMAC-style unit micromanagement battles as a batched tensor environment.

Every map of :data:`~mappo.envs.smac.maps.MAPS` is registered as ``smac/<map>``, e.g.
``mappo.envs.make("smac/3m", num_envs=1024)``. See :mod:`mappo.envs.smac.env` for the
simulation and its simplifications, and ``docs/smac.md``.
"""

from __future__ import annotations

import functools

from mappo.envs.registry import register
from mappo.envs.smac.env import SMACEnv
from mappo.envs.smac.maps import MAPS, MapSpec, get_map
from mappo.envs.smac.scripted import evaluate_scripted, scripted_actions
from mappo.envs.smac.units import UNIT_TYPES, UnitType

for _name, _spec in MAPS.items():
    register(
        f"smac/{_name}",
        functools.partial(SMACEnv, _name),
        f"SMAC {_name}: {_spec.n_agents} agents vs {_spec.n_enemies} enemies "
        f"(limit {_spec.limit} steps)",
    )

__all__ = [
    "MAPS",
    "UNIT_TYPES",
    "MapSpec",
    "SMACEnv",
    "UnitType",
    "evaluate_scripted",
    "get_map",
    "scripted_actions",
]
