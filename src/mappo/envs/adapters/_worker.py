"""The part of the adapters that steps Python environments and writes their output into arrays.

This module imports only the standard library and numpy (Gymnasium lazily, for spaces); it never
imports torch or the rest of ``mappo``. Worker processes execute it as a script through
:func:`runpy.run_path` instead of importing it as ``mappo.envs.adapters._worker``: importing it
as a package module would run ``mappo/envs/__init__.py``, which imports torch (about a second of
CPU per worker under the ``spawn`` start method). The main process imports it as a normal module
for the in-process mode (``num_workers=0``) and for the functions it shares with the workers.

Everything is written for the PettingZoo ``ParallelEnv`` protocol (``possible_agents``,
``agents``, ``observation_space(agent)``, ``action_space(agent)``, ``reset(seed) -> (obs,
infos)``, ``step(actions) -> (obs, rewards, terminations, truncations, infos)``, all dicts keyed
by agent). A Gymnasium environment with ``Tuple`` spaces is first wrapped into that protocol by
:class:`TupleEnvAsParallel`.

Buffers (``E`` = copies handled here, ``n`` = agents in a group, ``d`` = flat observation size,
``k`` = action heads, ``m`` = action-mask width, ``S`` = state size), one set per group ``g``:
``obs/g`` and ``final_obs/g`` ``[E, n, d]`` float32, ``reward/g`` ``[E, n]`` float32, ``alive/g``
``[E, n]`` bool, ``mask/g`` ``[E, n, m]`` bool, ``action/g`` ``[E, n, k]`` int64 (``[E, n, d]``
float32 for a Box action space); and per copy:
``state``/``final_state`` ``[E, S]`` float32, ``terminated``/``truncated`` ``[E]`` bool,
``episode_return``/``episode_length`` and each extra episode statistic ``[E]`` float32.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import os
import pickle
import signal
import threading
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

WORKER_RUN_NAME = "__mappo_env_worker__"
"""``run_name`` under which a worker process executes this file (see the module docstring)."""

OK = b"k"
"""A worker's reply to a command that succeeded; a failure is ``b"e"`` + a pickled dict."""

FRAME = b"f"
"""The prefix of a reply to ``RENDER``: ``FRAME`` + the frame in ``.npy`` format."""

STEP = b"s"
RESET = b"r"
RENDER = b"d"
CLOSE = b"c"

Factory = tuple[str, Any, dict[str, Any]]
"""How to build one environment, as plain picklable data: ``(kind, target, kwargs)`` with kind
``"callable"`` (target: a picklable callable), ``"import"`` (target: ``"pkg.module"`` or
``"pkg.module:attr"``; a bare module means its ``parallel_env``) or ``"gymnasium"`` (target: a
Gymnasium id, optionally ``"package:EnvId"`` so that Gymnasium imports the package first)."""


class EnvOutputFault(Exception):
    """An environment returned a malformed observation, reward, mask or state."""


_RETURNS = {
    "reset": "(observations, infos)",
    "step": "(observations, rewards, terminations, truncations, infos)",
}


def _returned(result: Any, method: str, count: int) -> tuple:
    """``result`` of the env's ``method`` as the tuple of ``count`` values the API asks for, or
    an :class:`EnvOutputFault` saying what came instead (an older API's 4-tuple step, a reset
    without its infos)."""
    if isinstance(result, tuple) and len(result) == count:
        return result
    got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
    raise EnvOutputFault(f"{method}() must return {_RETURNS[method]}, got {got}")


def _each(obs: Any, n: int, method: str) -> Any:
    """A Tuple-space env's per-agent observations, checked to be one per agent."""
    try:
        count = len(obs)
    except TypeError:
        count = None
    if count != n:
        raise EnvOutputFault(
            f"{method}() returned {'no sequence' if count is None else count} observation"
            f"{'' if count == 1 else 's'} for {n} agents; a Tuple observation space asks for "
            "one per agent"
        )
    return obs


# -- building environments ----------------------------------------------------------------------
def import_attr(target: str, default_attr: str) -> Any:
    """``"pkg.mod:attr.sub"`` -> that object; ``"pkg.mod"`` -> ``pkg.mod.<default_attr>``."""
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in (attr or default_attr).split("."):
        obj = getattr(obj, part)
    return obj


def make_env(factory: Factory, wrap: str) -> Any:
    """Build one environment and return it in the ParallelEnv protocol."""
    kind, target, kwargs = factory
    if kind == "callable":
        env = target(**kwargs)
    elif kind == "import":
        env = import_attr(target, "parallel_env")(**kwargs)
    elif kind == "gymnasium":
        import gymnasium

        # Multi-agent Tuple envs return reward lists, which Gymnasium's single-agent checker
        # warns about on every make; the user can still ask for it explicitly.
        env = gymnasium.make(
            _own_step_limit(target, kwargs), **{"disable_env_checker": True, **kwargs}
        )
    else:
        raise ValueError(f"unknown environment factory kind {kind!r}")
    return TupleEnvAsParallel(env) if wrap == "tuple" else env


