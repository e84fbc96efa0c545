"""Batched envs over environments the project did not write: PettingZoo and Gymnasium.

:class:`PettingZooAdapter` turns any PettingZoo ``ParallelEnv`` factory, and
:class:`GymnasiumAdapter` any Gymnasium multi-agent env with ``Tuple`` spaces (``lbforaging``,
``rware``), into a :class:`~mappo.envs.base.BatchedEnv` of ``num_envs`` copies, stepped in worker
processes (see :mod:`mappo.envs.adapters.pool`) or in-process with ``num_workers=0``.

What the adapter does with the wrapped env (the contract is in :mod:`mappo.envs.base`):

- **Groups.** Agents with identical observation and action spaces form a group, named after the
  agents' common prefix (``adversary_0``, ``adversary_1`` -> ``adversary``), else ``group_<i>``;
  or as the user maps them with ``groups={"name": [agents]}``.
- **Observations** are flattened to float32 (``gymnasium.spaces.flatten`` for non-Box spaces).
- **Global state**: the env's ``state()`` where it has one, else every agent's observation joined
  in ``possible_agents`` order, ``[E, sum(n * d)]`` (option ``global_state``).
- **Actions**: ``Discrete`` and ``MultiDiscrete`` spaces become categorical heads; a ``Box``
  becomes a continuous group of ``d`` components (the box flattened in C order, reshaped and cast
  to the box's dtype on the way back), with the box's bounds.
- **Action masks**: the ``action_mask`` entry of dict observations (PettingZoo's convention), or
  ``info[agent]["action_mask"]``.
- **Episodes**: an env is done when every agent is terminated or truncated, when no agent is left,
  or at ``episode_limit`` steps (a truncation). Agents that leave early are not ``alive``, with
  zero observation and zero reward (death masking); rewards an env still reports for them are
  dropped. An agent's own termination ends its returns there (``EnvStep.agent_terminated``), while
  its env's episode goes on. Done copies are reset in the same step (``final_obs`` holds the
  observation they ended on).
- **Seeding**: ``reset(seed)`` resets copy ``i`` with a seed hashed from ``(seed, i)``
  (``_worker.copy_seed``: two seeds' batches share no copy's stream); later episodes continue
  each copy's own RNG, so ``(seed, num_envs)`` replays exactly, with or without workers.
- **Statistics**: ``episode_return`` (the episode's reward summed over steps, averaged over all
  agents) and ``episode_length`` (steps); and any number the env reports in an agent's info on
  the step that ends an episode, named by the option ``episode_stats`` or, by default, by the
  env's ``episode_stats`` attribute (e.g. ``success`` for Google Research Football).
- **Rendering**: ``render(i)`` asks the worker of copy ``i`` for ``env.render()`` of that copy,
  which must return an ``[H, W, 3]`` uint8 frame (PettingZoo envs made with
  ``render_mode="rgb_array"``).

The host round trip is in the nature of wrapping Python envs: actions go to host memory and
observations come back to ``device`` once per step, as one copy per array.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import re
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mappo.data import channel_axis
from mappo.envs.adapters import _worker
from mappo.envs.adapters.pool import (
    EnvOutputError,
    EnvWorkerError,
    SharedBuffers,
    WorkerPool,
    default_start_method,
    display_hint,
)
from mappo.envs.base import ActionSpec, BatchedEnv, EnvError, EnvSpec, EnvStep, GroupSpec
from mappo.envs.importing import one_line, require_module

ADAPTER_OPTIONS = frozenset(
    {
        "name",
        "groups",
        "num_workers",
        "envs_per_worker",
        "start_method",
        "timeout",
        "startup_timeout",
        "episode_limit",
        "truncate_at_limit",
        "check_finite",
        "global_state",
        "episode_stats",
        "env_kwargs",
    }
)
"""Keyword arguments of the scheme factories that configure the adapter; all others are passed
to the environment (use ``env_kwargs={...}`` for an env argument with one of these names)."""

EXTRAS = {"pettingzoo": "pettingzoo", "mpe2": "pettingzoo", "gymnasium": "pettingzoo"}
EXTRAS |= {"lbforaging": "lbf", "rware": "rware"}
"""Top-level package -> the ``mappo`` extra that installs it."""

STAT_NAMES = ("episode_return", "episode_length")
RESERVED_FIELDS = ("terminated", "truncated", "state", "final_state")
"""Per-copy buffers of the adapter, whose names an extra episode statistic cannot take."""

DEFAULT_TIMEOUT = 60.0
"""Seconds a step or reset of the worker processes may take when no ``timeout`` is given."""


class ParallelEnvAdapter(BatchedEnv):
    """A batch of Python environments in the ParallelEnv protocol (base of both adapters).

    Args:
        factory: how to build one copy (``_worker.Factory``).
        wrap: ``"parallel"`` (already a ParallelEnv) or ``"tuple"`` (Gymnasium Tuple spaces).
        num_envs, device, seed: as every :class:`BatchedEnv`.
        name: the name in messages (e.g. ``pettingzoo:mpe2.simple_spread_v3``).
        groups: ``{"group": [agent, ...]}`` to group agents yourself; default: by spaces.
        num_workers: worker processes; ``0`` steps the envs in this process; default
            ``min(num_envs, os.cpu_count())`` (or ``num_envs / envs_per_worker``).
        envs_per_worker: copies per worker (the last workers get fewer when it does not divide).
        start_method: ``"forkserver"`` (default where available) or ``"spawn"``.
        timeout: seconds a step or reset may take before a worker counts as hung; default
            60. Needs worker processes: with ``num_workers=0`` a hanging step cannot be
            interrupted, so an explicit ``timeout`` is refused there.
        startup_timeout: seconds the workers may take to start and build their envs.
        episode_limit: steps after which an episode is truncated; default: what the env declares
            (``max_cycles``, ``max_steps``, ``spec.max_episode_steps``...).
        truncate_at_limit: report an episode that the env ends exactly at ``episode_limit`` as
            truncated, not terminated (LBF and RWARE signal their time limit as termination).
        check_finite: refuse observations, rewards and states with NaN or inf.
        global_state: ``"env"`` (the env's ``state()``), ``"obs"`` (every agent's
            observation joined in ``possible_agents`` order, zeros for absent agents, as the
            MAPPO paper's MPE critic input), or ``"auto"``: the env's ``state()`` where it has
            one, except when it is the joined observations (as in PettingZoo's MPE), which the
            adapter then joins itself instead of having every env compute them twice.
        episode_stats: names of numbers that the env puts in an agent's info on the step that
            ends an episode, reported per episode beside ``episode_return`` (default: the env's
            ``episode_stats`` attribute, else none).
    """

    agent_terminations = True  # an agent's own termination ends its returns (EnvStep)

    def __init__(
        self,
        factory: _worker.Factory,
        wrap: str,
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int = 0,
        *,
        name: str,
        groups: Mapping[str, Sequence[str]] | None = None,
        num_workers: int | None = None,
        envs_per_worker: int | None = None,
        start_method: str | None = None,
        timeout: float | None = None,
        startup_timeout: float = 120.0,
        episode_limit: int | None = None,
        truncate_at_limit: bool = True,
        check_finite: bool = True,
        global_state: str = "auto",
        episode_stats: Sequence[str] | None = None,
    ) -> None:
        self.name = name
        super().__init__(num_envs, device, seed)
        # ``None`` marks the default, so that a timeout the user asked for can be told apart.
        timeout_given = timeout is not None
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise EnvError(f"{name}: timeout must be a positive number of seconds, got {timeout!r}")
        if episode_limit is not None and not _positive_int(episode_limit):
            raise EnvError(
                f"{name}: episode_limit must be a positive integer, got {episode_limit!r}"
            )
        if global_state not in ("auto", "env", "obs"):
            raise EnvError(
                f"{name}: global_state must be 'auto', 'env' or 'obs', got {global_state!r}"
            )
        ranges = _split_batch(name, num_envs, num_workers, envs_per_worker)
        if timeout_given and not ranges:
            # In-process, a step that never returns blocks the only thread that could stop it;
            # only a worker process can be abandoned and killed (see pool.WorkerPool).
            raise EnvError(
                f"{name}: timeout needs worker processes: with num_workers=0 a hanging step "
                "cannot be interrupted; set num_workers>=1 or drop timeout"
            )
        if start_method not in (None, "forkserver", "spawn"):
            raise EnvError(
                f"{name}: start_method must be 'forkserver' or 'spawn', got {start_method!r} "
                "('fork' is unsafe in a process that runs torch)"
            )
        self._closed_reason = ""
        self._pool: WorkerPool | None = None
        self._runner: _worker.EnvRunner | None = None
        self._buffers: SharedBuffers | None = None
        self._was_reset = False
        self._masks: dict[str, Tensor] = {}

        self._state_bytes = False  # whether the env's state() is uint8 (set by _inspect)
        descs, env_state, joined, limit, env_stats = self._inspect(
            factory, wrap, seed, episode_limit, read_state=global_state != "obs"
        )
        # An image state keeps its shape for the critic's convolutions (model.encoder=cnn).
        image_state = None if env_state is None or env_state.ndim != 3 else env_state.shape
        env_state = None if env_state is None else env_state.reshape(-1)
        extra_stats = _check_stat_names(name, env_stats if episode_stats is None else episode_stats)
        self._stat_names = STAT_NAMES + extra_stats
        if global_state == "env" and env_state is None:
            raise EnvError(f"{name}: the environment has no state(); use global_state='obs'")
        # Equal to the joined observations (and not trivially, as all zeros would be).
        state_is_joined_obs = np.array_equal(env_state, joined) and np.ptp(joined) > 0
        use_env_state = env_state is not None and (
            global_state == "env" or (global_state == "auto" and not state_is_joined_obs)
        )
        state_dim = int(env_state.size) if use_env_state else None
        members = _group_agents(name, descs, groups)
        state_shape = None if state_dim is None else (image_state or (state_dim,))
        # Every agent observes a picture of one shape and the env has no state of its own: the
        # joined state is the pictures stacked along their channel axis, a picture the critic's
        # convolutions can read ([H, W, N * C] in possible_agents order), not one flat row.
        pictures = {_image_shape(d["desc"]) for d in descs.values()}
        picture = next(iter(pictures)) if len(pictures) == 1 else None
        axis = None if picture is None or state_dim is not None else channel_axis(picture)
        self._join_axis = axis
        if axis is not None:
            stacked = list(picture)
            stacked[axis] *= len(descs)
            state_shape = tuple(stacked)
        # 8-bit observations (pixels) stay bytes in rollouts and replay buffers, a quarter of
        # float32 (BatchedEnv.byte_observations): every agent's observation a uint8 Box, and
        # the state the env's own uint8 array or those observations joined.
        byte_obs = all(_byte_box(d["desc"]["obs_space"]) for d in descs.values())
        # Pictures whose Box says they are already in [0, 1] (a normalising wrapper): the
        # trainer warns where model.image_scale would divide them by 255 again.
        self.unit_pictures = any(_unit_picture(d["desc"]) for d in descs.values())
        self.byte_observations = byte_obs and (state_dim is None or self._state_bytes)
        self.spec = _make_spec(descs, members, state_shape, limit, self._stat_names)
        self._state_dim = state_dim
        self._join_index = _join_index(descs, members)
        grouped = [a for agents in members.values() for a in agents]
        order = [grouped.index(a) for a in descs]  # descs: possible_agents order
        self._agent_order = None if order == list(range(len(order))) else torch.tensor(order)
        config = {
            "env_name": name,
            "groups": [(g, [descs[a]["desc"] for a in agents]) for g, agents in members.items()],
            "mask_modes": {g: descs[agents[0]]["desc"]["mask"] for g, agents in members.items()},
            "state_dim": state_dim,
            "episode_limit": limit,
            "truncate_at_limit": bool(truncate_at_limit),
            "check_finite": bool(check_finite),
            "episode_stats": list(extra_stats),
        }
        self._buffers = SharedBuffers(self._fields(), shared=bool(ranges))
        if ranges:
            self._pool = self._run(
                "start",
                lambda: WorkerPool(
                    env_name=name,
                    factory=factory,
                    wrap=wrap,
                    config=config,
                    ranges=ranges,
                    timeout=float(timeout),
                    startup_timeout=float(max(startup_timeout, timeout)),
                    start_method=start_method or default_start_method(),
                    buffers=self._buffers,
                ),
            )
        else:
            arrays = self._buffers.arrays
            self._runner = self._run(
                "start", lambda: _worker.EnvRunner(factory, wrap, config, arrays, 0, num_envs)
            )

    # -- the contract -------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> EnvStep:
        """Reset every copy; copy ``i`` is seeded ``copy_seed(seed, i)`` (the constructor's seed
        the first time when ``seed`` is ``None``; later ``None`` resets continue each copy's
        RNG)."""
        self._ensure_open()
        if seed is None and not self._was_reset:
            seed = self.seed
        self.reseed(seed)
        backend = self._pool if self._pool is not None else self._runner
        self._run("reset", lambda: backend.reset(seed))
        self._was_reset = True
        return self._collect(initial=True)

    def _step(self, actions: dict[str, Tensor]) -> EnvStep:
        self._ensure_open()
        if not self._was_reset:
            raise EnvError(f"{self.name}: call reset() before step()")
        if self.validate_actions and self._masks:
            self.check_action_masks(actions, self._masks)
        arrays = self._buffers.arrays
        for group in self.spec.groups:
            target = torch.from_numpy(arrays[f"action/{group}"])
            target.copy_(actions[group].reshape(target.shape))
        self._run("step", (self._pool or self._runner).step)
        return self._collect(initial=False)

    def get_state(self) -> dict[str, Tensor]:
        """Not available: the state of Python envs in other processes is opaque (a checkpoint
        of a run on an adapter resumes with fresh episodes)."""
        raise NotImplementedError(
            f"{self.name}: the simulator state of wrapped Python environments cannot be "
            "exported; state injection is available for the built-in tensor environments"
        )

    def set_state(self, state: dict[str, Tensor], env_ids: Tensor | None = None) -> EnvStep:
        """Not available (see :meth:`get_state`)."""
        raise NotImplementedError(
            f"{self.name}: wrapped Python environments cannot be put into a given state; "
            "state injection is available for the built-in tensor environments"
        )

    def render(self, env_index: int = 0, size: int = 400) -> np.ndarray:
        """``[H, W, 3]`` uint8: copy ``env_index`` drawn by its own ``render()`` (``size`` is
        not used: the wrapped env draws at its own size). PettingZoo envs draw only when made
        with ``render_mode="rgb_array"``; an env that cannot draw raises
        ``NotImplementedError``, and the batch stays usable."""
        self._ensure_open()
        if not self._was_reset:
            raise EnvError(f"{self.name}: call reset() before render()")
        if not (isinstance(env_index, int) and 0 <= env_index < self.num_envs):
            raise EnvError(
                f"{self.name}: env_index must be in 0..{self.num_envs - 1}, got {env_index!r}"
            )
        try:
            if self._pool is not None:
                frame = self._pool.render(env_index)
            else:
                frame = self._runner.render(env_index)
        except NotImplementedError as err:
            reason = str(err).strip() or "its render() is not implemented"
            raise NotImplementedError(f"the wrapped environment does not draw: {reason}") from err
        except EnvWorkerError as err:  # a worker died or hung: the pool is gone
            self._fail(str(err))
            raise
        except EnvError:  # the env's render() raised in its worker; the batch is intact
            raise
        except Exception as err:  # the same, in this process
            raise EnvError(
                f"{self.name}: render() of copy {env_index} raised {one_line(err)}"
                + display_hint(f"{type(err).__name__} {err}")
            ) from err
        if frame is None:
            raise NotImplementedError(
                f"{self.name}: the wrapped environment's render() returned None (a PettingZoo "
                'env draws only when made with render_mode="rgb_array": add render_mode=rgb_array '
                "to the eval or render command)"
            )
        return frame

    def close(self) -> None:
        """End the worker processes and release the shared memory; idempotent."""
        if self._pool is not None:
            self._pool.close()
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if self._buffers is not None:
            self._buffers.close()
        if not self._closed_reason:
            self._closed_reason = "closed"

    def __enter__(self) -> ParallelEnvAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def num_workers(self) -> int:
        """Worker processes (``0`` when the envs run in this process)."""
        return 0 if self._pool is None else len(self._pool.procs)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers (empty in-process)."""
        return [] if self._pool is None else self._pool.pids

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name!r}, num_envs={self.num_envs}, "
            f"num_workers={self.num_workers})"
        )

    # -- internals ----------------------------------------------------------------------------
    def _inspect(
        self,
        factory: _worker.Factory,
        wrap: str,
        seed: int,
        episode_limit: int | None,
        read_state: bool = True,
    ) -> tuple[dict[str, dict[str, Any]], np.ndarray | None, np.ndarray, int, Sequence[str]]:
        """Build one env here to read its agents, spaces, masks, episode limit and episode
        statistics, and its first ``state()`` (``None`` without one, or unless ``read_state``)
        and joined observations."""
        try:
            probe = _worker.make_env(factory, wrap)
        except TypeError as err:
            raise EnvError(
                f"{self.name}: bad parameter for the environment: {err}{_option_hint(err)}"
            ) from err
        except Exception as err:
            hint = _option_hint(err)
            if isinstance(err, AttributeError) and "attribute 'parallel_env'" in str(err):
                hint = (
                    "; the adapter takes PettingZoo's parallel API, which a module offers as "
                    "parallel_env (turn-based games, such as pettingzoo.classic's, have none); "
                    "or name a function that returns a parallel env: pettingzoo:<module>:<name>"
                )
            raise EnvError(
                f"{self.name}: could not create the environment: {type(err).__name__}: {err}{hint}"
            ) from err
        try:
            agents = list(getattr(probe, "possible_agents", []))
            if not agents:
                raise EnvError(f"{self.name}: the environment lists no possible_agents")
            descs: dict[str, dict[str, Any]] = {}
            for agent in agents:
                try:
                    obs_space = probe.observation_space(agent)
                    act_space = probe.action_space(agent)
                except Exception as err:
                    raise EnvError(
                        f"{self.name}: the environment's observation_space() or action_space() "
                        f"for agent '{agent}' raised {one_line(err)}"
                    ) from err
                try:
                    desc = _worker.describe_agent(agent, obs_space, act_space)
                except ValueError as err:
                    raise EnvError(f"{self.name}: {err}") from None
                descs[agent] = {"desc": desc, "obs_space": obs_space, "act_space": act_space}
            try:
                first = probe.reset(seed=seed)
            except Exception as err:
                raise EnvError(
                    f"{self.name}: the environment's reset() raised {type(err).__name__}: {err}"
                ) from err
            if first is None and hasattr(probe, "agent_selection"):  # PettingZoo's AEC API
                parallelizable = bool(getattr(probe, "metadata", {}).get("is_parallelizable"))
                raise EnvError(
                    f"{self.name}: this is a PettingZoo AEC env (agents act in turns); give its "
                    "parallel form (a module's parallel_env, or a function that returns "
                    "pettingzoo.utils.conversions.aec_to_parallel(env))"
                    if parallelizable
                    else f"{self.name}: this is a PettingZoo AEC env whose agents act in turns "
                    "and that has no parallel form (a turn-based game, metadata "
                    "is_parallelizable false); the adapters take parallel envs only"
                )
            if not (isinstance(first, tuple) and len(first) == 2 and isinstance(first[0], dict)):
                raise EnvError(
                    f"{self.name}: reset() must return (observations, infos), dicts keyed by "
                    f"agent as in PettingZoo's parallel API; got {type(first).__name__}"
                )
            obs, infos = first
            for agent in agents:
                info = infos.get(agent) if isinstance(infos, dict) else None
                desc = descs[agent]["desc"]
                if desc["mask"] is None and isinstance(info, dict) and "action_mask" in info:
                    if desc["box"] is not None:
                        raise EnvError(
                            f"{self.name}: agent '{agent}' has a Box action space and an "
                            "action_mask in its info; masks apply to discrete actions only"
                        )
                    desc["mask"] = "info"
            env_state = None
            try:
                if read_state:
                    raw = np.asarray(probe.state())
                    self._state_bytes = raw.dtype == np.uint8
                    env_state = raw.astype(np.float32)
            except (NotImplementedError, AttributeError):
                pass
            except Exception as err:
                raise EnvError(
                    f"{self.name}: the environment's state() raised {type(err).__name__}: {err}; "
                    "global_state=obs gives the critic every agent's observation instead "
                    "(env.kwargs.global_state=obs)"
                ) from err
            parts = []
            for a in agents:
                if a not in obs:
                    parts.append(np.zeros(descs[a]["desc"]["obs_dim"], np.float32))
                    continue
                try:
                    parts.append(_worker.flat_observation(descs[a]["desc"], obs[a]))
                except Exception as err:  # (an array indexed as a dict: an IndexError)
                    raise EnvError(
                        f"{self.name}: the observation of agent '{a}' after reset() does not "
                        f"fit its observation space {descs[a]['obs_space']} (it returned "
                        f"{_worker.described(obs[a])}: {type(err).__name__}: {err})"
                    ) from err
            joined = np.concatenate(parts)
            limit = episode_limit or _worker.infer_episode_limit(probe)
            env_stats = getattr(probe, "episode_stats", ())
        finally:
            try:
                probe.close()
            except Exception:  # only the probe's resources; the batch builds its own envs
                pass
        if limit is None:
            raise EnvError(
                f"{self.name}: cannot tell the episode length limit of this environment (it has "
                "no max_cycles, max_steps or spec.max_episode_steps); pass episode_limit=<steps>"
            )
        return descs, env_state, joined, limit, env_stats

    def _fields(self) -> dict[str, tuple[tuple[int, ...], str]]:
        e = self.num_envs
        fields: dict[str, tuple[tuple[int, ...], str]] = {}
        for g, spec in self.spec.groups.items():
            n, d = spec.num_agents, math.prod(spec.obs_shape)
            fields[f"obs/{g}"] = ((e, n, d), "float32")
            fields[f"final_obs/{g}"] = ((e, n, d), "float32")
            fields[f"reward/{g}"] = ((e, n), "float32")
            fields[f"alive/{g}"] = ((e, n), "bool")
            fields[f"agent_terminated/{g}"] = ((e, n), "bool")
            kind = "float32" if spec.action.continuous else "int64"
            fields[f"action/{g}"] = ((e, n, spec.action.num_heads), kind)
            if spec.has_action_mask:
                fields[f"mask/{g}"] = ((e, n, spec.action.total), "bool")
        if self._state_dim is not None:
            fields["state"] = ((e, self._state_dim), "float32")
            fields["final_state"] = ((e, self._state_dim), "float32")
        for flag in ("terminated", "truncated"):
            fields[flag] = ((e,), "bool")
        for stat in self._stat_names:
            fields[stat] = ((e,), "float32")
        return fields

    def _run(self, what: str, call: Callable[[], Any]) -> Any:
        """Run a command of the workers or of the in-process runner; on any failure close the
        env and raise. In-process failures are reported as the workers report theirs."""
        try:
            return call()
        except EnvWorkerError as err:  # from the worker pool, with every detail already
            self._fail(str(err))
            raise
        except _worker.EnvOutputFault as err:
            index = None if self._runner is None else self._runner.current
            tb = traceback.format_exc()
            self._fail(str(err))
            raise EnvOutputError(
                f"{err}; fix the environment: the adapter does not train on malformed output",
                env_name=self.name,
                worker=None,
                env_index=index,
                remote_traceback=tb,
            ) from err
        except Exception as err:
            index = None if self._runner is None else self._runner.current
            tb = traceback.format_exc()
            self._fail(str(err))
            if isinstance(err, EnvError):  # e.g. a worker pool that could not start
                raise
            copy = "" if index is None else f" in copy {index} of the batch"
            method = what if self._runner is None else self._runner.method
            raise EnvWorkerError(
                f"{self.name}: the environment raised {type(err).__name__}: {err} in {method}"
                f"{copy} (in-process)",
                env_name=self.name,
                worker=None,
                env_index=index,
                remote_traceback=tb,
            ) from err
        except BaseException:  # Ctrl-C: the workers are mid-command, their state is unknown
            self._fail("interrupted")
            raise

    def _fail(self, reason: str) -> None:
        self._closed_reason = f"closed after an error ({reason.splitlines()[0][:200]})"
        self.close()

    def _ensure_open(self) -> None:
        if self._closed_reason:
            raise EnvError(f"{self.name} is {self._closed_reason}; create a new environment")

    def _join(self, obs: dict[str, Tensor]) -> Tensor:
        """``[E, sum(n * d)]``: every agent's observation in ``possible_agents`` order; for
        pictures of one shape, ``[E, *shape]`` with the agents' pictures stacked along the
        channel axis (``[E, H, W, N * C]`` or ``[E, N * C, H, W]``)."""
        if self._join_axis is not None:
            pics = torch.cat(list(obs.values()), dim=1)  # [E, N, *shape], groups' order
            if self._agent_order is not None:
                pics = pics.index_select(1, self._agent_order.to(pics.device))
            if self._join_axis == 2:  # [E, N, H, W, C] -> [E, H, W, N, C]
                pics = pics.permute(0, 2, 3, 1, 4)
            return pics.reshape(pics.shape[0], *self.spec.state_shape)
        joined = torch.cat([o.flatten(1) for o in obs.values()], dim=1)
        if self._join_index is None:
            return joined
        return joined.index_select(1, self._join_index.to(joined.device))

    def _collect(self, initial: bool) -> EnvStep:
        """Copy the output arrays to ``device`` tensors (``final_*`` only after a step)."""
        arrays = self._buffers.arrays
        device = self.device

        def get(key: str) -> Tensor:
            return torch.from_numpy(arrays[key]).to(device, copy=True)

        groups = list(self.spec.groups)
        E, specs = self.num_envs, self.spec.groups

        def shaped(key: str, g: str) -> Tensor:
            """A group's observations ``[E, n, *obs_shape]`` (images keep their axes)."""
            return get(key).view(E, specs[g].num_agents, *specs[g].obs_shape)

        obs = {g: shaped(f"obs/{g}", g) for g in groups}
        reward = {g: get(f"reward/{g}") for g in groups}
        alive = {g: get(f"alive/{g}") for g in groups}
        masks = {g: get(f"mask/{g}") for g in groups if self.spec.groups[g].has_action_mask}
        agent_terminated = {g: get(f"agent_terminated/{g}") for g in groups}
        terminated, truncated = get("terminated"), get("truncated")
        if self._state_dim is not None:
            state = get("state").view(E, *self.spec.state_shape)
        else:
            state = self._join(obs)
        final_obs = final_state = None
        if not initial:
            done = terminated | truncated
            final_obs = {
                g: torch.where(
                    done.view(E, *[1] * (obs[g].dim() - 1)),
                    shaped(f"final_obs/{g}", g),
                    obs[g],
                )
                for g in groups
            }
            if self._state_dim is not None:
                final = get("final_state").view(E, *self.spec.state_shape)
                final_state = torch.where(done.view(E, *[1] * (state.dim() - 1)), final, state)
            else:
                final_state = self._join(final_obs)
        self._masks = masks
        return EnvStep(
            obs=obs,
            state=state,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            alive=alive,
            action_mask=masks,
            final_obs=final_obs,
            final_state=final_state,
            stats={s: get(s) for s in self._stat_names},
            agent_terminated=agent_terminated,
        )


