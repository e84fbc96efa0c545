"""A VMAS scenario as a :class:`~mappo.envs.BatchedEnv` (VMAS: Bettini et al. 2022, "VMAS: A
Vectorized Multi-Agent Simulator for Collective Robot Learning", DARS 2022).

VMAS already simulates ``num_envs`` copies of a scenario as batched torch tensors on one device,
so :class:`VmasEnv` hands its tensors through without moving them: per-agent actions are views of
the ``[E, n, d]`` action batch, per-agent observations ``[E, obs_dim]`` are stacked once into the
group's ``[E, n, obs_dim]`` and the global state is a view of (or one concatenation of) those.

What VMAS 1.5 does, and what the wrapper does about it:

- **Groups.** VMAS lists agents (``agent_0``, ``adversary_1``...) each with a gym observation and
  action space. Agents with identical spaces form one group, in VMAS's agent order; the group is
  named after the agents' common name prefix, pluralised (``agent_3`` -> ``agents``, ``speaker_0``
  -> ``speakers``), so that names do not change with ``n_agents``. ``groups=`` overrides this.
- **Actions.** ``continuous_actions=True`` gives a box per agent: ``[-u_range, u_range]`` for each
  physical component and ``[0, 1]`` for each communication component. Otherwise VMAS's flat
  ``Discrete`` action (the product of the agent's per-axis choices), or with
  ``multidiscrete_actions=True`` one head per axis (and one for the message).
- **Terminated vs truncated.** ``terminated_truncated=True`` makes VMAS report the scenario's own
  ``done()`` (a terminal state) apart from its time limit ``steps >= max_steps`` (a truncation);
  an episode that does both in one step counts as terminated.
- **Random numbers.** VMAS draws from torch's, numpy's and Python's global RNGs inside its
  ``local_seed`` decorator, which swaps in one class-level state shared by every VMAS env of the
  process and restores the caller's CPU states afterwards. So VMAS does not disturb the caller's
  CPU RNGs, but (a) all VMAS envs of a process share one stream, (b) ``seed=`` calls
  ``torch.manual_seed``, which reseeds every CUDA generator too, and (c) on a GPU the scenarios
  draw from the device's global CUDA generator, which ``local_seed`` does not save. The wrapper
  keeps its own copy of the three CPU states (and of its device's CUDA generator state) and
  swaps it in around every call into VMAS: each env has its own stream, nothing of the caller's
  is touched, and ``reset(seed)`` is exactly VMAS's ``reset(seed=seed)`` on the CPU.
- **Auto-reset.** VMAS resets either one env (``reset_at(index)``: the scenario's reset code runs
  in Python for that env, 1 to 6 ms) or all of them (``reset()``, one batched call). When all
  envs finish together (every time limit when nothing terminated earlier) the wrapper calls the
  batched reset. When some finish while others run on, the scenarios of
  :data:`BATCHED_RESET_SCENARIOS` get a batched reset too, after which the unfinished envs are
  put back as they were (:class:`_MaskedReset`: about one batched reset plus 2 ms at 4096 envs,
  however many finished); other scenarios get ``reset_at`` per finished env. Either way the
  observations are then computed once, and a step in which no env finished costs one host sync
  (``done.sum()``) and nothing else. (VMAS 1.5.2's ``reset_at(i)`` also disturbs the other envs
  in a few scenarios: ``ball_trajectory`` overwrites every env's position shaping with env
  ``i``'s, and in ``buzz_wire``, ``joint_passage`` and ``joint_passage_size`` the joints of
  other envs move; the batched path leaves the unfinished envs exactly as they were.)
- **State.** VMAS has no snapshot API and keeps scenario state in arbitrary Python objects, so
  :meth:`VmasEnv.get_state` and :meth:`VmasEnv.set_state` raise ``NotImplementedError``.
- **Rendering.** VMAS's pyglet renderer draws off-screen through EGL where ``libEGL`` is
  installed (Mesa's software EGL does: no display needed); elsewhere it needs an X display, and
  :meth:`VmasEnv.render` raises an :class:`~mappo.envs.EnvError` naming ``xvfb-run``.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import re
import traceback
import types
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mappo.envs.base import ActionSpec, BatchedEnv, EnvError, EnvSpec, EnvStep, GroupSpec
from mappo.envs.importing import one_line

DEFAULT_MAX_STEPS = 100
"""Episode limit of a scenario without an entry in :data:`MAX_STEPS`."""

MAX_STEPS = {
    # BenchMARL's VMAS task configs (benchmarl/conf/task/vmas/*.yaml); 100 for all others.
    "ball_passage": 500,
    "football": 500,
    "joint_passage": 500,
    "joint_passage_size": 500,
    "multi_give_way": 200,
    "passage": 500,
}
"""Default ``max_steps`` per scenario where it is not :data:`DEFAULT_MAX_STEPS`."""

BATCHED_RESET_SCENARIOS = frozenset(
    {
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
        "transport",
        "wheel",
        "wind_flocking",
    }
)
"""Scenarios whose finished envs are reset by :class:`_MaskedReset` by default: VMAS's main
scenarios, checked to keep every per-env value in tensors and to change nothing shared in a
batched reset (tests/test_vmas.py). Not ``road_traffic``, whose batched reset loops over every env
in Python; not ``sampling``, whose batched reset builds new per-env distributions (it never
terminates, so only time limits reset it, all envs at once); not the MPE ports, whose batched
reset redraws goals shared by all envs (a Python attribute that ``reset_at`` leaves alone); not
the debug scenarios (unchecked)."""

_UNUSED_KWARGS = r".*passed but not used by the scenario.*"
"""VMAS's warning for scenario keyword arguments that the scenario ignored (a typo)."""