def _own_step_limit(target: str, kwargs: dict[str, Any]) -> Any:
    """``target``, or its registered spec with ``max_episode_steps`` among the env's own keyword
    arguments where its registration passes one of that name (LBF: ``gymnasium.make`` keeps the
    word for its own TimeLimit wrapper, and the env would still end every episode at its
    registered 50)."""
    if kwargs.get("max_episode_steps") is None:  # (None: the registered limit)
        return target
    import dataclasses

    import gymnasium

    module, _, env_id = target.rpartition(":")
    if module:
        importlib.import_module(module)
    try:
        spec = gymnasium.spec(env_id)
    except gymnasium.error.Error:
        return target  # gymnasium.make names the problem
    if "max_episode_steps" not in spec.kwargs:
        return target
    own = {**spec.kwargs, "max_episode_steps": kwargs["max_episode_steps"]}
    return dataclasses.replace(spec, kwargs=own)


class TupleEnvAsParallel:
    """A Gymnasium multi-agent env with ``Tuple`` spaces, seen through the ParallelEnv protocol.

    Conventions of the Tuple-space envs (``lbforaging``, ``rware``): ``observation_space`` and
    ``action_space`` are ``Tuple`` of per-agent spaces; ``step`` takes a tuple of per-agent
    actions and returns a tuple of observations, a list of rewards (a scalar is shared by all
    agents) and ``terminated``/``truncated`` as one bool for the whole env or one bool per agent.
    Agents are named ``agent_0 ... agent_{n-1}``. Per-agent action masks are read from
    ``info["action_mask"]`` (``[n, sum(nvec)]``) where the env provides them.
    """

    def __init__(self, env: Any) -> None:
        from gymnasium import spaces

        obs_space, act_space = env.observation_space, env.action_space
        if not isinstance(obs_space, spaces.Tuple) or not isinstance(act_space, spaces.Tuple):
            # not TypeError: the adapter reads that as a bad keyword argument of the env
            raise ValueError(
                f"expected observation and action spaces of type gymnasium.spaces.Tuple (one "
                f"entry per agent), got {type(obs_space).__name__} and "
                f"{type(act_space).__name__}"
            )
        if len(obs_space.spaces) != len(act_space.spaces):
            raise ValueError(
                f"the observation Tuple has {len(obs_space.spaces)} entries but the action "
                f"Tuple has {len(act_space.spaces)}; both need one entry per agent"
            )
        self.env = env
        self.possible_agents = [f"agent_{i}" for i in range(len(obs_space.spaces))]
        self.agents: list[str] = []
        self._obs_spaces = dict(zip(self.possible_agents, obs_space.spaces, strict=True))
        self._act_spaces = dict(zip(self.possible_agents, act_space.spaces, strict=True))
        # An agent that is done still needs an entry in the action tuple: its first action.
        self._filler = tuple(_first_action(s) for s in act_space.spaces)

    def observation_space(self, agent: str) -> Any:
        return self._obs_spaces[agent]

    def action_space(self, agent: str) -> Any:
        return self._act_spaces[agent]

    @property
    def unwrapped(self) -> Any:
        return self.env.unwrapped

    def reset(
        self, seed: int | None = None, options: dict | None = None
    ) -> tuple[dict[str, Any], dict[str, dict]]:
        obs, info = _returned(self.env.reset(seed=seed, options=options), "reset", 2)
        self.agents = list(self.possible_agents)
        return dict(
            zip(self.possible_agents, _each(obs, len(self.agents), "reset"), strict=True)
        ), (self._infos(info))

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        joint = tuple(
            actions.get(a, f) for a, f in zip(self.possible_agents, self._filler, strict=True)
        )
        obs, reward, terminated, truncated, info = _returned(self.env.step(joint), "step", 5)
        n = len(self.possible_agents)
        obs = _each(obs, n, "step")
        rewards = np.asarray(reward, dtype=np.float64)
        if rewards.ndim == 0:
            rewards = np.full(n, float(rewards))
        if rewards.shape != (n,):
            raise EnvOutputFault(
                f"step() returned rewards of shape {rewards.shape}; expected a scalar or one "
                f"reward per agent ({n})"
            )
        term = _per_agent(terminated, n, "terminated")
        trunc = _per_agent(truncated, n, "truncated")
        agents = self.possible_agents
        alive = set(self.agents)
        self.agents = [a for i, a in enumerate(agents) if a in alive and not (term[i] or trunc[i])]
        return (
            dict(zip(agents, obs, strict=True)),
            dict(zip(agents, rewards.tolist(), strict=True)),
            dict(zip(agents, term, strict=True)),
            dict(zip(agents, trunc, strict=True)),
            self._infos(info),
        )

    def state(self) -> np.ndarray:
        raise NotImplementedError("Tuple-space Gymnasium envs define no global state")

    def render(self) -> Any:
        """The env drawn as an ``[H, W, 3]`` frame. The Tuple-space envs draw with the older
        ``render(mode="rgb_array")`` (lbforaging advertises only ``human`` but returns the
        frame; rware takes both); one with Gymnasium's ``render()`` is asked that way."""
        render = self.env.unwrapped.render
        try:
            return render(mode="rgb_array")
        except TypeError as err:
            if "mode" not in str(err):
                raise
            return render()

    def close(self) -> None:
        self.env.close()

    def _infos(self, info: dict) -> dict[str, dict]:
        masks = info.get("action_mask") if isinstance(info, dict) else None
        if masks is None:
            return {a: {} for a in self.possible_agents}
        return {a: {"action_mask": m} for a, m in zip(self.possible_agents, masks, strict=True)}