class PettingZooAdapter(ParallelEnvAdapter):
    """Any PettingZoo ``ParallelEnv`` as a batched env.

    ``env_fn`` builds one copy: an import path (``"mpe2.simple_spread_v3"`` means its
    ``parallel_env``; ``"package.module:callable"``), or a callable. With worker processes a
    callable must be picklable (a module-level function or class, or a ``functools.partial`` of
    one); PettingZoo's own ``parallel_env`` functions are closures, so pass their import path.
    ``env_kwargs`` are passed to it. The other keyword arguments are those of
    :class:`ParallelEnvAdapter`.

    Example::

        env = PettingZooAdapter("mpe2.simple_spread_v3", num_envs=64, num_workers=4,
                                env_kwargs={"N": 3, "max_cycles": 25})
    """

    def __init__(
        self,
        env_fn: str | Callable[..., Any],
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int = 0,
        *,
        env_kwargs: Mapping[str, Any] | None = None,
        name: str | None = None,
        **options: Any,
    ) -> None:
        kwargs = dict(env_kwargs or {})
        if isinstance(env_fn, str):
            module = env_fn.partition(":")[0]
            name = name or f"pettingzoo:{env_fn}"
            _require(name, "gymnasium")
            _require(name, module)
            factory: _worker.Factory = ("import", env_fn, kwargs)
        elif callable(env_fn):
            name = name or f"pettingzoo:{getattr(env_fn, '__qualname__', type(env_fn).__name__)}"
            _require(name, "gymnasium")
            factory = ("callable", env_fn, kwargs)
        else:
            raise EnvError(
                f"PettingZooAdapter needs an import path or a callable that returns a "
                f"ParallelEnv, got {type(env_fn).__name__}"
            )
        super().__init__(factory, "parallel", num_envs, device, seed, name=name, **options)