def import_vmas(env_name: str) -> types.ModuleType:
    """``import vmas``, or an :class:`EnvError` in one line saying how to install it."""
    try:
        return importlib.import_module("vmas")
    except ModuleNotFoundError as err:
        if (err.name or "vmas").split(".")[0] == "vmas":
            raise EnvError(
                f"{env_name} needs the Python package 'vmas', which is not installed; "
                "install it with `pip install 'mappo[vmas]'`"
            ) from None
        raise EnvError(
            f"{env_name}: vmas is installed but its dependency '{err.name}' is missing; "
            "reinstall it with `pip install 'mappo[vmas]'`"
        ) from None


class VmasEnv(BatchedEnv):
    """One VMAS scenario, ``num_envs`` copies on ``device`` (see the module docstring).

    Observations per group ``[E, n, obs_dim]`` float32 (VMAS's own per-agent observation); global
    state ``[E, sum of all agents' obs_dim]``, the observations concatenated in VMAS's agent
    order (VMAS defines no global state); rewards ``[E, n]`` per agent as VMAS returns them;
    every agent is alive every step; no action masks; no episode statistics.
    """

    def __init__(
        self,
        scenario: Any,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int = 0,
        *,
        continuous_actions: bool = True,
        multidiscrete_actions: bool = False,
        max_steps: int | None = None,
        groups: Mapping[str, Sequence[str]] | None = None,
        batched_reset: bool | None = None,
        **scenario_kwargs: Any,
    ) -> None:
        """Create ``scenario`` (a VMAS scenario name such as ``"balance"``, or a
        ``vmas.simulator.scenario.BaseScenario`` instance) with ``scenario_kwargs``
        (e.g. ``n_agents=4``).

        ``max_steps`` is the episode limit in steps (default: BenchMARL's task config,
        :data:`MAX_STEPS`). ``groups`` maps group names to VMAS agent names, replacing the
        automatic grouping. ``batched_reset`` chooses how envs that finish while others run on are
        reset: ``True`` with one batched reset (:class:`_MaskedReset`), ``False`` one by one with
        VMAS's ``reset_at``, ``None`` (default) batched for :data:`BATCHED_RESET_SCENARIOS`.
        """
        label = scenario if isinstance(scenario, str) else type(scenario).__name__
        self.name = f"vmas/{label}"
        vmas = import_vmas(self.name)
        if not isinstance(continuous_actions, bool) or not isinstance(multidiscrete_actions, bool):
            raise EnvError(
                f"{self.name}: continuous_actions and multidiscrete_actions must be booleans, "
                f"got {continuous_actions!r} and {multidiscrete_actions!r}"
            )
        if continuous_actions and multidiscrete_actions:
            raise EnvError(
                f"{self.name}: multidiscrete_actions=True needs continuous_actions=False"
            )
        if max_steps is None:
            max_steps = MAX_STEPS.get(label, DEFAULT_MAX_STEPS)
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise EnvError(f"{self.name}: max_steps must be an integer >= 1, got {max_steps!r}")
        super().__init__(num_envs, device, seed)
        self.continuous_actions = continuous_actions
        self.max_steps = max_steps
        self._scenario_kwargs = dict(scenario_kwargs)
        self._rng = _VmasRandomState(self.device, seed)
        self._shared_rng = vmas.simulator.environment.Environment.vmas_random_state
        with warnings.catch_warnings():
            # A scenario keyword that the scenario ignores is a typo: make it an error.
            warnings.filterwarnings("error", message=_UNUSED_KWARGS)
            try:
                with _caller_rng_kept_on_error(), self._vmas_rng():
                    self._env = vmas.make_env(
                        scenario,
                        num_envs=num_envs,
                        device=self.device,
                        continuous_actions=continuous_actions,
                        multidiscrete_actions=multidiscrete_actions,
                        max_steps=max_steps,
                        # Our own check_actions enforces the bounds when validation is on; the
                        # clamp only absorbs float rounding of a policy's squashed actions.
                        clamp_actions=True,
                        terminated_truncated=True,
                        **scenario_kwargs,
                    )
            except UserWarning as err:
                raise EnvError(f"{self.name}: {err} (check the parameter names)") from None
            except (AssertionError, ValueError, KeyError) as err:
                what = one_line(err)
                if isinstance(err, AssertionError) and not str(err).strip():
                    # A bare assert says nothing; its source line names the parameter it checks.
                    frames = traceback.extract_tb(err.__traceback__)
                    if frames and frames[-1].line:
                        what = f"AssertionError at `{frames[-1].line}`"
                raise EnvError(
                    f"{self.name}: VMAS rejected the scenario parameters {scenario_kwargs}: {what}"
                ) from err
        self._vmas_agents = [agent.name for agent in self._env.agents]
        self.spec = self._make_spec(groups)
        self._slots = [
            (group, k)
            for agent in self._vmas_agents
            for group, g in self.spec.groups.items()
            for k, a in enumerate(g.agents)
            if a == agent
        ]
        self._group_rows = {
            group: [self._vmas_agents.index(a) for a in g.agents]
            for group, g in self.spec.groups.items()
        }
        # One group listing every agent in VMAS order: the state is a view of its observations.
        self._state_is_obs = len(self.spec.groups) == 1 and next(
            iter(self._group_rows.values())
        ) == list(range(len(self._vmas_agents)))
        # Why finished envs are reset one by one with reset_at (None: in one batch).
        self._masked_reset: _MaskedReset | None = None
        self.batched_reset_off_reason = self._masked_reset_refusal(label, batched_reset)
        if self.batched_reset_off_reason is None:
            self._masked_reset = _MaskedReset(self._env, self.num_envs, self.name)
            with self._vmas_rng():
                self.batched_reset_off_reason = self._masked_reset.probe()
            if self.batched_reset_off_reason is not None:
                self._masked_reset = None
                if batched_reset:
                    warnings.warn(
                        f"{self.name}: batched_reset=True refused "
                        f"({self.batched_reset_off_reason}); finished envs are reset one by one",
                        stacklevel=2,
                    )
        # Construction drew random numbers; start from the seed again, so that a new env and
        # reset(seed) replay the same episodes.
        self._rng.seed(seed)

    # -- the contract -------------------------------------------------------------------------
    @torch.no_grad()
    def reset(self, seed: int | None = None) -> EnvStep:
        if seed is not None:
            self.reseed(seed)
            self._rng.seed(seed)
        with self._vmas_rng():
            try:
                obs_list = self._env.reset()
            except Exception as err:
                raise EnvError(f"{self.name}: VMAS's reset() raised {one_line(err)}") from err
        obs, state = self._assemble(obs_list)
        bad = next((g for g, o in obs.items() if not bool(o.isfinite().all())), None)
        if bad is not None:  # (one check per reset: a scenario's parameters gave NaN physics)
            raise EnvError(
                f"{self.name}: the first observations of group '{bad}' hold NaN or inf; check "
                f"the scenario's parameters{self._parameters()}"
            )
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
        )

    def _parameters(self) -> str:
        """`` (env.kwargs: a=1, b=2)`` naming the scenario's parameters given, or empty."""
        given = ", ".join(f"{k}={v!r}" for k, v in self._scenario_kwargs.items())
        return f" (env.kwargs: {given})" if given else ""

    def _step_failed(self, err: Exception, actions: dict[str, Tensor]) -> EnvError:
        """One line for an exception inside VMAS's step: where the actions were NaN (VMAS
        asserts on them), the cause is the observations the policy acted on."""
        what = f"{self.name}: VMAS's step() raised {one_line(err)}"
        if any(a.is_floating_point() and not bool(a.isfinite().all()) for a in actions.values()):
            what += (
                " on actions holding NaN or inf, computed from observations that held them; "
                f"check the scenario's parameters{self._parameters()}"
            )
        return EnvError(f"{what} (MAPPO_DEBUG=1 shows the traceback)")

    @torch.no_grad()
    def _step(self, actions: dict[str, Tensor]) -> EnvStep:
        # Views, no copies: VMAS clones each agent's [E, d] action itself.
        per_agent = [actions[group][:, k] for group, k in self._slots]
        with self._vmas_rng():
            try:
                obs_list, rewards, terminated, time_up, _ = self._env.step(per_agent)
            except Exception as err:
                raise self._step_failed(err, actions) from err
        obs, state = self._assemble(obs_list)
        reward = {
            group: torch.stack([rewards[i].reshape(self.num_envs) for i in rows], dim=1)
            for group, rows in self._group_rows.items()
        }
        terminated = terminated.to(torch.bool)
        time_up = time_up.to(torch.bool)
        truncated = time_up & ~terminated
        done = terminated | time_up
        # The step's one host sync: VMAS's resets are driven from Python.
        finished = int(done.sum())
        if finished == 0:
            new_obs, new_state = obs, state
        else:
            with self._vmas_rng():
                self._reset_finished(done, finished)
                new_list = self._env.get_from_scenario(
                    get_observations=True, get_rewards=False, get_infos=False, get_dones=False
                )[0]
            new_obs, new_state = self._assemble(new_list)
            if finished < self.num_envs:
                # Recomputed observations of unfinished envs equal theirs unless a scenario adds
                # observation noise: keep the ones this step returned.
                new_obs, new_state = self._merge(done, new_obs, obs)
        return EnvStep(
            obs=new_obs,
            state=new_state,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            alive=self._alive(),
            final_obs=obs,
            final_state=state,
        )

    def get_state(self) -> dict[str, Tensor]:
        raise NotImplementedError(self._no_state_message())

    def set_state(self, state: dict[str, Tensor], env_ids: Tensor | None = None) -> EnvStep:
        raise NotImplementedError(self._no_state_message())

    def render(self, env_index: int = 0, size: int = 400) -> np.ndarray:
        """An RGB frame ``[size, size, 3]`` uint8 of env ``env_index`` drawn by VMAS's own
        renderer (letterboxed onto white where the scenario's view is not square)."""
        if isinstance(env_index, bool) or not 0 <= int(env_index) < self.num_envs:
            raise EnvError(
                f"{self.name}: env_index {env_index} is out of range [0, {self.num_envs})"
            )
        try:
            with _caller_rng_kept_on_error(), self._vmas_rng():
                frame = self._env.render(
                    mode="rgb_array", env_index=int(env_index), visualize_when_rgb=False
                )
        except Exception as err:  # pyglet raises its own types (no display, no OpenGL)
            raise EnvError(
                f"{self.name}: VMAS cannot render without a display here ({one_line(err)}); "
                "install EGL (e.g. apt-get install libegl1) or run under a virtual display: "
                "`xvfb-run -a python ...`"
            ) from err
        return _letterbox(np.asarray(frame, dtype=np.uint8)[..., :3], size)

    def close(self) -> None:
        viewer = getattr(self._env, "viewer", None) if hasattr(self, "_env") else None
        if viewer is not None:
            viewer.close()
            self._env.viewer = None

    @property
    def vmas_env(self) -> Any:
        """The wrapped ``vmas.simulator.environment.Environment`` (for its scenario and world).
        Call into it only through :meth:`vmas_random_state`, to keep the env's own stream."""
        return self._env

    def vmas_random_state(self) -> contextlib.AbstractContextManager[None]:
        """A context in which VMAS draws from this env's own random stream (see the module
        docstring); the caller's RNG states are restored on exit."""
        return self._vmas_rng()

    # -- internals ------------------------------------------------------------------------------
    def _vmas_rng(self) -> contextlib.AbstractContextManager[None]:
        return self._rng.active(self._shared_rng)

    def _reset_finished(self, done: Tensor, finished: int) -> None:
        """Reset the ``finished`` envs flagged in ``done`` ``[E]`` (observations not computed)."""
        env = self._env
        if finished == self.num_envs:
            env.reset(return_observations=False)
        elif self._masked_reset is not None:
            self._masked_reset.reset(done)
        else:
            for index in done.nonzero().flatten().tolist():
                env.reset_at(index, return_observations=False)

    def _assemble(self, obs_list: list[Tensor]) -> tuple[dict[str, Tensor], Tensor]:
        """Per-group observations ``[E, n, *obs_shape]`` and the state ``[E, state_dim]`` from
        VMAS's per-agent observations ``[E, *obs_shape]`` (one copy of the data)."""
        e = self.num_envs
        if self._state_is_obs:
            name = next(iter(self.spec.groups))
            obs = torch.stack(obs_list, dim=1).to(torch.float32)
            return {name: obs}, obs.view(e, -1)
        obs = {
            group: torch.stack([obs_list[i] for i in rows], dim=1).to(torch.float32)
            for group, rows in self._group_rows.items()
        }
        state = torch.cat([o.reshape(e, -1) for o in obs_list], dim=1).to(torch.float32)
        return obs, state

    def _merge(
        self, done: Tensor, new: dict[str, Tensor], old: dict[str, Tensor]
    ) -> tuple[dict[str, Tensor], Tensor]:
        """New observations where ``done``, the old ones elsewhere; the state to match."""
        obs = {}
        for group, value in new.items():
            mask = done.view(-1, *([1] * (value.dim() - 1)))
            obs[group] = torch.where(mask, value, old[group])
        if self._state_is_obs:
            return obs, next(iter(obs.values())).view(self.num_envs, -1)
        parts = [obs[g][:, k].reshape(self.num_envs, -1) for g, k in self._slots]
        return obs, torch.cat(parts, dim=1)

    def _alive(self) -> dict[str, Tensor]:
        """Every VMAS agent acts every step."""
        return {
            g: torch.ones(self.num_envs, spec.num_agents, dtype=torch.bool, device=self.device)
            for g, spec in self.spec.groups.items()
        }

    def _masked_reset_refusal(self, label: str, batched_reset: bool | None) -> str | None:
        """Why this env resets finished envs one by one (``None``: it need not)."""
        if batched_reset is None:
            batched_reset = label in BATCHED_RESET_SCENARIOS
            if not batched_reset:
                return f"'{label}' is not in BATCHED_RESET_SCENARIOS (batched_reset=True forces it)"
        if not isinstance(batched_reset, bool):
            raise EnvError(f"{self.name}: batched_reset must be a boolean or None")
        if not batched_reset:
            return "batched_reset=False"
        if self.num_envs == 1:
            return "one env: it never resets alone"
        return None

    def _no_state_message(self) -> str:
        return (
            f"{self.name}: VMAS keeps scenario state in scenario-specific Python objects and has "
            "no snapshot API, so its state cannot be saved or injected; a resumed run starts "
            "fresh episodes"
        )

    def _make_spec(self, groups: Mapping[str, Sequence[str]] | None) -> EnvSpec:
        """Groups of agents with identical spaces; the state is all observations joined."""
        descs: dict[str, tuple[tuple[int, ...], ActionSpec]] = {}
        for agent, obs_space, act_space in zip(
            self._vmas_agents,
            self._env.observation_space,
            self._env.action_space,
            strict=True,
        ):
            if not hasattr(obs_space, "shape") or obs_space.shape is None:
                raise EnvError(
                    f"{self.name}: agent '{agent}' has a dict observation ({obs_space}); only "
                    "tensor observations are supported (turn off the scenario's dict_obs)"
                )
            descs[agent] = (tuple(int(d) for d in obs_space.shape), _action_spec(act_space))
        members = _auto_groups(descs) if groups is None else _check_groups(self.name, descs, groups)
        group_specs = {}
        for name, agents in members.items():
            obs_shape, action = descs[agents[0]]
            group_specs[name] = GroupSpec(agents=tuple(agents), obs_shape=obs_shape, action=action)
        state_dim = sum(int(np.prod(shape)) for shape, _ in descs.values())
        return EnvSpec(groups=group_specs, state_shape=(state_dim,), episode_limit=self.max_steps)