def _first_action(space: Any) -> Any:
    if hasattr(space, "low") and hasattr(space, "high"):  # a Box: the point nearest zero
        return np.clip(np.zeros(space.shape), space.low, space.high).astype(space.dtype)
    start = getattr(space, "start", 0)
    return start if np.ndim(start) == 0 and not hasattr(space, "nvec") else np.asarray(start)


def _per_agent(flag: Any, n: int, what: str) -> list[bool]:
    """A whole-env bool or a per-agent sequence of bools -> one bool per agent."""
    values = np.asarray(flag, dtype=bool)
    if values.ndim == 0:
        return [bool(values)] * n
    if values.shape != (n,):
        raise EnvOutputFault(
            f"step() returned '{what}' of shape {values.shape}; expected () or ({n},)"
        )
    return values.tolist()


# -- describing agents --------------------------------------------------------------------------
def describe_agent(agent: str, obs_space: Any, act_space: Any) -> dict[str, Any]:
    """How to flatten an agent's observations and translate its actions (plain picklable data).

    Raises ``ValueError`` (with a one-line reason) for unsupported action spaces.
    """
    from gymnasium import spaces

    box: tuple[list[float], list[float]] | None = None
    if isinstance(act_space, spaces.Box):
        # A box of any shape is flattened to d components (C order) and reshaped on the way
        # back; bounds stay per component.
        act_kind, nvec, start = "box", (), None
        low = np.asarray(act_space.low, dtype=np.float64).reshape(-1)
        high = np.asarray(act_space.high, dtype=np.float64).reshape(-1)
        if low.size == 0:
            raise ValueError(f"agent '{agent}' has an empty Box action space {act_space}")
        if not np.issubdtype(act_space.dtype, np.floating):
            raise ValueError(
                f"agent '{agent}' has a Box action space of dtype {act_space.dtype}; continuous "
                "actions need a floating Box (use Discrete or MultiDiscrete for integers)"
            )
        box = (low.tolist(), high.tolist())
    elif isinstance(act_space, spaces.Discrete):
        act_kind, nvec, start = "discrete", (int(act_space.n),), int(act_space.start)
    elif isinstance(act_space, spaces.MultiDiscrete):
        if act_space.nvec.ndim != 1:
            raise ValueError(
                f"agent '{agent}' has a MultiDiscrete action space of shape "
                f"{act_space.nvec.shape}; only one-dimensional MultiDiscrete spaces are supported"
            )
        act_kind, nvec, start = "multi", tuple(int(v) for v in act_space.nvec), act_space.start
    else:
        raise ValueError(
            f"agent '{agent}' has action space {act_space}; the adapters support Discrete, "
            "MultiDiscrete and Box action spaces"
        )
    value_space, obs_key = obs_space, None
    mask_from_obs = isinstance(obs_space, spaces.Dict) and "action_mask" in obs_space.spaces
    if mask_from_obs:
        # PettingZoo's convention for masked actions: {"observation": ..., "action_mask": ...}.
        if "observation" in obs_space.spaces:
            value_space, obs_key = obs_space["observation"], "observation"
        else:
            rest = {k: v for k, v in obs_space.spaces.items() if k != "action_mask"}
            value_space, obs_key = spaces.Dict(rest), "rest"
        mask_width = int(np.prod(obs_space["action_mask"].shape))
        if box is not None:
            raise ValueError(
                f"agent '{agent}' has a Box action space and an action_mask; masks apply to "
                "discrete actions only"
            )
        if mask_width != sum(nvec):
            raise ValueError(
                f"agent '{agent}' has an action_mask of {mask_width} entries but its action "
                f"space {act_space} needs {sum(nvec)} (one per action of every head)"
            )
    is_box = isinstance(value_space, spaces.Box)
    return {
        "agent": agent,
        "obs_space": value_space,
        "obs_key": obs_key,
        "obs_box": is_box,
        "obs_shape": tuple(value_space.shape) if is_box else None,
        "obs_dim": int(spaces.flatdim(value_space)),
        "mask": "obs" if mask_from_obs else None,
        "act_kind": act_kind,
        "nvec": nvec,
        "box": box,
        "act_shape": tuple(act_space.shape) if box is not None else None,
        "act_dtype": str(act_space.dtype) if box is not None else None,
        "act_start": start,
    }


