"""Using a trained policy outside training: ``mappo.load_policy(path).act(observations)``."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mappo import config as config_mod
from mappo.acting import Acting, act
from mappo.checkpoint import CheckpointError, load_checkpoint, load_latest
from mappo.data import (
    EnvSpec,
    EnvStep,
    library_defaults,
    spec_difference,
    spec_from_dict,
    spec_to_dict,
)
from mappo.envs.base import EnvError
from mappo.learners import build_networks


class Policy:
    """A trained policy of any family: every group's actor (or Q-agent), with its state.

    ``act`` takes per-group observations ``[E, n, *obs_shape]`` (or ``[n, *obs_shape]`` for a
    single env) as tensors or arrays and returns per-group actions ``[E, n, k]``: int64 heads
    of a discrete group, float32 components (in the action box) of a continuous one (``[n, k]``
    for a single env). The recurrent state is kept between calls for ``E`` envs; pass
    ``starts`` (``[E]`` bool, True where an episode begins), act on the env's
    :class:`~mappo.data.EnvStep` (its ends and a reset's step start episodes), or call
    :meth:`reset` at episode boundaries.
    """

    def __init__(
        self,
        policy: Acting,
        spec: EnvSpec,
        cfg: config_mod.TrainConfig,
        device: torch.device,
        checkpoint: Path | None = None,
        env_steps: int | None = None,
        source: str | None = None,
    ) -> None:
        self.model = policy.eval()
        self.spec = spec
        self.config = cfg
        self.device = device
        self.checkpoint = checkpoint
        """The checkpoint file the policy was loaded from (``None``: built in this process)."""
        self.source = source or (str(checkpoint) if checkpoint is not None else None)
        """What it was loaded from as the caller named it (a run directory or a checkpoint)."""
        self.env_steps = env_steps
        """The env steps its run had trained when the checkpoint was saved, where known."""
        self._states: dict[str, Tensor] | None = None

    def __repr__(self) -> str:
        groups = ", ".join(f"{name}: {g.num_agents}" for name, g in self.spec.groups.items())
        trained = f", {self.env_steps:,} env steps" if self.env_steps is not None else ""
        return (
            f"Policy({self.config.algo_name} on {self.config.env.name}, agents {{{groups}}}"
            f"{trained}, {self.device})"
        )

    def reset(self) -> None:
        """Forget the recurrent state (the next ``act`` starts new episodes)."""
        self._states = None

    def evaluate(
        self,
        episodes: int = 100,
        seed: int = 0,
        deterministic: bool = True,
        generator: torch.Generator | None = None,
        **env_kwargs: Any,
    ) -> dict[str, float]:
        """One episode in each of ``episodes`` copies of the run's env (its name and keyword
        arguments from the run's config, ``env_kwargs`` replacing some of them), the envs reset
        with ``seed``, played greedily (sampled with ``deterministic=False``, from ``generator``
        or else one seeded with ``seed``, so that a sampled evaluation repeats): the mean and
        standard deviation of the per-agent episode return (``eval_return_mean``,
        ``eval_return_std``) and the mean of each episode statistic, what ``mappo eval RUN``
        prints. The recurrent state kept for :meth:`act` is left as it was.

        A policy loaded from a file makes its env as ``mappo eval`` does: a name in it that
        imports a module by name needs that module trusted first
        (:func:`mappo.envs.trust_module`)."""
        import operator

        from mappo.envs.registry import fit_workers, from_saved, make
        from mappo.evaluation import evaluate
        from mappo.trainer import check_evaluation_memory

        if isinstance(episodes, bool):
            raise ValueError(f"episodes must be a positive integer, got {episodes!r}")
        try:
            episodes, seed = operator.index(episodes), operator.index(seed)
        except TypeError:
            raise TypeError(f"episodes and seed are integers, got {episodes!r}, {seed!r}") from None
        if episodes < 1:
            raise ValueError(f"episodes must be a positive integer, got {episodes!r}")
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
        fixes = {"num_envs": "episodes=N", "device": "load_policy(device=)"}
        taken = sorted(env_kwargs.keys() & fixes.keys())
        if taken:
            key = taken[0]
            raise ValueError(f"{key} is not an env parameter of evaluate; use {fixes[key]}")
        name = self.config.env.name
        kwargs = {**self.config.env.kwargs, **env_kwargs}
        env_cfg = dataclasses.replace(self.config.env, kwargs=kwargs)
        cfg = dataclasses.replace(self.config, env=env_cfg)
        if not deterministic and generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        saved = contextlib.nullcontext() if self.source is None else from_saved(self.source)
        with saved, library_defaults():  # (float32 observations, whatever the caller's)
            # (inside: the memory check makes a copy of the env, under the same trust rule)
            check_evaluation_memory(cfg, episodes, self.device)
            env = make(
                name,
                num_envs=episodes,
                device=self.device,
                seed=seed,
                **fit_workers(kwargs, episodes),
            )
        with env, library_defaults():
            check_same_spec(self.spec, env, name, self.source or "the policy", env_kwargs)
            return evaluate(self.model, env, seed, deterministic, generator)

    @torch.no_grad()
    def act(
        self,
        observations: dict[str, Any] | EnvStep,
        action_mask: dict[str, Any] | None = None,
        starts: Any = None,
        deterministic: bool = True,
        generator: torch.Generator | None = None,
    ) -> dict[str, Tensor]:
        """Actions for ``observations`` (greedy unless ``deterministic=False``).

        ``observations`` may be an :class:`~mappo.envs.base.EnvStep`, whose action masks and
        episode starts are then used as well: the envs that finished in it, or every env for the
        step of a ``reset`` (no ``final_obs``), start with a fresh recurrent state. Given plain
        arrays, a group whose env has action masks needs them in ``action_mask`` (a
        ``ValueError`` otherwise: unmasked, the policy would return actions the env forbids).
        """
        alive: dict[str, Tensor] | None = None
        if isinstance(observations, EnvStep):
            step = observations
            observations, action_mask, alive = step.obs, step.action_mask, step.alive
            if starts is None:
                # (a reset's step: the recurrent state of the episodes before must not carry on)
                starts = True if step.final_obs is None else step.done
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if not isinstance(observations, Mapping):
            raise TypeError(
                "observations must be a dict of arrays, one per group "
                f"{list(self.spec.groups)} (or an EnvStep), got {type(observations).__name__}"
            )
        if set(observations) != set(self.spec.groups):
            raise ValueError(
                f"observations must have one entry per group {list(self.spec.groups)}, got "
                f"{sorted(observations)}"
            )
        obs, single = {}, False
        for name, group in self.spec.groups.items():
            x = _as_tensor(
                observations[name], torch.float32, self.device, f"observations['{name}']"
            )
            if tuple(x.shape) == (group.num_agents, *group.obs_shape):
                x, single = x.unsqueeze(0), True
            if tuple(x.shape[1:]) != (group.num_agents, *group.obs_shape):
                raise ValueError(
                    f"observations for group '{name}' have shape {tuple(x.shape)}, expected "
                    f"[num_envs, {group.num_agents}, {', '.join(map(str, group.obs_shape))}]"
                )
            if not bool(x.isfinite().all()):
                raise ValueError(f"observations for group '{name}' hold NaN or inf")
            obs[name] = x
        sizes = {name: x.shape[0] for name, x in obs.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"observations of the groups are for different numbers of envs {sizes}; give "
                "every group's observations for the same envs, [num_envs, agents, ...]"
            )
        E = next(iter(obs.values())).shape[0]
        if self._states is None or next(iter(self._states.values())).shape[0] != E:
            before = None if self._states is None else next(iter(self._states.values()))
            if before is not None and before.shape[-1] > 0:
                # (acting on the envs still running, say, would forget every env's memory)
                warnings.warn(
                    f"the recurrent state was kept for {before.shape[0]} envs and is started "
                    f"afresh for {E}: act on the same envs every call (give finished ones "
                    "starts=True), or call reset() where that is meant",
                    stacklevel=3,  # (past torch.no_grad's wrapper, to the caller's line)
                )
            self._states = self.model.acting_states(E, self.device)
            starts_t = torch.ones(E, dtype=torch.bool, device=self.device)
        elif starts is None:
            starts_t = torch.zeros(E, dtype=torch.bool, device=self.device)
        else:
            starts_t = _as_tensor(starts, torch.bool, self.device, "starts")
            if starts_t.numel() == 1:  # one flag for every env (True, False, np.True_, 0)
                starts_t = starts_t.reshape(1).expand(E)
            if starts_t.numel() != E:
                raise ValueError(f"starts must hold one flag per env ({E}), got {starts_t.numel()}")
            starts_t = starts_t.reshape(E)
        masks = {}
        if action_mask is not None and not isinstance(action_mask, Mapping):
            raise TypeError(
                "action_mask must be a dict of arrays, one per group with masks "
                f"{list(self.spec.groups)}, got {type(action_mask).__name__}"
            )
        unknown = sorted(set(action_mask or {}) - set(self.spec.groups))
        if unknown:
            raise ValueError(
                f"action_mask has groups {unknown} this policy does not know; its groups are "
                f"{list(self.spec.groups)}"
            )
        for name, group in self.spec.groups.items():
            if group.has_action_mask and (action_mask is None or name not in action_mask):
                # Unmasked, the policy returns actions its env forbids.
                raise ValueError(
                    f"group '{name}' acts under action masks (its env returns them); pass "
                    f"action_mask={{'{name}': ...}} ([num_envs, {group.num_agents}, "
                    f"{group.action.total}] bool), or the EnvStep itself"
                )
            if action_mask is not None and name in action_mask:
                mask = _as_tensor(
                    action_mask[name], torch.bool, self.device, f"action_mask['{name}']"
                )
                want = (E, group.num_agents, group.action.total)
                # The shape itself, not only the count: a transposed [n, E, A] mask reshaped
                # would allow one agent's actions to another.
                if tuple(mask.shape) not in ((want, want[1:]) if single or E == 1 else (want,)):
                    raise ValueError(
                        f"action_mask for group '{name}' has shape {tuple(mask.shape)}, expected "
                        f"[{', '.join(map(str, want if not single else want[1:]))}]"
                    )
                masks[name] = _usable_mask(
                    name, mask.reshape(want), group.action.nvec, alive, single
                )
        acted = act(self.model, obs, masks, self._states, starts_t, deterministic, generator)
        self._states = acted.states
        return {name: a[0] if single else a for name, a in acted.env_actions.items()}


def check_same_spec(
    trained: EnvSpec, env: Any, name: str, path: str, given: dict[str, Any] | None = None
) -> None:
    """Refuse an env whose spec no longer fits the run's networks (its code or parameters
    changed since training, or ``given``: parameters of the caller's), in one line instead
    of a shape error deep in a network."""
    problem = spec_difference(spec_to_dict(trained), env.spec, bounds=True)
    if problem is not None and given:
        words = " ".join(f"{k}={v}" for k, v in given.items())
        raise EnvError(
            f"the env '{name}' with {words} does not fit the networks of '{path}' ({problem}); "
            "drop the parameters that change what the agents observe or do"
        )
    if problem is not None:
        raise EnvError(
            f"the env '{name}' is not the one '{path}' was trained on ({problem}); "
            "evaluate with the env's code and parameters of the training"
        )


def _usable_mask(
    group: str,
    mask: Tensor,
    nvec: tuple[int, ...],
    alive: dict[str, Tensor] | None,
    single: bool,
) -> Tensor:
    """``mask`` ``[E, n, sum(nvec)]``, checked: a head that forbids every action of an agent
    is refused (the policy would return an action the mask forbids, or none at all), except for
    dead agents when the caller passed an :class:`EnvStep` (its ``alive`` flags): the env ignores
    their actions, so their empty heads are opened to every action."""
    dead = None
    if alive is not None and group in alive:
        dead = ~torch.as_tensor(alive[group], dtype=torch.bool, device=mask.device)
    start = 0
    for head, size in enumerate(nvec):
        part = mask[..., start : start + size]
        empty = ~part.any(-1)
        if dead is not None and bool((empty & dead).any()):
            mask = mask.clone()
            mask[..., start : start + size] |= (empty & dead).unsqueeze(-1)
            empty &= ~dead
        start += size
        if bool(empty.any()):
            env, agent = (int(i) for i in empty.nonzero()[0])
            where = f"agent {agent}" if single else f"agent {agent} of env {env}"
            head_name = f" in action head {head}" if len(nvec) > 1 else ""
            raise ValueError(
                f"action_mask for group '{group}' allows no action for {where}{head_name}; "
                "every acting agent needs at least one allowed action (for dead agents, pass "
                "the EnvStep, whose alive flags excuse them)"
            )
    return mask


def _as_tensor(value: Any, dtype: torch.dtype, device: torch.device, what: str) -> Tensor:
    """``value`` (a tensor, an array or nested lists of numbers) as a tensor of ``dtype``, or a
    ``TypeError`` naming ``what`` (numpy's and torch's own errors name neither)."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype)
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{what} must be an array of numbers, got {type(value).__name__}")
    try:
        array = np.asarray(value)
        if array.dtype == object or array.dtype.kind in "USV":
            raise TypeError(f"{what} must be an array of numbers, got {array.dtype} values")
        return torch.as_tensor(array, dtype=dtype, device=device)
    except (ValueError, RuntimeError) as err:  # ragged lists
        raise TypeError(f"{what} must be an array of numbers ({err})") from None


def _warn_of_a_foreign_checkpoint(run_dir: Path, path: Path, ckpt: dict[str, Any]) -> None:
    """Warn where the run's newest checkpoint and its ``config.yaml`` disagree on what the
    networks depend on (a checkpoint copied in from another run): the policy is the
    checkpoint's."""
    import warnings

    from mappo.trainer import config_file_difference, difference_text

    differs = config_file_difference(run_dir, ckpt.get("config") or {})
    if differs is not None and differs[0]:
        warnings.warn(
            f"'{path}' and '{run_dir / 'config.yaml'}' disagree "
            f"({difference_text(*differs[1][0])}): the checkpoint may be of another run; this "
            "is its policy",
            stacklevel=3,
        )


def load_policy(path: str | Path, device: str | torch.device = "cpu") -> Policy:
    """Load the policy of a run directory (its newest checkpoint) or of a checkpoint file."""
    given, path = str(path), Path(path)
    if path.is_dir():
        run_dir = path
        path, ckpt = load_latest(run_dir)
        _warn_of_a_foreign_checkpoint(run_dir, path, ckpt)
    else:
        ckpt = load_checkpoint(path)
    try:
        cfg = config_mod.from_dict(ckpt["config"])
        spec = spec_from_dict(ckpt["spec"])
    except (KeyError, TypeError, ValueError) as err:  # ConfigError is a ValueError
        raise CheckpointError(f"'{path}' has no usable config or env spec: {err}") from None
    dev = config_mod.check_device(str(device))
    with torch.random.fork_rng(devices=[]), library_defaults():  # (float32 networks)
        model = build_networks(spec, cfg)
    try:
        model.load_state_dict(ckpt["learner"]["policy"])
    except RuntimeError as err:  # missing or misshapen tensors
        first = str(err).strip().splitlines()[-1].strip()
        raise CheckpointError(f"'{path}' does not match its own config: {first}") from None
    progress = ckpt.get("progress")
    steps = progress.get("env_steps") if isinstance(progress, dict) else None
    return Policy(model.to(dev), spec, cfg, dev, checkpoint=path, env_steps=steps, source=given)