class GymnasiumAdapter(ParallelEnvAdapter):
    """A Gymnasium multi-agent env with ``Tuple`` observation and action spaces as a batched env.

    ``env`` is a Gymnasium id, ``"package:EnvId"`` to have the package imported first so that it
    registers its ids (``"lbforaging:Foraging-8x8-2p-2f-v3"``, ``"rware:rware-tiny-2ag-v2"``), or
    a picklable callable returning the env. ``env_kwargs`` go to ``gymnasium.make`` (or to the
    callable). Agents are named ``agent_0 ... agent_{n-1}``; see ``_worker.TupleEnvAsParallel``
    for the conventions read from ``step``.
    """

    def __init__(
        self,
        env: str | Callable[..., Any],
        num_envs: int = 1,
        device: str | torch.device = "cpu",
        seed: int = 0,
        *,
        env_kwargs: Mapping[str, Any] | None = None,
        name: str | None = None,
        **options: Any,
    ) -> None:
        kwargs = dict(env_kwargs or {})
        if isinstance(env, str):
            name = name or f"gymnasium:{env}"
            package, sep, _ = env.partition(":")
            if sep:  # (its extra, lbf or rware, brings gymnasium too: named first)
                _require_extra(name, package)
            _require(name, "gymnasium")
            if sep:
                _require(name, package)
            factory: _worker.Factory = ("gymnasium", env, kwargs)
        elif callable(env):
            name = name or f"gymnasium:{getattr(env, '__qualname__', type(env).__name__)}"
            _require(name, "gymnasium")
            factory = ("callable", env, kwargs)
        else:
            raise EnvError(
                f"GymnasiumAdapter needs a Gymnasium id or a callable that returns the env, got "
                f"{type(env).__name__}"
            )
        super().__init__(factory, "tuple", num_envs, device, seed, name=name, **options)