def described(value: Any) -> str:
    """What an env returned, in a few words for an error: its type, and its shape where it
    has one (``ndarray of shape (9,)``, ``dict with keys ['obs']``)."""
    kind = type(value).__name__
    if isinstance(value, dict):
        return f"{kind} with keys {sorted(map(str, value))}"
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{kind} of shape {tuple(shape)}"
    if isinstance(value, (list, tuple)):
        return f"{kind} of length {len(value)}"
    return kind


def flat_observation(desc: dict[str, Any], value: Any) -> np.ndarray:
    """One agent's observation (without its action mask) as a flat float32 vector."""
    if desc["mask"] == "obs":
        if desc["obs_key"] == "observation":
            value = value["observation"]
        else:
            value = {k: v for k, v in value.items() if k != "action_mask"}
    if desc["obs_box"]:
        return np.asarray(value, dtype=np.float32).reshape(-1)
    from gymnasium import spaces

    return np.asarray(spaces.flatten(desc["obs_space"], value), dtype=np.float32).reshape(-1)


def infer_episode_limit(env: Any) -> int | None:
    """The smallest step limit an env declares (Gymnasium ``spec.max_episode_steps``, PettingZoo
    MPE's ``max_cycles``, RWARE's ``max_steps``, LBF's ``_max_episode_steps``, PettingZoo SISL's
    game's ``max_cycles``...), or ``None``."""
    inner = env.env if isinstance(env, TupleEnvAsParallel) else env
    found: list[int] = []
    spec = getattr(inner, "spec", None)
    limit = getattr(spec, "max_episode_steps", None)
    if isinstance(limit, int) and limit > 0:
        found.append(limit)
    unwrapped = getattr(inner, "unwrapped", None)
    # (PettingZoo's SISL and butterfly envs keep max_cycles on the game their class wraps)
    for obj in (inner, unwrapped, getattr(unwrapped, "env", None)):
        for attr in ("max_cycles", "max_steps", "max_episode_steps", "_max_episode_steps"):
            try:
                value = getattr(obj, attr, None)
            except Exception:  # some wrappers refuse access to private attributes loudly
                value = None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.append(value)
    return min(found) if found else None


# -- shared buffers -----------------------------------------------------------------------------
def buffer_layout(
    fields: dict[str, tuple[tuple[int, ...], str]],
) -> tuple[dict[str, tuple[int, tuple[int, ...], str]], int]:
    """Place named arrays ``name -> (shape, dtype)`` in one buffer, each 64-byte aligned.

    Returns ``name -> (offset, shape, dtype)`` and the total size in bytes.
    """
    layout: dict[str, tuple[int, tuple[int, ...], str]] = {}
    offset = 0
    for name, (shape, dtype) in fields.items():
        layout[name] = (offset, shape, dtype)
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        offset += (size + 63) // 64 * 64
    return layout, offset


def buffer_views(buf: Any, layout: dict[str, tuple[int, tuple[int, ...], str]]) -> dict:
    """numpy views of the arrays of ``layout`` on the buffer ``buf`` (no copy)."""
    return {
        name: np.ndarray(shape, dtype=dtype, buffer=buf, offset=offset)
        for name, (offset, shape, dtype) in layout.items()
    }


