"""The batched environment contract.

One :class:`BatchedEnv` object simulates ``num_envs`` independent copies of a task on one torch
device. Every environment of the project (the particle world, the combat simulator, the adapters
for PettingZoo and Gymnasium environments) implements it, and the trainer relies only on it.

Shapes (``E`` = ``num_envs``, ``n`` = agents in a group, ``k`` = action heads of the group):

- agents come in **groups** of identical observation and action spaces, keyed by group name;
- per-agent tensors are ``[E, n, ...]``: observations ``[E, n, *obs_shape]`` (float32; uint8
  for an env that declares :attr:`BatchedEnv.byte_observations` and returns bytes), rewards
  ``[E, n]`` (float32), ``alive`` flags ``[E, n]`` (bool), action masks ``[E, n, sum(nvec)]``
  (bool, ``True`` = allowed), actions ``[E, n, k]`` (int64; ``[E, n]`` is accepted for one head);
- a group's actions are either discrete heads or a continuous box (:class:`ActionSpec`): box
  actions are ``[E, n, d]`` float32 within ``[low, high]`` (``[E, n]`` accepted for ``d = 1``),
  and a box group has no action mask; discrete and continuous groups mix freely in one env;
- the global state is ``[E, *state_shape]`` (the observations' dtype); an agent-specific
  state, where the env defines one, is ``[E, n, *agent_state_shape]`` per group;
- ``terminated`` and ``truncated`` are ``[E]`` bool and kept apart: a time limit is a truncation.

**Auto-reset.** An env whose episode ends in :meth:`BatchedEnv.step` is reset inside that call.
The returned :class:`EnvStep` then holds the first observation of the new episode in ``obs`` and
the observation the old episode ended on in ``final_obs`` (likewise ``state``/``final_state``), so
a truncated episode can be bootstrapped. ``reward``, ``terminated``, ``truncated`` and ``stats``
belong to the step that ended the episode.

**Seeding.** ``reset(seed)`` reseeds the env's own ``torch.Generator``; the same ``(seed,
num_envs, device)`` replays the same episodes. Nothing touches torch's global RNG.

**State injection.** :meth:`BatchedEnv.get_state` returns the full simulator state as a dict of
tensors with a leading ``[E]`` axis; :meth:`BatchedEnv.set_state` puts (some of) the envs into a
given state, for reference-trajectory tests and curricula.

**Input checks.** With ``validate_actions = True`` (the default) every ``step`` checks the action
batch (shape, dtype, range or box bounds, finiteness, mask) and raises :class:`ActionError`
naming the group and what was expected. The trainer switches the per-step checks off in its hot
loop once its actions are known to be well formed.
"""

from __future__ import annotations

import abc
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

# The spec and step types live on the ground floor (mappo.data); they are re-exported here
# because they are part of the environment contract.
from mappo.data import (  # noqa: F401
    ActionSpec,
    EnvSpec,
    EnvStep,
    GroupSpec,
    LazyGroups,
    spec_from_dict,
    spec_to_dict,
)


class EnvError(ValueError):
    """A bad environment name, parameter or call; the message names the problem and the fix."""


class ActionError(EnvError):
    """An action batch of the wrong shape, dtype or range, or an action a mask forbids."""