# -- random numbers ---------------------------------------------------------------------------
def _numpy_seed(seed: int) -> int:
    """``seed`` where numpy's legacy ``RandomState`` takes it (below 2**32), else a 32-bit seed
    derived from all of its bits: the episode collections of the value family, COMA and MADDPG
    reset with seeds of 64 bits (the run seed in the high ones), which ``seed % 2**32`` would
    make the same for every run."""
    if 0 <= seed < 2**32:
        return seed
    return int(np.random.SeedSequence(seed).generate_state(1)[0])


class _VmasRandomState:
    """One env's own copy of the RNG states VMAS draws from: torch's CPU generator, numpy's
    legacy global ``RandomState`` and Python's ``random`` (the three that VMAS's ``local_seed``
    swaps), plus the default CUDA generator of the env's device when it is a GPU."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.cuda_index: int | None = None
        if device.type == "cuda":
            index = device.index
            self.cuda_index = torch.cuda.current_device() if index is None else index
        self.seed(seed)

    def seed(self, seed: int) -> None:
        """The states that ``torch.manual_seed``, ``np.random.seed`` and ``random.seed`` set,
        made without touching the global generators."""
        self.states: list[Any] = [
            torch.Generator().manual_seed(seed).get_state(),
            np.random.RandomState(_numpy_seed(seed)).get_state(),
            random.Random(seed).getstate(),
        ]
        self.cuda_state: Tensor | None = None
        if self.cuda_index is not None:
            gen = torch.Generator(device=f"cuda:{self.cuda_index}").manual_seed(seed)
            self.cuda_state = gen.get_state()

    @contextlib.contextmanager
    def active(self, shared: list[Any]) -> Iterator[None]:
        """Run VMAS calls on this env's stream. ``shared`` is VMAS's class-level state list,
        which every ``local_seed``-decorated VMAS method loads into the global generators and
        writes back; swapping list entries costs nothing."""
        saved = shared[:]
        shared[:] = self.states
        caller_cuda = None
        if self.cuda_index is not None:
            caller_cuda = torch.cuda.get_rng_state(self.cuda_index)
            torch.cuda.set_rng_state(self.cuda_state, self.cuda_index)
        try:
            yield
        finally:
            self.states = shared[:]
            shared[:] = saved
            if self.cuda_index is not None:
                self.cuda_state = torch.cuda.get_rng_state(self.cuda_index)
                torch.cuda.set_rng_state(caller_cuda, self.cuda_index)


@contextlib.contextmanager
def _caller_rng_kept_on_error() -> Iterator[None]:
    """Restore the caller's global CPU RNG states if the body raises: VMAS's ``local_seed``
    restores them only when the call returns (a failed make_env or render would leave the env's
    states in place). Around the calls that fail for reasons outside the program (parameters,
    no display); it costs ~40 us, too much for every step."""
    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        yield
    except BaseException:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
        raise


# -- batched partial resets -------------------------------------------------------------------
class _MaskedReset:
    """Reset a subset of a VMAS env's copies with one batched reset.

    VMAS resets one copy with ``reset_at(i)``: the scenario's reset code runs in Python for that
    copy (1 to 6 ms in the main scenarios), so when hundreds of copies finish in one step
    (``balance`` with random actions: several per cent of them) the loop costs far more than the
    step. Instead, :meth:`reset` snapshots every tensor with an env axis that is reachable from
    the scenario (its world, entities, their states and actions, sensors, dynamics, scripted
    policies, torch distributions), runs VMAS's batched reset, and writes the snapshot back into
    the rows of the unfinished copies with one ``torch.where`` per tensor (in place, so that
    aliases stay aliases). The env's step counters are restored the same way.

    This is exact when every per-copy value lives in such tensors, as VMAS asks of scenarios (a
    copy's state must be indexable by ``env_index``), and when the batched reset changes nothing
    shared by all copies that ``reset_at`` would leave alone: :data:`BATCHED_RESET_SCENARIOS`
    lists the scenarios checked for both. What can be caught is caught: :meth:`probe` (once, at
    construction) and every :meth:`reset` refuse a reset that creates tensors with an env axis
    that no snapshot covers, or that changes their shapes.
    """

    def __init__(self, env: Any, num_envs: int, name: str) -> None:
        self.env = env
        self.num_envs = num_envs
        self.name = name
        self.modules = frozenset({"", "__main__", type(env.scenario).__module__})

    def probe(self) -> str | None:
        """Run one batched reset and check that the snapshot covers the state; the reason the
        masked reset cannot be used, or ``None``."""
        before = self._locations()
        self.env.reset(return_observations=False)
        return self._uncovered(before, self._locations())

    def reset(self, done: Tensor) -> None:
        """Reset the copies where ``done`` ``[E]`` bool, leave the others as they are."""
        env = self.env
        before = self._locations()
        clones: dict[int, Tensor] = {}  # a tensor held in several places is copied once
        saved = []
        for holder, key, value in before.values():
            if id(value) not in clones:
                clones[id(value)] = value.clone()
            saved.append((holder, key, clones[id(value)]))
        steps = env.steps.clone()
        env.reset(return_observations=False)
        # The reset code is the same every time: probe() checked once that it creates no
        # uncovered per-env tensor. Here only what changed in place or was rebound is restored.
        for holder, key, old in saved:
            try:
                current = _get(holder, key)
            except (KeyError, IndexError, AttributeError):
                continue  # dropped by the reset (a cache emptied in place): nothing to keep
            if not isinstance(current, Tensor) or current.shape != old.shape:
                raise EnvError(
                    f"{self.name}: the batched reset changed '{key}' of {type(holder).__name__} "
                    f"from {tuple(old.shape)} to {_describe(current)}; create the env with "
                    "batched_reset=False"
                )
            axis = _env_axis(current, self.num_envs)
            mask = done.view([-1 if d == axis else 1 for d in range(current.dim())])
            restored = torch.where(mask, current, old)
            if _writable_in_place(current):
                current.copy_(restored)
            else:
                _set(holder, key, restored)
        env.steps = torch.where(done, env.steps, steps)

    def _locations(self) -> dict[tuple[int, Any], tuple[Any, Any, Tensor]]:
        """``(id(holder), key) -> (holder, key, tensor)`` for every tensor with an env axis."""
        found: dict[tuple[int, Any], tuple[Any, Any, Tensor]] = {}
        seen: set[int] = set()
        stack: list[Any] = [self.env.scenario]
        while stack:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            for key, value in _children(obj):
                if type(value) in _LEAVES:
                    continue
                if isinstance(value, Tensor):
                    if self.num_envs in value.shape:
                        found[(id(obj), key)] = (obj, key, value)
                elif _walkable(value, self.modules):
                    stack.append(value)
        return found

    def _uncovered(
        self,
        before: dict[tuple[int, Any], tuple[Any, Any, Tensor]],
        after: dict[tuple[int, Any], tuple[Any, Any, Tensor]],
    ) -> str | None:
        """Why ``after`` (the state after a batched reset) is not covered by the snapshot of
        ``before``, or ``None`` when it is."""
        restored: set[int] = set()
        for loc, (holder, key, old) in before.items():
            if loc not in after:
                continue
            new = after[loc][2]
            if new.shape != old.shape or new.dtype != old.dtype:
                return (
                    f"'{key}' of {type(holder).__name__} changes from {tuple(old.shape)} "
                    f"{old.dtype} to {tuple(new.shape)} {new.dtype}"
                )
            if _env_axis(new, self.num_envs) is None:
                return f"'{key}' of {type(holder).__name__} has several axes of size num_envs"
            restored.add(new.untyped_storage().data_ptr())
        for loc, (holder, key, new) in after.items():
            # A new tensor that merely views a restored one (a distribution's expanded mean) is
            # restored with it.
            if loc not in before and new.untyped_storage().data_ptr() not in restored:
                return f"the reset creates '{key}' of {type(holder).__name__}"
        return None


_LEAVES = frozenset({int, float, bool, str, bytes, type(None), torch.device, torch.dtype})
"""Types that hold no tensors: skipped without a look (most of what the walk meets)."""


def _describe(value: Any) -> str:
    return f"{tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


def _children(obj: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(obj, list | tuple):
        yield from enumerate(obj)
    elif isinstance(obj, dict):
        yield from obj.items()
    elif isinstance(obj, types.MethodType):
        # A scripted agent's policy is a bound method: its object holds the policy's state.
        yield "__self__", obj.__self__
    else:
        yield from vars(obj).items()


def _walkable(value: Any, modules: frozenset[str]) -> bool:
    """Containers, bound methods and the objects of VMAS, of scenario files (which VMAS loads as
    modules without a name), of the scenario's own module and of torch distributions: where
    scenario state lives."""
    if isinstance(value, list | tuple | dict | types.MethodType):
        return True
    if isinstance(value, type | types.ModuleType | types.FunctionType) or not hasattr(
        value, "__dict__"
    ):
        return False
    module = type(value).__module__ or ""
    return (
        module in modules
        or module.split(".")[0] == "vmas"
        or module.startswith("torch.distributions")
    )


def _env_axis(value: Tensor, num_envs: int) -> int | None:
    """The env axis of a tensor with a dimension of size ``num_envs``: the first (VMAS's
    convention), else the only one of that size (``None`` when that is ambiguous)."""
    shape = list(value.shape)
    if shape[0] == num_envs or shape.count(num_envs) == 1:
        return shape.index(num_envs)
    return None


def _writable_in_place(value: Tensor) -> bool:
    """A dense tensor: not a broadcast (stride 0) view, which cannot be written row by row."""
    return all(s != 0 or n <= 1 for s, n in zip(value.stride(), value.shape, strict=True))


def _get(holder: Any, key: Any) -> Any:
    return holder[key] if isinstance(holder, list | tuple | dict) else getattr(holder, key)


def _set(holder: Any, key: Any, value: Tensor) -> None:
    if isinstance(holder, tuple):
        raise EnvError(f"cannot restore a broadcast tensor inside a tuple ({key})")
    if isinstance(holder, list | dict):
        holder[key] = value
    else:
        setattr(holder, key, value)


# -- spaces and groups ------------------------------------------------------------------------
def _action_spec(space: Any) -> ActionSpec:
    """A VMAS (gym) action space as an :class:`ActionSpec`."""
    if hasattr(space, "nvec"):  # MultiDiscrete
        return ActionSpec(tuple(int(n) for n in space.nvec))
    if hasattr(space, "n"):  # Discrete
        return ActionSpec((int(space.n),))
    return ActionSpec.box(
        [float(x) for x in np.asarray(space.low).reshape(-1)],
        [float(x) for x in np.asarray(space.high).reshape(-1)],
    )


def _prefix(agent: str) -> str:
    """``agent_0`` -> ``agent``; ``agent 12`` -> ``agent``; ``lead_adversary_0`` ->
    ``lead_adversary``."""
    return re.sub(r"[\s_\-]*\d+$", "", agent) or "agent"


def _plural(word: str) -> str:
    if word.endswith("s"):
        return word
    if word.endswith("y") and len(word) > 1 and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


def _auto_groups(descs: dict[str, tuple[tuple[int, ...], ActionSpec]]) -> dict[str, list[str]]:
    """Agents with identical spaces share a group (VMAS's agent order); names from prefixes."""
    buckets: list[list[str]] = []
    for agent, desc in descs.items():
        for bucket in buckets:
            if descs[bucket[0]] == desc:
                bucket.append(agent)
                break
        else:
            buckets.append([agent])
    names = []
    for bucket in buckets:
        prefixes = list(dict.fromkeys(_prefix(a) for a in bucket))
        name = _plural(prefixes[0]) if len(prefixes) == 1 else "_".join(prefixes)
        names.append(re.sub(r"\W+", "_", name))
    for name in set(names):
        if names.count(name) > 1:  # same prefix, different spaces: number them
            indices = [i for i, n in enumerate(names) if n == name]
            for j, i in enumerate(indices):
                names[i] = f"{name}_{j}"
    return dict(zip(names, buckets, strict=True))


def _check_groups(
    env_name: str,
    descs: dict[str, tuple[tuple[int, ...], ActionSpec]],
    groups: Mapping[str, Sequence[str]],
) -> dict[str, list[str]]:
    """The user's ``groups``, checked: every agent in exactly one group of identical spaces."""
    if not isinstance(groups, Mapping) or not groups:
        raise EnvError(f"{env_name}: groups must be a non-empty mapping of name -> agent names")
    seen: dict[str, str] = {}
    out: dict[str, list[str]] = {}
    for name, members in groups.items():
        members = [members] if isinstance(members, str) else list(members)
        if not isinstance(name, str) or not name or not members:
            raise EnvError(f"{env_name}: group {name!r} needs a name and at least one agent")
        for agent in members:
            if agent not in descs:
                raise EnvError(
                    f"{env_name}: group '{name}' names agent '{agent}'; the scenario's agents "
                    f"are {list(descs)}"
                )
            if agent in seen:
                raise EnvError(
                    f"{env_name}: agent '{agent}' is in groups '{seen[agent]}' and '{name}'"
                )
            if descs[agent] != descs[members[0]]:
                raise EnvError(
                    f"{env_name}: group '{name}' mixes '{members[0]}' (observation "
                    f"{descs[members[0]][0]}, actions {descs[members[0]][1]}) and '{agent}' "
                    f"(observation {descs[agent][0]}, actions {descs[agent][1]})"
                )
            seen[agent] = name
        out[name] = members
    missing = [a for a in descs if a not in seen]
    if missing:
        raise EnvError(f"{env_name}: agents {missing} are in no group")
    return out


# -- small helpers ----------------------------------------------------------------------------
def _letterbox(frame: np.ndarray, size: int) -> np.ndarray:
    """``frame`` ``[H, W, 3]`` scaled to fit ``[size, size, 3]``, centred on white."""
    from PIL import Image

    h, w = frame.shape[:2]
    scale = size / max(h, w)
    new_w, new_h = max(1, round(w * scale)), max(1, round(h * scale))
    image = Image.fromarray(np.ascontiguousarray(frame)).resize((new_w, new_h), Image.BILINEAR)
    canvas = Image.new("RGB", (size, size), (255, 255, 255))
    canvas.paste(image, ((size - new_w) // 2, (size - new_h) // 2))
    return np.asarray(canvas, dtype=np.uint8)