# -- stepping a slice of the batch --------------------------------------------------------------
class _Slot:
    """Where one agent's data lives: its group, its index in the group, and its conversions."""

    __slots__ = (
        "agent",
        "group",
        "index",
        "space",
        "obs_key",
        "box_shape",
        "dim",
        "mask",
        "mask_heads",
        "discrete",
        "kind",
        "act_shape",
        "act_dtype",
        "act_low",
        "act_high",
        "start",
    )

    def __init__(self, group: str, index: int, desc: dict[str, Any], mask: str | None) -> None:
        self.agent: str = desc["agent"]
        self.group = group
        self.index = index
        self.space = desc["obs_space"]
        self.obs_key: str | None = desc["obs_key"]
        self.box_shape: tuple[int, ...] | None = desc["obs_shape"] if desc["obs_box"] else None
        self.dim: int = desc["obs_dim"]
        self.mask = mask
        bounds = np.cumsum((0,) + tuple(desc["nvec"]))
        self.mask_heads = [
            slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        self.kind: str = desc["act_kind"]
        self.discrete = self.kind == "discrete"
        self.act_shape: tuple[int, ...] | None = desc["act_shape"]
        self.act_dtype = np.dtype(desc["act_dtype"]) if desc["act_dtype"] else None
        self.act_low = self.act_high = None
        if desc["box"] is not None:
            shape, dtype = self.act_shape, self.act_dtype
            self.act_low = np.asarray(desc["box"][0], dtype=dtype).reshape(shape)
            self.act_high = np.asarray(desc["box"][1], dtype=dtype).reshape(shape)
        self.start = (
            desc["act_start"] if self.kind in ("discrete", "box") else np.asarray(desc["act_start"])
        )

    def env_action(self, row: list[int] | list[float]) -> Any:
        """One agent's action ``[k]`` (indices from 0), or ``[d]`` floats for a box -> what its
        action space expects (the box's shape and dtype)."""
        if self.discrete:
            return row[0] + self.start
        if self.kind == "box":
            # Clipped again in the box's own dtype: float32 bounds rounded outward by the policy
            # would otherwise put an action a hair outside a float64 box.
            action = np.asarray(row, dtype=self.act_dtype).reshape(self.act_shape)
            return np.clip(action, self.act_low, self.act_high)
        return np.asarray(row, dtype=np.int64) + self.start


class EnvRunner:
    """Steps copies ``lo .. hi - 1`` of the batch and writes their output into ``arrays``.

    ``arrays`` holds the whole batch (see the module docstring); this runner touches only its
    rows. Copy ``i`` is reset with seed :func:`copy_seed` ``(seed, i)`` by :meth:`reset`.
    ``config`` is built by the main process: ``env_name``, ``groups`` (``[(name, [agent
    descriptions])]``), ``mask_modes`` (group -> ``None``/``"obs"``/``"info"``), ``state_dim``
    (``None``: the main process concatenates observations instead), ``episode_limit``,
    ``truncate_at_limit``,
    ``check_finite``, ``episode_stats`` (names read from the infos of an episode's last step).
    """

    def __init__(
        self, factory: Factory, wrap: str, config: dict[str, Any], arrays: dict, lo: int, hi: int
    ) -> None:
        self.name: str = config["env_name"]
        self.lo = lo
        self.limit: int | None = config["episode_limit"]
        self.truncate_at_limit: bool = config["truncate_at_limit"]
        self.check: bool = config["check_finite"]
        self.state_dim: int | None = config["state_dim"]
        self.groups = [name for name, _ in config["groups"]]
        self.slots: dict[str, _Slot] = {}
        for group, descs in config["groups"]:
            for j, desc in enumerate(descs):
                self.slots[desc["agent"]] = _Slot(group, j, desc, config["mask_modes"][group])
        self.num_agents = len(self.slots)

        def rows(key: str) -> np.ndarray:
            return arrays[key][lo:hi]

        self.obs = {g: rows(f"obs/{g}") for g in self.groups}
        self.final_obs = {g: rows(f"final_obs/{g}") for g in self.groups}
        self.reward = {g: rows(f"reward/{g}") for g in self.groups}
        self.alive = {g: rows(f"alive/{g}") for g in self.groups}
        self.agent_terminated = {g: rows(f"agent_terminated/{g}") for g in self.groups}
        self.action = {g: rows(f"action/{g}") for g in self.groups}
        self.mask = {g: rows(f"mask/{g}") for g in self.groups if f"mask/{g}" in arrays}
        self.state = rows("state") if self.state_dim is not None else None
        self.final_state = rows("final_state") if self.state_dim is not None else None
        self.terminated = rows("terminated")
        self.truncated = rows("truncated")
        self.episode_return = rows("episode_return")
        self.episode_length = rows("episode_length")
        self.extra_stats = {name: rows(name) for name in config.get("episode_stats", ())}
        self.returns = np.zeros(hi - lo, dtype=np.float64)
        self.lengths = np.zeros(hi - lo, dtype=np.int64)
        # per copy, the agents whose termination or truncation came in an episode still going on
        self.ended: list[set[str]] = [set() for _ in range(hi - lo)]
        self.current: int | None = None
        """Batch index of the copy being stepped (for error reports)."""
        self.method = "reset"
        """The env method being called, for error reports (a step's auto-reset calls reset)."""
        self.envs: list[Any] = []
        for _ in range(hi - lo):
            self.envs.append(make_env(factory, wrap))

    # -- commands ---------------------------------------------------------------------------
    def reset(self, seed: int | None) -> None:
        """Reset every copy; copy ``i`` gets :func:`copy_seed` ``(seed, i)`` (``None``: continue
        its RNG)."""
        self._clear_step_outputs()
        for li, env in enumerate(self.envs):
            self.current = self.lo + li
            self._reset_env(li, env, None if seed is None else copy_seed(seed, self.lo + li))
        self.current = None
        if self.check:
            self._check_finite()

    def step(self) -> None:
        """Step every copy with the actions in ``action/g``; auto-reset the copies that end."""
        actions = {g: a.tolist() for g, a in self.action.items()}
        self._clear_step_outputs()
        slots = self.slots
        for li, env in enumerate(self.envs):
            self.current = self.lo + li
            self.method = "step"
            joint = {}
            for agent in env.agents:
                if agent in self.ended[li]:
                    # (its rewards would be trained on while it is marked not alive)
                    raise self._fault(
                        li,
                        agent,
                        "is still in env.agents after its termination or truncation was "
                        "reported; a ParallelEnv removes ended agents from env.agents",
                    )
                slot = slots.get(agent) or self._slot(li, agent)
                joint[agent] = slot.env_action(actions[slot.group][li][slot.index])
            obs, rewards, terms, truncs, infos = _returned(env.step(joint), "step", 5)
            self._after_step(li, env, joint, obs, rewards, terms, truncs, infos)
        self.current = None
        if self.check:
            self._check_finite()

    def render(self, index: int) -> np.ndarray | None:
        """Copy ``index`` (of the whole batch) drawn by its env's ``render()``: ``[H, W, 3]``
        uint8, or ``None`` where the env returns nothing."""
        self.method = "render"
        frame = self.envs[index - self.lo].render()
        if frame is None:
            return None
        frame = np.asarray(frame)
        if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            raise ValueError(
                f"render() returned shape {frame.shape} and dtype {frame.dtype}; "
                "an [H, W, 3] uint8 frame is needed"
            )
        return frame

    def close(self) -> None:
        for env in self.envs:
            try:
                env.close()
            except Exception:  # closing is best effort: the process may be going away anyway
                pass
        self.envs = []

    # -- internals --------------------------------------------------------------------------
    def _clear_step_outputs(self) -> None:
        # Absent agents (dead, or not yet spawned) read as zero observation, zero reward and
        # not alive: the death masking of the MAPPO paper (Yu et al. 2022, "death masking").
        for g in self.groups:
            self.obs[g].fill(0.0)
            self.reward[g].fill(0.0)
            self.alive[g].fill(False)
            self.agent_terminated[g].fill(False)
        for m in self.mask.values():
            m.fill(True)  # an absent agent's action is ignored; all-allowed keeps it samplable
        self.terminated.fill(False)
        self.truncated.fill(False)
        self.episode_return.fill(0.0)
        self.episode_length.fill(0.0)
        for values in self.extra_stats.values():
            values.fill(0.0)

    def _after_step(
        self,
        li: int,
        env: Any,
        acted: dict,
        obs: dict,
        rewards: dict,
        terms: dict,
        truncs: dict,
        infos: dict,
    ) -> None:
        """Write what ``env.step(acted)`` returned. Only the agents that acted (``acted``'s
        keys) have a reward, a termination and a final observation: many envs keep reporting
        agents that already left, whose rewards belong to no action of theirs."""
        for agent in rewards:
            self._slot(li, agent)  # an agent the env never declared is an error
        total = 0.0
        for agent in acted:
            slot = self._slot(li, agent)
            if agent not in rewards:
                raise self._fault(li, agent, "acted but the env returned no reward for it")
            r = rewards[agent]
            if not isinstance(r, (int, float, np.integer, np.floating, np.bool_)):
                if not (isinstance(r, np.ndarray) and r.ndim == 0 and r.dtype.kind in "biuf"):
                    raise self._fault(
                        li,
                        agent,
                        f"returned a reward of {_describe(r)}; a reward is one number (a Python "
                        "or numpy scalar)",
                    )
            r = float(r)
            self.reward[slot.group][li, slot.index] = r
            total += r
            if terms.get(agent, False):
                # Its own episode is over, even where the env goes on or is truncated: no
                # bootstrap past this step (PettingZoo's per-agent terminations).
                self.agent_terminated[slot.group][li, slot.index] = True
        self.returns[li] += total / self.num_agents
        self.lengths[li] += 1
        live = [a for a in env.agents if not (terms.get(a, False) or truncs.get(a, False))]
        self.ended[li].update(a for a in acted if terms.get(a, False) or truncs.get(a, False))
        at_limit = self.limit is not None and self.lengths[li] >= self.limit
        if live and not at_limit:
            self._write_agents(li, obs, infos, live, self.obs, as_next=True)
            if self.state is not None:
                self._write_state(li, env, self.state)
            return
        # The episode is over: the env said so (every agent done, or none left), or it reached
        # the step limit. LBF and RWARE end on their limit with terminated=True; a time limit is
        # a truncation (Pardo et al. 2018, "Time Limits in Reinforcement Learning").
        if at_limit and (live or self.truncate_at_limit):
            truncated = True
            # the agents' terminations on this step are the env's way of ending at its limit
            for g in self.groups:
                self.agent_terminated[g][li] = False
        else:
            truncated = any(bool(v) for v in truncs.values())
        self.terminated[li] = not truncated
        self.truncated[li] = truncated
        for g in self.groups:
            self.final_obs[g][li] = 0.0
        ended_on = [a for a in obs if a in acted]
        self._write_agents(li, obs, infos, ended_on, self.final_obs, as_next=False)
        if self.final_state is not None:
            self._write_state(li, env, self.final_state)
        self.episode_return[li] = self.returns[li]
        self.episode_length[li] = self.lengths[li]
        for name, values in self.extra_stats.items():
            values[li] = self._episode_stat(li, infos, name, required=not live)
        self._reset_env(li, env, None)

    def _episode_stat(self, li: int, infos: dict, name: str, required: bool) -> float:
        """The statistic ``name`` from the first agent info of the last step that has it.

        ``required``: the env ended the episode itself, so it must report the statistic; an
        episode the adapter cut at ``episode_limit`` reads 0 where the env reports nothing."""
        for info in infos.values():
            if isinstance(info, dict) and name in info:
                try:
                    return float(info[name])
                except (TypeError, ValueError):
                    raise EnvOutputFault(
                        f"{self.name}: copy {self.lo + li}: episode statistic {name!r} is "
                        f"{info[name]!r}, not a number"
                    ) from None
        if not required:
            return 0.0
        raise EnvOutputFault(
            f"{self.name}: copy {self.lo + li}: episode statistic {name!r} is in no agent's "
            "info on the step that ended the episode; report it there or drop it from "
            "episode_stats"
        )

    def _reset_env(self, li: int, env: Any, seed: int | None) -> None:
        self.method = "reset"
        obs, infos = _returned(env.reset(seed=seed), "reset", 2)
        self.ended[li].clear()
        self.returns[li] = 0.0
        self.lengths[li] = 0
        for g in self.groups:
            self.obs[g][li] = 0.0
            self.alive[g][li] = False
        for m in self.mask.values():
            m[li] = True
        self._write_agents(li, obs, infos, list(env.agents), self.obs, as_next=True)
        if self.state is not None:
            self._write_state(li, env, self.state)

    def _slot(self, li: int, agent: str) -> _Slot:
        try:
            return self.slots[agent]
        except KeyError:
            raise self._fault(li, agent, "is not one of the env's possible_agents") from None

    def _write_agents(
        self, li: int, obs: dict, infos: dict, agents: Sequence[str], target: dict, as_next: bool
    ) -> None:
        """Write the observations (and, for the next step, alive flags and masks) of ``agents``."""
        for agent in agents:
            slot = self._slot(li, agent)
            if agent not in obs:
                raise self._fault(li, agent, "is active but the env returned no observation for it")
            value = obs[agent]
            mask = None
            if slot.mask == "obs":
                if not isinstance(value, dict) or "action_mask" not in value:
                    raise self._fault(li, agent, "returned an observation without 'action_mask'")
                mask = value["action_mask"]
                if slot.obs_key == "observation":
                    value = value["observation"]
                else:
                    value = {k: v for k, v in value.items() if k != "action_mask"}
            elif slot.mask == "info":
                mask = (infos.get(agent) or {}).get("action_mask")
                if mask is None and as_next:
                    raise self._fault(
                        li,
                        agent,
                        "acts next but its info has no 'action_mask' (its first reset's info "
                        "had one: an agent with masks in its infos needs one in every info)",
                    )
            elif as_next and "action_mask" in (infos.get(agent) or {}):
                raise self._fault(
                    li,
                    agent,
                    "has an 'action_mask' in its info, but its first reset's info had none, so "
                    "masks are not read for it; put the mask in every info, reset's included",
                )
            self._write_obs(li, slot, value, target[slot.group][li, slot.index])
            if as_next:
                self.alive[slot.group][li, slot.index] = True
                if mask is not None:
                    self._write_mask(li, slot, mask)

    def _write_obs(self, li: int, slot: _Slot, value: Any, out: np.ndarray) -> None:
        if slot.box_shape is not None:
            arr = np.asarray(value)
            if arr.shape != slot.box_shape:
                raise self._fault(
                    li,
                    slot.agent,
                    f"returned an observation of shape {arr.shape}; its observation_space "
                    f"has shape {slot.box_shape}",
                )
            out[:] = arr.reshape(-1)
            return
        from gymnasium import spaces

        try:
            flat = np.asarray(spaces.flatten(slot.space, value), dtype=np.float32).reshape(-1)
        except Exception as err:
            raise self._fault(
                li,
                slot.agent,
                f"returned an observation that does not fit {slot.space} (it returned "
                f"{described(value)}: {type(err).__name__}: {err})",
            ) from err
        if flat.size != slot.dim:
            raise self._fault(
                li,
                slot.agent,
                f"returned an observation of {flat.size} values; {slot.space} has {slot.dim}",
            )
        out[:] = flat

    def _write_mask(self, li: int, slot: _Slot, mask: Any) -> None:
        if isinstance(mask, (tuple, list)):
            mask = np.concatenate([np.ravel(np.asarray(m)) for m in mask])
        flat = np.asarray(mask).astype(bool).reshape(-1)
        row = self.mask[slot.group][li, slot.index]
        if flat.size != row.size:
            raise self._fault(
                li,
                slot.agent,
                f"returned an action mask of {flat.size} entries; expected {row.size}",
            )
        for head in slot.mask_heads:
            if not flat[head].any():
                raise self._fault(li, slot.agent, "is alive but its action mask allows no action")
        row[:] = flat

    def _write_state(self, li: int, env: Any, target: np.ndarray) -> None:
        state = np.asarray(env.state(), dtype=np.float32).reshape(-1)
        if state.size != self.state_dim:
            raise EnvOutputFault(
                f"{self.name}: copy {self.lo + li} of the batch returned a state() of "
                f"{state.size} values; the first state had {self.state_dim}"
            )
        target[li] = state

    def _check_finite(self) -> None:
        """Refuse NaN/inf in what the trainer would learn from, naming the agent."""
        done = self.terminated | self.truncated
        for g in self.groups:
            for what, arr in (("observation", self.obs[g]), ("reward", self.reward[g])):
                self._check_array(g, what, arr)
            if done.any():
                final = np.where(done[:, None, None], self.final_obs[g], 0.0)
                self._check_array(g, "final observation", final)
        for what, arr in (("state", self.state), ("final state", self.final_state)):
            if arr is not None and not np.isfinite(arr).all():
                li = int(np.argwhere(~np.isfinite(arr))[0][0])
                raise EnvOutputFault(
                    f"{self.name}: copy {self.lo + li} of the batch returned a {what} with "
                    "NaN or inf values"
                )

    def _check_array(self, group: str, what: str, arr: np.ndarray) -> None:
        if np.isfinite(arr).all():
            return
        li, j = (int(i) for i in np.argwhere(~np.isfinite(arr))[0][:2])
        agent = next(s.agent for s in self.slots.values() if s.group == group and s.index == j)
        article = "an" if what[0] in "aeiou" else "a"
        raise self._fault(li, agent, f"returned {article} {what} with NaN or inf values")

    def _fault(self, li: int, agent: str, what: str) -> EnvOutputFault:
        return EnvOutputFault(
            f"{self.name}: agent '{agent}' in copy {self.lo + li} of the batch {what}"
        )


# -- the worker process -------------------------------------------------------------------------
def copy_seed(seed: int, index: int) -> int:
    """The seed that copy ``index`` of a batch reset with ``seed`` gets: a hash of both (numpy's
    ``SeedSequence``), so that the copies of two seeds share no stream (with ``seed + index``,
    seeds 1 and 2 of a 10-copy batch shared nine; and so did an evaluation's copies with the
    next evaluation's)."""
    entropy = [seed % 2**64, index]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint32)[0])


