"""The particle world of the MAPPO paper's MPE as one batched tensor program.

:class:`ParticleEnv` holds ``num_envs`` copies of a world of agents and landmarks and advances
all of them with a few large tensor operations per step. The physics follows the paper's copy of
the Multi-Agent Particle Environments (Lowe et al. 2017, as vendored by Yu et al. 2022): discrete
moves become forces, soft contact forces push colliding entities apart, velocities are damped and
integrated with an explicit Euler step; communication actions set one-hot messages. Scenarios
(:mod:`~mappo.envs.mpe.simple_spread` and friends) subclass it and supply reset distributions,
observations, rewards and episode statistics.

**Continuous actions** (``continuous_actions=True``) follow PettingZoo's ``mpe2``
(``mpe2/_mpe_utils/simple_env.py``: ``SimpleEnv.__init__`` builds the spaces, ``_set_action``
reads them). An agent's action is one float32 vector in ``[0, 1]^d``: first, for an agent that
moves, 5 movement components ``[no-op, -x, +x, -y, +y]`` giving the force
``5 * (a[2] - a[1], a[4] - a[3])`` (``a[0]`` is ignored; the sensitivity 5 is mpe2's default,
no scenario here sets ``accel``); then, for an agent that speaks, ``dim_c`` message components
that become the agent's communication state as they are (no one-hot, no normalisation). Note
the signs: component 1 pushes -x in mpe2's continuous (and discrete) convention, while the
paper's discrete move 1 pushes +x.

**Physics conventions.** ``physics="paper"`` (default) integrates as the paper's MPE
(``World.integrate_state``): damp the velocity, add ``force * dt``, then move by the *new*
velocity. ``physics="pettingzoo"`` integrates as ``mpe2``'s ``World.integrate_state``: move by
the *old* velocity, then damp and add ``force * dt``, so a push shows in the position one step
later. The two give different trajectories from the same actions; matching ``mpe2`` step for step
needs ``physics="pettingzoo"`` (and the scenario's ``reward="pettingzoo"``).

**Memory layout.** Internally every state tensor is stored with its axes *reversed* relative to
the public layout: agent positions are ``[2, N, E]`` instead of ``[E, N, 2]``, so the env axis is
innermost and contiguous. On a CPU this turns every coordinate-wise operation and every reduction
over agents or landmarks into a long vectorised loop over envs (the public ``[E, N, 2]`` layout
makes them strided loops over 2- or 3-element rows, 10-50x slower). Observations are assembled
feature-major in a scratch buffer and transposed once into the public ``[E, n, obs_dim]`` layout.
:meth:`ParticleEnv.get_state` and :meth:`ParticleEnv.set_state` speak the public layout.

**Time feature** (``time_feature=True``): every agent's observation, and the global state, end
with one more float, the fraction of the episode elapsed (``step / episode_length``: 0 on an
episode's first observation, 1 on the final observation at the time limit). The paper's
observations have no clock, and its code treats the time limit as terminal, so a feed-forward
critic must predict a return that depends on the steps left without seeing them (the return
still to come in Spread is mostly the per-step cost of the steps left). Appending the time is
the remedy of Pardo et al. (2018), "Time Limits in Reinforcement Learning"; a recurrent network
can count the steps itself. Off by default: the paper's presets keep the paper's observations.

**Episode ends without host syncs.** The only episode end is the time limit, and every env
advances one step per call, so the step at which each env ends is known on the host from the
step counters seen at the last ``reset`` or ``set_state``: the host keeps the set of "phases"
(steps modulo the episode length) at which some env ends and runs the masked reset only on those
steps. ``step`` never reads a tensor back to the host.

Returned tensors are fresh each step; the global state may share memory with the observations,
so treat both as read-only.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mappo.envs.base import ActionSpec, BatchedEnv, EnvError, EnvStep
from mappo.envs.mpe.params import check_bool, check_choice
from mappo.envs.mpe.render import draw_world

DT = 0.1
"""Integration time step (MPE ``World.dt``)."""
DAMPING = 0.25
"""Velocity damping per step (MPE ``World.damping``)."""
CONTACT_FORCE = 100.0
"""Contact force scale (MPE ``World.contact_force``)."""
CONTACT_MARGIN = 1e-3
"""Softness of contacts (MPE ``World.contact_margin``)."""
SENSITIVITY = 5.0
"""Force per unit of move action (the MPE env's default ``sensitivity``; all masses are 1)."""

MOVE_DIRECTIONS = ((0.0, 0.0), (1.0, 0.0), (-1.0, 0.0), (0.0, 1.0), (0.0, -1.0))
"""Unit push of each discrete move in the paper's convention: 0 no-op, 1 +x, 2 -x, 3 +y, 4 -y
(the PettingZoo MPE uses the opposite signs)."""
MOVE_COMPONENTS = 5
"""Movement components of a continuous action, mpe2's ``[no-op, -x, +x, -y, +y]``."""
PHYSICS = ("paper", "pettingzoo")
"""Integration orders: the paper's MPE (velocity first) and mpe2 (position first)."""


@dataclass(frozen=True)
class WorldSpec:
    """Static properties of a particle world's entities (agents first, then landmarks).

    Landmarks never move. Sizes are radii in world units.
    """

    agent_size: tuple[float, ...]
    agent_movable: tuple[bool, ...]
    agent_collide: tuple[bool, ...]
    agent_silent: tuple[bool, ...]
    landmark_size: tuple[float, ...]
    landmark_collide: tuple[bool, ...]
    dim_c: int
    """Length of a communication message (the one-hot width)."""

    @property
    def num_agents(self) -> int:
        return len(self.agent_size)

    @property
    def num_landmarks(self) -> int:
        return len(self.landmark_size)

    def contact_pairs(self) -> list[tuple[int, int]]:
        """Unordered entity pairs ``(a, b)``, ``a < b`` in entity order, that exert contact
        forces: both collide and at least one can move (MPE ``World.apply_environment_force``)."""
        collide = self.agent_collide + self.landmark_collide
        movable = self.agent_movable + (False,) * self.num_landmarks
        return [
            (a, b)
            for a in range(len(collide))
            for b in range(a + 1, len(collide))
            if collide[a] and collide[b] and (movable[a] or movable[b])
        ]


@dataclass(frozen=True)
class StateField:
    """One entry of the public simulator state: trailing shape after ``[E]`` and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    low: int | None = None
    """Smallest allowed value (integer fields)."""
    high: int | None = None
    """One past the largest allowed value (integer fields)."""


def planar_norm(x: Tensor, y: Tensor) -> Tensor:
    """``sqrt(x^2 + y^2)`` elementwise: the length of 2-D vectors given their coordinates
    (faster than ``torch.hypot`` on a CPU, which guards against overflow we cannot reach)."""
    return torch.addcmul(x * x, y, y).sqrt_()


def sub_into(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out[...] = a - b`` for a strided view ``out``: ``torch.sub(out=)`` eagerly (no
    temporary), a copy inside a compiled graph (which cannot trace ``out=`` into a
    non-contiguous view; inductor fuses the subtraction into the copy)."""
    if torch.compiler.is_compiling():
        out.copy_(a - b)
    else:
        torch.sub(a, b, out=out)


def _to_internal(x: Tensor) -> Tensor:
    """Public ``[E, a, b]`` -> internal ``[b, a, E]`` (all axes reversed), a view."""
    return x.permute(*reversed(range(x.dim())))


def _to_public(x: Tensor) -> Tensor:
    """Internal -> public layout (the same reversal), a view."""
    return x.permute(*reversed(range(x.dim())))


class ParticleEnv(BatchedEnv):
    """Batched particle world; scenarios subclass it (see the module docstring).

    Subclasses set ``self.spec`` (with :meth:`_action_spec` for each group) and call
    :meth:`_init_world` in ``__init__``, and implement the scenario hooks :meth:`_sample_extras`,
    :meth:`_split_actions`, :meth:`_observe`, :meth:`_reward_and_stats` and :meth:`_render_info`.
    """

    landmark_spawn_scale: float = 1.0
    """Landmarks spawn uniformly in ``[-s, s]^2`` (the paper uses 0.8 in Spread and Reference)."""
    continuous_actions: bool = False
    """Actions are mpe2's continuous boxes (see the module docstring) instead of discrete heads."""
    physics: str = "paper"
    """The integration order, one of :data:`PHYSICS` (see the module docstring)."""
    time_feature: bool = False
    """Observations and the state end with ``step / episode_length`` (see the module docstring)."""

    def __init__(
        self,
        num_envs: int,
        device: str | torch.device = "cpu",
        seed: int = 0,
        *,
        continuous_actions: bool = False,
        physics: str = "paper",
        time_feature: bool = False,
    ) -> None:
        self.continuous_actions = check_bool(self.name, "continuous_actions", continuous_actions)
        self.physics = check_choice(self.name, "physics", physics, PHYSICS)
        self.time_feature = check_bool(self.name, "time_feature", time_feature)
        super().__init__(num_envs, device, seed)

    # -- construction -------------------------------------------------------------------------
    def _action_spec(self, moves: bool, dim_c: int) -> ActionSpec:
        """The action space of an agent that ``moves`` and speaks ``dim_c`` messages (0: silent).

        Discrete: a move head ``5`` and a message head ``dim_c``, present as the agent can. With
        ``continuous_actions``: mpe2's ``Box(0, 1, (5 * moves + dim_c,))``, movement first.
        """
        if self.continuous_actions:
            d = MOVE_COMPONENTS * moves + dim_c
            return ActionSpec.box([0.0] * d, [1.0] * d)
        return ActionSpec((len(MOVE_DIRECTIONS),) * moves + ((dim_c,) if dim_c else ()))

    def _move_and_message(
        self, actions: Tensor, moves: bool, speaks: bool
    ) -> tuple[Tensor | None, Tensor | None]:
        """Split one group's actions ``[E, n, k or d]`` laid out as :meth:`_action_spec` into the
        move ``[E, n]`` int64 (``[E, n, 5]`` float32 continuous) and the message ``[E, n]`` int64
        (``[E, n, dim_c]`` float32 continuous); ``None`` for a part the agents lack."""
        if self.continuous_actions:
            move = actions[..., :MOVE_COMPONENTS] if moves else None
            message = actions[..., MOVE_COMPONENTS * moves :] if speaks else None
        else:
            move = actions[..., 0] if moves else None
            message = actions[..., int(moves)] if speaks else None
        return move, message

    def _init_world(self, world: WorldSpec, episode_length: int) -> None:
        """Precompute index tensors and draw the first episode (the generator is then reseeded,
        so that ``reset()`` without a seed replays the same first episode)."""
        self.world = world
        self.episode_length = episode_length
        if self.time_feature:
            self.spec = dataclasses.replace(
                self.spec,
                groups={
                    name: dataclasses.replace(g, obs_shape=(g.obs_shape[0] + 1,))
                    for name, g in self.spec.groups.items()
                },
                state_shape=(self.spec.state_shape[0] + 1,),
            )
        dev = self.device
        n, c = world.num_agents, world.dim_c
        self._mov_idx = torch.tensor(
            [i for i in range(n) if world.agent_movable[i]], dtype=torch.long, device=dev
        )
        self._all_movable = all(world.agent_movable)
        self._mov_mask = torch.tensor(world.agent_movable, device=dev).view(n, 1)
        self._speak_idx = torch.tensor(
            [i for i in range(n) if not world.agent_silent[i]], dtype=torch.long, device=dev
        )
        self._all_speak = not any(world.agent_silent)
        self._silent = torch.tensor(world.agent_silent, device=dev)
        self._msg_values = torch.arange(c, device=dev).view(c, 1, 1)
        # [2, 5]: column m is the force of move m (sensitivity x unit push).
        self._move_force = SENSITIVITY * torch.tensor(MOVE_DIRECTIONS, device=dev).t().contiguous()
        self._init_contacts(world)
        self._state: dict[str, Tensor] = {}
        self._ahead_slots: dict[int, list[dict[str, Tensor]]] = {}
        """Per claimed run length, the fresh episodes drawn ahead for its steps."""
        self._ahead: list[dict[str, Tensor]] = []
        self._ahead_at = 0
        self._fields = self._state_fields()
        self._reset_envs(None)
        self.generator.manual_seed(self.seed)
        self._sync_phases()

    def _init_contacts(self, world: WorldSpec) -> None:
        """Index tensors of the contact pairs and of which pair ends receive a force."""
        dev = self.device
        n = world.num_agents
        pairs = world.contact_pairs()
        self._num_pairs = len(pairs)
        self._pair_a = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=dev)
        self._pair_b = torch.tensor([b for _, b in pairs], dtype=torch.long, device=dev)
        self._contact_uses_landmarks = any(b >= n for _, b in pairs)
        self._pair_min_dist = torch.tensor(
            [
                (world.agent_size + world.landmark_size)[a]
                + (world.agent_size + world.landmark_size)[b]
                for a, b in pairs
            ],
            device=dev,
        ).view(-1, 1)
        # A pair end receives a force only if it is a movable agent; mass ratio 1 (all masses 1).
        movable = world.agent_movable + (False,) * world.num_landmarks
        self._push_a = self._push_targets([a for a, _ in pairs], movable)
        self._push_b = self._push_targets([b for _, b in pairs], movable)

    def _push_targets(
        self, ends: list[int], movable: tuple[bool, ...]
    ) -> tuple[Tensor | None, Tensor] | None:
        """``(pair subset or None for all pairs, agent indices)`` receiving that end's force."""
        keep = [p for p, e in enumerate(ends) if movable[e]]
        if not keep:
            return None
        agents = torch.tensor([ends[p] for p in keep], dtype=torch.long, device=self.device)
        if len(keep) == len(ends):
            return None, agents
        return torch.tensor(keep, dtype=torch.long, device=self.device), agents

    def _state_fields(self) -> dict[str, StateField]:
        """The public state layout: world fields plus the scenario's extra fields."""
        n, m, c = self.world.num_agents, self.world.num_landmarks, self.world.dim_c
        fields = {
            "agent_pos": StateField((n, 2), torch.float32),
            "agent_vel": StateField((n, 2), torch.float32),
            "agent_comm": StateField((n, c), torch.float32),
            "landmark_pos": StateField((m, 2), torch.float32),
            "step": StateField((), torch.int64, 0, self.episode_length),
        }
        fields.update(self._extra_fields())
        return fields

    # -- scenario hooks -----------------------------------------------------------------------
    def _extra_fields(self) -> dict[str, StateField]:
        """Scenario state beyond the world (goals, episode accumulators)."""
        return {}

    def _sample_extras(self) -> dict[str, Tensor]:
        """Random scenario state of a fresh episode for every env, internal layout; drawn
        before the positions (the reference draws goals first)."""
        return {}

    def _fresh_accumulators(self) -> dict[str, Tensor]:
        """Episode accumulators of a fresh episode (zeros), internal layout."""
        return {}

    @abc.abstractmethod
    def _split_actions(self, actions: dict[str, Tensor]) -> tuple[Tensor | None, Tensor | None]:
        """``(moves, messages)`` in agent order: ``moves`` ``[E, movable agents]`` int64 and
        ``messages`` ``[E, speaking agents]`` int64, or with ``continuous_actions`` ``[E, movable
        agents, 5]`` and ``[E, speaking agents, dim_c]`` float32 (see :meth:`_move_and_message`)."""

    @abc.abstractmethod
    def _observe(self) -> tuple[dict[str, Tensor], Tensor]:
        """Per-group observations ``[E, n, obs_dim]`` and the global state ``[E, state_dim]``."""

    def _views(self) -> tuple[dict[str, Tensor], Tensor]:
        """:meth:`_observe`, with the fraction of the episode elapsed appended to every
        observation and to the state when :attr:`time_feature` is on."""
        obs, state = self._observe()
        if not self.time_feature:
            return obs, state
        t = self._state["step"].to(state.dtype) / self.episode_length  # [E]
        obs = {
            g: torch.cat([o, t[:, None, None].expand(-1, o.shape[1], 1)], -1)
            for g, o in obs.items()
        }
        return obs, torch.cat([state, t[:, None]], -1)

    @abc.abstractmethod
    def _reward_and_stats(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Per-group rewards ``[E, n]`` of the state just reached and the episode statistics
        ``[E]`` so far; updates the episode accumulators in ``self._state``."""

    @abc.abstractmethod
    def _render_info(
        self, env_index: int
    ) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float]], list[str]]:
        """Agent colours, landmark colours (RGB in [0, 1]) and text lines for env ``env_index``."""

    # -- the contract -------------------------------------------------------------------------
    @torch.no_grad()
    def reset(self, seed: int | None = None) -> EnvStep:
        """Reset every env; a ``seed`` reseeds the env's generator (and ends :meth:`seed_blocks`:
        every env draws from that one generator again)."""
        if seed is not None:
            self._blocks = None
        self.reseed(seed)
        self._reset_envs(None)
        self._sync_phases()
        return self._first_step()

    # -- many seeds in one env ----------------------------------------------------------------
    _blocks: list[torch.Generator] | None = None

    @torch.no_grad()
    def seed_blocks(self, seeds: list[int]) -> EnvStep:
        """Split the envs into ``len(seeds)`` equal blocks of consecutive copies, each drawing
        its random numbers from a generator of its own, and reset block ``k`` from
        ``seeds[k]``: block ``k`` then replays exactly what an env of ``num_envs / len(seeds)``
        copies does after ``reset(seed=seeds[k])``, in one batched step for all blocks (the
        seeds of a stacked run, ``num_seeds``)."""
        if not seeds or self.num_envs % len(seeds):
            raise EnvError(
                f"{self.name}: {self.num_envs} envs do not split into {len(seeds)} equal blocks"
            )
        self._blocks = []
        for seed in seeds:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self._blocks.append(g)
        self._reset_envs(None)
        self._sync_phases()
        return self._first_step()

    def block_generator(self, k: int) -> torch.Generator:
        """Block ``k``'s generator (:meth:`seed_blocks`)."""
        if self._blocks is None:
            raise EnvError(f"{self.name}: the envs are not split into seed blocks")
        return self._blocks[k]

    def _rand(self, *lead: int) -> Tensor:
        """Uniform ``[0, 1)`` numbers ``[*lead, E]`` (the internal env-last layout), each seed
        block's from its own generator."""
        if self._blocks is None:
            return torch.rand(*lead, self.num_envs, device=self.device, generator=self.generator)
        per = self.num_envs // len(self._blocks)
        parts = [torch.rand(*lead, per, device=self.device, generator=g) for g in self._blocks]
        return torch.cat(parts, -1)

    def _randint(self, high: int, *lead: int) -> Tensor:
        """Integers in ``[0, high)``, ``[*lead, E]``, as :meth:`_rand` draws."""
        if self._blocks is None:
            return torch.randint(
                0, high, (*lead, self.num_envs), device=self.device, generator=self.generator
            )
        per = self.num_envs // len(self._blocks)
        parts = [
            torch.randint(0, high, (*lead, per), device=self.device, generator=g)
            for g in self._blocks
        ]
        return torch.cat(parts, -1)

    @torch.no_grad()
    def _step(self, actions: dict[str, Tensor]) -> EnvStep:
        ends = self._an_episode_ends_next()
        self._now += 1
        if not ends:
            return self._plain_step(actions)
        # Some env reaches the time limit on this step: a truncation, not a terminal state.
        obs, state, reward, stats = self._world_step(actions)
        e = self.num_envs
        truncated = self._state["step"] >= self.episode_length
        self._reset_envs(truncated)
        new_obs, new_state = self._views()
        return EnvStep(
            obs=new_obs,
            state=new_state,
            reward=reward,
            terminated=torch.zeros(e, dtype=torch.bool, device=self.device),
            truncated=truncated,
            alive=self._alive(),
            final_obs=obs,
            final_state=state,
            stats=stats,
        )

    def _world_step(
        self, actions: dict[str, Tensor]
    ) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """Advance the world by ``actions``; the observations, global state, rewards and episode
        statistics of the state reached (rewards read what ``_observe`` just wrote)."""
        moves, messages = self._split_actions(actions)
        self._advance(moves, messages)
        obs, state = self._views()
        reward, stats = self._reward_and_stats()
        return obs, state, reward, stats

    def _traced_step(self, actions: dict[str, Tensor]) -> EnvStep:
        """One step of a claimed run (:meth:`claim_traced_steps`): tensor code only, so the
        compiled rollout can trace it. Envs that reach the time limit start the episode that
        the claim drew ahead for this step (:meth:`_draw_ahead`), as :meth:`_step` would
        start them; on the steps where no env ends, the same code keeps every env as it is,
        so that one graph serves runs with and without episode ends."""
        fresh = self._ahead[self._ahead_at]
        self._ahead_at += 1
        obs, state, reward, stats = self._world_step(actions)
        truncated = self._state["step"] >= self.episode_length
        self._state = {k: torch.where(truncated, fresh[k], v) for k, v in self._state.items()}
        new_obs, new_state = self._views()
        return EnvStep(
            obs=new_obs,
            state=new_state,
            reward=reward,
            terminated=torch.zeros_like(truncated),
            truncated=truncated,
            alive=self._alive(),
            final_obs=obs,
            final_state=state,
            stats=stats,
        )

    def _draw_ahead(self, count: int) -> None:
        """Draw now the fresh episodes that the next ``count`` steps start where envs reach the
        time limit, in the order :meth:`_step` would draw them (so the random numbers are the
        same), into per-step slots that :meth:`_traced_step` reads in turn. The slots are
        allocated once per ``count`` and overwritten in place: a traced graph sees the same
        tensors on every call, so nothing recompiles with the pattern of episode ends."""
        slots = self._ahead_slots.get(count)
        if slots is None or slots[0].keys() != self._state.keys():
            slots = [{k: torch.empty_like(v) for k, v in self._state.items()} for _ in range(count)]
            self._ahead_slots[count] = slots
        for ahead in range(1, count + 1):
            if self._an_episode_ends_next(ahead):
                for k, v in self._fresh_episode().items():
                    slots[ahead - 1][k].copy_(v)
        self._ahead, self._ahead_at = slots, 0

    def _plain_step(self, actions: dict[str, Tensor]) -> EnvStep:
        """A step at which no episode ends: tensor code only (no random numbers, no host
        reads)."""
        obs, state, reward, stats = self._world_step(actions)
        done = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        return EnvStep(
            obs=obs,
            state=state,
            reward=reward,
            terminated=done,
            truncated=done.clone(),
            alive=self._alive(),
            final_obs=obs,
            final_state=state,
            stats=stats,
        )

    def claim_traced_step(self) -> Callable[[dict[str, Tensor]], EnvStep] | None:
        """:meth:`_traced_step` for the next step where actions are not checked. The time
        limit is the only episode end and is known on the host, so the random numbers of the
        episodes that start on that step are drawn now (:meth:`_draw_ahead`) and the step
        itself draws none. A subclass that overrides ``_step`` (another way to end episodes,
        say) is never traced."""
        return self._claim(1)

    def claim_traced_steps(self, count: int) -> Callable[[dict[str, Tensor]], EnvStep] | None:
        """:meth:`_traced_step` for the next ``count`` steps, episode ends included (see
        :meth:`claim_traced_step`). A subclass that overrides only :meth:`claim_traced_step`
        (to trace fewer steps, or none) is asked one step at a time."""
        if type(self).claim_traced_step is not ParticleEnv.claim_traced_step:
            return super().claim_traced_steps(count)
        return self._claim(count)

    def _claim(self, count: int) -> Callable[[dict[str, Tensor]], EnvStep] | None:
        if type(self)._step is not ParticleEnv._step or self.validate_actions:
            return None
        # Every claim takes the one function, whether or not an episode ends in it, so that
        # each run length compiles once. A single step that ends nothing could skip the reset's
        # selection and second observation, but as a second graph it cost the paper's
        # recurrent preset (which steps singly) about 20 s of its cold compile to save 1-2% of
        # a rollout that is a tenth of its iteration (BENCHMARKS.md).
        self._draw_ahead(count)
        self._now += count
        return self._traced_step

    def _an_episode_ends_next(self, ahead: int = 1) -> bool:
        """Whether some env reaches the time limit on the step ``ahead`` steps from now
        (host-side phases)."""
        return (self._now + ahead) % self.episode_length in self._end_phases

    def get_state(self) -> dict[str, Tensor]:
        """The full simulator state in the public layout (see :meth:`state_fields`), clones."""
        return {
            k: _to_public(v).clone(memory_format=torch.contiguous_format)
            for k, v in self._state.items()
        }

    def state_fields(self) -> dict[str, StateField]:
        """The keys of :meth:`get_state` with their trailing shapes and dtypes."""
        return dict(self._fields)

    @torch.no_grad()
    def set_state(self, state: dict[str, Tensor], env_ids: Tensor | None = None) -> EnvStep:
        """Overwrite state fields of envs ``env_ids`` (all when ``None``).

        ``state`` maps any subset of :meth:`state_fields` to tensors of shape
        ``[len(env_ids), *field.shape]``; fields not given keep their values.
        """
        if not isinstance(state, dict):
            raise EnvError(f"{self.name}: set_state expects a dict of field -> tensor")
        unknown = sorted(set(state) - set(self._fields))
        if unknown:
            raise EnvError(
                f"{self.name}: unknown state field(s) {unknown}; valid fields: {list(self._fields)}"
            )
        ids = self._env_ids(env_ids)
        values = {k: self._check_field(k, v, len(ids)) for k, v in state.items()}
        for key, value in values.items():
            self._state[key][..., ids] = _to_internal(value)
        self._sync_phases()
        return self._first_step()

    def render(self, env_index: int = 0, size: int = 400) -> np.ndarray:
        if not 0 <= env_index < self.num_envs:
            raise EnvError(
                f"{self.name}: env_index {env_index} is out of range [0, {self.num_envs})"
            )
        agent_colors, landmark_colors, lines = self._render_info(env_index)
        return draw_world(
            agent_pos=self._state["agent_pos"][..., env_index].t().cpu().numpy(),
            agent_size=self.world.agent_size,
            agent_colors=agent_colors,
            landmark_pos=self._state["landmark_pos"][..., env_index].t().cpu().numpy(),
            landmark_size=self.world.landmark_size,
            landmark_colors=landmark_colors,
            lines=lines,
            size=size,
        )

    def _said(self, agent: int, env_index: int) -> str:
        """Render text for what ``agent`` last said in env ``env_index``: the message index, or
        the message components with ``continuous_actions`` (as mpe2's renderer); ``-`` before
        its first message."""
        comm = self._state["agent_comm"][:, agent, env_index]
        if not bool(comm.any()):
            return "-"
        if self.continuous_actions:
            # Two decimals fit a short message on a 400-pixel frame; one for a long one.
            digits = 2 if comm.numel() <= 5 else 1
            return "[" + ",".join(f"{float(v):.{digits}f}" for v in comm) + "]"
        return str(int(comm.argmax()))

    # -- simulation ---------------------------------------------------------------------------
    def _advance(self, moves: Tensor | None, messages: Tensor | None) -> None:
        """One world step in place: forces, integration, messages, step counter."""
        s = self._state
        pos, vel = s["agent_pos"], s["agent_vel"]
        force = self._action_force(moves)
        # Contact forces act at the positions before this step's move in both conventions.
        contact = self._contact_force(pos) if self._num_pairs else None
        paper = self.physics == "paper"
        if self._all_movable:
            if not paper:
                # mpe2's World.integrate_state: move by the old velocity first.
                pos.add_(vel, alpha=DT)
            # Both conventions damp, then add force * dt; the paper's MPE then moves by the new
            # velocity (its World.integrate_state).
            vel.mul_(1.0 - DAMPING).add_(force, alpha=DT)
            if contact is not None:
                vel.add_(contact, alpha=DT)
            if paper:
                pos.add_(vel, alpha=DT)
        else:
            if contact is not None:
                force = force + contact
            new_vel = torch.where(self._mov_mask, vel * (1.0 - DAMPING) + force * DT, vel)
            s["agent_vel"] = new_vel
            moved_by = new_vel if paper else vel
            s["agent_pos"] = torch.where(self._mov_mask, pos + moved_by * DT, pos)
        if messages is not None:
            self._set_messages(messages)
        s["step"] = s["step"] + 1

    def _action_force(self, moves: Tensor | None) -> Tensor:
        """``[2, N, E]`` force of the move actions ``[E, movable agents]`` (int64 moves) or
        ``[E, movable agents, 5]`` (continuous components, float32)."""
        n, e = self.world.num_agents, self.num_envs
        if moves is None:
            return torch.zeros(2, n, e, device=self.device)
        m = moves.shape[1]
        if self.continuous_actions:
            # mpe2's _set_action: u = sensitivity * (a[2] - a[1], a[4] - a[3]); a[0] is unused.
            push = torch.stack((moves[..., 2] - moves[..., 1], moves[..., 4] - moves[..., 3]))
            force = push.mul_(SENSITIVITY).transpose(1, 2)  # [2, E, m] -> [2, m, E]
        else:
            # Gather in the actions' own [E, m] order, then view it as [2, m, E] (no transpose
            # copy).
            force = (
                self._move_force.index_select(1, moves.reshape(-1)).view(2, e, m).transpose(1, 2)
            )
        if self._all_movable:
            return force
        full = torch.zeros(2, n, e, device=self.device)
        return full.index_copy_(1, self._mov_idx, force)

    def _contact_force(self, pos: Tensor) -> Tensor:
        """``[2, N, E]`` soft contact forces on the agents at positions ``pos`` ``[2, N, E]``."""
        if self._contact_uses_landmarks:
            pos = torch.cat([pos, self._state["landmark_pos"]], dim=1)
        delta = pos.index_select(1, self._pair_a) - pos.index_select(1, self._pair_b)
        dist = planar_norm(delta[0], delta[1])
        # penetration = k * log(1 + exp(-(dist - dist_min) / k)); softplus is the overflow-safe
        # form of log(1 + exp(x)) (x reaches 300 for deeply overlapping agents).
        pen = torch.nn.functional.softplus((self._pair_min_dist - dist) * (1.0 / CONTACT_MARGIN))
        # f = contact_force * delta / dist * penetration. Coincident entities would divide
        # 0 by 0 (NaN in the reference); the clamp makes their force 0 instead.
        scale = pen.mul_(CONTACT_FORCE * CONTACT_MARGIN).div_(dist.clamp_min_(1e-12))
        pair_force = delta.mul_(scale)
        force = torch.zeros(2, self.world.num_agents, self.num_envs, device=self.device)
        for push, sign in ((self._push_a, 1.0), (self._push_b, -1.0)):
            if push is None:
                continue
            subset, agents = push
            f = pair_force if subset is None else pair_force.index_select(1, subset)
            force.index_add_(1, agents, f, alpha=sign)
        return force

    def _set_messages(self, messages: Tensor) -> None:
        """A speaking agent's message becomes the one-hot of its message action ``[E, s]``, or
        with ``continuous_actions`` its message components ``[E, s, dim_c]`` as they are (mpe2's
        ``_set_action`` and ``World.update_agent_state`` copy them into the comm state)."""
        if self.continuous_actions:
            # A copy in the internal [c, s, E] layout: the state must not alias the caller's
            # action tensor.
            said = messages.permute(2, 1, 0).clone(memory_format=torch.contiguous_format)
        else:
            said = (self._msg_values == messages.t().unsqueeze(0)).to(torch.float32)
        if self._all_speak:
            self._state["agent_comm"] = said
        else:
            comm = torch.zeros_like(self._state["agent_comm"])
            self._state["agent_comm"] = comm.index_copy_(1, self._speak_idx, said)

    def _reset_envs(self, mask: Tensor | None) -> None:
        """Draw a fresh episode for every env and keep it where ``mask`` ``[E]`` is True (all
        envs when ``None``)."""
        fresh = self._fresh_episode()
        if mask is None:
            self._state = fresh
        else:
            self._state = {k: torch.where(mask, fresh[k], v) for k, v in self._state.items()}

    def _fresh_episode(self) -> dict[str, Tensor]:
        """A new episode's state for every env (the internal layout), drawn from the env's
        generators."""
        n, m, c, e = (
            self.world.num_agents,
            self.world.num_landmarks,
            self.world.dim_c,
            self.num_envs,
        )
        dev = self.device
        fresh = self._sample_extras()
        fresh["agent_pos"] = self._rand(2, n).mul_(2.0).sub_(1.0)
        fresh["agent_vel"] = torch.zeros(2, n, e, device=dev)
        fresh["agent_comm"] = torch.zeros(c, n, e, device=dev)
        fresh["landmark_pos"] = self._rand(2, m).mul_(2.0).sub_(1.0).mul_(self.landmark_spawn_scale)
        fresh["step"] = torch.zeros(e, dtype=torch.int64, device=dev)
        fresh.update(self._fresh_accumulators())
        return fresh

    def _sync_phases(self) -> None:
        """Recompute on the host the step phases at which some env hits the time limit."""
        self._now = 0
        left = self.episode_length - self._state["step"].cpu()
        self._end_phases = set((left % self.episode_length).tolist())

    def _first_step(self) -> EnvStep:
        """The :class:`EnvStep` of a (re)set state: observations, zero rewards, no ends."""
        obs, state = self._views()
        e, dev = self.num_envs, self.device
        return EnvStep(
            obs=obs,
            state=state,
            reward={
                g: torch.zeros(e, spec.num_agents, device=dev)
                for g, spec in self.spec.groups.items()
            },
            terminated=torch.zeros(e, dtype=torch.bool, device=dev),
            truncated=torch.zeros(e, dtype=torch.bool, device=dev),
            alive=self._alive(),
            stats={k: torch.zeros(e, device=dev) for k in self.spec.stat_names},
        )

    def _alive(self) -> dict[str, Tensor]:
        """Every agent of the particle world acts every step."""
        return {
            g: torch.ones(self.num_envs, spec.num_agents, dtype=torch.bool, device=self.device)
            for g, spec in self.spec.groups.items()
        }

    # -- input checks -------------------------------------------------------------------------
    def _env_ids(self, env_ids: Tensor | None) -> Tensor:
        if env_ids is None:
            return torch.arange(self.num_envs, device=self.device)
        ids = torch.as_tensor(env_ids).to(device=self.device).reshape(-1)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise EnvError(f"{self.name}: env_ids must be integers, got dtype {ids.dtype}")
        ids = ids.long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_envs):
            raise EnvError(
                f"{self.name}: env_ids must lie in [0, {self.num_envs}), got {ids.tolist()}"
            )
        if ids.unique().numel() != ids.numel():
            raise EnvError(f"{self.name}: env_ids must not repeat, got {ids.tolist()}")
        return ids

    def _check_field(self, key: str, value: Tensor, count: int) -> Tensor:
        field = self._fields[key]
        value = torch.as_tensor(value)
        expected = (count, *field.shape)
        if tuple(value.shape) != expected:
            raise EnvError(
                f"{self.name}: state field '{key}' has shape {tuple(value.shape)}, expected "
                f"{expected} (len(env_ids), {', '.join(map(str, field.shape)) or 'scalar'})"
            )
        if field.dtype == torch.int64 and (value.dtype.is_floating_point or value.is_complex()):
            raise EnvError(f"{self.name}: state field '{key}' must be integer, got {value.dtype}")
        value = value.to(device=self.device, dtype=field.dtype)
        if field.low is not None and value.numel():
            lo, hi = int(value.min()), int(value.max())
            if lo < field.low or hi >= field.high:
                raise EnvError(
                    f"{self.name}: state field '{key}' must lie in [{field.low}, {field.high}), "
                    f"got values in [{lo}, {hi}]"
                )
        if field.dtype.is_floating_point and not bool(torch.isfinite(value).all()):
            raise EnvError(f"{self.name}: state field '{key}' has non-finite values")
        if key == "agent_comm" and bool(value[:, self._silent].any()):
            # A silent agent's message is all zeros at every step (MPE World.update_agent_state),
            # which lets scenarios skip it.
            raise EnvError(
                f"{self.name}: agent_comm of silent agents must be zeros "
                f"(silent: {[i for i, q in enumerate(self.world.agent_silent) if q]})"
            )
        return value
