"""The ground floor: data types that every other part of the package imports downward from.

Environments, networks, losses and loops all speak in these records and import nothing sideways
or upward to get them: the environment spec (:class:`EnvSpec` and its parts), the step record
(:class:`EnvStep`), the on-policy rollout (:class:`Rollout`) and the episode batch of the replay
buffer (:class:`EpisodeBatch`). This module imports only ``torch``.

Shapes: ``E`` envs, ``n`` agents of a group, ``k`` action heads (or ``d`` continuous components),
``T`` rollout steps, ``B`` episodes, ``L`` the episode limit (+1 for the step after the last
action).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@contextlib.contextmanager
def library_defaults() -> Iterator[None]:
    """Torch's global settings that the library's code is written for, whatever the caller's:
    float32 as the default dtype (networks, states and stored rollouts are float32; a notebook
    that set float64 for its own work built float64 networks that met float32 batches) and
    gradients enabled, outside inference mode (a training call inside ``torch.no_grad()`` had
    none for its update). The caller's settings come back afterwards. The default dtype is one
    setting of the whole process: it is changed only where the caller's is not float32 already
    (so calls from several threads of a float32 process change nothing)."""
    dtype = torch.get_default_dtype()
    if dtype != torch.float32:
        torch.set_default_dtype(torch.float32)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        if dtype != torch.float32:
            torch.set_default_dtype(dtype)


# -- the environment spec and the step record -------------------------------------------------


@dataclass(frozen=True)
class ActionSpec:
    """A group's action space: discrete heads, or a box of continuous components.

    Discrete: ``Discrete(5)`` is ``ActionSpec((5,))``; the particle world's move + message is
    ``ActionSpec((5, 10))``. An action is one integer per head, ``[..., k]`` int64.

    Continuous: ``ActionSpec.box(low, high)`` with one bound per component (``-inf``/``inf``
    for an unbounded side). An action is ``[..., d]`` float32 inside ``[low, high]``.
    """

    nvec: tuple[int, ...] = ()
    low: tuple[float, ...] | None = None
    """Continuous only: the lower bound of each component (``None`` for a discrete space)."""
    high: tuple[float, ...] | None = None
    """Continuous only: the upper bound of each component."""

    def __post_init__(self) -> None:
        if (self.low is None) != (self.high is None):
            raise ValueError("a continuous ActionSpec needs both low and high")
        if self.low is None:
            if not self.nvec or min(self.nvec) < 1:
                raise ValueError(f"nvec must list positive head sizes, got {self.nvec}")
            return
        if self.nvec:
            raise ValueError("an ActionSpec is either discrete (nvec) or continuous (low/high)")
        if not self.low or len(self.low) != len(self.high):
            raise ValueError(
                f"low and high need one bound per component, got {len(self.low)} and "
                f"{len(self.high)}"
            )
        if any(math.isnan(b) for b in (*self.low, *self.high)):
            raise ValueError(
                f"the bounds hold NaN (low={self.low} high={self.high}); give numbers, or -inf "
                "and inf for an unbounded component"
            )
        if any(not lo <= hi for lo, hi in zip(self.low, self.high, strict=True)):
            raise ValueError(f"every low must be <= its high, got low={self.low} high={self.high}")

    @classmethod
    def box(cls, low: Any, high: Any) -> ActionSpec:
        """A continuous space from bounds: numbers, sequences, arrays or tensors of any shape
        (flattened in C order); a single ``low`` or ``high`` is broadcast to the other's size."""
        lo = torch.as_tensor(low, dtype=torch.float64).reshape(-1)
        hi = torch.as_tensor(high, dtype=torch.float64).reshape(-1)
        if lo.numel() == 1:
            lo = lo.expand_as(hi)
        if hi.numel() == 1:
            hi = hi.expand_as(lo)
        return cls(low=tuple(lo.tolist()), high=tuple(hi.tolist()))

    @property
    def continuous(self) -> bool:
        return self.low is not None

    @property
    def num_heads(self) -> int:
        """Numbers per agent and step: ``k`` heads, or ``d`` continuous components."""
        return len(self.nvec) if self.low is None else len(self.low)

    @property
    def total(self) -> int:
        """Width of a flat logits or mask vector (the sum of the head sizes); ``d`` for a box."""
        return int(sum(self.nvec)) if self.low is None else len(self.low)

    @property
    def dtype(self) -> torch.dtype:
        """How actions are stored: int64 for discrete heads, float32 for a box."""
        return torch.float32 if self.continuous else torch.int64

    @property
    def bounded(self) -> bool:
        """Continuous with finite bounds and a positive width on every component (what tanh
        squashing needs)."""
        if self.low is None or self.high is None:
            return False
        # (the networks hold the bounds in float32, where 1e39 is inf)
        top = float(torch.finfo(torch.float32).max)
        return all(
            abs(lo) <= top and abs(hi) <= top and hi > lo
            for lo, hi in zip(self.low, self.high, strict=True)
        )


