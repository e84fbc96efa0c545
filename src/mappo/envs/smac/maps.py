"""The SMAC maps as data: unit compositions, episode limits, map sizes and starting points.

Compositions and episode limits are those of SMAC's map registry
(``smac/env/starcraft2/maps/smac_maps.py``, the ``n_agents``, ``n_enemies`` and ``limit`` of
each map) and of the SMAC paper's map table (Samvelyan et al. 2019, Table 1). The SMAC map
files are 32 x 32 with the two armies spawning facing each other across the middle (allies around
(9, 16), enemies around (23, 16); on ``corridor`` the allies start near the centre and the
zerglings in the upper-right corner), as read from the maps in the StarCraft II editor by the
SMAClite authors (``smaclite/env/maps``). A new map is one more :class:`MapSpec` row.

Units are listed in SMAC's agent order: allies sorted by unit type (e.g. MMM: marauders, marines,
medivac); the order of the unit types is also the order of the unit-type one-hot features.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from mappo.envs.base import EnvError
from mappo.envs.smac.units import UNIT_TYPES, UnitType


@dataclass(frozen=True)
class MapSpec:
    """One SMAC scenario."""

    name: str
    allies: tuple[tuple[str, int], ...]
    """``(unit type, count)`` of the agents' army, in agent order."""
    enemies: tuple[tuple[str, int], ...]
    """``(unit type, count)`` of the built-in AI's army, in enemy order."""
    limit: int
    """Episode limit in agent steps (SMAC's ``limit``)."""
    size: tuple[float, float] = (32.0, 32.0)
    ally_start: tuple[float, float] = (9.0, 16.0)
    enemy_start: tuple[float, float] = (23.0, 16.0)

    def ally_units(self) -> list[UnitType]:
        return [UNIT_TYPES[name] for name, count in self.allies for _ in range(count)]

    def enemy_units(self) -> list[UnitType]:
        return [UNIT_TYPES[name] for name, count in self.enemies for _ in range(count)]

    @property
    def n_agents(self) -> int:
        return sum(count for _, count in self.allies)

    @property
    def n_enemies(self) -> int:
        return sum(count for _, count in self.enemies)

    @property
    def unit_types(self) -> tuple[str, ...]:
        """Unit types of the one-hot type features: SMAC's ``unit_type_bits`` is the number of
        the allies' unit types when there is more than one, else 0 (no type features)."""
        names = tuple(dict.fromkeys(name for name, _ in self.allies))
        return names if len(names) > 1 else ()

    @property
    def medivac_rule(self) -> bool:
        """SMAC's MMM rule: a side with only medivacs left has lost (it cannot fight)."""
        return any(UNIT_TYPES[name].healer for name, _ in self.allies + self.enemies)


def _m(name: str, allies: dict[str, int], enemies: dict[str, int], limit: int, **kw) -> MapSpec:
    return MapSpec(name, tuple(allies.items()), tuple(enemies.items()), limit, **kw)


MAPS: dict[str, MapSpec] = {
    m.name: m
    for m in (
        _m("3m", {"marine": 3}, {"marine": 3}, 60),
        _m("8m", {"marine": 8}, {"marine": 8}, 120),
        _m("25m", {"marine": 25}, {"marine": 25}, 150),
        _m("5m_vs_6m", {"marine": 5}, {"marine": 6}, 70),
        _m("8m_vs_9m", {"marine": 8}, {"marine": 9}, 120),
        _m("10m_vs_11m", {"marine": 10}, {"marine": 11}, 150),
        _m("27m_vs_30m", {"marine": 27}, {"marine": 30}, 180),
        _m("2m_vs_1z", {"marine": 2}, {"zealot": 1}, 150),
        _m("2s3z", {"stalker": 2, "zealot": 3}, {"stalker": 2, "zealot": 3}, 120),
        _m("3s5z", {"stalker": 3, "zealot": 5}, {"stalker": 3, "zealot": 5}, 150),
        _m("3s5z_vs_3s6z", {"stalker": 3, "zealot": 5}, {"stalker": 3, "zealot": 6}, 170),
        _m("3s_vs_3z", {"stalker": 3}, {"zealot": 3}, 150),
        _m("3s_vs_4z", {"stalker": 3}, {"zealot": 4}, 200),
        _m("3s_vs_5z", {"stalker": 3}, {"zealot": 5}, 250),
        _m(
            "MMM",
            {"marauder": 2, "marine": 7, "medivac": 1},
            {"marauder": 2, "marine": 7, "medivac": 1},
            150,
        ),
        _m(
            "MMM2",
            {"marauder": 2, "marine": 7, "medivac": 1},
            {"marauder": 3, "marine": 8, "medivac": 1},
            180,
        ),
        _m("6h_vs_8z", {"hydralisk": 6}, {"zealot": 8}, 150),
        _m(
            "corridor",
            {"zealot": 6},
            {"zergling": 24},
            400,
            ally_start=(19.04, 19.12),
            enemy_start=(27.91, 28.24),
        ),
    )
}


def get_map(name: str) -> MapSpec:
    """The :class:`MapSpec` called ``name``; raises :class:`EnvError` naming the known maps."""
    if name not in MAPS:
        close = difflib.get_close_matches(name, list(MAPS), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise EnvError(f"unknown SMAC map '{name}'; {hint}known maps: {', '.join(MAPS)}")
    spec = MAPS[name]
    missing = {n for n, _ in spec.enemies} - set(spec.unit_types)
    if spec.unit_types and missing:
        raise EnvError(
            f"SMAC map '{name}': enemy unit types {sorted(missing)} have no unit-type feature; "
            "list them among the allies' types or use a single ally type"
        )
    return spec
