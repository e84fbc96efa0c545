"""Many seeds in one process (``num_seeds=N``): N independent MAPPO runs in one set of kernels.

Seeds ``seed, seed + 1, ..., seed + N - 1`` of one configuration are trained side by side. Each
keeps what a run of its own would have: its networks (initialised from its seed), optimiser
moments, sampling and shuffling generators, its ``E`` envs (seeded as a single run seeds them),
its episode statistics, evaluations, metrics, checkpoints and run directory. What they share is
the work: the parameters of all seeds are stacked along a leading seed axis and every network
call runs once for all seeds with :func:`torch.func.vmap` (a batched matrix multiply where a
single run makes a plain one), so N seeds launch about as many kernels per step as one.

Exactness: seed ``k`` of an N-seed run computes what a single run of seed ``k`` computes, in the
same order, up to floating-point rounding of the batched kernels (tests compare parameters after
a few updates). Adam is elementwise, so one Adam over the stacked parameters is N Adams; gradient
clipping, ValueNorm/PopArt and advantage normalisation are per seed. A seed's checkpoint has the
format of a single run's: ``mappo train --resume`` continues one seed alone, and
``mappo train --resume DIR DIR ...`` continues several together.

Envs that can split their random draws by seed (the particle world's ``seed_blocks``) step all
seeds in one call; others are stepped one seed after another, since an env's draws must come
from its own seed's generator for the runs to be exact. The networks, the sampling and the
update are shared calls; the returns and the ValueNorm/PopArt statistics are computed per seed.
With ``compile=on`` (or ``auto`` where it compiles, :func:`mappo.learners.ppo.cpu_pays`) the
vmapped step and loss are compiled (``torch.compile``, one graph each; not yet replayed as CUDA
graphs). Where one env holds every seed's envs and lets its step be traced (the particle
world), its step joins the stacked policy step in one graph, as for one seed
(:func:`mappo.compiled.fuses_env_step`); elsewhere the env steps eagerly between the graphs.
Only the PPO family (mappo, ippo and their recurrent forms) trains this way.

Shapes: ``N`` seeds, ``E`` envs per seed; the collector sees ``N * E`` envs, seed ``k`` owning
rows ``k * E`` to ``(k + 1) * E - 1``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from mappo.acting import Acted
from mappo.algos.mappo import (
    GroupSamples,
    Optimizers,
    Samples,
    load_optimizer_state,
    loss_terms,
    make_samples,
)
from mappo.checkpoint import restore_generator
from mappo.compiled import (
    MAX_COMPILED_CHUNK,
    compile_fn,
    compile_seconds,
    wanted,
)
from mappo.config import ConfigError, TrainConfig
from mappo.data import (
    EnvStep,
    GroupBuffer,
    LazyGroups,
    Rollout,
    final_state_unread,
    step_from_dict,
    step_to_dict,
)
from mappo.envs.base import BatchedEnv
from mappo.envs.registry import make as make_env
from mappo.learners.ppo import clock, cpu_pays, fuse_env_steps, generator
from mappo.nn.actor_critic import ActorCritic
from mappo.rollout import (
    Collector,
    EpisodeTracker,
    allocate,
    policy_step,
    warn_fresh_episodes,
)

# -- the envs of all seeds as one batch -------------------------------------------------------


def cat_steps(steps: list[EnvStep]) -> EnvStep:
    """The :class:`EnvStep` of several env batches, concatenated along the env axis (a lazy
    per-group field stays lazy)."""

    def cat(values: list[Any]) -> Any:
        first = values[0]
        if first is None:
            return None
        if isinstance(first, Tensor):
            return torch.cat(values)
        if isinstance(first, LazyGroups):
            return LazyGroups(
                {g: (lambda g=g: torch.cat([v[g] for v in values])) for g in first}  # type: ignore[misc]
            )
        if isinstance(first, Mapping):
            return {g: torch.cat([v[g] for v in values]) for g in first}
        raise TypeError(f"cannot concatenate {type(first).__name__}")

    fields = {
        f.name: cat([getattr(s, f.name) for s in steps])
        for f in dataclasses.fields(EnvStep)
        if f.name != "final_state"
    }
    # The final states stay unread where an env gives them as a function (reading them would
    # put together a state few training runs ask for, on every step).
    if any(final_state_unread(s) for s in steps):
        fields["final_state"] = lambda: cat([s.final_state for s in steps])
    else:
        fields["final_state"] = cat([s.final_state for s in steps])
    return EnvStep(**fields)


class SeedBlocks:
    """The envs of N seeds as one batch of ``N * E`` copies, seed ``k`` owning rows
    ``k * E .. (k + 1) * E - 1``: N envs of ``E`` copies stepped one after another (any env).
    :class:`OneEnvBlocks` does the same in one env that splits its random draws by seed."""

    def __init__(self, envs: list[BatchedEnv], seeds: list[int]) -> None:
        self.envs = envs
        self.seeds = seeds
        self.spec = envs[0].spec
        self.per_seed = envs[0].num_envs
        self.num_envs = self.per_seed * len(envs)
        self.device = envs[0].device
        self.name = envs[0].name
        # the rollout stores byte observations as bytes (mappo.rollout.stored_dtypes)
        self.byte_observations = envs[0].byte_observations
        self.agent_terminations = envs[0].agent_terminations

    def rows(self, k: int) -> slice:
        """Seed ``k``'s rows of the batch."""
        return slice(k * self.per_seed, (k + 1) * self.per_seed)

    def env_of(self, k: int) -> BatchedEnv:
        """The env that seed ``k``'s run holds (its spec; closed with the run)."""
        return self.envs[k]

    def first_step(self) -> EnvStep:
        """Every seed's envs reset from its seed, as a single run resets them."""
        for env in self.envs:
            env.validate_actions = False  # the trainer's own actions are always well formed
        return cat_steps([env.reset(seed=s) for env, s in zip(self.envs, self.seeds, strict=True)])

    def step(self, actions: dict[str, Tensor]) -> EnvStep:
        """Step every seed's envs with its rows of ``actions`` (``[N * E, n, ...]`` per group)."""
        return cat_steps(
            [
                env.step({g: a[self.rows(k)] for g, a in actions.items()})
                for k, env in enumerate(self.envs)
            ]
        )

    def claim_traced_step(self) -> Callable[[dict[str, Tensor]], EnvStep] | None:
        """Never: the seeds' envs step one after another (:class:`OneEnvBlocks` can)."""
        return None

    def claim_traced_steps(self, count: int) -> Callable[[dict[str, Tensor]], EnvStep] | None:
        return None

    def seed_state(self, k: int) -> dict[str, Any] | None:
        """Seed ``k``'s env snapshot and generator state (``None`` where the env cannot be
        snapshotted), as :meth:`mappo.rollout.Collector.state_dict` saves a single run's."""
        env = self.envs[k]
        try:
            return {"state": env.get_state(), "rng": env.generator.get_state()}
        except NotImplementedError:
            return None

    def load_seed_state(self, k: int, saved: dict[str, Any], iteration: int = 0) -> None:
        """Put seed ``k``'s envs back into a :meth:`seed_state` (of ``iteration``)."""
        env = self.envs[k]
        env.set_state({n: v.to(self.device) for n, v in saved["state"].items()})
        restore_generator(env.generator, saved["rng"], self.seeds[k] + iteration, "env")

    def reset_seed(self, k: int, seed: int) -> EnvStep:
        """Fresh episodes for seed ``k``'s envs (an env without snapshots, on resume)."""
        return self.envs[k].reset(seed=seed)

    def close(self) -> None:
        """Release the envs' resources (worker processes of adapted envs)."""
        for env in self.envs:
            env.close()