# -- config names -------------------------------------------------------------------------------
def make_pettingzoo(
    target: str,
    /,  # (an env keyword argument may be called 'target' too)
    num_envs: int = 1,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **kwargs: Any,
) -> PettingZooAdapter:
    """Factory of the ``pettingzoo:`` scheme: ``pettingzoo:mpe2.simple_spread_v3`` or
    ``pettingzoo:package.module:callable``. Adapter options (:data:`ADAPTER_OPTIONS`) configure
    the adapter; every other keyword argument is passed to the env factory."""
    options, env_kwargs = _split_kwargs(kwargs)
    name = f"pettingzoo:{target}"
    return PettingZooAdapter(
        target, num_envs, device, seed, env_kwargs=env_kwargs, name=name, **options
    )


def make_gymnasium(
    target: str,
    /,  # (an env keyword argument may be called 'target' too)
    num_envs: int = 1,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **kwargs: Any,
) -> GymnasiumAdapter:
    """Factory of the ``gymnasium:`` scheme: ``gymnasium:lbforaging:Foraging-8x8-2p-2f-v3``
    imports ``lbforaging`` (which registers its ids) and calls ``gymnasium.make`` with the
    keyword arguments that are not adapter options (:data:`ADAPTER_OPTIONS`)."""
    options, env_kwargs = _split_kwargs(kwargs)
    name = f"gymnasium:{target}"
    return GymnasiumAdapter(
        target, num_envs, device, seed, env_kwargs=env_kwargs, name=name, **options
    )