@dataclass(frozen=True)
class GroupSpec:
    """One group of agents sharing observation and action spaces."""

    agents: tuple[str, ...]
    obs_shape: tuple[int, ...]
    action: ActionSpec
    has_action_mask: bool = False
    agent_state_shape: tuple[int, ...] | None = None
    """Shape of the agent-specific global state (the MAPPO paper's "AS" state), if any."""

    def __post_init__(self) -> None:
        if not isinstance(self.action, ActionSpec):
            raise TypeError(
                f"the action of agents {list(self.agents)} must be an ActionSpec, e.g. "
                f"ActionSpec((3,)) for 3 discrete actions, got {self.action!r}"
            )
        if self.action.continuous and self.has_action_mask:
            raise ValueError(
                f"agents {list(self.agents)} act in a continuous box, which has no action mask; "
                "set has_action_mask=False"
            )

    @property
    def num_agents(self) -> int:
        return len(self.agents)


@dataclass(frozen=True)
class EnvSpec:
    """Everything the trainer needs to know before the first step."""

    groups: dict[str, GroupSpec]
    state_shape: tuple[int, ...]
    episode_limit: int
    stat_names: tuple[str, ...] = ()
    """Names of the per-env episode statistics reported in :attr:`EnvStep.stats`."""

    @property
    def num_agents(self) -> int:
        return sum(g.num_agents for g in self.groups.values())