def _describe(value: Any) -> str:
    """A short description of a value that is not what the adapter expected."""
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    text = repr(value)
    return f"{text[:60]}... ({type(value).__name__})" if len(text) > 60 else text


def npy_bytes(array: np.ndarray) -> bytes:
    """``array`` in ``.npy`` format (read back with ``np.load(..., allow_pickle=False)``)."""
    import io

    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def error_reply(
    err: BaseException, kind: str, env_index: int | None, method: str | None = None
) -> bytes:
    """The reply that reports ``err`` to the main process (``method``: the env method that
    raised it, where known)."""
    info = {
        "kind": kind,
        "method": method,
        "type": type(err).__name__,
        "message": str(err),
        "traceback": traceback.format_exc(),
        "env_index": env_index,
    }
    return b"e" + pickle.dumps(info)


def _exit_with_parent() -> None:
    """End this worker when the main process dies, even while an env step hangs."""
    import multiprocessing
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="mappo-parent-watch", daemon=True).start()


def worker_main(
    conn: Any,
    shm_name: str,
    layout: dict[str, tuple[int, tuple[int, ...], str]],
    factory: Factory,
    wrap: str,
    config: dict[str, Any],
    lo: int,
    hi: int,
    stack_file: str | None,
) -> None:
    """Serve commands from the main process until it sends ``CLOSE`` or goes away."""
    from multiprocessing import shared_memory

    # Ctrl-C and SIGTERM reach the whole process group; the trainer handles them (it finishes
    # its update, which needs the workers) and then stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent()
    stack_out = None
    if stack_file is not None and hasattr(signal, "SIGUSR1"):
        # On a hang the main process sends SIGUSR1 and reports where the env was stuck.
        stack_out = open(stack_file, "w", encoding="utf-8")  # noqa: SIM115 (kept open for the process lifetime)
        faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
    shm = shared_memory.SharedMemory(name=shm_name)
    runner = None
    try:
        arrays = buffer_views(shm.buf, layout)
        try:
            runner = EnvRunner(factory, wrap, config, arrays, lo, hi)
        except BaseException as err:
            conn.send_bytes(error_reply(err, "create", None))
            return
        # Everything imported so far (the main module's imports, the envs' modules) lives as
        # long as the worker: keep it out of the garbage collector's passes.
        gc.freeze()
        conn.send_bytes(OK)
        while True:
            try:
                command = conn.recv_bytes()
            except (EOFError, OSError):
                return
            if command == CLOSE:
                return
            try:
                if command == STEP:
                    runner.step()
                elif command[:1] == RENDER:
                    frame = runner.render(int(command[1:]))
                    conn.send_bytes(FRAME + (b"" if frame is None else npy_bytes(frame)))
                    continue
                else:
                    seed = command[1:]
                    runner.reset(int(seed) if seed else None)
            except EnvOutputFault as err:
                conn.send_bytes(error_reply(err, "output", runner.current))
            except BaseException as err:
                conn.send_bytes(error_reply(err, "env", runner.current, runner.method))
            else:
                conn.send_bytes(OK)
    finally:
        if runner is not None:
            runner.close()
        del runner
        arrays = None
        try:
            shm.close()
        except BufferError:
            pass
        if stack_out is not None:
            stack_out.close()


if __name__ == WORKER_RUN_NAME:
    worker_main(**globals()["WORKER_ARGS"])