def _option_hint(err: Exception) -> str:
    """Where the env refused a keyword argument that is a misspelt option of the adapter
    (``num_worker``), the option meant; else empty."""
    found = re.search(r"keyword argument '(\w+)'", str(err))
    close = found and difflib.get_close_matches(found.group(1), sorted(ADAPTER_OPTIONS), n=1)
    return f"; did you mean the adapter's option '{close[0]}'?" if close else ""


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    options = {k: v for k, v in kwargs.items() if k in ADAPTER_OPTIONS and k != "env_kwargs"}
    env_kwargs = {k: v for k, v in kwargs.items() if k not in ADAPTER_OPTIONS}
    env_kwargs.update(kwargs.get("env_kwargs") or {})
    options.pop("name", None)
    return options, env_kwargs


def _require_extra(env_name: str, module: str) -> None:
    """Refuse a ``module`` of one of the project's extras that is not installed, naming that
    extra (the whole fix), before its dependencies' own extras are named one by one."""
    top = module.split(".")[0]
    if top in EXTRAS and importlib.util.find_spec(top) is None:
        raise EnvError(
            f"{env_name} needs the Python package '{top}', which is not installed; install it "
            f"with `pip install 'mappo[{EXTRAS[top]}]'`"
        )


def _require(env_name: str, module: str) -> None:
    """Import ``module`` or raise :class:`EnvError` in one line saying why it failed (the
    packages of the project's extras, :data:`EXTRAS`, with their install command)."""
    require_module(env_name, module, EXTRAS)