class OneEnvBlocks(SeedBlocks):
    """The envs of N seeds in one env of ``N * E`` copies whose random draws come, per block of
    ``E`` copies, from each seed's own generator (``seed_blocks``, e.g. the particle world's):
    one batched env step for all seeds, and block ``k`` replays exactly seed ``k``'s env."""

    def __init__(self, env: BatchedEnv, seeds: list[int]) -> None:
        super().__init__([env], seeds)
        self.per_seed = env.num_envs // len(seeds)

    def env_of(self, k: int) -> BatchedEnv:
        return self.envs[0]

    def first_step(self) -> EnvStep:
        env = self.envs[0]
        env.validate_actions = False
        return env.seed_blocks(self.seeds)  # type: ignore[attr-defined]

    def step(self, actions: dict[str, Tensor]) -> EnvStep:
        return self.envs[0].step(actions)

    def claim_traced_step(self) -> Callable[[dict[str, Tensor]], EnvStep] | None:
        """The one env's traced step (:meth:`~mappo.envs.base.BatchedEnv.claim_traced_step`):
        all seeds' envs step in it."""
        return self.envs[0].claim_traced_step()

    def claim_traced_steps(self, count: int) -> Callable[[dict[str, Tensor]], EnvStep] | None:
        return self.envs[0].claim_traced_steps(count)

    def seed_state(self, k: int) -> dict[str, Any] | None:
        env, rows = self.envs[0], self.rows(k)
        state = {n: v[rows].clone() for n, v in env.get_state().items()}
        return {"state": state, "rng": env.block_generator(k).get_state()}  # type: ignore[attr-defined]

    def load_seed_state(self, k: int, saved: dict[str, Any], iteration: int = 0) -> None:
        env, rows = self.envs[0], self.rows(k)
        ids = torch.arange(rows.start, rows.stop, device=self.device)
        env.set_state({n: v.to(self.device) for n, v in saved["state"].items()}, env_ids=ids)
        block = env.block_generator(k)  # type: ignore[attr-defined]
        restore_generator(block, saved["rng"], self.seeds[k] + iteration, "env")

    def reset_seed(self, k: int, seed: int) -> EnvStep:
        raise NotImplementedError("an env with seed blocks is always snapshotted")