class BatchedEnv(abc.ABC):
    """Base class of every batched environment (see the module docstring for the contract).

    Subclasses set ``self.spec`` in ``__init__`` and implement :meth:`reset`, :meth:`_step`,
    :meth:`get_state` and :meth:`set_state`; :meth:`render` where they can draw themselves.
    """

    spec: EnvSpec
    num_envs: int
    device: torch.device
    name: str = "env"
    validate_actions: bool = True
    byte_observations: bool = False
    """Whether every observation and global state value this env returns is a whole number from
    0 to 255 (Hanabi's 0/1 encodings): MAPPO's rollout (:func:`~mappo.rollout.stored_dtypes`) and
    the value family's replay buffer (:class:`~mappo.episodes.EpisodeBuffer`) then store them as
    bytes, a quarter of float32. A rollout checks its first step's values and refuses others.
    Such an env may return them as uint8 tensors rather than float32 (Hanabi does by default: a
    quarter of the memory its step writes); every network of the library converts its inputs to
    float32 itself."""

    agent_terminations: bool = False
    """Whether :meth:`step` reports :attr:`EnvStep.agent_terminated`: agents whose own episode
    ends while their env's goes on (the adapters, from PettingZoo's per-agent terminations).
    MAPPO's returns then stop at such an agent's last step. The library's own envs leave it
    off: in the combat simulator a fallen unit keeps the team's later rewards and is
    bootstrapped from its death-masked input, as in the MAPPO paper's code."""

    def __init__(self, num_envs: int, device: str | torch.device = "cpu", seed: int = 0) -> None:
        if not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1:
            raise EnvError(f"{self.name}: num_envs must be a positive integer, got {num_envs!r}")
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.seed = seed
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    # -- the contract -------------------------------------------------------------------------
    @abc.abstractmethod
    def reset(self, seed: int | None = None) -> EnvStep:
        """Reset every env; reseed the env's generator first when ``seed`` is given."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Remember the action masks of every EnvStep handed out by reset/set_state, or by an
        # env's own way of starting episodes (Hanabi's deal of given decks; step does it
        # itself), so that a checked step can refuse actions the agent was not allowed to take.
        super().__init_subclass__(**kwargs)
        for method in ("reset", "set_state", "deal"):
            if method in cls.__dict__:
                setattr(cls, method, _remember_masks(cls.__dict__[method]))

    def step(self, actions: dict[str, Tensor]) -> EnvStep:
        """Advance every env by one step; actions per group ``[E, n, k]`` int64, or ``[E, n, d]``
        float32 for a continuous group (see the module doc).

        With ``validate_actions`` the actions are checked against the spec and against the
        action masks of the last returned :class:`EnvStep`.
        """
        if self.validate_actions:
            actions = self.check_actions(actions)
            masks = getattr(self, "_last_action_mask", None)
            if masks:
                self.check_action_masks(actions, masks, getattr(self, "_last_alive", None))
        try:
            result = self._step(actions)
        except Exception as err:
            failure = _failed(self, "step", err)
            if failure is err:
                raise
            raise failure from err
        _check_early_output(self, result, "step")
        if not isinstance(result, EnvStep):  # (checked on every step: it costs nothing)
            raise EnvError(
                f"{self.name}: step() must return an EnvStep, got {type(result).__name__}"
            )
        self._last_action_mask, self._last_alive = result.action_mask, result.alive
        self.__dict__["_last_output"] = (result, "step")
        return result

    @abc.abstractmethod
    def _step(self, actions: dict[str, Tensor]) -> EnvStep:
        """``step`` without the input checks; actions are ``[E, n, k]`` int64 (``[E, n, d]``
        float32 for continuous groups) on the device."""

    def claim_traced_step(self) -> Callable[[dict[str, Tensor]], EnvStep] | None:
        """Optional, for the compiled rollout (``compile=on``): a function that computes the
        next step as pure tensor code, to be traced into one graph with the policy, or ``None``
        where the next step must go through :meth:`step` (the default).

        A returned function must be called exactly once, in place of :meth:`step`, with
        actions that need no checks: the env has already counted the step in any host-side
        bookkeeping it keeps. Return the same function each time (a bound method) and let it
        read no Python value that differs from one claim to the next when it is called (a step
        counter, a flag): the compiled graph is specialised on such values and would be
        recompiled on every step. Random numbers cannot enter a graph: draw them when the step
        is claimed, into tensors the function reads. The action masks of a traced step are not
        remembered for :meth:`check_action_masks`, so an env with action masks should only
        offer it while ``validate_actions`` is off. The particle world offers it on every step,
        drawing the episodes that start on it (at the time limit) when it is claimed."""
        return None

    def claim_traced_steps(self, count: int) -> Callable[[dict[str, Tensor]], EnvStep] | None:
        """:meth:`claim_traced_step` for the next ``count`` steps at once: the function to call
        ``count`` times in a row in place of :meth:`step`, or ``None`` (nothing claimed) where
        any of them must go through :meth:`step`. The compiled rollout traces runs of steps into
        one graph with it. The default claims one step at a time only."""
        return self.claim_traced_step() if count == 1 else None

    @abc.abstractmethod
    def get_state(self) -> dict[str, Tensor]:
        """The full simulator state, each tensor with a leading ``[E]`` axis (clones)."""

    @abc.abstractmethod
    def set_state(self, state: dict[str, Tensor], env_ids: Tensor | None = None) -> EnvStep:
        """Put envs ``env_ids`` (all when ``None``) into ``state`` (leading axis = len(env_ids));
        returns the observations of the resulting state, as ``reset`` does."""

    def render(self, env_index: int = 0, size: int = 400) -> np.ndarray:
        """An RGB frame ``[size, size, 3]`` uint8 of env ``env_index``; no display needed."""
        raise NotImplementedError(f"{self.name} cannot render itself")

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for tensor envs
        """Release worker processes or other resources (no-op for tensor envs)."""

    def __enter__(self) -> BatchedEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------------------
    def reseed(self, seed: int | None) -> None:
        if seed is not None:
            self.seed = seed
            self.generator.manual_seed(seed)

    def check_actions(self, actions: Any) -> dict[str, Tensor]:
        """Validate an action batch and return it as ``[E, n, k]`` int64 tensors on the device.

        Raises :class:`ActionError` naming the group and what was expected.
        """
        if not isinstance(actions, dict):
            raise ActionError(
                f"{self.name}: actions must be a dict of group name -> tensor "
                f"(groups: {list(self.spec.groups)}), got {type(actions).__name__}"
            )
        unknown = set(actions) - set(self.spec.groups)
        missing = set(self.spec.groups) - set(actions)
        if unknown or missing:
            raise ActionError(
                f"{self.name}: action groups {sorted(actions)} do not match the env's groups "
                f"{list(self.spec.groups)} (missing {sorted(missing)}, unknown {sorted(unknown)})"
            )
        out: dict[str, Tensor] = {}
        for name, group in self.spec.groups.items():
            a = actions[name]
            if not isinstance(a, Tensor):
                try:
                    a = torch.as_tensor(np.asarray(a))
                except (TypeError, ValueError, RuntimeError) as err:  # a dict, ragged lists
                    raise ActionError(
                        f"{self.name}: actions for group '{name}' must be a tensor or array of "
                        f"shape ({self.num_envs}, {group.num_agents}"
                        f"{'' if group.action.num_heads == 1 else f', {group.action.num_heads}'}"
                        f"), got a {type(a).__name__} that is not one ({err})"
                    ) from None
            expected = (self.num_envs, group.num_agents, group.action.num_heads)
            if a.dim() == 2 and group.action.num_heads == 1:
                a = a.unsqueeze(-1)
            if tuple(a.shape) != expected:
                raise ActionError(
                    f"{self.name}: actions for group '{name}' have shape {tuple(a.shape)}, "
                    f"expected {expected} (num_envs, agents, "
                    f"{'components' if group.action.continuous else 'heads'})"
                )
            if group.action.continuous:
                out[name] = self._check_box(name, group.action, a)
                continue
            if a.dtype.is_floating_point or a.dtype == torch.bool or a.dtype.is_complex:
                raise ActionError(
                    f"{self.name}: actions for group '{name}' have dtype {a.dtype}, "
                    "expected an integer dtype (torch.int64)"
                )
            a = a.to(device=self.device, dtype=torch.int64)
            high = torch.tensor(group.action.nvec, device=self.device)
            bad = (a < 0) | (a >= high)
            if bool(bad.any()):
                idx = tuple(int(i) for i in bad.nonzero()[0])
                raise ActionError(
                    f"{self.name}: action {int(a[idx])} for group '{name}' at (env, agent, head) "
                    f"{idx} is out of range; head sizes are {group.action.nvec}"
                )
            out[name] = a
        return out

    def _check_box(self, name: str, space: ActionSpec, a: Tensor) -> Tensor:
        """Check one continuous group's actions ``[E, n, d]``: floating dtype, finite, in bounds."""
        if not a.dtype.is_floating_point:
            raise ActionError(
                f"{self.name}: actions for group '{name}' have dtype {a.dtype}, expected a "
                "floating dtype (torch.float32): the group's action space is continuous"
            )
        a = a.to(device=self.device, dtype=torch.float32)
        finite = torch.isfinite(a)
        if not bool(finite.all()):
            idx = tuple(int(i) for i in (~finite).nonzero()[0])
            raise ActionError(
                f"{self.name}: action {float(a[idx])} for group '{name}' at (env, agent, "
                f"component) {idx} is not finite; check the policy's outputs for NaN"
            )
        low = torch.tensor(space.low, device=self.device)
        high = torch.tensor(space.high, device=self.device)
        bad = (a < low) | (a > high)
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise ActionError(
                f"{self.name}: action {float(a[idx]):.6g} for group '{name}' at (env, agent, "
                f"component) {idx} is outside the box [{space.low[idx[-1]]}, "
                f"{space.high[idx[-1]]}]; clip actions to the box before stepping"
            )
        return a

    def check_action_masks(
        self,
        actions: dict[str, Tensor],
        masks: dict[str, Tensor],
        alive: dict[str, Tensor] | None = None,
    ) -> None:
        """Raise :class:`ActionError` if an action is forbidden by its mask ``[E, n, A]``. A head
        whose mask allows nothing is not checked for agents that ``alive`` (``[E, n]`` per group,
        the last step's) marks dead: their actions are ignored (:func:`check_output` allows
        them such masks); a dead agent's mask that allows some actions (a no-op) still holds."""
        for name, mask in masks.items():
            if self.spec.groups[name].action.continuous:
                continue
            nvec = self.spec.groups[name].action.nvec
            offsets = torch.tensor(np.cumsum((0,) + nvec[:-1]), device=self.device)
            flat = actions[name] + offsets
            allowed = mask.gather(-1, flat)
            if alive is not None and name in alive:
                empty = ~torch.stack([h.any(-1) for h in mask.split(nvec, dim=-1)], dim=-1)
                allowed = allowed | (empty & ~alive[name].unsqueeze(-1))
            if not bool(allowed.all()):
                idx = tuple(int(i) for i in (~allowed).nonzero()[0])
                raise ActionError(
                    f"{self.name}: action {int(actions[name][idx])} for group '{name}' at "
                    f"(env, agent, head) {idx} is not allowed by its action mask; "
                    "sample from the masked distribution or check step.action_mask"
                )