# -- groups and spec ------------------------------------------------------------------------------
def _prefix(agent: str) -> str:
    """``adversary_0`` -> ``adversary``; ``agent-12`` -> ``agent``."""
    return re.sub(r"[_\-]?\d+$", "", agent)


def _group_agents(
    env_name: str,
    descs: dict[str, dict[str, Any]],
    groups: Mapping[str, Sequence[str]] | None,
) -> dict[str, list[str]]:
    """Group name -> agents, in the env's agent order (automatic) or as the user mapped them."""
    agents = list(descs)
    if groups is not None:
        return _check_user_groups(env_name, descs, groups)
    buckets: list[list[str]] = []
    for agent in agents:
        for bucket in buckets:
            first = descs[bucket[0]]
            same = (
                first["obs_space"] == descs[agent]["obs_space"]
                and first["act_space"] == descs[agent]["act_space"]
                and first["desc"]["mask"] == descs[agent]["desc"]["mask"]
            )
            if same:
                bucket.append(agent)
                break
        else:
            buckets.append([agent])
    prefixes = [{_prefix(a) for a in bucket} for bucket in buckets]
    names = []
    for i, p in enumerate(prefixes):
        unique = len(p) == 1 and "" not in p and prefixes.count(p) == 1
        names.append(next(iter(p)) if unique else f"group_{i}")
    if len(set(names)) != len(names):  # a prefix that reads like a generated name
        names = [f"group_{i}" for i in range(len(buckets))]
    return dict(zip(names, buckets, strict=True))