def make_seed_envs(cfgs: list[TrainConfig], device: torch.device) -> SeedBlocks:
    """The envs of the seeds ``cfgs`` (configs that differ only in ``seed``): one env split into
    seed blocks where the env can (:class:`OneEnvBlocks`), else one env per seed."""
    envs: list[BatchedEnv] = []
    try:
        for c in cfgs:
            env = make_env(
                c.env.name, num_envs=c.env.num_envs, device=device, seed=c.seed, **c.env.kwargs
            )
            envs.append(env)
            if hasattr(env, "seed_blocks"):
                # (the first seed's env told that its kind splits; one env for all seeds)
                env.close()
                envs.clear()
                one = make_env(
                    c.env.name,
                    num_envs=c.env.num_envs * len(cfgs),
                    device=device,
                    seed=c.seed,
                    **c.env.kwargs,
                )
                return OneEnvBlocks(one, [c.seed for c in cfgs])
    except BaseException:
        for env in envs:
            env.close()
        raise
    return SeedBlocks(envs, [c.seed for c in cfgs])


# -- episode statistics per seed --------------------------------------------------------------


class BlockTracker:
    """:class:`~mappo.rollout.EpisodeTracker` over ``N * E`` envs with sums per seed: running
    returns ``[N * E]``, sums of finished episodes ``[N]``. :meth:`seed` is seed ``k``'s
    tracker as the trainer reads it, and its state is a single run's tracker state."""

    def __init__(self, seeds: int, stat_names: tuple[str, ...], tracker: EpisodeTracker) -> None:
        self.seeds = seeds
        self.t = tracker  # the per-env fields [N * E]; its sums are overwritten with [N] here
        z = torch.zeros(seeds, device=tracker.returns.device)
        self.t.finished, self.t.return_sum, self.t.length_sum = z.clone(), z.clone(), z.clone()
        self.t.stat_sums = {s: z.clone() for s in stat_names}

    def record(self, step: EnvStep) -> None:
        """Add a step's rewards; add the episodes it ended to their seed's sums."""
        t, N = self.t, self.seeds
        # in-place methods, not ``+=``, as in EpisodeTracker.record (no attribute stores for a
        # compiled rollout to return)
        rewards = torch.cat([r for r in step.reward.values()], dim=1)
        t.returns.add_(rewards.mean(1))
        t.lengths.add_(1)
        done = step.done.to(t.returns.dtype)
        t.finished.add_(done.view(N, -1).sum(1))
        t.return_sum.add_((t.returns * done).view(N, -1).sum(1))
        t.length_sum.add_((t.lengths * done).view(N, -1).sum(1))
        for name, total in t.stat_sums.items():
            total.add_((step.stats[name] * done).view(N, -1).sum(1))
        t.returns.mul_(1.0 - done)
        t.lengths.mul_(1.0 - done)

    def seed(self, k: int, rows: slice) -> EpisodeTracker:
        """Seed ``k``'s tracker (``rows`` of the per-env fields): views, so that its ``read``
        and ``load_state_dict`` act on this tracker."""
        t = self.t
        return _TrackerView(
            t.returns[rows],
            t.lengths[rows],
            t.finished[k],
            t.return_sum[k],
            t.length_sum[k],
            {s: v[k] for s, v in t.stat_sums.items()},
        )


class _TrackerView(EpisodeTracker):
    """An :class:`EpisodeTracker` whose tensors are views into a :class:`BlockTracker`'s;
    loading copies into them instead of replacing them."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            value, mine = state[f.name], getattr(self, f.name)
            if isinstance(value, dict):
                for k, v in value.items():
                    mine[k].copy_(v)
            else:
                mine.copy_(value)

    def state_dict(self) -> dict[str, Any]:
        """Copies: a view saved by ``torch.save`` would carry every seed's storage."""
        return {
            f.name: (
                {k: v.clone() for k, v in getattr(self, f.name).items()}
                if isinstance(getattr(self, f.name), dict)
                else getattr(self, f.name).clone()
            )
            for f in dataclasses.fields(self)
        }


# -- stacked parameters and vmapped calls -----------------------------------------------------