def living_without_actions(nvec: tuple[int, ...], mask: Tensor, alive: Tensor) -> tuple[int, ...]:
    """The index into ``alive [...]`` of the first agent marked alive whose action mask
    ``mask [..., sum(nvec)]`` allows no action in some head; ``()`` where there is none (one
    sync with the device)."""
    start = 0
    for size in nvec:
        empty = ~mask[..., start : start + size].any(-1) & alive
        if bool(empty.any()):
            return tuple(int(v) for v in empty.nonzero()[0])
        start += size
    return ()


def refuse_living_without_actions(
    env: BatchedEnv,
    masks: Mapping[str, Tensor | None],
    alive: Mapping[str, Tensor],
    where: str,
    step: int | None = None,
) -> None:
    """Raise a one-line :class:`EnvError` where ``masks[name] [..., E, n, sum(nvec)]`` allows no
    action for an agent that ``alive[name] [..., E, n]`` marks alive. Only an env's first
    outputs are checked as they come (:func:`check_output`); after them such a mask left the
    policy to pick a forbidden action, which the env took and a loss scored, with no error.
    ``where`` names what the steps belong to ("a rollout"); ``step`` is the step of ``[E, n]``
    inputs (a leading axis of steps gives its own)."""
    for name, mask in masks.items():
        if mask is None:
            continue
        found = living_without_actions(env.spec.groups[name].action.nvec, mask, alive[name])
        if found:
            *t, e, i = found
            raise EnvError(
                f"{env.name}: action_mask['{name}'] allows no action for alive agent {i} of env "
                f"{e} at step {t[0] if t else step} of {where}; allow at least one (a no-op), "
                "or mark the agent not alive"
            )