def _check_user_groups(
    env_name: str, descs: dict[str, dict[str, Any]], groups: Mapping[str, Sequence[str]]
) -> dict[str, list[str]]:
    if not isinstance(groups, Mapping) or not groups:
        raise EnvError(f"{env_name}: groups must be a non-empty mapping of name -> agent names")
    seen: dict[str, str] = {}
    out: dict[str, list[str]] = {}
    for name, members in groups.items():
        if not isinstance(name, str) or not name:
            raise EnvError(f"{env_name}: group names must be non-empty strings, got {name!r}")
        members = [members] if isinstance(members, str) else list(members)
        if not members:
            raise EnvError(f"{env_name}: group '{name}' has no agents")
        for agent in members:
            if agent not in descs:
                raise EnvError(
                    f"{env_name}: group '{name}' names agent '{agent}', which the env does not "
                    f"have; its agents are {list(descs)}"
                )
            if agent in seen:
                raise EnvError(
                    f"{env_name}: agent '{agent}' is in groups '{seen[agent]}' and '{name}'; "
                    "each agent belongs to exactly one group"
                )
            seen[agent] = name
        first = descs[members[0]]["desc"]
        for agent in members[1:]:
            d = descs[agent]["desc"]
            differ = any(d[key] != first[key] for key in ("obs_dim", "nvec", "box", "mask"))
            if differ or _image_shape(d) != _image_shape(first):
                raise EnvError(
                    f"{env_name}: group '{name}' mixes agents with different spaces: "
                    f"'{members[0]}' (observation shape {_obs_words(first)}, actions "
                    f"{first['nvec'] or first['box']}) and '{agent}' (observation shape "
                    f"{_obs_words(d)}, actions {d['nvec'] or d['box']}); a group shares one "
                    "observation and action space"
                )
        out[name] = members
    missing = [a for a in descs if a not in seen]
    if missing:
        raise EnvError(f"{env_name}: agents {missing} are in no group; add them to one")
    return out


