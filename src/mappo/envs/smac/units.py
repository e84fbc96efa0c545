"""StarCraft II unit figures used by the SMAC maps.

Sources (facts, not code):

- Combat figures (health, shields, armour, damage and bonus damage, weapon cooldown, range,
  movement speed, sight, attributes, radius) are the Legacy of the Void multiplayer values of
  Liquipedia's "Unit Statistics (Legacy of the Void)" tables, for the 4.x game versions that SMAC
  runs on. Liquipedia quotes times and speeds at the "Faster" game speed (22.4 game loops per real
  second); :func:`loops` and :func:`per_loop` convert them to game loops.
- The normalising constants of the cooldown / energy features (``smac_max_cooldown``) are those
  of SMAC's ``StarCraft2Env.unit_max_cooldown`` (``smac/env/starcraft2/starcraft2.py``).
- Game mechanics: Protoss shields regenerate 2 points per game second after 10 game seconds
  without taking damage; a medivac heals 9 health per game second at 1 energy per 3 health and
  regenerates 0.5625 energy per game second (energy 200, starting with 50). A game second is 16
  game loops.
"""

from __future__ import annotations

from dataclasses import dataclass

LOOPS_PER_GAME_SECOND = 16.0
"""Game loops per game second ("Normal" speed); SC2's engine runs in game loops."""
LOOPS_PER_FASTER_SECOND = 22.4
"""Game loops per real second at the "Faster" speed Liquipedia quotes its figures in."""
MELEE_RANGE = 0.1
"""Weapon range of melee attacks (zealot, zergling), added to both units' radii."""

SHIELD_REGEN_PER_LOOP = 2.0 / LOOPS_PER_GAME_SECOND
SHIELD_REGEN_DELAY_LOOPS = 10.0 * LOOPS_PER_GAME_SECOND
HEAL_PER_LOOP = 9.0 / LOOPS_PER_GAME_SECOND
HEAL_PER_ENERGY = 3.0
ENERGY_REGEN_PER_LOOP = 0.5625 / LOOPS_PER_GAME_SECOND


def loops(faster_seconds: float) -> float:
    """A duration quoted in real seconds at "Faster" speed, in game loops."""
    return faster_seconds * LOOPS_PER_FASTER_SECOND


def per_loop(faster_rate: float) -> float:
    """A rate quoted per real second at "Faster" speed (e.g. a movement speed), per game loop."""
    return faster_rate / LOOPS_PER_FASTER_SECOND


@dataclass(frozen=True)
class UnitType:
    """One StarCraft II unit type (Liquipedia LotV figures; distances in map units)."""

    name: str
    letter: str
    """One character drawn on the unit when rendering."""
    health: float
    shield: float
    armor: float
    damage: float
    """Damage per hit, before armour."""
    bonus_armored: float
    """Extra damage per hit against units with the Armored attribute (stalker, marauder)."""
    attacks: int
    """Hits per weapon cycle (the zealot's Psi Blades hit twice)."""
    cooldown: float
    """Weapon period in game loops."""
    range: float
    """Weapon (or heal) range, between the two units' edges."""
    speed: float
    """Movement speed in map units per game loop."""
    radius: float
    sight: float
    """The game's sight range; SMAC's observations use a fixed 9 for every unit instead."""
    armored: bool
    biological: bool
    air: bool = False
    hits_air: bool = True
    healer: bool = False
    energy: float = 0.0
    start_energy: float = 0.0
    smac_max_cooldown: float = 15.0
    """SMAC's normaliser of the weapon cooldown (or energy, for a medivac) in the state."""


UNIT_TYPES: dict[str, UnitType] = {
    t.name: t
    for t in (
        UnitType(
            name="marine",
            letter="m",
            health=45.0,
            shield=0.0,
            armor=0.0,
            damage=6.0,
            bonus_armored=0.0,
            attacks=1,
            cooldown=loops(0.61),
            range=5.0,
            speed=per_loop(3.15),
            radius=0.375,
            sight=9.0,
            armored=False,
            biological=True,
            smac_max_cooldown=15.0,
        ),
        UnitType(
            name="marauder",
            letter="M",
            health=125.0,
            shield=0.0,
            armor=1.0,
            damage=10.0,
            bonus_armored=10.0,
            attacks=1,
            cooldown=loops(1.07),
            range=6.0,
            speed=per_loop(3.15),
            radius=0.5625,
            sight=10.0,
            armored=True,
            biological=True,
            hits_air=False,
            smac_max_cooldown=25.0,
        ),
        UnitType(
            name="medivac",
            letter="V",
            health=150.0,
            shield=0.0,
            armor=1.0,
            damage=0.0,
            bonus_armored=0.0,
            attacks=0,
            cooldown=0.0,
            range=4.0,
            speed=per_loop(3.5),
            radius=0.75,
            sight=11.0,
            armored=True,
            biological=False,
            air=True,
            hits_air=False,
            healer=True,
            energy=200.0,
            start_energy=50.0,
            smac_max_cooldown=200.0,
        ),
        UnitType(
            name="stalker",
            letter="s",
            health=80.0,
            shield=80.0,
            armor=1.0,
            damage=13.0,
            bonus_armored=5.0,
            attacks=1,
            cooldown=loops(1.34),
            range=6.0,
            speed=per_loop(4.13),
            radius=0.625,
            sight=10.0,
            armored=True,
            biological=False,
            smac_max_cooldown=35.0,
        ),
        UnitType(
            name="zealot",
            letter="z",
            health=100.0,
            shield=50.0,
            armor=1.0,
            damage=8.0,
            bonus_armored=0.0,
            attacks=2,
            cooldown=loops(0.86),
            range=MELEE_RANGE,
            speed=per_loop(3.15),
            radius=0.5,
            sight=9.0,
            armored=False,
            biological=True,
            hits_air=False,
            smac_max_cooldown=22.0,
        ),
        UnitType(
            # Cooldown 0.59 s is the 4.x value; later patches lowered it to 0.54 s.
            name="hydralisk",
            letter="h",
            health=90.0,
            shield=0.0,
            armor=0.0,
            damage=12.0,
            bonus_armored=0.0,
            attacks=1,
            cooldown=loops(0.59),
            range=5.0,
            speed=per_loop(3.15),
            radius=0.625,
            sight=9.0,
            armored=False,
            biological=True,
            smac_max_cooldown=10.0,
        ),
        UnitType(
            name="zergling",
            letter="g",
            health=35.0,
            shield=0.0,
            armor=0.0,
            damage=5.0,
            bonus_armored=0.0,
            attacks=1,
            cooldown=loops(0.497),
            range=MELEE_RANGE,
            speed=per_loop(4.13),
            radius=0.375,
            sight=8.0,
            armored=False,
            biological=True,
            hits_air=False,
            smac_max_cooldown=11.0,
        ),
    )
}