def _stack_aliased(modules: list[nn.Module]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Stack the parameters and buffers of identical ``modules`` along a new leading axis, and
    make each module's own tensors views of its slice, so that an update of the stacked tensors
    (the optimiser's, a normaliser's) is what every module holds, and what it saves."""
    params: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    for out, named in ((params, "named_parameters"), (buffers, "named_buffers")):
        per_module = [dict(getattr(m, named)()) for m in modules]
        for name, first in per_module[0].items():
            parts = [d[name] for d in per_module]
            stacked = torch.stack([p.detach() for p in parts])
            if isinstance(first, nn.Parameter):
                stacked = nn.Parameter(stacked, requires_grad=first.requires_grad)
            for k, p in enumerate(parts):
                p.data = stacked.data[k]
            out[name] = stacked
    return params, buffers


class _Call(nn.Module):
    """A function of an :class:`ActorCritic` as a module's forward, for ``functional_call``."""

    def __init__(self, policy: ActorCritic, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.policy = policy
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(self.policy, *args)


def _step_of(d: dict[str, Any], starts: Tensor) -> EnvStep:
    """An :class:`EnvStep` with the parts agents act on (``step_to_dict``), for a vmapped call."""
    return EnvStep(
        obs=d["obs"],
        state=d["state"],
        reward={},
        terminated=starts,
        truncated=starts,
        alive=d["alive"],
        action_mask=d["action_mask"],
        agent_state=d["agent_state"],
    )


def _policy_step(
    policy: ActorCritic,
    step: dict[str, Any],
    actor_states: dict[str, Tensor],
    critic_states: dict[str, Tensor],
    starts: Tensor,
    noise: dict[str, Tensor],
) -> tuple[Any, ...]:
    """:func:`mappo.rollout.policy_step` on a step given as a dict, with tensors out."""
    acted, critic_x, values, new_critic = policy_step(
        policy, _step_of(step, starts), actor_states, critic_states, starts, noise
    )
    return (
        acted.actions,
        acted.env_actions,
        acted.states,
        acted.log_probs,
        critic_x,
        values,
        new_critic,
    )


def _critic(
    policy: ActorCritic, name: str, x: Tensor, state: Tensor, starts: Tensor
) -> tuple[Tensor, Tensor]:
    """Group ``name``'s critic on ``x [L, E, C, in]``: normalised values and the final state."""
    return policy.critics[name](x, state, starts)


_SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(GroupSamples))
"""(Read here, not in the traced function: ``dataclasses.fields`` does not compile.)"""


def _samples_of(d: dict[str, Any], padded: bool) -> Samples:
    groups = {
        name: GroupSamples(**{k: g.get(k) for k in _SAMPLE_FIELDS})
        for name, g in d["groups"].items()
    }
    return Samples(groups, d["starts"], d["valid"], padded)


def _fields(x: Any, drop_none: bool = False) -> dict[str, Any]:
    """A dataclass's fields as a dict (without the ``None`` ones when ``drop_none``: vmap
    takes tensors only)."""
    out = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    return {k: v for k, v in out.items() if v is not None} if drop_none else out


class _SeedCritic:
    """What the collector calls as ``policy.critics[name]``: every seed's critic at once on
    ``[L, N * E, C, in]`` inputs."""

    def __init__(self, owner: StackedPolicy, name: str) -> None:
        self.owner, self.name = owner, name
        self.state_size = owner.template.critics[name].state_size

    def __call__(self, x: Tensor, state: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
        o = self.owner
        N, L, E = o.seeds, x.shape[0], x.shape[1] // o.seeds
        values, new_state = o.critic_fn(
            o.params,
            o.buffers,
            self.name,
            x.reshape(L, N, E, *x.shape[2:]),
            state.reshape(N, E, *state.shape[1:]),
            starts.reshape(L, N, E),
        )
        return values.reshape(L, N * E, *values.shape[3:]), new_state.reshape(state.shape)


class StackedPolicy:
    """The seeds' actor-critics behind the interface the collector uses of one
    :class:`ActorCritic` (``critics``, ``critic_input``, ``draw_noise``, a step function)."""

    def __init__(
        self,
        policies: list[ActorCritic],
        generators: list[torch.Generator],
        compiled: bool,
        fallback: bool = False,
    ) -> None:
        self.policies = policies
        self.template = policies[0]
        self.seeds = len(policies)
        self.generators = generators
        self.params, self.buffers = _stack_aliased(policies)

        def call(fn: Callable[..., Any]) -> Callable[..., Any]:
            module = _Call(self.template, fn)
            prefix = "policy."

            def run(params: dict[str, Tensor], buffers: dict[str, Tensor], *args: Any) -> Any:
                state = {prefix + k: v for k, v in {**params, **buffers}.items()}
                return functional_call(module, state, args)

            run.__name__ = f"stacked{fn.__name__}"  # names it in compile=auto's warnings
            return run

        step = vmap(call(_policy_step), in_dims=0, randomness="error")
        critic = vmap(
            call(_critic), in_dims=(0, 0, None, 1, 0, 1), out_dims=(1, 0), randomness="error"
        )
        self._raw_step = step  # traced inside the fused rollout graphs (traced_step)
        if compiled:
            # (without CUDA graphs: replaying vmapped graphs on a GPU is not tested yet)
            step = compile_fn(step, fallback=fallback)
            critic = compile_fn(critic, fallback=fallback)
        self._step, self.critic_fn = step, critic
        self.critics = {name: _SeedCritic(self, name) for name in self.template.critics}

    def critic_input(self, name: str, step: EnvStep, final: bool = False) -> Tensor:
        """The critic input of every env (it has no parameters of its own)."""
        return self.template.critic_input(name, step, final)

    def draw_noise(self, batch: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """Each seed's sampling noise from its own generator (``generator`` is not used),
        concatenated along the env axis: ``[1, N * E, ...]`` per group."""
        per_seed = [self.template.draw_noise(batch // self.seeds, g) for g in self.generators]
        return {g: torch.cat([d[g] for d in per_seed], 1) for g in per_seed[0]}

    def draw_noises(
        self, steps: int, batch: int, generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        """:meth:`draw_noise` for ``steps`` consecutive steps, stacked: ``[steps, 1, N * E,
        ...]`` per group."""
        draws = [self.draw_noise(batch, generator) for _ in range(steps)]
        return {name: torch.stack([d[name] for d in draws]) for name in draws[0]}

    def step(self, policy: Any, *args: Any) -> Any:
        """The collector's step function (:func:`mappo.rollout.policy_step`, the same arguments
        and results; ``policy`` is this object) for all seeds; :meth:`_run` lists them."""
        return self._run(self._step, *args)

    def traced_step(self, policy: Any, *args: Any) -> Any:
        """:meth:`step` (the same arguments) with the vmapped step uncompiled, for tracing
        inside a compiled graph that also steps the env (:func:`mappo.rollout.fused_step`)."""
        return self._run(self._raw_step, *args)

    def _run(
        self,
        fn: Callable[..., Any],
        step: EnvStep,
        actor_states: dict[str, Tensor],
        critic_states: dict[str, Tensor],
        starts: Tensor,
        noise: dict[str, Tensor],
    ) -> tuple[Any, dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
        """Seed-split arguments through the vmapped ``fn``, results merged back to ``N * E``."""
        N = self.seeds

        def split(x: Tensor, dim: int = 0) -> Tensor:
            return x.reshape(*x.shape[:dim], N, x.shape[dim] // N, *x.shape[dim + 1 :])

        def split_all(tree: Any) -> Any:
            return torch.utils._pytree.tree_map(split, tree)

        noise_ = {g: split(v, 1).movedim(1, 0) for g, v in noise.items()}
        out = fn(
            self.params,
            self.buffers,
            split_all(step_to_dict(step)),
            split_all(actor_states),
            split_all(critic_states),
            split(starts),
            noise_,
        )
        actions, env_actions, states, log_probs, critic_x, values, new_critic = (
            torch.utils._pytree.tree_map(
                lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), out
            )
        )
        acted = Acted(actions, states, log_probs, env_actions)
        return acted, critic_x, values, new_critic


# -- the learner ------------------------------------------------------------------------------


def _rows(ro: Rollout, rows: slice) -> Rollout:
    """Seed rows of a rollout (views)."""

    def cut(x: Tensor | None) -> Tensor | None:
        return None if x is None else x[:, rows]

    groups = {
        name: GroupBuffer(**{k: cut(v) for k, v in _fields(buf).items()})
        for name, buf in ro.groups.items()
    }
    return Rollout(groups, ro.starts[:, rows], ro.terminated[:, rows], ro.truncated[:, rows])


def _stack_samples(per_seed: list[Samples]) -> Samples:
    """Stack seeds' samples along a new leading axis (an injection one seed does not need is
    zeros there)."""

    def stack(values: list[Tensor | None]) -> Tensor | None:
        present = [v for v in values if v is not None]
        if not present:
            return None
        return torch.stack([torch.zeros_like(present[0]) if v is None else v for v in values])

    groups = {
        name: GroupSamples(
            **{
                f.name: stack([getattr(s.groups[name], f.name) for s in per_seed])
                for f in dataclasses.fields(GroupSamples)
            }
        )
        for name in per_seed[0].groups
    }
    return Samples(
        groups,
        torch.stack([s.starts for s in per_seed]),
        torch.stack([s.valid for s in per_seed]),
        per_seed[0].padded,
    )


def _select(samples: Samples, idx: Tensor | None) -> Samples:
    """Each seed's chunks ``idx [N, m]`` of stacked ``samples`` (all of them when ``None``)."""
    if idx is None:
        return samples
    seeds = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1)

    def take(x: Tensor | None) -> Tensor | None:
        # [N, L, M, ...] -> [N, m, L, ...] (advanced indices first) -> [N, L, m, ...]
        return None if x is None else x[seeds, :, idx].transpose(1, 2)

    def pick(name: str, x: Tensor | None) -> Tensor | None:
        if name in ("actor_state", "critic_state"):
            return x[seeds, idx]  # type: ignore[index]
        return take(x)

    groups = {
        name: GroupSamples(**{k: pick(k, v) for k, v in _fields(s).items()})
        for name, s in samples.groups.items()
    }
    return Samples(groups, take(samples.starts), take(samples.valid), samples.padded)


def seed_grad_norms(params: list[Tensor], max_norm: float | None) -> Tensor:
    """Per seed ``[N]``, the global norm of the gradients of stacked ``params`` (``[N, ...]``
    each), after clipping each seed's to ``max_norm`` as
    :func:`torch.nn.utils.clip_grad_norm_` clips one run's."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads], 1)
    total = torch.linalg.vector_norm(norms, dim=1)
    if max_norm is not None:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))
    return total


class StackedPPOLearner:
    """N seeds of the MAPPO learner (:class:`~mappo.learners.ppo.PPOLearner`), stacked."""

    def __init__(self, cfgs: list[TrainConfig], blocks: SeedBlocks) -> None:
        self.cfgs = cfgs
        self.cfg = cfg = cfgs[0]
        self.seeds = len(cfgs)
        self.device = blocks.device
        spec = blocks.spec
        policies = []
        for c in cfgs:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(c.seed)
                policies.append(ActorCritic(spec, c.model, c.algo).to(self.device))
        self.policies = policies
        self.recurrent = cfg.model.recurrent != "none"
        self.sample_gens = [generator(self.device, c.seed + 1) for c in cfgs]
        self.shuffle_gens = [generator(torch.device("cpu"), c.seed + 2) for c in cfgs]
        self.compiled = wanted(cfg.compile, self.device, cpu_pays(cfg, blocks.env_of(0)))
        self.stacked = StackedPolicy(
            policies, self.sample_gens, self.compiled, fallback=cfg.compile == "auto"
        )
        a = cfg.algo
        named = self.stacked.params
        self.actor_params = [p for n, p in named.items() if n.startswith("actors.")]
        self.critic_params = [p for n, p in named.items() if n.startswith("critics.")]
        self.group_params = {
            g: (
                [p for n, p in named.items() if n.startswith(f"actors.{g}.")],
                [p for n, p in named.items() if n.startswith(f"critics.{g}.")],
            )
            for g in policies[0].actors
        }
        # One Adam over the stacked parameters is N Adams (it is elementwise), in the parameter
        # order of a single run's (checkpoints index the moments by it).
        fused = True if self.device.type in ("cpu", "cuda") else None
        self.optim = Optimizers(
            torch.optim.Adam(
                self.actor_params, lr=a.actor_lr, eps=a.adam_eps, weight_decay=a.weight_decay,
                fused=fused,
            ),
            torch.optim.Adam(
                self.critic_params, lr=a.critic_lr, eps=a.adam_eps, weight_decay=a.weight_decay,
                fused=fused,
            ),
        )  # fmt: skip
        self.blocks = blocks
        first = blocks.first_step()
        E = blocks.num_envs
        template = policies[0]
        actor_states, critic_states = template.initial_states(E, self.device)
        tracker = EpisodeTracker.create(E, spec.stat_names, self.device)
        self.block_tracker = BlockTracker(self.seeds, spec.stat_names, tracker)
        self.collector = Collector(
            env=self.blocks,  # type: ignore[arg-type]
            policy=self.stacked,  # type: ignore[arg-type]
            rollout=allocate(template, self.blocks, cfg.rollout_length, a.bootstrap_truncation),  # type: ignore[arg-type]
            generator=self.sample_gens[0],
            step=first,
            actor_states=actor_states,
            critic_states=critic_states,
            starts=torch.ones(E, dtype=torch.bool, device=self.device),
            tracker=self.block_tracker,  # type: ignore[arg-type]
            bootstrap=a.bootstrap_truncation,
            step_fn=self.stacked.step,
            traced_step_fn=self.stacked.traced_step,
        )
        if self.compiled and isinstance(blocks, OneEnvBlocks):
            # The one env's step for all seeds joins the stacked policy step, as for one seed.
            fuse_env_steps(self.collector, blocks.env_of(0), cfg, self.recurrent, blocks.per_seed)
        compile_loss = self.compiled and (
            not self.recurrent or a.data_chunk_length <= MAX_COMPILED_CHUNK
        )
        self._loss_fns: dict[bool, Callable[..., Any]] = {}
        self._compile_loss = compile_loss
        self._compile_start = compile_seconds() if self.compiled else 0.0

    # -- one iteration ------------------------------------------------------------------------
    def _loss_fn(self, padded: bool) -> Callable[..., Any]:
        if padded not in self._loss_fns:
            cfg = self.cfg.algo

            def terms(policy: ActorCritic, batch: dict[str, Any]) -> dict[str, Tensor]:
                return loss_terms(policy, _samples_of(batch, padded), cfg)

            module = _Call(self.policies[0], terms)

            def run(
                params: dict[str, Tensor], buffers: dict[str, Tensor], batch: dict[str, Any]
            ) -> dict[str, Tensor]:
                state = {"policy." + k: v for k, v in {**params, **buffers}.items()}
                return functional_call(module, state, (batch,))

            run.__name__ = "stacked_loss_terms"  # names it in compile=auto's warnings
            fn = vmap(run, randomness="error")
            if self._compile_loss:
                fn = compile_fn(fn, fallback=self.cfg.compile == "auto")
            self._loss_fns[padded] = fn
        return self._loss_fns[padded]

    def iterate(self, iteration: int, env_steps: int) -> list[dict[str, float]]:
        """Collect one rollout of every seed and update every seed once; returns each seed's
        result as :meth:`PPOLearner.iterate` does (the timings are the shared call's)."""
        cfg = self.cfg
        if cfg.algo.lr_decay:
            self.optim.set_lr_fraction(1.0 - iteration / cfg.num_updates, cfg.algo)
        t0 = time.perf_counter()
        for p in self.policies:
            p.eval()
        rollout = self.collector.collect()
        t1 = clock(self.device)
        for p in self.policies:
            p.train()
        samples = _stack_samples(
            [
                make_samples(
                    p,
                    _rows(rollout, self.blocks.rows(k)),
                    cfg.algo,
                    self.recurrent,
                    # one graph for the compiled loss (as a single run's, PPOLearner)
                    always_inject=self._compile_loss,
                )
                for k, p in enumerate(self.policies)
            ]
        )
        losses = self._update(samples)
        t2 = clock(self.device)
        out = []
        for k in range(self.seeds):
            result = {
                "env_steps": cfg.steps_per_update,
                "rollout_seconds": t1 - t0,
                "update_seconds": t2 - t1,
                **losses[k],
            }
            if self.compiled:
                result["compile_seconds"] = compile_seconds() - self._compile_start
            out.append(result)
        return out

    def _update(self, samples: Samples) -> list[dict[str, float]]:
        """:func:`mappo.algos.mappo.update` for every seed at once."""
        a = self.cfg.algo
        M = samples.starts.shape[2]
        loss_fn = self._loss_fn(samples.padded)
        sums: dict[str, Tensor] = {}
        batches = 0
        for _ in range(a.epochs):
            if a.num_minibatches == 1:
                chunks: list[Tensor | None] = [None]
            else:
                orders = torch.stack([torch.randperm(M, generator=g) for g in self.shuffle_gens])
                chunks = list(orders.to(self.device).tensor_split(a.num_minibatches, dim=1))
            for idx in chunks:
                batch = _select(samples, idx)
                for k, policy in enumerate(self.policies):
                    valid = batch.valid[k].bool()
                    for name, s in batch.groups.items():
                        ret = s.returns[k]
                        policy.critics[name].update_normalizer(ret[valid] if batch.padded else ret)
                terms = loss_fn(
                    self.stacked.params,
                    self.stacked.buffers,
                    {
                        "groups": {n: _fields(s, True) for n, s in batch.groups.items()},
                        "starts": batch.starts,
                        "valid": batch.valid,
                    },
                )
                self.optim.actor.zero_grad(set_to_none=True)
                self.optim.critic.zero_grad(set_to_none=True)
                (terms["actor_loss"] + terms["critic_loss"]).sum().backward()
                for g, (actor, critic) in self.group_params.items():
                    terms[f"{g}/actor_grad_norm"] = seed_grad_norms(actor, a.max_grad_norm)
                    terms[f"{g}/critic_grad_norm"] = seed_grad_norms(critic, a.max_grad_norm)
                self.optim.actor.step()
                self.optim.critic.step()
                for k, v in terms.items():
                    sums[k] = sums.get(k, 0.0) + v.detach()
                batches += 1
        keys = list(sums)
        table = (torch.stack([sums[k] for k in keys], 1) / batches).cpu().tolist()  # [N, keys]
        return [dict(zip(keys, row, strict=True)) for row in table]

    def schedule_metrics(self) -> dict[str, float]:
        """Learning rates now (the same for every seed)."""
        return {
            "actor_lr": self.optim.actor.param_groups[0]["lr"],
            "critic_lr": self.optim.critic.param_groups[0]["lr"],
        }

    # -- a seed's state, in a single run's format ---------------------------------------------
    def _optim_state(self, opt: torch.optim.Optimizer, k: int) -> dict[str, Any]:
        saved = opt.state_dict()
        state = {
            i: {key: (v.clone() if key == "step" else v[k].clone()) for key, v in s.items()}
            for i, s in saved["state"].items()
        }
        return {"state": state, "param_groups": saved["param_groups"]}

    def seed_state_dict(self, k: int) -> dict[str, Any]:
        """What a single run of seed ``k`` would save as its learner state
        (:meth:`PPOLearner.state_dict`)."""
        rows = self.blocks.rows(k)
        env_state = self.blocks.seed_state(k)
        c = self.collector

        def cut(tree: Any) -> Any:
            return torch.utils._pytree.tree_map(lambda x: x[rows].clone(), tree)

        return {
            "policy": {n: v.clone() for n, v in self.policies[k].state_dict().items()},
            "optim": {
                "actor": self._optim_state(self.optim.actor, k),
                "critic": self._optim_state(self.optim.critic, k),
            },
            "rng": {
                "sample": self.sample_gens[k].get_state(),
                "shuffle": self.shuffle_gens[k].get_state(),
            },
            "collector": {
                "env": env_state,
                "step": cut(step_to_dict(c.step)),
                "actor_states": cut(c.actor_states),
                "critic_states": cut(c.critic_states),
                "starts": c.starts[rows].clone(),
                "tracker": self.seed_tracker(k).state_dict(),
            },
        }

    def seed_tracker(self, k: int) -> EpisodeTracker:
        """Seed ``k``'s episode statistics, as a single run's tracker."""
        return self.block_tracker.seed(k, self.blocks.rows(k))

    def load_seed_states(self, states: list[dict[str, Any]], iteration: int) -> None:
        """Restore every seed from a single run's learner state (:meth:`seed_state_dict`)."""
        with torch.no_grad():
            for k, state in enumerate(states):
                self.policies[k].load_state_dict(state["policy"])  # copies into the stacked
                seed = self.cfgs[k].seed
                restore_generator(
                    self.sample_gens[k], state["rng"]["sample"], seed, iteration, "sample"
                )
                restore_generator(
                    self.shuffle_gens[k], state["rng"]["shuffle"], seed, iteration, "order"
                )
        for opt, key in ((self.optim.actor, "actor"), (self.optim.critic, "critic")):
            saved = [s["optim"][key] for s in states]
            steps = {float(s["state"][0]["step"]) if 0 in s["state"] else 0.0 for s in saved}
            if len(steps) > 1:
                raise ConfigError(
                    f"the seeds' optimisers have taken different numbers of steps "
                    f"{sorted(steps)}; resume them separately"
                )
            stacked: dict[int, dict[str, Tensor]] = {}
            for i in saved[0]["state"]:
                stacked[i] = {
                    name: (
                        value
                        if name == "step"
                        else torch.stack([s["state"][i][name] for s in saved])
                    )
                    for name, value in saved[0]["state"][i].items()
                }
            load_optimizer_state(opt, {"state": stacked, "param_groups": saved[0]["param_groups"]})
        c = self.collector
        steps_: list[EnvStep] = []
        for k, state in enumerate(states):
            saved_c = state["collector"]
            rows = self.blocks.rows(k)
            if saved_c["env"] is None:
                # An env that cannot be snapshotted starts fresh episodes (as a single run does).
                if k == 0:
                    warn_fresh_episodes(self.blocks.env_of(0))
                steps_.append(self.blocks.reset_seed(k, self.cfgs[k].seed + iteration))
                self.seed_tracker(k).load_state_dict(saved_c["tracker"])
                self.seed_tracker(k).fresh_episodes()
                continue
            dev = self.device
            self.blocks.load_seed_state(k, saved_c["env"], iteration)
            steps_.append(step_from_dict(saved_c["step"], dev))
            for name, v in saved_c["actor_states"].items():
                c.actor_states[name][rows] = v.to(dev)
            for name, v in saved_c["critic_states"].items():
                c.critic_states[name][rows] = v.to(dev)
            c.starts[rows] = saved_c["starts"].to(dev)
            self.seed_tracker(k).load_state_dict(saved_c["tracker"])
        c.step = cat_steps(steps_)


def release(policies: list[nn.Module]) -> None:
    """Give each seed's parameters and buffers storage of their own (after training): a view of
    the stacked tensors would save every seed's values with one seed's, and stop following the
    stack silently after ``.to()``."""
    with torch.no_grad():
        for policy in policies:
            for t in [*policy.parameters(), *policy.buffers()]:
                t.data = t.data.clone()


class SeedSlot:
    """Seed ``k`` of a :class:`StackedPPOLearner`, as the trainer sees a learner: its networks,
    its episode tracker, its state (the trainer's loop iterates the stack, not the slot)."""

    collector = None

    def __init__(self, stack: StackedPPOLearner, k: int) -> None:
        self.stack, self.k = stack, k
        self.policy = stack.policies[k]
        self.tracker = stack.seed_tracker(k)

    def iterate(self, iteration: int, env_steps: int) -> dict[str, float]:
        raise RuntimeError("a seed of a stacked run iterates with the others (StackedPPOLearner)")

    def last_rollout(self) -> Rollout | None:
        """This seed's rows of the stack's last rollout (views), or None before the first."""
        rollout = getattr(self.stack.collector, "rollout", None)
        return None if rollout is None else _rows(rollout, self.stack.blocks.rows(self.k))

    def schedule_metrics(self) -> dict[str, float]:
        return self.stack.schedule_metrics()

    def state_dict(self, periodic: bool = True) -> dict[str, Any]:
        return self.stack.seed_state_dict(self.k)

    def load_state_dict(self, state: dict[str, Any], iteration: int) -> None:
        raise RuntimeError("restore a stacked run with StackedPPOLearner.load_seed_states")
