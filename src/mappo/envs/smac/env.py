"""A batched, tensor-program version of SMAC's unit micromanagement battles.

The StarCraft Multi-Agent Challenge (Samvelyan et al. 2019; code: ``oxwhirl/smac``,
``smac/env/starcraft2/starcraft2.py``) pits agents, one per allied unit, against an army run by
the game's built-in AI. This module simulates those battles itself, ``num_envs`` at a time, as
tensor operations on one device, and reproduces SMAC's interface: its observations, global
state, action space and availability masks, shaped reward and end conditions.

Simulation (per agent step = SMAC's ``step_mul`` of 8 game loops; figures in :mod:`.units`):

- Every unit has health, Protoss shields (absorbing damage first, regenerating 2 per game second
  after 10 game seconds without damage), armour (subtracted from each hit that reaches health,
  at least 0.5 damage per hit), damage per hit with bonus damage against Armored targets, hits per
  attack (the zealot's two), a weapon range between unit edges, a weapon cooldown in game loops
  and a movement speed. Medivacs heal (9 health per game second, 1 energy per 3 health, energy
  regenerating 0.5625 per game second) instead of attacking; ground-only weapons cannot hit them.
- Allied orders, as in SMAC: *stop* (the unit idles, and like an idle SC2 unit it fires at the
  closest enemy already in weapon range), *move* toward the point 2 map units north / south /
  east / west (every unit covers less than that in 8 game loops), *attack* / *heal* a unit
  (approach it until in range, then fire whenever the weapon is ready).
- The built-in AI attack-moves at the allies: each enemy keeps its current target while that
  target lives and stays in weapon range, otherwise takes the closest ally it can hit; it fires
  at a target in range and else moves toward it. An enemy medivac heals the closest damaged
  friendly unit, else follows the closest friendly one.

Deliberate simplifications of the game (also listed in ``docs/smac.md``):

- No terrain, pathing grid, cliffs or chokes: the map is an open 32 x 32 rectangle and moves
  stay inside it (``corridor`` is therefore open ground).
- All orders of a step are resolved simultaneously from the positions at the start of the step:
  a unit in range fires once if its weapon becomes ready during the 8 game loops (the residual
  cooldown carries over, so firing rates are exact), otherwise it moves; a unit that closes in
  fires from the next step on. No attack wind-up, projectile flight, turning or acceleration.
- Hits landing on one unit in the same step are applied in unit order, so shields and armour
  act per hit exactly as they would in that order.
- Unit collision is one relaxation pass pushing overlapping ground units apart after moving (air
  units never collide); there is no pathfinding around other units.
- No upgrades, zerg health regeneration, creep, marauder slow (Concussive Shells), stim,
  charge, or spell-casting; an ordered attack on a target the weapon cannot hit is unavailable.

SMAC interface: observations see units within SMAC's sight range 9 and attacks are available on
live enemies within SMAC's shooting range 6 (centre distance, the same for every unit type, as in
``get_avail_agent_actions``); a live agent cannot no-op and a dead agent can only no-op. Rewards
are SMAC's defaults (``reward_only_positive=True``, ``reward_death_value=10``, ``reward_win=200``,
``reward_scale_rate=20``). A time limit is reported as a truncation.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from mappo.envs.base import (
    ActionSpec,
    BatchedEnv,
    EnvError,
    EnvSpec,
    EnvStep,
    GroupSpec,
    LazyGroups,
)
from mappo.envs.smac.maps import MapSpec, get_map
from mappo.envs.smac.render import render_battle
from mappo.envs.smac.units import (
    ENERGY_REGEN_PER_LOOP,
    HEAL_PER_ENERGY,
    HEAL_PER_LOOP,
    SHIELD_REGEN_DELAY_LOOPS,
    SHIELD_REGEN_PER_LOOP,
    UnitType,
)

STEP_MUL = 8
"""Game loops per agent step (SMAC's ``step_mul``)."""
SIGHT_RANGE = 9.0
"""SMAC's ``unit_sight_range``: observation radius and distance normaliser, every unit type."""
SHOOT_RANGE = 6.0
"""SMAC's ``unit_shoot_range``: an attack (heal) is available within this centre distance."""
MOVE_CHECK = 1.0
"""SMAC's ``can_move`` looks half a move (``move_amount / 2`` = 1) ahead for the map edge."""
N_NO_ATTACK = 6
"""no-op, stop, move north, south, east, west; then one action per enemy (or per ally)."""
APPROACH_MARGIN = 0.05
"""A unit closing in stops this far inside its reach, so collisions rarely push it back out."""
MIN_HIT = 0.5
"""SC2's least damage a hit deals to health after armour."""

_MOVES = ((0.0, 1.0), (0.0, -1.0), (1.0, 0.0), (-1.0, 0.0))
"""Unit directions of actions 2..5 (north = +y, as in SMAC's ``get_agent_action``)."""

STAT_NAMES = ("battle_won", "allies_killed", "enemies_killed", "damage_dealt")


RESET_REDRAW = 8
"""Steps between redraws of the spare starting battles used by auto-resets (see ``_spare``)."""
SPARE = "spare_"
"""The prefix of the spare battle's keys in :meth:`SMACEnv.get_state`."""
HISTORY = "_history"
"""The suffix of the stacked frames' keys in :meth:`SMACEnv.get_state`."""


class SMACEnv(BatchedEnv):
    """``num_envs`` SMAC battles on one map, as one batched environment.

    One group ``allies`` with agents ``ally_0 .. ally_{n-1}``. Shapes (``E`` = ``num_envs``,
    ``n`` agents, ``m`` enemies, ``U = n + m`` units, allies first):

    - observation ``[E, n, 4 + m * (5 + s_e + t) + (n - 1) * (5 + s_a + t) + 1 + s_a + t]``:
      move availability (N, S, E, W); per enemy: attackable, distance, relative x, y (all divided
      by the sight range 9), health / max, shield / max (if the enemies are Protoss), unit-type
      one-hot (``t`` types); per other ally: visible, distance, relative x, y, health, shield,
      type; own health, shield, type. Units out of sight or dead are all zeros; a dead agent's
      whole observation is zeros. ``s_a``, ``s_e`` are 1 for a Protoss side, else 0. With
      ``obs_last_action`` each other ally's block (while it is visible) and the agent's own
      part (while it lives) end with that unit's last action one-hot (``6 + m`` more values
      each); with ``obs_agent_id`` the observation ends with the agent's one-hot id (``n``
      values, a dead agent's too), as in the MAPPO paper's SMAC env.
    - global state ``[n * (4 + s_a + t) + m * (3 + s_e + t) + n * (6 + m)]``: per ally health,
      weapon cooldown / SMAC's max cooldown (energy / 200 for a medivac), x, y relative to the map
      centre / map size, shield, type; per enemy health, x, y, shield, type (all zeros for a
      dead unit); the allies' last actions one-hot (all zeros after a reset; left out with
      ``state_last_action=False``), as SMAC's ``get_state``.
    - agent-specific state, ``agent_state="as"`` (or ``True``): ``[E, n, state + obs + n]``,
      the global state, the agent's own observation and its one-hot id (the MAPPO paper's "AS"
      critic input). ``agent_state="fp"``: the paper's feature-pruned form, as its code's
      ``get_state_agent`` builds it, every unit seen from the agent without a sight limit, ``[E,
      n, (n - 1) * (8 + s_a + t + A) + m * (8 + s_e + t) + 4 + (7 + s_a + t + A) + n]`` (``A =
      6 + m``, left out with ``state_last_action=False``): per other ally visible (within 9),
      distance, relative x, y (over 9), weapon cooldown / max (a medivac's energy / 200),
      health, shield, x, y relative to the map centre / map size, type, last action one-hot; per
      enemy the availability of the agent's action slot for it, distance, relative x, y, visible,
      health, shield, type, x, y from the centre; the agent's move availability; its own 1, 0,
      0, 0, health, shield, x, y from the centre, type, last action; its one-hot id. A dead
      unit's block is zeros. In both forms a dead agent's is all zeros but its id (the paper's
      death masking of the critic input).
    - actions ``ActionSpec((6 + m,))`` with masks; rewards ``[E, n]``, the same for every agent.

    Auto-resets draw their starting positions ahead of time: every :data:`RESET_REDRAW` steps a
    spare starting battle is drawn for every env, with its observations, and an env that ends
    restarts from its spare. (An env ending twice within one redraw period restarts from the
    same jittered positions twice.)

    Args:
        map_name: a SMAC map (see :data:`mappo.envs.smac.maps.MAPS`).
        num_envs, device, seed: see :class:`~mappo.envs.base.BatchedEnv`.
        jitter: half-width in map units of the uniform noise added to each starting coordinate.
        reward_only_positive: SMAC's default ``True``; ``False`` subtracts half the damage and
            deaths the allies take, as SMAC's ``reward_negative_scale=0.5``.
        reward_scale_rate: the maximum episode return after scaling (SMAC's default 20).
        regeneration_reward: with ``reward_only_positive``, SMAC takes the absolute value of each
            step's damage + kill sum, so enemy shield regeneration and enemy healing are paid as
            if they were damage, and a policy can farm them (hit, wait ten game seconds, hit
            again). ``True`` (the default) keeps SMAC's reward; ``False`` keeps the sign instead,
            so regeneration counts against the damage dealt and an episode's return is at most
            ``reward_scale_rate``.
        agent_state: which agent-specific state to produce: ``"as"`` (or ``True``) the global
            state with the agent's observation and id, the MAPPO paper's "AS"; ``"fp"`` the
            paper's feature-pruned "FP", the form its code trains SMAC's critics on (above).
            ``False`` leaves it out (``agent_state_shape`` is ``None``): a critic on the global
            state (``algo.critic_input=state``) or on observations does not need it, and on the
            larger maps building it is a large share of the step.
        state_last_action: the global state's last actions (SMAC's default ``True``); PyMARL's
            COMA turns them off, as its critic adds the joint last action itself.
        obs_last_action, obs_agent_id: the observation's last actions and one-hot id (above).
            SMAC's own defaults are ``False``; the MAPPO paper's copy of SMAC's env turns both
            on (its ``StarCraft2_Env``), and the ``smac/<map>`` MAPPO presets do so too.
        stacked_frames: ``k``: the observation, the global state and the agent-specific state
            are each the episode's last ``k`` frames side by side, oldest first, zeros before
            its first step (sizes ``k`` times the above; the MAPPO paper's scripts stack 4 on
            3s_vs_4z and 3s_vs_5z). 1 (the default) stacks nothing.
    """

    def __init__(
        self,
        map_name: str,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int = 0,
        *,
        jitter: float = 0.25,
        reward_only_positive: bool = True,
        reward_scale_rate: float = 20.0,
        regeneration_reward: bool = True,
        agent_state: bool | str = True,
        state_last_action: bool = True,
        obs_last_action: bool = False,
        obs_agent_id: bool = False,
        stacked_frames: int = 1,
    ) -> None:
        self.name = f"smac/{map_name}"
        self.map: MapSpec = get_map(map_name)
        super().__init__(num_envs, device, seed)
        if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not 0 <= jitter <= 2:
            raise EnvError(
                f"{self.name}: jitter must be a number in [0, 2] map units, got {jitter!r}"
            )
        if isinstance(reward_scale_rate, bool) or not isinstance(reward_scale_rate, (int, float)):
            raise EnvError(
                f"{self.name}: reward_scale_rate must be a number, got {reward_scale_rate!r}"
            )
        if not 0 < reward_scale_rate < math.inf:  # (inf made every quiet step's reward NaN)
            raise EnvError(
                f"{self.name}: reward_scale_rate must be a positive finite number, got "
                f"{reward_scale_rate}"
            )
        self.jitter = float(jitter)
        self.reward_scale_rate = float(reward_scale_rate)
        for key, flag in (
            ("reward_only_positive", reward_only_positive),  # ('false' read as true)
            ("regeneration_reward", regeneration_reward),
            ("state_last_action", state_last_action),
            ("obs_last_action", obs_last_action),
            ("obs_agent_id", obs_agent_id),
        ):
            if not isinstance(flag, bool):
                raise EnvError(f"{self.name}: {key} must be true or false, got {flag!r}")
        if not (isinstance(agent_state, bool) or agent_state in ("as", "fp")):
            raise EnvError(
                f"{self.name}: agent_state must be 'as' (or true), 'fp' or false, got "
                f"{agent_state!r}"
            )
        if (
            isinstance(stacked_frames, bool)
            or not isinstance(stacked_frames, int)
            or stacked_frames < 1
        ):
            raise EnvError(
                f"{self.name}: stacked_frames must be a whole number >= 1 (1: no stacking), got "
                f"{stacked_frames!r}"
            )
        self.stacked_frames = k = stacked_frames
        self.reward_only_positive = reward_only_positive
        self.regeneration_reward = regeneration_reward
        self.with_agent_state = agent_state is not False
        # "as" or "fp" (None: left out)
        self.agent_state_form = {True: "as", False: None}.get(agent_state, agent_state)
        self.obs_last_action = obs_last_action
        self.state_last_action = state_last_action
        self.obs_agent_id = obs_agent_id

        ally_types = self.map.ally_units()
        enemy_types = self.map.enemy_units()
        self.units: list[UnitType] = ally_types + enemy_types
        self.n_agents = n = len(ally_types)
        self.n_enemies = m = len(enemy_types)
        self.n_units = n + m
        self.n_actions = N_NO_ATTACK + m
        self._build_static(ally_types, enemy_types)

        type_bits = len(self.map.unit_types)
        sa, se = int(self._shield_ally), int(self._shield_enemy)
        self.obs_dim = 4 + m * (5 + se + type_bits) + (n - 1) * (5 + sa + type_bits)
        self.obs_dim += 1 + sa + type_bits
        self.obs_dim += n * self.n_actions * obs_last_action + n * obs_agent_id
        self.state_dim = n * (4 + sa + type_bits) + m * (3 + se + type_bits)
        self.state_dim += n * self.n_actions * state_last_action
        a_last = self.n_actions * state_last_action
        if self.agent_state_form == "fp":
            agent_state_dim = (n - 1) * (8 + sa + type_bits + a_last) + m * (8 + se + type_bits)
            agent_state_dim += 4 + 7 + sa + type_bits + a_last + n
        else:
            agent_state_dim = self.state_dim + self.obs_dim + n
        self.spec = EnvSpec(
            groups={
                "allies": GroupSpec(
                    agents=tuple(f"ally_{i}" for i in range(n)),
                    obs_shape=(self.obs_dim * k,),
                    action=ActionSpec((self.n_actions,)),
                    has_action_mask=True,
                    agent_state_shape=(agent_state_dim * k,) if self.with_agent_state else None,
                )
            },
            state_shape=(self.state_dim * k,),
            episode_limit=self.map.limit,
            stat_names=STAT_NAMES,
        )
        # SMAC divides rewards by max_reward / reward_scale_rate, where max_reward counts every
        # enemy's health and shield, reward_death_value per enemy and the win bonus.
        max_reward = sum(u.health + u.shield for u in enemy_types) + 10.0 * m + 200.0
        self._reward_scale = self.reward_scale_rate / max_reward
        self._s: dict[str, Tensor] = {}
        self._mask: Tensor | None = None
        self._spare: dict[str, Tensor] = {}
        self._spare_view: tuple[Tensor, Tensor, Tensor] | None = None
        self._spare_age = 0
        # With stacked frames: per stacked output ("obs" [E, n, k, O], "state" [E, k, S],
        # "agent_state" [E, n, k, D]) its last k frames, the newest last.
        self._window: dict[str, Tensor] = {}
        self.reset(seed)

    # -- static tables ------------------------------------------------------------------------
    def _build_static(self, ally_types: list[UnitType], enemy_types: list[UnitType]) -> None:
        """Per-unit ``[U]`` and per-pair ``[U, U]`` constants, built once on the device."""
        dev = self.device
        units = self.units
        n, U = len(ally_types), len(units)
        m = U - n

        def tensor(values: object, dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        self._health_max = tensor([u.health for u in units])
        self._shield_max = tensor([u.shield for u in units])
        self._inv_health = 1.0 / self._health_max
        self._inv_shield = tensor([1.0 / u.shield if u.shield > 0 else 0.0 for u in units])
        self._armor = tensor([u.armor for u in units])
        self._period = tensor([u.cooldown for u in units])
        self._speed = tensor([u.speed * STEP_MUL for u in units])
        self._energy_max = tensor([u.energy for u in units])
        self._start_energy = tensor([u.start_energy for u in units])
        self._inv_cd = tensor([1.0 / u.smac_max_cooldown for u in units])
        self._healer = tensor([u.healer for u in units], torch.bool)
        self._has_healer = any(u.healer for u in units)
        self._has_shield = any(u.shield > 0 for u in units)
        self._shield_ally = any(u.shield > 0 for u in ally_types)
        self._shield_enemy = any(u.shield > 0 for u in enemy_types)
        self._hits = max(u.attacks for u in units)
        attacks = tensor([u.attacks for u in units], torch.int64)
        # [U, hits]: 1 where the unit's weapon lands that many hits per attack (zealot: 2).
        self._hit_slots = (torch.arange(self._hits, device=dev) < attacks[:, None]).float()
        self._inf = tensor(float("inf"))

        # Damage of one hit of unit i on unit j (bonus vs Armored). Who may act on whom:
        # attack = hostile and the weapon reaches the target's layer (ground / air);
        # heal = a medivac on a friendly biological unit.
        self._hit_damage = tensor(
            [[u.damage + (u.bonus_armored if v.armored else 0.0) for v in units] for u in units]
        )
        ally = [i < n for i in range(U)]
        can_attack = [
            [
                ally[i] != ally[j] and not u.healer and (u.hits_air or not v.air)
                for j, v in enumerate(units)
            ]
            for i, u in enumerate(units)
        ]
        can_heal = [
            [ally[i] == ally[j] and u.healer and v.biological for j, v in enumerate(units)]
            for i, u in enumerate(units)
        ]
        self._can_attack = tensor(can_attack, torch.bool)
        self._can_heal = tensor(can_heal, torch.bool)
        radius = tensor([u.radius for u in units])
        weapon = tensor([u.range for u in units])
        self._reach = weapon[:, None] + radius[:, None] + radius[None, :]
        ground = tensor([not u.air for u in units], torch.bool)
        self._collide = (
            ground[:, None] & ground[None, :] & ~torch.eye(U, dtype=torch.bool, device=dev)
        )
        self._contact = radius[:, None] + radius[None, :]

        self._reach_flat = self._reach.reshape(-1)
        self._hit_damage_flat = self._hit_damage.reshape(-1)
        self._row_base = torch.arange(U, device=dev) * U
        self._enemy_base = self._row_base[n:]
        self._reach_ae = self._reach[:n, n:]
        self._attack_ae = self._can_attack[:n, n:]
        self._attack_ea = self._can_attack[n:, :n]

        # Action slot j of ally i acts on unit n + j (enemy j), or on ally j for a medivac.
        slot_unit = [[(j if u.healer else n + j) for j in range(m)] for u in ally_types]
        self._slot_unit = tensor(slot_unit, torch.int64).clamp(max=U - 1)
        slot_ok = [[(j < n if u.healer else True) for j in range(m)] for u in ally_types]
        self._slot_ok = tensor(slot_ok, torch.bool) & (self._can_attack | self._can_heal)[
            :n
        ].gather(1, self._slot_unit)
        self._slot_unit_flat = self._slot_unit.reshape(-1)
        self._slot_ok_flat = self._slot_ok.reshape(-1)
        self._slot_base = torch.arange(n, device=dev) * m
        # Flat indices of (ally i, other ally j) pairs in SMAC's order, into [n * U] and [n].
        others = [(i, j) for i in range(n) for j in range(n) if j != i]
        self._pair_flat = tensor([i * U + j for i, j in others], torch.int64)
        self._pair_other = tensor([j for _, j in others], torch.int64)
        self._pair_nn = tensor([i * n + j for i, j in others], torch.int64)  # into [n * n]
        self._own_head = tensor([1.0, 0.0, 0.0, 0.0])  # the FP state's own visible, distance, x, y

        # Unit-type one-hot [U, t] in the map's type order (SMAC's get_unit_type_id).
        names = self.map.unit_types
        self._type_onehot = tensor([[float(u.name == t) for t in names] for u in units]).view(
            U, len(names)
        )
        self._moves = tensor([list(d) for d in _MOVES])
        self._map_size = tensor(list(self.map.size))
        self._action_ids = torch.arange(self.n_actions, device=dev)
        self._agent_id = torch.eye(n, device=dev)
        self._formation = self._formation_offsets(ally_types, enemy_types)

    def _formation_offsets(self, ally_types: list[UnitType], enemy_types: list[UnitType]) -> Tensor:
        """``[U, 2]`` starting positions: each army in a square-ish block (``ceil(sqrt(k))``
        units per column, columns one unit diameter apart) facing the other army, front column
        first, in unit order, around its map starting point (SC2 spawns a map's units as such a
        blob)."""
        starts = (np.array(self.map.ally_start), np.array(self.map.enemy_start))
        out = []
        for k, types in enumerate((ally_types, enemy_types)):
            own, other = starts[k], starts[1 - k]
            face = (other - own) / np.linalg.norm(other - own)
            side = np.array([-face[1], face[0]])
            count = len(types)
            spacing = 2.0 * max(t.radius for t in types) + 0.25
            rows = math.ceil(math.sqrt(count))
            for i in range(count):
                c, r = divmod(i, rows)
                in_col = min(rows, count - c * rows)
                out.append(own - face * c * spacing + side * (r - (in_col - 1) / 2) * spacing)
        pos = np.clip(np.array(out), 0.0, np.array(self.map.size))
        return torch.tensor(pos, dtype=torch.float32, device=self.device)

    # -- state --------------------------------------------------------------------------------
    def _initial_state(self) -> dict[str, Tensor]:
        """A fresh battle for every env (positions jittered with the env's generator)."""
        E, U, n, m = self.num_envs, self.n_units, self.n_agents, self.n_enemies
        dev = self.device
        noise = torch.rand((E, U, 2), generator=self.generator, device=dev) * 2.0 - 1.0
        pos = torch.minimum((self._formation + self.jitter * noise).clamp(min=0.0), self._map_size)
        return {
            "pos": pos,
            "health": self._health_max.expand(E, U).clone(),
            "shield": self._shield_max.expand(E, U).clone(),
            "energy": self._start_energy.expand(E, U).clone(),
            "cooldown": torch.zeros(E, U, device=dev),
            "since_damage": torch.full((E, U), SHIELD_REGEN_DELAY_LOOPS, device=dev),
            "enemy_target": torch.full((E, m), -1, dtype=torch.int64, device=dev),
            "last_action": torch.full((E, n), -1, dtype=torch.int64, device=dev),
            "target": torch.full((E, U), -1, dtype=torch.int64, device=dev),
            "fired": torch.zeros(E, U, dtype=torch.bool, device=dev),
            "t": torch.zeros(E, dtype=torch.int64, device=dev),
            "damage_dealt": torch.zeros(E, device=dev),
        }

    def _redraw_spare(self) -> None:
        self._spare = self._initial_state()
        self._spare_view = self._observe(self._spare)
        self._spare_age = 0

    def get_state(self) -> dict[str, Tensor]:
        """The simulator state (clones), each with a leading ``[E]`` axis:

        ``pos [E, U, 2]`` map units; ``health``, ``shield``, ``energy [E, U]``; ``cooldown
        [E, U]`` game loops until the weapon is ready; ``since_damage [E, U]`` game loops since
        the unit last took damage (shield regeneration); ``enemy_target [E, m]`` the built-in
        AI's current target (ally index, -1 none); ``last_action [E, n]`` (-1 none); ``target
        [E, U]`` unit each unit acted on in the last step (-1 none) and ``fired [E, U]`` whether
        it fired or healed (for rendering); ``t [E]`` steps into the episode;
        ``damage_dealt [E]`` health + shield the enemies lost so far. Units with zero health are
        dead; allies come first, then enemies.

        The battle each env restarts from when its episode ends, drawn ahead of time, is there
        too, under the same keys with ``spare_`` before them, with ``spare_age [E]`` (steps since
        it was drawn, one count for every env, as they are redrawn together; :meth:`set_state`
        takes the largest given): without them a run resumed from a checkpoint restarted its
        battles from other positions than the run never stopped.

        With ``stacked_frames=k > 1`` the k - 1 frames before the current one of each stacked
        output, oldest first, are there as well (zeros before an episode's first step):
        ``obs_history [E, n, k - 1, O]``, ``state_history [E, k - 1, S]`` and, with the
        agent-specific state, ``agent_state_history [E, n, k - 1, D]`` (``O``, ``S``, ``D``: one
        frame's size). :meth:`set_state` recomputes the current frame from the battle.
        """
        state = {k: v.clone() for k, v in self._s.items()}
        state.update({f"{k}{HISTORY}": w[..., :-1, :].clone() for k, w in self._window.items()})
        state.update({f"{SPARE}{k}": v.clone() for k, v in self._spare.items()})
        state[f"{SPARE}age"] = torch.full(
            (self.num_envs,), self._spare_age, dtype=torch.int64, device=self.device
        )
        return state

    def set_state(self, state: dict[str, Tensor], env_ids: Tensor | None = None) -> EnvStep:
        """Overwrite the given keys of :meth:`get_state` for envs ``env_ids`` (all when
        ``None``); keys left out keep their current values."""
        spare_keys = {f"{SPARE}{k}" for k in self._spare} | {f"{SPARE}age"}
        history_keys = {f"{k}{HISTORY}" for k in self._window}
        unknown = set(state) - set(self._s) - spare_keys - history_keys
        if unknown:
            histories = f", {', '.join(sorted(history_keys))}" if history_keys else ""
            raise EnvError(
                f"{self.name}: unknown state keys {sorted(unknown)}; expected some of "
                f"{sorted(self._s)}, their spare_ forms{histories} (see get_state)"
            )
        # (the outputs already returned are views of the frames kept: written into copies)
        self._window = {key: window.clone() for key, window in self._window.items()}
        if env_ids is None:
            ids = torch.arange(self.num_envs, device=self.device)
        else:
            ids = torch.as_tensor(env_ids, device=self.device, dtype=torch.int64).reshape(-1)
        for key, value in state.items():
            if key == f"{SPARE}age":
                # One count for every env (the spares are redrawn together): the largest given.
                ages = torch.as_tensor(value)
                if ages.numel() > 0:
                    self._spare_age = min(max(int(ages.max()), 0), RESET_REDRAW - 1)
                continue
            if key in history_keys:  # (a view: the frames before the current one)
                cur = self._window[key[: -len(HISTORY)]][..., :-1, :]
            else:
                cur = self._spare[key[len(SPARE) :]] if key in spare_keys else self._s[key]
            value = torch.as_tensor(value, device=self.device, dtype=cur.dtype)
            expected = (len(ids), *cur.shape[1:])
            if tuple(value.shape) != expected:
                raise EnvError(
                    f"{self.name}: state '{key}' has shape {tuple(value.shape)}, expected "
                    f"{expected} (len(env_ids), ...)"
                )
            cur[ids] = value
        self._s["health"].clamp_(min=0.0)
        if spare_keys & set(state):
            self._spare["health"].clamp_(min=0.0)
            self._spare_view = self._observe(self._spare)
        return self._observe_now()

    # -- the contract -------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> EnvStep:
        self.reseed(seed)
        self._s = self._initial_state()
        self._window = {}
        self._redraw_spare()
        return self._observe_now()

    def _observe_now(self) -> EnvStep:
        obs, state, mask = self._observe(self._s)
        self._mask = mask
        frames = {"obs": obs, "state": state}
        if self.with_agent_state:
            frames["agent_state"] = self._agent_state(self._s, state, obs, mask)
        if self.stacked_frames > 1:
            # The current frames after the ones kept (none after a reset: zeros).
            k = self.stacked_frames
            for key, frame in frames.items():
                old = self._window.get(key)
                if old is None:
                    old = frame.new_zeros(*frame.shape[:-1], k, frame.shape[-1])
                self._window[key] = _appended(old[..., :-1, :], frame)
                frames[key] = self._window[key].flatten(-2)
        E, n = self.num_envs, self.n_agents
        alive = self._s["health"][:, :n] > 0
        false = torch.zeros(E, dtype=torch.bool, device=self.device)
        return EnvStep(
            obs={"allies": frames["obs"]},
            state=frames["state"],
            reward={"allies": torch.zeros(E, n, device=self.device)},
            terminated=false,
            truncated=false.clone(),
            alive={"allies": alive},
            action_mask={"allies": mask},
            agent_state={"allies": frames["agent_state"]} if self.with_agent_state else {},
            stats={k: torch.zeros(E, device=self.device) for k in STAT_NAMES},
        )

    def step(self, actions: dict[str, Tensor]) -> EnvStep:
        if self.validate_actions:
            actions = self.check_actions(actions)
            assert self._mask is not None
            self.check_action_masks(actions, {"allies": self._mask})
        return self._step(actions)

    def _step(self, actions: dict[str, Tensor]) -> EnvStep:
        act = actions["allies"]
        if act.dim() == 3:
            act = act[..., 0]
        new, reward, won, terminated = self._simulate(self._s, act)
        n, E = self.n_agents, self.num_envs
        truncated = ~terminated & (new["t"] >= self.map.limit)
        done = terminated | truncated
        health = new["health"]
        stats = {
            "battle_won": won.float(),
            "allies_killed": (health[:, :n] <= 0).sum(1).float(),
            "enemies_killed": (health[:, n:] <= 0).sum(1).float(),
            "damage_dealt": new["damage_dealt"],
        }
        final_obs, final_state, final_mask = self._observe(new)
        # Auto-reset by a masked select from the spare battles (no host sync, no branch).
        assert self._spare_view is not None
        after = {k: _select(done, self._spare[k], v) for k, v in new.items()}
        obs, state, mask = (
            _select(done, a, b)
            for a, b in zip(self._spare_view, (final_obs, final_state, final_mask), strict=True)
        )
        alive = after["health"][:, :n] > 0
        self._s = after
        self._mask = mask
        self._spare_age += 1
        if self._spare_age >= RESET_REDRAW:
            self._redraw_spare()
        frames = {"obs": obs, "state": state}
        if self.with_agent_state:
            frames["agent_state"] = self._agent_state(after, state, obs, mask)

        history: dict[str, Tensor] = {}
        if self.stacked_frames > 1:
            # Each output's k - 1 frames before this step's go before the frame the episode
            # ended on (final_*) and, cleared where a new episode began, before the next one.
            history = {key: window[..., 1:, :] for key, window in self._window.items()}
            for key, frame in frames.items():
                kept = _select(done, torch.zeros_like(history[key]), history[key])
                self._window[key] = _appended(kept, frame)
                frames[key] = self._window[key].flatten(-2)
        unstacked = (final_state, final_obs, final_mask)

        def final_agent_state() -> Tensor:
            frame = self._agent_state(new, *unstacked)
            return _appended(history["agent_state"], frame).flatten(-2) if history else frame

        if history:
            final_obs = _appended(history["obs"], final_obs).flatten(-2)
            final_state = _appended(history["state"], final_state).flatten(-2)
        return EnvStep(
            obs={"allies": frames["obs"]},
            state=frames["state"],
            reward={"allies": reward[:, None].expand(E, n).contiguous()},
            terminated=terminated,
            truncated=truncated,
            alive={"allies": alive},
            action_mask={"allies": mask},
            agent_state={"allies": frames["agent_state"]} if self.with_agent_state else {},
            final_obs={"allies": final_obs},
            final_state=final_state,
            final_action_mask={"allies": final_mask},
            # Only a critic bootstrapping truncated episodes reads it: built on demand.
            final_agent_state=(
                LazyGroups({"allies": final_agent_state}) if self.with_agent_state else {}
            ),
            stats=stats,
        )

    def render(self, env_index: int = 0, size: int = 400) -> np.ndarray:
        """An RGB frame ``[size, size, 3]`` uint8 of battle ``env_index`` (see :mod:`.render`)."""
        return render_battle(self, env_index, size)

    # -- simulation ---------------------------------------------------------------------------
    def _fighting(self, health: Tensor) -> tuple[Tensor, Tensor]:
        """``[E]`` bool per side: some unit that can fight is alive. On maps with medivacs a
        side with only medivacs left has lost (SMAC's ``only_medivac_left``)."""
        n = self.n_agents
        able = (health > 0) & ~self._healer if self.map.medivac_rule else health > 0
        return able[:, :n].any(1), able[:, n:].any(1)

    def _simulate(
        self, s: dict[str, Tensor], act: Tensor
    ) -> tuple[dict[str, Tensor], Tensor, Tensor, Tensor]:
        """One agent step of 8 game loops for every env. ``act [E, n]`` int64.

        Returns the new state, the team reward ``[E]`` (scaled), ``won`` and ``terminated``
        ``[E]`` (some side can no longer fight; both sides defeated at once is a draw).
        """
        E, n, U = self.num_envs, self.n_agents, self.n_units
        pos, health, shield = s["pos"], s["health"], s["shield"]
        energy, cooldown = s["energy"], s["cooldown"]
        alive = health > 0
        ally_alive = alive[:, :n]
        x, y = pos[..., 0], pos[..., 1]
        # Ally-to-enemy distances [E, n, m]; the built-in AI reads them transposed.
        d_ae = torch.hypot(x[:, None, n:] - x[:, :n, None], y[:, None, n:] - y[:, :n, None])
        inf = self._inf

        # Allied orders: 2..5 move, >= 6 attack (heal) a unit, 1 stop, 0 no-op (dead).
        slot = (act - N_NO_ATTACK).clamp(min=0, max=self.n_enemies - 1)
        a_target = self._slot_unit_flat[self._slot_base + slot]
        a_has = (act >= N_NO_ATTACK) & self._slot_ok_flat[self._slot_base + slot]
        a_has &= alive.gather(1, a_target) & ally_alive
        is_move = (act >= 2) & (act < N_NO_ATTACK) & ally_alive
        move_vec = self._moves[(act - 2).clamp(0, 3)] * (is_move * self._speed[:n])[..., None]
        # A stopped unit fires at the closest enemy already in weapon range (an idle SC2 unit).
        in_weapon = self._attack_ae & alive[:, None, n:] & (d_ae <= self._reach_ae)
        d_idle, idle_target = torch.where(in_weapon, d_ae, inf).min(-1)
        stop = (act == 1) & (d_idle < inf) & ally_alive
        a_target = torch.where(stop, idle_target + n, a_target)
        a_has |= stop

        # Built-in AI: keep a live target in range, else the closest ally it can hit.
        d_ea = d_ae.transpose(1, 2)
        e_ok = self._attack_ea & ally_alive[:, None, :]
        closest_d, closest = torch.where(e_ok, d_ea, inf).min(-1)
        prev = s["enemy_target"]
        prev_c = prev.clamp(min=0)
        keep = e_ok.gather(2, prev_c[..., None])[..., 0] & (prev >= 0)
        keep &= (
            d_ea.gather(2, prev_c[..., None])[..., 0] <= self._reach_flat[self._enemy_base + prev_c]
        )
        e_target = torch.where(keep, prev_c, closest)
        e_has = (keep | (closest_d < inf)) & alive[:, n:]
        if self._has_healer:
            # Enemy medivacs: the closest damaged friendly unit, else follow the closest one.
            healer = self._healer[n:]
            xe, ye = x[:, n:], y[:, n:]
            d_friend = torch.hypot(xe[:, None, :] - xe[:, :, None], ye[:, None, :] - ye[:, :, None])
            heal_ok = self._can_heal[n:, n:] & alive[:, None, n:]
            hurt = health[:, None, n:] < self._health_max[n:]
            # Any injured unit comes before every uninjured one, then the closest.
            score = torch.where(heal_ok, d_friend + 1e4 * (~hurt), inf)
            h_d, h_target = score.min(-1)
            e_target = torch.where(healer, h_target + n, e_target)
            e_has = torch.where(healer, (h_d < inf) & alive[:, n:], e_has)
            enemy_target = torch.where(e_has & ~healer, e_target, -1)
        else:
            enemy_target = torch.where(e_has, e_target, -1)

        target = torch.cat((a_target, e_target), 1)  # [E, U]
        has = torch.cat((a_has, e_has), 1)
        pair = self._row_base + target  # flat (unit, target) index into [U * U] tables
        tdx = x.gather(1, target) - x
        tdy = y.gather(1, target) - y
        d_t = torch.hypot(tdx, tdy)
        gap = d_t - self._reach_flat[pair]
        in_reach = has & (gap <= 1e-5)

        # Weapons fire once if the cooldown runs out within this step's 8 loops; the residual
        # cooldown carries over so that the firing rate is exact.
        fire = in_reach & (cooldown < STEP_MUL)
        if self._has_healer:
            fire &= ~self._healer
        new_cd = torch.where(
            fire, cooldown + (self._period - STEP_MUL), (cooldown - STEP_MUL).clamp(min=0)
        )

        # Hits in unit order; each hit first drains shields, the rest goes to health less armour
        # (at least 0.5 when the whole hit reaches health).
        dmg = torch.where(fire, self._hit_damage_flat[pair], 0.0)
        hit_tgt = target
        if self._hits > 1:
            dmg = (dmg[..., None] * self._hit_slots).reshape(E, U * self._hits)
            hit_tgt = target.repeat_interleave(self._hits, dim=1)
        armor = self._armor[hit_tgt]
        zeros = torch.zeros(E, U, device=self.device)
        if self._has_shield:
            per_target = torch.zeros(E, dmg.shape[1], U, device=self.device)
            per_target.scatter_(2, hit_tgt[..., None], dmg[..., None])
            before = (per_target.cumsum(1) - per_target).gather(2, hit_tgt[..., None])[..., 0]
            absorbed = torch.minimum((shield.gather(1, hit_tgt) - before).clamp(min=0.0), dmg)
            rest = dmg - absorbed
            to_health = torch.where(absorbed > 0, rest - armor, (rest - armor).clamp(min=MIN_HIT))
            to_health = torch.where(dmg > 0, to_health.clamp(min=0.0), 0.0)
            shield_loss = zeros.scatter_add(1, hit_tgt, absorbed)
        else:
            to_health = torch.where(dmg > 0, (dmg - armor).clamp(min=MIN_HIT), 0.0)
            shield_loss = zeros
        health_loss = zeros.scatter_add(1, hit_tgt, to_health)
        left = health - health_loss
        dies = alive & (left <= 0)
        new_health = torch.where(dies, zeros, left)

        new_energy = energy
        if self._has_healer:
            # 9 health per game second, 1 energy per 3 health, never above max health.
            heal = in_reach & self._healer & (energy > 0)
            missing = (self._health_max - health).gather(1, target)
            amount = torch.minimum(missing, energy * HEAL_PER_ENERGY)
            amount = torch.where(heal, amount.clamp(max=HEAL_PER_LOOP * STEP_MUL), 0.0)
            healed = zeros.scatter_add(1, target, amount)
            healed = torch.where(new_health > 0, healed, 0.0)
            new_health = torch.minimum(new_health + healed, self._health_max)
            new_energy = (
                energy - amount / HEAL_PER_ENERGY + ENERGY_REGEN_PER_LOOP * STEP_MUL
            ).clamp(max=self._energy_max)
            heal = heal & (amount > 0)
            fire = fire | heal

        since = s["since_damage"]
        new_shield = shield
        if self._has_shield:
            # Shields regenerate 2 per game second after 10 game seconds without damage.
            hit = zeros.scatter_add(1, hit_tgt, dmg) > 0
            since = torch.where(hit, zeros, since + STEP_MUL)
            regen = torch.where(
                since >= SHIELD_REGEN_DELAY_LOOPS, SHIELD_REGEN_PER_LOOP * STEP_MUL, 0.0
            )
            new_shield = torch.minimum(shield - shield_loss + regen, self._shield_max)
            new_shield = torch.where(new_health > 0, new_shield, 0.0)

        # Movement: ordered moves, or closing in on a target out of range; then overlapping
        # ground units are pushed apart once, and everything stays on the map.
        go = torch.minimum(self._speed, gap + APPROACH_MARGIN) / d_t.clamp(min=1e-6)
        go = torch.where(has & ~in_reach, go.clamp(min=0.0), 0.0)
        tx = tdx * go
        ty = tdy * go
        tx[:, :n] += move_vec[..., 0]
        ty[:, :n] += move_vec[..., 1]
        nx, ny = x + tx, y + ty
        live = new_health > 0
        sx = nx[:, None, :] - nx[:, :, None]
        sy = ny[:, None, :] - ny[:, :, None]
        sd = torch.hypot(sx, sy)
        both = self._collide & live[:, :, None] & live[:, None, :]
        push = torch.where(both, (self._contact - sd).clamp(min=0.0) / sd.clamp(min=1e-6), 0.0)
        push = push * 0.5
        nx = nx - (sx * push).sum(2)
        ny = ny - (sy * push).sum(2)
        new_pos = torch.stack((nx, ny), -1).clamp(min=0.0)
        new_pos = torch.minimum(new_pos, self._map_size)

        # SMAC's reward_battle: health + shield the enemies lost (all of it on death) plus
        # reward_death_value per kill; with reward_only_positive it takes abs() of the sum, as
        # SMAC does (shield regeneration and heals can make it negative), unless
        # regeneration_reward is off; reward_win on a win.
        enemy_loss = (health + shield - new_health - new_shield)[:, n:]
        enemy_loss = torch.where(alive[:, n:], enemy_loss, 0.0)
        delta = enemy_loss.sum(1) + 10.0 * dies[:, n:].sum(1)
        ally_fight, enemy_fight = self._fighting(new_health)
        won = ally_fight & ~enemy_fight
        terminated = ~(ally_fight & enemy_fight)
        if self.reward_only_positive:
            reward = delta.abs() if self.regeneration_reward else delta
        else:
            ally_loss = ((health + shield) - (new_health + new_shield))[:, :n] * ally_alive
            reward = delta - 0.5 * (ally_loss.sum(1) + 10.0 * dies[:, :n].sum(1))
        reward = (reward + 200.0 * won) * self._reward_scale

        new = {
            "pos": new_pos,
            "health": new_health,
            "shield": new_shield,
            "energy": new_energy,
            "cooldown": new_cd,
            "since_damage": since,
            "enemy_target": enemy_target,
            "last_action": act,
            "target": torch.where(has, target, -1),
            "fired": fire,
            "t": s["t"] + 1,
            "damage_dealt": s["damage_dealt"] + enemy_loss.clamp(min=0.0).sum(1),
        }
        return new, reward, won, terminated

    # -- observations -------------------------------------------------------------------------
    def _observe(self, s: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """``(obs [B, n, O], state [B, S], mask [B, n, A])`` of a batch of states (SMAC's
        ``get_obs_agent``, ``get_state`` and ``get_avail_agent_actions``)."""
        pos, health, shield = s["pos"], s["health"], s["shield"]
        B = pos.shape[0]
        n, m, U = self.n_agents, self.n_enemies, self.n_units
        alive = health > 0
        me = alive[:, :n]
        x, y = pos[..., 0], pos[..., 1]
        dx = x[:, None, :] - x[:, :n, None]  # [B, n, U]
        dy = y[:, None, :] - y[:, :n, None]
        dist = torch.hypot(dx, dy)

        # Mask: no-op only when dead, stop when alive, moves whose half-step stays on the map,
        # attacks (heals) on live valid units within SMAC's shooting range.
        xa, ya = x[:, :n], y[:, :n]
        w, h = self.map.size
        moves = torch.stack(
            (ya + MOVE_CHECK < h, ya - MOVE_CHECK >= 0, xa + MOVE_CHECK < w, xa - MOVE_CHECK >= 0),
            -1,
        )
        if self._has_healer:
            d_slot = dist.gather(2, self._slot_unit.expand(B, n, m))
            ok = alive[:, self._slot_unit] & self._slot_ok
            ok &= ~self._healer[:n, None] | (health < self._health_max)[:, self._slot_unit]
        else:
            d_slot = dist[:, :, n:]
            ok = alive[:, None, n:] & self._slot_ok
        ok = ok & (d_slot <= SHOOT_RANGE) & me[..., None]
        mask = torch.cat((~me[..., None], me[..., None], moves & me[..., None], ok), -1)

        # Per-unit features: health / max, shield / max (Protoss sides), unit-type one-hot.
        hp = (health * self._inv_health)[..., None]
        sh = (shield * self._inv_shield)[..., None]
        types = self._type_onehot.expand(B, U, -1)
        a_parts = [hp[:, :n], sh[:, :n]] if self._shield_ally else [hp[:, :n]]
        e_parts = [hp[:, n:], sh[:, n:]] if self._shield_enemy else [hp[:, n:]]
        unit_a = torch.cat((*a_parts, types[:, :n]), -1)  # [B, n, 1 + s_a + t]
        unit_e = torch.cat((*e_parts, types[:, n:]), -1)  # [B, m, 1 + s_e + t]

        # Per pair (agent i, unit j): visible, distance, relative x, y over the sight range,
        # all zero when j is out of sight or dead, or i is dead.
        vis = ((dist < SIGHT_RANGE) & alive[:, None, :] & me[:, :, None]).float()
        rel = torch.stack((torch.full_like(dist, SIGHT_RANGE), dist, dx, dy), -1)
        rel = rel * (vis * (1.0 / SIGHT_RANGE))[..., None]  # [B, n, U, 4]
        # SMAC's "attackable" is the availability of action slot j, shown only for a visible
        # enemy j. An available attack implies a visible enemy; a medivac's slot j heals ally j.
        attackable = ok.float()
        if self._has_healer:
            attackable = attackable * vis[:, :, n:]
        enemy = torch.cat(
            (attackable[..., None], rel[:, :, n:, 1:], unit_e[:, None] * vis[:, :, n:, None]), -1
        )
        last = (s["last_action"][..., None] == self._action_ids).float()  # [B, n, A]
        pairs = rel.reshape(B, n * U, 4).index_select(1, self._pair_flat)
        # each unit's features as its allies see them (and as it sees its own)
        own = torch.cat((unit_a, last), -1) if self.obs_last_action else unit_a
        ally = torch.cat((pairs, own.index_select(1, self._pair_other) * pairs[..., :1]), -1)
        me_f = me[..., None].float()
        parts = [mask[..., 2:6].float(), enemy.reshape(B, n, -1), ally.reshape(B, n, -1)]
        parts.append(own * me_f)
        if self.obs_agent_id:
            parts.append(self._agent_id.expand(B, n, n))
        obs = torch.cat(parts, -1)

        # Global state: positions relative to the map centre over the map size; cooldown over
        # SMAC's max cooldown (a medivac's energy over 200); last actions one-hot.
        centred = (pos - self._map_size * 0.5) / self._map_size
        cd = s["cooldown"][:, :n]
        if self._has_healer:
            cd = torch.where(self._healer[:n], s["energy"][:, :n], cd)
        cd = (cd * self._inv_cd[:n])[..., None]
        a_state = torch.cat((unit_a[..., :1], cd, centred[:, :n], unit_a[..., 1:]), -1)
        e_state = torch.cat((unit_e[..., :1], centred[:, n:], unit_e[..., 1:]), -1)
        units = [
            (a_state * me_f).reshape(B, -1),
            (e_state * alive[:, n:, None].float()).reshape(B, -1),
        ]
        state = torch.cat([*units, last.reshape(B, -1)] if self.state_last_action else units, -1)
        return obs, state, mask

    def _agent_state(
        self, s: dict[str, Tensor], state: Tensor, obs: Tensor, mask: Tensor
    ) -> Tensor:
        """The agent-specific state ``[B, n, D]`` of a batch of battles ``s`` whose global
        state, observations and action masks are ``state [B, S]``, ``obs [B, n, O]`` and ``mask
        [B, n, A]``: the "AS" form ``[state * alive | obs | one-hot id]``, written in place, or
        the "FP" form (:meth:`_feature_pruned`)."""
        if self.agent_state_form == "fp":
            return self._feature_pruned(s, mask)
        alive = s["health"][:, : self.n_agents] > 0
        B, n = obs.shape[:2]
        s_dim, o_dim = self.state_dim, self.obs_dim
        out = torch.empty(B, n, s_dim + o_dim + n, device=self.device)
        torch.mul(state[:, None], alive[..., None].float(), out=out[..., :s_dim])
        out[..., s_dim : s_dim + o_dim] = obs
        out[..., s_dim + o_dim :] = self._agent_id
        return out

    def _feature_pruned(self, s: dict[str, Tensor], mask: Tensor) -> Tensor:
        """The MAPPO paper's feature-pruned agent-specific state ``[B, n, D]`` (the form of its
        code's ``StarCraft2_Env.get_state_agent`` with that env's defaults: centre coordinates
        on, last actions and id on, terrain off) of a batch of battles ``s`` with action masks
        ``mask [B, n, A]``. Each agent sees every living unit, however far: the global state's
        content in the agent's frame, without the observation's duplicates."""
        pos, health, shield = s["pos"], s["health"], s["shield"]
        B = pos.shape[0]
        n, m, U = self.n_agents, self.n_enemies, self.n_units
        alive = health > 0
        x, y = pos[..., 0], pos[..., 1]
        dx = x[:, None, :] - x[:, :n, None]  # [B, n, U]
        dy = y[:, None, :] - y[:, :n, None]
        dist = torch.hypot(dx, dy)
        # per pair (agent i, unit j): visible, distance, relative x, y over the sight range
        rel = torch.stack(((dist < SIGHT_RANGE).float(), dist / SIGHT_RANGE, dx / SIGHT_RANGE,
                           dy / SIGHT_RANGE), -1)  # fmt: skip
        hp = (health * self._inv_health)[..., None]
        sh = (shield * self._inv_shield)[..., None]
        centred = (pos - self._map_size * 0.5) / self._map_size  # [B, U, 2]
        types = self._type_onehot.expand(B, U, -1)
        cd = s["cooldown"][:, :n]
        if self._has_healer:
            cd = torch.where(self._healer[:n], s["energy"][:, :n], cd)
        cd = (cd * self._inv_cd[:n])[..., None]
        a_health = [hp[:, :n], sh[:, :n]] if self._shield_ally else [hp[:, :n]]
        e_health = [hp[:, n:], sh[:, n:]] if self._shield_enemy else [hp[:, n:]]
        last = [(s["last_action"][..., None] == self._action_ids).float()]  # [B, n, A]
        last = last if self.state_last_action else []
        # Each ally's features as every agent's state shows them, and the agent's own.
        ally_unit = torch.cat((*a_health, centred[:, :n], types[:, :n], *last), -1)
        ally = torch.cat((rel[:, :, :n, :1], rel[:, :, :n, 1:], cd[:, None].expand(B, n, n, 1),
                          ally_unit[:, None].expand(B, n, n, -1)), -1)  # fmt: skip
        ally = ally * alive[:, None, :n, None]
        ally = ally.reshape(B, n * n, -1).index_select(1, self._pair_nn).reshape(B, n, -1)
        # (the agent's action slot j: attack enemy j, or heal ally j for a medivac, as the
        # paper's env reads it)
        slot = mask[..., N_NO_ATTACK:, None].float()  # [B, n, m, 1]
        enemy_unit = torch.cat((*e_health, types[:, n:], centred[:, n:]), -1)  # [B, m, F]
        enemy = torch.cat((slot, rel[:, :, n:, 1:], rel[:, :, n:, :1],
                           enemy_unit[:, None].expand(B, n, m, -1)), -1)  # fmt: skip
        enemy = (enemy * alive[:, None, n:, None]).reshape(B, n, -1)
        own = torch.cat((self._own_head.expand(B, n, 4), ally_unit), -1)
        me = alive[:, :n, None].float()
        parts = (ally * me, enemy * me, mask[..., 2:N_NO_ATTACK].float() * me, own * me)
        return torch.cat((*parts, self._agent_id.expand(B, n, n)), -1)


def _appended(history: Tensor, frame: Tensor) -> Tensor:
    """``[..., k, D]``: the frames ``history [..., k - 1, D]`` then ``frame [..., D]``, oldest
    first."""
    return torch.cat((history, frame.unsqueeze(-2)), -2)


def _select(cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``torch.where`` with an ``[E]`` condition broadcast over the trailing axes."""
    return torch.where(cond.view(-1, *([1] * (a.dim() - 1))), a, b)