class LazyGroups(Mapping[str, Tensor]):
    """A read-only per-group mapping whose tensors are computed on first access and kept.

    For outputs that cost a real share of a step and that most consumers never read, such as the
    pre-reset agent-specific state of a large map. ``makers`` maps each group to a function of no
    arguments that returns its tensor.
    """

    def __init__(self, makers: Mapping[str, Callable[[], Tensor]]) -> None:
        self._makers = dict(makers)
        self._done: dict[str, Tensor] = {}

    def __getitem__(self, key: str) -> Tensor:
        if key not in self._done:
            self._done[key] = self._makers[key]()
        return self._done[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


@dataclass
class EnvStep:
    """What ``reset`` and ``step`` return; every tensor is on the env's device."""

    obs: dict[str, Tensor]
    """Per group ``[E, n, *obs_shape]``: the observation to act on next (post auto-reset)."""
    state: Tensor
    """``[E, *state_shape]`` global state, post auto-reset."""
    reward: dict[str, Tensor]
    """Per group ``[E, n]``: reward of the step just taken (zeros after ``reset``)."""
    terminated: Tensor
    """``[E]`` bool: the episode reached a terminal state (no bootstrap)."""
    truncated: Tensor
    """``[E]`` bool: the episode was cut by the time limit (bootstrap when asked)."""
    alive: dict[str, Tensor]
    """Per group ``[E, n]`` bool: agents that act in the next step (death masking)."""
    action_mask: dict[str, Tensor] = field(default_factory=dict)
    """Per group with masks ``[E, n, sum(nvec)]`` bool, True = allowed; absent = all allowed."""
    agent_state: dict[str, Tensor] = field(default_factory=dict)
    """Per group with an agent-specific state ``[E, n, *agent_state_shape]``."""
    final_obs: Mapping[str, Tensor] | None = None
    """Per group ``[E, n, ...]``: the observation each env's last step ended on (pre-reset).
    Equal to ``obs`` where the env did not finish; ``None`` after ``reset``. May be a
    :class:`LazyGroups` (Hanabi's: put together when read, since training without truncated
    episodes never reads it)."""
    final_state: Tensor | Callable[[], Tensor] | None = None
    """``[E, *state_shape]`` pre-reset state, as ``final_obs``. An env may give a function of no
    arguments instead: it is called when the field is first read, and reading gives its tensor
    (Hanabi's: a copy of ``state`` with the ended games' rows replaced, which training without
    truncated episodes never reads)."""
    final_action_mask: Mapping[str, Tensor] = field(default_factory=dict)
    """Per group with masks, the pre-reset action masks, as ``final_obs``, where the env reports
    them (the value family's bootstrap at a time limit uses them); absent = not reported. May
    be a :class:`LazyGroups`."""
    final_agent_state: Mapping[str, Tensor] = field(default_factory=dict)
    """Per group pre-reset agent-specific state, as ``final_obs``. May be a :class:`LazyGroups`
    (computed when first read: only a critic bootstrapping truncated episodes reads it)."""
    stats: dict[str, Tensor] = field(default_factory=dict)
    """Per statistic ``[E]`` float32: the statistics of the episode that ended in this step;
    meaningful only where ``done``."""
    agent_terminated: dict[str, Tensor] = field(default_factory=dict)
    """Per group ``[E, n]`` bool, from envs that declare
    :attr:`~mappo.envs.base.BatchedEnv.agent_terminations`: the agent's own episode reached a
    terminal state with this step (PettingZoo's per-agent ``terminations``), whether or not its
    env goes on; its return is not bootstrapped past this step. Absent: only ``terminated``
    ends an agent's returns."""

    @property
    def done(self) -> Tensor:
        """``[E]`` bool: the episode ended (terminated or truncated) and the env was reset."""
        return self.terminated | self.truncated


def _read_final_state(step: EnvStep) -> Tensor | None:
    value = step.__dict__["_final_state"]
    if callable(value):  # given as a function: made on first read, kept
        value = step.__dict__["_final_state"] = value()
    return value


def _write_final_state(step: EnvStep, value: Tensor | Callable[[], Tensor] | None) -> None:
    step.__dict__["_final_state"] = value


def final_state_unread(step: EnvStep) -> bool:
    """Whether ``step.final_state`` is still a function not yet called (reading the field would
    call it)."""
    return callable(step.__dict__["_final_state"])


# after @dataclass: its __init__ assigns the field, which goes through the property
EnvStep.final_state = property(_read_final_state, _write_final_state)  # type: ignore[assignment]


def check_bytes(x: Tensor, what: str, whole: bool = False) -> None:
    """Raise :class:`ValueError` where ``x`` holds a value outside 0-255 or NaN: the cheap half
    of the byte contract (``BatchedEnv.byte_observations``; one pass, one host sync), which the
    replay buffer checks on every add. ``whole``: also refuse fractions (a few passes more; a
    rollout checks its first step so). Unchecked fractions are truncated by the byte storage."""
    if x.numel() == 0 or x.dtype in (torch.uint8, torch.bool):
        return
    lo, hi = torch.aminmax(x.detach())
    problem = None
    if not (float(lo) >= 0 and float(hi) <= 255):
        problem = f"values from {float(lo)} to {float(hi)}"
    elif whole and bool((x != x.round()).any()):
        problem = "values that are not whole numbers"
    if problem is not None:
        raise ValueError(
            f"the env declares byte_observations=True but its {what} holds {problem} (bytes "
            "hold whole numbers from 0 to 255); set byte_observations=False on the env"
        )


def spec_to_dict(spec: EnvSpec) -> dict[str, Any]:
    """A plain (checkpoint- and YAML-safe) description of ``spec``."""
    return {
        "groups": {
            name: {
                "agents": list(g.agents),
                "obs_shape": list(g.obs_shape),
                "nvec": list(g.action.nvec),
                "low": None if g.action.low is None else list(g.action.low),
                "high": None if g.action.high is None else list(g.action.high),
                "has_action_mask": g.has_action_mask,
                "agent_state_shape": None
                if g.agent_state_shape is None
                else list(g.agent_state_shape),
            }
            for name, g in spec.groups.items()
        },
        "state_shape": list(spec.state_shape),
        "episode_limit": spec.episode_limit,
        "stat_names": list(spec.stat_names),
    }


def spec_difference(saved: dict[str, Any], spec: EnvSpec, bounds: bool = False) -> str | None:
    """The first difference that matters to a trained run's networks between the spec a run
    saved (:func:`spec_to_dict`) and ``spec`` of the env made now, in words; None if none.

    Groups, agent counts, observation, state and action shapes and action masks shape the
    networks; episode limits and statistics do not, and are not compared. A continuous action
    box's bounds may change for training on (a resume builds its networks for the new box);
    ``bounds``: a box narrower than the one trained in is a difference too (a saved policy acts
    in the box it was trained in; a wider one holds its actions)."""
    now = spec_to_dict(spec)
    if list(saved["groups"]) != list(now["groups"]):
        return f"groups {list(now['groups'])} now, {list(saved['groups'])} when trained"
    for name, then in saved["groups"].items():
        g = now["groups"][name]
        if len(then["agents"]) != len(g["agents"]):
            return (
                f"group '{name}' has {len(g['agents'])} agents now, {len(then['agents'])} "
                "when trained"
            )
        kinds = [_action_kind(d) for d in (g, then)]
        if kinds[0] != kinds[1]:  # (the fields below would compare a box's empty heads)
            return f"group '{name}': {kinds[0]} now, {kinds[1]} when trained"
        for key, what in _SPEC_FIELDS:
            old, new = then.get(key), g.get(key)
            if key in ("low", "high"):  # their count is the action size
                old, new = (None if v is None else len(v) for v in (old, new))
            if key in ("obs_shape", "agent_state_shape") and _flattened(old, new):
                continue
            if old != new:
                return f"group '{name}': {what} {_shown(new)} now, {_shown(old)} when trained"
        if bounds and then.get("low") is not None and not _contains(g, then):
            return (
                f"group '{name}': the action box [{_shown(g['low'])}, {_shown(g['high'])}] "
                f"now is narrower than [{_shown(then['low'])}, {_shown(then['high'])}] when "
                "trained"
            )
    same_state = list(saved["state_shape"]) == list(now["state_shape"])
    # (a state of the agents' pictures stacked along their channels holds the values of the
    # flat join it replaced in another order: not the same input)
    if not same_state and (
        not _flattened(saved["state_shape"], now["state_shape"]) or _joined_pictures(now)
    ):
        return (
            f"the global state has shape {tuple(now['state_shape'])} now, "
            f"{tuple(saved['state_shape'])} when trained"
        )
    return None


def channel_axis(shape: tuple[int, ...]) -> int | None:
    """The colour-channel axis of a picture's ``shape`` (three axes): ``2`` for ``[H, W, C]``
    (Gymnasium and PettingZoo), ``0`` for ``[C, H, W]`` (torch), taken as the end axis smaller
    than both others (RGB 3, RGBA 4, stacked frames 12 against 84 x 84 pixels); ``None`` where
    the sizes do not tell (both ends or neither)."""
    if len(shape) != 3:
        return None
    first = shape[0] < shape[1] and shape[0] < shape[2]
    last = shape[2] < shape[0] and shape[2] < shape[1]
    if first == last:
        return None
    return 0 if first else 2


def _flattened(then: Any, now: Any) -> bool:
    """Whether a shape saved flat, ``(H * W * C,)``, is the picture ``now`` has axes for
    (``(H, W, C)``): the PettingZoo and Gymnasium adapters kept pictures flat before
    ``model.encoder=cnn`` existed, and a network trained on them reads ``now`` flattened, the
    same values in the same order."""
    if then is None or now is None or len(then) != 1 or len(now) < 2:
        return False
    return int(then[0]) == math.prod(int(v) for v in now)


def _joined_pictures(spec: dict[str, Any]) -> bool:
    """Whether a spec's (:func:`spec_to_dict`) state is its agents' pictures joined: every
    group observes pictures, and the state holds exactly all of their values."""
    groups = spec["groups"].values()
    if not all(len(g["obs_shape"]) == 3 for g in groups):
        return False
    values = sum(len(g["agents"]) * math.prod(g["obs_shape"]) for g in groups)
    return math.prod(spec["state_shape"]) == values


def _contains(now: dict[str, Any], then: dict[str, Any]) -> bool:
    """Whether a saved group's action box ``now`` holds the box ``then`` the policy was trained
    in (up to float32 rounding of the bounds): the policy's actions stay inside that box."""

    def slack(x: float) -> float:
        return 1e-6 * max(1.0, abs(x)) if math.isfinite(x) else 0.0

    lows = zip(now["low"], then["low"], strict=True)
    highs = zip(now["high"], then["high"], strict=True)
    return all(n <= o + slack(o) for n, o in lows) and all(n >= o - slack(o) for n, o in highs)


def _action_kind(group: dict[str, Any]) -> str:
    """A saved group's kind of actions in words: ``discrete actions`` or ``continuous
    actions``, as the networks' heads differ between them."""
    return "discrete actions" if group.get("low") is None else "continuous actions"


def _shown(value: Any) -> Any:
    """A spec field for a message: lists as tuples (shapes read as ``(4,)``)."""
    return tuple(value) if isinstance(value, list) else value


_SPEC_FIELDS = (
    ("obs_shape", "observation shape"),
    ("nvec", "discrete action heads"),
    ("low", "continuous action components"),
    ("has_action_mask", "action masks"),
    ("agent_state_shape", "agent-specific state shape"),
)


def spec_from_dict(data: dict[str, Any]) -> EnvSpec:
    """Inverse of :func:`spec_to_dict`."""
    groups = {
        name: GroupSpec(
            agents=tuple(g["agents"]),
            obs_shape=tuple(g["obs_shape"]),
            action=ActionSpec(tuple(g["nvec"]))
            if g.get("low") is None
            else ActionSpec(low=tuple(g["low"]), high=tuple(g["high"])),
            has_action_mask=bool(g["has_action_mask"]),
            agent_state_shape=None
            if g["agent_state_shape"] is None
            else tuple(g["agent_state_shape"]),
        )
        for name, g in data["groups"].items()
    }
    return EnvSpec(
        groups, tuple(data["state_shape"]), int(data["episode_limit"]), tuple(data["stat_names"])
    )


def step_to_dict(step: EnvStep) -> dict[str, Any]:
    """The parts of an :class:`EnvStep` that agents act on next (for checkpoints)."""
    return {
        "obs": step.obs,
        "state": step.state,
        "alive": step.alive,
        "action_mask": step.action_mask,
        "agent_state": step.agent_state,
    }


def step_from_dict(d: dict[str, Any], device: Any) -> EnvStep:
    """Inverse of :func:`step_to_dict` on ``device``: rewards zero, nothing done."""

    def to(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: to(v) for k, v in x.items()}
        return x.to(device)

    alive = to(d["alive"])
    zeros = d["state"].new_zeros(d["state"].shape[0], dtype=torch.bool).to(device)
    return EnvStep(
        obs=to(d["obs"]),
        state=to(d["state"]),
        reward={k: torch.zeros_like(v, dtype=torch.float32) for k, v in alive.items()},
        terminated=zeros,
        truncated=zeros.clone(),
        alive=alive,
        action_mask=to(d["action_mask"]),
        agent_state=to(d["agent_state"]),
    )


# -- on-policy rollouts ----------------------------------------------------------------------


@dataclass
class GroupBuffer:
    """One group's rollout: ``T`` steps of ``E`` envs."""

    obs: Tensor  # [T, E, n, *obs_shape]
    critic_x: Tensor  # [T, E, C, in]
    actor_state: Tensor  # [T, E, n, S_a]  recurrent state *before* step t (pre-reset)
    critic_state: Tensor  # [T, E, C, S_c]
    actions: Tensor  # [T, E, n, k] int64, or [T, E, n, d] float32 for a box
    log_probs: Tensor  # [T, E, n]
    values: Tensor  # [T + 1, E, C] normalised critic outputs
    rewards: Tensor  # [T, E, n]
    alive: Tensor  # [T, E, n] bool: the agent acted at step t
    action_mask: Tensor | None  # [T, E, n, A] bool
    final_values: Tensor | None  # [T, E, C] normalised V(final obs) for truncation bootstrap
    agent_terminated: Tensor | None = None  # [T, E, n] bool: the agent's own episode ended


@dataclass
class Rollout:
    groups: dict[str, GroupBuffer]
    starts: Tensor  # [T, E] bool: an episode starts at step t (recurrent state reset)
    terminated: Tensor  # [T, E] bool: the episode ended in a terminal state after step t
    truncated: Tensor  # [T, E] bool: the episode hit its time limit after step t


# -- whole episodes (the value family's replay buffer) ----------------------------------------


@dataclass
class EpisodeBatch:
    """``B`` whole episodes, time-major and padded to the episode limit: ``[L + 1, B, ...]``.

    Index ``t`` holds what the agents saw before acting at step ``t`` (observation, state, masks,
    alive flags), the actions they took and what that step returned (team reward, terminated,
    truncated). An episode of ``T`` steps fills ``t < T`` (``filled``); index ``T`` holds the
    observation, state and action masks the episode ended on (the bootstrap input of a truncated
    episode; the masks allow every action where the env does not report final masks). Steps
    after ``T`` are padding: zeros, masks that allow every action, ``filled`` False.
    """

    obs: dict[str, Tensor]  # [L+1, B, n, *obs_shape] float32 per group
    action_mask: dict[str, Tensor]  # [L+1, B, n, A] bool, groups with masks only
    alive: dict[str, Tensor]  # [L+1, B, n] bool
    actions: dict[str, Tensor]  # [L+1, B, n, k] int64 / [.., d] float32 (zeros from T on)
    state: Tensor  # [L+1, B, *state_shape]
    reward: Tensor  # [L+1, B] team reward of step t: the mean over all agents' rewards
    terminated: Tensor  # [L+1, B] bool: the episode reached a terminal state after step t
    truncated: Tensor  # [L+1, B] bool: the episode hit its time limit after step t
    filled: Tensor  # [L+1, B] bool: step t is a step of the episode

    def map(self, fn: Callable[[Tensor], Tensor]) -> EpisodeBatch:
        """A batch with ``fn`` applied to every tensor (dicts keep their keys)."""
        return EpisodeBatch(
            **{
                name: {k: fn(v) for k, v in value.items()} if isinstance(value, dict) else fn(value)
                for name, value in self.fields().items()
            }
        )

    def fields(self) -> dict[str, Any]:
        """Field name -> tensor or per-group dict of tensors (no copies)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @property
    def ends(self) -> Tensor:
        """``[L+1, B]`` bool: the episode ends after step t."""
        return self.terminated | self.truncated


def field_layout(x: Any) -> tuple[Any, ...]:
    """The fields of dataclass instance ``x`` as a compiled function's call key sees them
    (:class:`mappo.compiled.DirectCalls`): a dict by its keys, ``None`` as ``None``, anything
    else by its type. An :class:`EnvStep` after ``reset`` has no final observations, after
    ``step`` it has: two kinds of call of a compiled rollout step."""
    return tuple(
        tuple(v) if type(v) is dict else (None if v is None else type(v))
        for v in x.__dict__.values()
    )