def _remember_masks(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(self: BatchedEnv, *args: Any, **kwargs: Any) -> EnvStep:
        # A subclass's reset may call its parent's: only the outermost call's result is the
        # env's (checked against its spec); the parent's is an intermediate it reworks.
        outer = not self.__dict__.get("_in_wrapped_call", False)
        self.__dict__["_in_wrapped_call"] = True
        try:
            result = fn(self, *args, **kwargs)
        except Exception as err:
            failure = _failed(self, fn.__name__, err) if outer else err
            if failure is err:
                raise
            raise failure from err
        finally:
            if outer:
                self.__dict__["_in_wrapped_call"] = False
        if not outer:
            return result
        _check_early_output(self, result, fn.__name__)
        if isinstance(result, EnvStep):
            self._last_action_mask, self._last_alive = result.action_mask, result.alive
            self.__dict__["_last_output"] = (result, fn.__name__)
        return result

    return wrapper


def one_line(err: BaseException) -> str:
    """``Type: first line of the message``: an error named in one line, without traceback."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def is_users_env(env: BatchedEnv) -> bool:
    """Whether ``env`` is written outside this library (a user's env, which gets the checks
    and one-line errors a new env needs; the library's own envs are tested instead)."""
    return type(env).__module__.split(".")[0] != "mappo"


def _failed(env: BatchedEnv, method: str, err: Exception) -> Exception:
    """What a user's env raising ``err`` in ``method`` becomes: one line naming the env and the
    method (an :class:`EnvError` or :class:`ActionError` passes as it is). ``MAPPO_DEBUG=1``
    makes the ``mappo`` command show the traceback instead."""
    if isinstance(err, EnvError) or not is_users_env(env):
        return err
    return EnvError(
        f"{env.name}: {method}() raised {one_line(err)} (MAPPO_DEBUG=1 shows the traceback)"
    )


OUTPUT_CHECKS = 8
"""How many outputs (of ``reset``, ``set_state`` and ``step``, together) of an env written
outside this library :func:`check_output` checks: a mistake in a new env shows on its first
steps, and later steps then cost nothing. The library's own envs are tested instead."""


def _check_early_output(env: BatchedEnv, step: Any, method: str) -> None:
    """:func:`check_output` on the first :data:`OUTPUT_CHECKS` outputs of a user's env."""
    if not is_users_env(env):
        return
    done = env.__dict__.get("_outputs_checked", 0)
    if done < OUTPUT_CHECKS:
        env.__dict__["_outputs_checked"] = done + 1
        check_output(env, step, method)


T = TypeVar("T")

# What a malformed output leads to where it is used (a shape that does not broadcast, a missing
# group or statistic, a numpy array where a tensor goes).
_OUTPUT_FAILURES = (RuntimeError, TypeError, ValueError, KeyError, IndexError, AttributeError)


def explain_failure(env: BatchedEnv, err: Exception) -> Exception:
    """What ``err``, raised while training or evaluating on ``env``, becomes where ``env`` is a
    user's env whose last output breaks the contract: the :class:`EnvError` of
    :func:`check_output` on that output, which names the mistake in one line. Outputs after
    the first :data:`OUTPUT_CHECKS` go unchecked, so that a wrong shape returned later
    surfaced as a traceback where the rollout stored it, and a statistic left out as a missing
    key. Otherwise ``err`` itself."""
    last = env.__dict__.get("_last_output")
    if isinstance(err, EnvError) or not isinstance(err, _OUTPUT_FAILURES):
        return err
    if last is None or not is_users_env(env):
        return err
    try:
        check_output(env, *last)
    except EnvError as found:
        return found
    return err


def explained(envs: list[BatchedEnv], fn: Callable[[], T]) -> T:
    """``fn()``, where a failure that the last output of one of ``envs`` explains becomes that
    output's one-line :class:`EnvError` (:func:`explain_failure`)."""
    try:
        return fn()
    except Exception as err:
        for env in envs:
            found = explain_failure(env, err)
            if found is not err:
                raise found from err
        raise


_GROUP_NAME = re.compile(r"[^.]+")  # torch's module dicts refuse '' and '.'


def _taken_by_module_dicts(name: str) -> bool:
    """Whether torch's ``nn.ModuleDict`` refuses ``name`` as a key: its own attributes
    (``items``, ``train``, ``training``...), which the networks' per-group dicts would shadow."""
    return hasattr(torch.nn.ModuleDict(), name)


def check_spec(env: BatchedEnv) -> None:
    """Check the types in ``env.spec`` (shapes of whole numbers, at least one group and agent,
    statistics as a tuple of names): a spec written by hand is read by the networks and the
    trainer, where a mistake would surface as a traceback far from it. Raises :class:`EnvError`."""
    spec = getattr(env, "spec", None)
    name = f"{env.name}: spec"
    if not isinstance(spec, EnvSpec):
        raise EnvError(f"{name} must be an EnvSpec, got {type(spec).__name__}")

    def shape(field: str, value: Any) -> None:
        ok = isinstance(value, tuple | list) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in value
        )
        if not ok:
            raise EnvError(
                f"{name}: {field} must be a tuple of positive whole numbers, e.g. (4,), got "
                f"{value!r}"
            )

    if not isinstance(spec.groups, dict) or not spec.groups:
        raise EnvError(f"{name}: groups must be a dict of at least one GroupSpec")
    seen: dict[str, str] = {}  # agent name -> its group
    for g, gs in spec.groups.items():
        if not isinstance(g, str) or not _GROUP_NAME.fullmatch(g) or _taken_by_module_dicts(g):
            # Group names key the networks' module dicts, where these are torch errors.
            raise EnvError(
                f"{name}: group name {g!r} must be a non-empty name without '.' and not one of "
                "torch's module attributes (items, train, ...); rename the group (e.g. "
                "'red_team')"
            )
        if not isinstance(gs, GroupSpec):
            raise EnvError(f"{name}: group '{g}' must be a GroupSpec, got {type(gs).__name__}")
        if not isinstance(gs.agents, tuple | list) or not gs.agents:
            raise EnvError(f"{name}: group '{g}' needs at least one agent, got {gs.agents!r}")
        for agent in gs.agents:
            if agent in seen:
                where = "twice in group" if seen[agent] == g else f"in groups '{seen[agent]}' and"
                raise EnvError(
                    f"{name}: agent name {agent!r} appears {where} '{g}'; give every agent a "
                    "name of its own"
                )
            seen[agent] = g
        shape(f"groups['{g}'].obs_shape", gs.obs_shape)
        if gs.agent_state_shape is not None:
            shape(f"groups['{g}'].agent_state_shape", gs.agent_state_shape)
    shape("state_shape", spec.state_shape)
    limit = spec.episode_limit
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise EnvError(
            f"{name}: episode_limit must be a positive whole number of steps, got {limit!r}"
        )
    names = spec.stat_names
    if not isinstance(names, tuple | list) or not all(isinstance(n, str) for n in names):
        raise EnvError(
            f"{name}: stat_names must be a tuple of names, e.g. ('hits',), got {names!r}"
        )


def _check_final_fields(
    name: str, step: EnvStep, tensor: Callable[..., None], floats: set[torch.dtype]
) -> None:
    """The pre-reset fields of a ``step()`` output (``final_obs``, ``final_state``,
    ``final_action_mask``, ``final_agent_state``): where an episode ended, ``final_obs`` and
    ``final_state`` must be given (a critic bootstrapping a truncated episode reads them), and
    every one given must have its live counterpart's shape and dtype and hold finite values."""
    ended = bool(step.done.any()) if isinstance(step.done, Tensor) else False
    if step.final_obs is None or step.final_state is None:
        if ended:
            missing = "final_obs" if step.final_obs is None else "final_state"
            raise EnvError(
                f"{name}: an episode ended in this step but {missing} is None; set final_obs "
                "and final_state to the observations and state the episodes ended on (before "
                "the auto-reset; equal to obs and state where no episode ended)"
            )
        return
    parts: list[tuple[str, Mapping[str, Tensor], Mapping[str, Tensor]]] = [
        ("final_obs", step.final_obs, step.obs),
        ("final_action_mask", step.final_action_mask, step.action_mask),
        ("final_agent_state", step.final_agent_state, step.agent_state),
    ]
    for field, finals, live in parts:
        for g in finals:
            if g not in live:
                raise EnvError(
                    f"{name}: {field} has group '{g}', which the live field does not have "
                    f"(its groups: {sorted(live)})"
                )
            got, want = finals[g], live[g]
            tensor(f"{field}['{g}']", got, tuple(want.shape), {want.dtype})
        if field == "final_obs" and set(finals) != set(live):
            raise EnvError(
                f"{name}: final_obs has the groups {sorted(finals)}, obs has {sorted(live)}"
            )
    tensor("final_state", step.final_state, tuple(step.state.shape), floats)


def check_output(env: BatchedEnv, step: Any, method: str = "step") -> None:
    """Check an :class:`EnvStep` that ``env.<method>`` returned against ``env.spec``: the groups,
    every tensor's shape and dtype, finite observations, state and rewards, and at least one
    allowed action (in every head) for every alive agent with a mask. Raises
    :class:`EnvError` naming the env, the field, what it holds and what the spec asks for.
    Called on the first outputs of envs written outside this library; call it on yours too."""
    check_spec(env)
    name = f"{env.name}: {method}()"
    if not isinstance(step, EnvStep):
        raise EnvError(f"{name} must return an EnvStep, got {type(step).__name__}")
    spec, e = env.spec, env.num_envs
    byte_obs = bool(getattr(env, "byte_observations", False))
    floats = {torch.float32, torch.get_default_dtype()} | ({torch.uint8} if byte_obs else set())

    def tensor(field: str, value: Any, shape: tuple[int, ...], kinds: set[torch.dtype]) -> None:
        if not isinstance(value, Tensor):
            raise EnvError(f"{name}: {field} must be a tensor, got {type(value).__name__}")
        if tuple(value.shape) != shape:
            raise EnvError(
                f"{name}: {field} has shape {list(value.shape)}, the spec asks for {list(shape)}"
            )
        if value.dtype not in kinds:
            wanted = sorted(str(k).removeprefix("torch.") for k in kinds)
            fix = f"; convert it with .to(torch.{wanted[0]})" if len(wanted) == 1 else ""
            raise EnvError(
                f"{name}: {field} has dtype {value.dtype}, expected {' or '.join(wanted)}{fix}"
            )
        if value.is_floating_point() and not bool(value.isfinite().all()):
            raise EnvError(f"{name}: {field} holds NaN or inf")

    for part in ("obs", "reward", "alive"):
        got = set(getattr(step, part))
        if got != set(spec.groups):
            raise EnvError(
                f"{name}: {part} has the groups {sorted(got)}, the spec's are {sorted(spec.groups)}"
            )
    if not isinstance(step.action_mask, Mapping):
        raise EnvError(
            f"{name}: action_mask must be a dict of masks per group (empty for none), got "
            f"{type(step.action_mask).__name__}"
        )
    for g in step.action_mask:
        if g not in spec.groups:
            raise EnvError(
                f"{name}: action_mask has group '{g}', which the spec does not have (its groups: "
                f"{sorted(spec.groups)})"
            )
        if not spec.groups[g].has_action_mask:
            # Actions would be sampled with the mask and scored by the loss without it.
            raise EnvError(
                f"{name}: action_mask has group '{g}', whose spec does not say "
                "has_action_mask=True; set it in the group's GroupSpec (or return no mask)"
            )
    for g, gs in spec.groups.items():  # observations first: the most common mistakes
        tensor(f"obs['{g}']", step.obs[g], (e, gs.num_agents, *gs.obs_shape), floats)
    tensor("state", step.state, (e, *spec.state_shape), floats)
    tensor("terminated", step.terminated, (e,), {torch.bool})
    tensor("truncated", step.truncated, (e,), {torch.bool})
    for g, gs in spec.groups.items():
        n = gs.num_agents
        tensor(f"reward['{g}']", step.reward[g], (e, n), {torch.float32, torch.get_default_dtype()})
        tensor(f"alive['{g}']", step.alive[g], (e, n), {torch.bool})
        if gs.agent_state_shape is not None and g in step.agent_state:
            tensor(
                f"agent_state['{g}']", step.agent_state[g], (e, n, *gs.agent_state_shape), floats
            )
        if env.agent_terminations and method == "step":
            if g not in step.agent_terminated:
                raise EnvError(
                    f"{name}: agent_terminated has no '{g}', which the env's "
                    "agent_terminations=True promises from every step"
                )
            tensor(f"agent_terminated['{g}']", step.agent_terminated[g], (e, n), {torch.bool})
        if not gs.has_action_mask:
            continue
        if g not in step.action_mask:
            raise EnvError(f"{name}: action_mask has no '{g}', whose spec says has_action_mask")
        mask = step.action_mask[g]
        tensor(f"action_mask['{g}']", mask, (e, n, gs.action.total), {torch.bool})
        start = 0
        for size in gs.action.nvec:
            allowed = mask[..., start : start + size].any(-1) | ~step.alive[g]
            if not bool(allowed.all()):
                env_i, agent = (int(i) for i in (~allowed).nonzero()[0])
                raise EnvError(
                    f"{name}: action_mask['{g}'] allows no action for alive agent {agent} of env "
                    f"{env_i}; allow at least one (a no-op), or mark the agent not alive"
                )
            start += size
    if method == "step":
        _check_final_fields(name, step, tensor, floats)
    stats = step.stats if isinstance(step.stats, dict) else {}
    for stat in spec.stat_names:
        if stat in stats:
            tensor(f"stats['{stat}']", stats[stat], (e,), floats)
        elif method == "step":  # (no episode has ended at a reset)
            # the trainer would average a 0 over the episodes that ended, silently
            raise EnvError(
                f"{name}: stats has no '{stat}', which spec.stat_names lists; return it from "
                "every step, for every env (its value counts where an episode ended)"
            )