def _byte_box(space: Any) -> bool:
    """Whether an observation space is a ``Box`` of ``uint8`` values (pixels)."""
    box = any(c.__name__ == "Box" for c in type(space).__mro__)  # (gymnasium imported lazily)
    return box and np.dtype(space.dtype) == np.uint8


def _unit_picture(desc: dict[str, Any]) -> bool:
    """Whether an agent observes a float picture (a ``Box`` of three axes) bounded by 1."""
    space = desc["obs_space"]
    if _image_shape(desc) is None or np.dtype(space.dtype).kind != "f":
        return False
    return bool(np.all(np.asarray(space.high) <= 1.0))


def _image_shape(desc: dict[str, Any]) -> tuple[int, ...] | None:
    """The shape of an agent's observation box if it is an image (three axes), else ``None``."""
    shape = desc["obs_shape"]
    return tuple(shape) if desc["obs_box"] and len(shape) == 3 else None


def _obs_words(desc: dict[str, Any]) -> str:
    return str(_image_shape(desc) or (desc["obs_dim"],))


def _make_spec(
    descs: dict[str, dict[str, Any]],
    members: dict[str, list[str]],
    state_shape: tuple[int, ...] | None,
    episode_limit: int,
    stat_names: tuple[str, ...] = STAT_NAMES,
) -> EnvSpec:
    """The spec of the grouped agents. Observations are flat ``(d,)``, except images (a
    ``Box`` of three axes), which keep their shape for ``model.encoder=cnn``; ``state_shape``:
    the env's own state's (flat, or an image's), or ``None`` for the observations joined."""
    groups = {}
    for name, agents in members.items():
        first = descs[agents[0]]["desc"]
        groups[name] = GroupSpec(
            agents=tuple(agents),
            obs_shape=_image_shape(first) or (first["obs_dim"],),
            action=ActionSpec(tuple(first["nvec"]))
            if first["box"] is None
            else ActionSpec.box(*first["box"]),
            has_action_mask=first["mask"] is not None,
        )
    if state_shape is None:
        state_shape = (sum(g.num_agents * math.prod(g.obs_shape) for g in groups.values()),)
    return EnvSpec(
        groups=groups,
        state_shape=tuple(state_shape),
        episode_limit=episode_limit,
        stat_names=stat_names,
    )


def _check_stat_names(env_name: str, names: Any) -> tuple[str, ...]:
    """The extra episode statistics as a tuple of distinct identifiers, or a one-line error."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise EnvError(
            f"{env_name}: episode_stats must be a list of names, got {names!r}; e.g. "
            "episode_stats=['success']"
        )
    out = tuple(names)
    for stat in out:
        if not (isinstance(stat, str) and stat.isidentifier()):
            raise EnvError(f"{env_name}: episode_stats names must be identifiers, got {stat!r}")
        if stat in STAT_NAMES + RESERVED_FIELDS:
            raise EnvError(
                f"{env_name}: episode_stats must not name {stat!r}: the adapter uses that name "
                "itself"
            )
    if len(set(out)) != len(out):
        raise EnvError(f"{env_name}: episode_stats names a statistic twice: {list(out)}")
    return out


def _join_index(descs: dict[str, dict[str, Any]], members: dict[str, list[str]]) -> Tensor | None:
    """Columns of the group-ordered joined observations, in ``possible_agents`` order (``None``
    when the groups already list the agents in that order)."""
    start, blocks = 0, {}
    for agents in members.values():
        for agent in agents:
            dim = descs[agent]["desc"]["obs_dim"]
            blocks[agent] = torch.arange(start, start + dim)
            start += dim
    if list(blocks) == list(descs):
        return None
    return torch.cat([blocks[a] for a in descs])


def _split_batch(
    env_name: str, num_envs: int, num_workers: int | None, envs_per_worker: int | None
) -> list[tuple[int, int]]:
    """Per worker the contiguous copies ``(lo, hi)`` it steps; ``[]`` for in-process."""

    if envs_per_worker is not None:
        if not _positive_int(envs_per_worker):
            raise EnvError(
                f"{env_name}: envs_per_worker must be a positive integer, got {envs_per_worker!r}"
            )
        needed = -(-num_envs // envs_per_worker)
        if num_workers is None:
            num_workers = needed
        elif num_workers != needed:
            raise EnvError(
                f"{env_name}: {num_workers} workers x {envs_per_worker} envs per worker do not "
                f"make num_envs={num_envs}; set only one of num_workers and envs_per_worker"
            )
    if num_workers is None:
        num_workers = min(num_envs, os.cpu_count() or 1)
    if not (isinstance(num_workers, int) and not isinstance(num_workers, bool)) or num_workers < 0:
        raise EnvError(
            f"{env_name}: num_workers must be a non-negative integer (0 = in-process), got "
            f"{num_workers!r}"
        )
    if num_workers > num_envs:
        raise EnvError(
            f"{env_name}: num_workers={num_workers} is more than num_envs={num_envs}; use at most "
            "one worker per env"
        )
    if num_workers == 0:
        return []
    base, extra = divmod(num_envs, num_workers)
    bounds = np.cumsum([0] + [base + 1] * extra + [base] * (num_workers - extra))
    return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
