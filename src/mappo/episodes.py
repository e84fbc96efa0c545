"""Whole episodes for the value family: collection on the batched contract, and the replay buffer.

**Collection.** Each call plays one episode in every env: all envs are reset (with a seed the
learner derives from the run's seed and the iteration, so that a resumed run replays the same
episodes on any env, worker-process ones included), step together,
and an env whose episode has ended waits, masked, until the last one ends (its further steps are
neither recorded nor counted as env steps). The episodes of a batch therefore all start at step
0, which is what the agents' recurrent unroll over a stored episode assumes. On fixed-length
tasks (the particle world) nothing waits; on SMAC maps the waiting costs the difference between
an env's episode and the longest in the batch.

**Buffer.** Episodes are stored episode-major, ``[capacity, L + 1, ...]``, on the env's device,
and overwrite the oldest when full; a batch is sampled uniformly without replacement and
returned time-major, cut to its longest episode. Where the env declares that its observations
and global states are whole numbers from 0 to 255 (``BatchedEnv.byte_observations``: Hanabi's
0/1 encodings), they are stored as bytes, a quarter of their float32 size, and read back as the
same float32 values: Hanabi's buffer of PyMARL's 5,000 episodes takes 1.1 GB instead of 4.4 GB,
and so do checkpoints that keep it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from mappo.acting import Acting, act
from mappo.data import EpisodeBatch, check_bytes
from mappo.envs.base import BatchedEnv, is_users_env, refuse_living_without_actions
from mappo.rollout import EpisodeTracker


def allocate_episodes(env: BatchedEnv, batch: int) -> EpisodeBatch:
    """Zeroed storage for ``batch`` episodes of ``env``: ``[L + 1, batch, ...]``."""
    spec, dev = env.spec, env.device
    T = spec.episode_limit + 1

    def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.zeros(T, batch, *shape, dtype=dtype, device=dev)

    groups = spec.groups.items()
    return EpisodeBatch(
        obs={name: zeros(g.num_agents, *g.obs_shape) for name, g in groups},
        action_mask={
            name: zeros(g.num_agents, g.action.total, dtype=torch.bool)
            for name, g in groups
            if g.has_action_mask
        },
        alive={name: zeros(g.num_agents, dtype=torch.bool) for name, g in groups},
        actions={
            name: zeros(g.num_agents, g.action.num_heads, dtype=g.action.dtype)
            for name, g in groups
        },
        state=zeros(*spec.state_shape),
        reward=zeros(),
        terminated=zeros(dtype=torch.bool),
        truncated=zeros(dtype=torch.bool),
        filled=zeros(dtype=torch.bool),
    )


# An odd multiplier: run_seed * _SPREAD is a bijection modulo 2**31, and spreads neighbouring run
# seeds about 2**29 apart, far beyond any run's number of iterations.
_SPREAD = 0x9E3779B1


def collection_seed(run_seed: int, iteration: int) -> int:
    """The env seed of a run's ``iteration``-th collection: distinct across runs and iterations,
    and never one of the evaluation seeds of small run seeds (its low 32 bits are 2**31 or more).

    The run seed enters the low 32 bits as well as the high ones: torch's CPU generator keeps
    only the low 32 bits of a seed (``manual_seed(2**32 + 5)`` draws what ``manual_seed(5)``
    draws), so with the run seed in the high bits alone every run played the same episodes at
    the same iteration on the batched envs seeded through torch. Generators that read all 64
    bits (CUDA's, numpy's ``SeedSequence``) still see the run seed in the high ones."""
    low = 2**31 + (run_seed * _SPREAD + iteration) % 2**31
    return (run_seed * 2**32 + low) % 2**63


def _put(target: Tensor, t: int, value: Tensor, where: Tensor) -> None:
    """``target[t] = value`` in the envs where ``where [E]`` is True."""
    shape = (-1,) + (1,) * (value.dim() - 1)
    target[t] = torch.where(where.view(shape), value, target[t])


def end_check_every(device: torch.device) -> int:
    """How often (in env steps) an episode collection asks whether every episode has ended:
    the answer is read back from the device, which on a GPU waits for the step's kernels, so
    there every 8 steps (the steps after the ends store nothing); on the CPU it costs nothing,
    and every step keeps the random draws of one collection as they were."""
    return 1 if device.type == "cpu" else 8


class EpisodeCollector:
    """Plays one episode per env with an :class:`~mappo.acting.Acting` policy."""

    def __init__(
        self, env: BatchedEnv, policy: Acting, generator: torch.Generator, tracker: EpisodeTracker
    ) -> None:
        self.env = env
        self.policy = policy
        self.generator = generator
        self.tracker = tracker
        self.batch = allocate_episodes(env, env.num_envs)
        # Collections left in which to compare the groups' rewards (none with one group).
        self._group_checks = 8 if len(env.spec.groups) > 1 else 0

    @torch.no_grad()
    def collect(self, epsilon: float, seed: int) -> tuple[EpisodeBatch, int]:
        """Fill :attr:`batch` with one epsilon-greedy episode per env, the envs reset with
        ``seed``; returns the batch (reused by the next call) and the env steps it took."""
        env, b = self.env, self.batch
        # Steps after an episode's end stay zero (nothing stale reaches the buffer, so a resumed
        # run stores exactly what an uninterrupted one does), and their masks allow every action
        # (a target's max over a padded step stays finite; the loss gives it no weight).
        b.map(torch.Tensor.zero_)
        for mask in b.action_mask.values():
            mask.fill_(True)
        E, L = env.num_envs, env.spec.episode_limit
        step = env.reset(seed=seed)
        states = self.policy.acting_states(E, env.device)
        starts = torch.ones(E, dtype=torch.bool, device=env.device)
        active = torch.ones(E, dtype=torch.bool, device=env.device)
        check_every = end_check_every(env.device)
        # Where groups' rewards differ (opposing teams), the widest gap of a step, read once.
        gap = torch.zeros((), device=env.device) if self._group_checks > 0 else None
        t = 0
        for t in range(L):
            for name, obs in step.obs.items():
                _put(b.obs[name], t, obs, active)
                _put(b.alive[name], t, step.alive[name], active)
            for name, mask in b.action_mask.items():
                _put(mask, t, step.action_mask[name], active)
            _put(b.state, t, step.state, active)
            acted = act(
                self.policy,
                step.obs,
                step.action_mask,
                states,
                starts,
                greedy=False,
                generator=self.generator,
                epsilon=epsilon,
            )
            states, starts = acted.states, torch.zeros_like(starts)
            alive_before = step.alive  # (the step's rewards are for the agents alive in it)
            step = env.step(acted.env_actions)
            self.tracker.record(step, active)
            for name, a in acted.actions.items():
                _put(b.actions[name], t, a, active)
            b.reward[t] = torch.cat(list(step.reward.values()), dim=1).mean(1) * active
            if gap is not None:
                gap = torch.maximum(gap, _group_reward_gap(step.reward, alive_before, active))
            b.terminated[t] = step.terminated & active
            b.truncated[t] = step.truncated & active
            b.filled[t] = active
            ended = step.done & active
            # The observation the episode ended on goes after its last step (the bootstrap input
            # of a truncated episode), with its masks where the env reports them.
            for name in step.obs:
                _put(b.obs[name], t + 1, step.final_obs[name], ended)
                _put(b.alive[name], t + 1, torch.ones_like(step.alive[name]), ended)
            for name, final_mask in step.final_action_mask.items():
                if name in b.action_mask:
                    _put(b.action_mask[name], t + 1, final_mask, ended)
            _put(b.state, t + 1, step.final_state, ended)
            active = active & ~step.done
            if (t + 1) % check_every == 0 and not bool(active.any()):
                break
        if bool(active.any()):
            # An env that outlives the declared episode limit is cut there, as a time limit.
            b.truncated[t] |= active
            for name in step.obs:
                _put(b.obs[name], t + 1, step.obs[name], active)
                _put(b.alive[name], t + 1, step.alive[name], active)
            _put(b.state, t + 1, step.state, active)
        if is_users_env(env):
            # (as mappo.rollout's check: only an env's first outputs are checked as they come)
            acting = {name: a & b.filled[..., None] for name, a in b.alive.items()}
            refuse_living_without_actions(env, b.action_mask, acting, "an episode")
        if gap is not None:
            self._group_checks -= 1
        if gap is not None and float(gap) > 1e-6:
            self._group_checks = 0
            groups = ", ".join(f"'{g}'" for g in env.spec.groups)
            warnings.warn(
                f"the groups {groups} of {env.name} get different rewards, and the algorithms "
                "on whole episodes (IQL, VDN, QMIX, COMA, MADDPG, FACMAC) learn one team reward, "
                "the mean over every agent (PyMARL's common reward): opposing groups are trained "
                "on each other's rewards; train competing groups with algo.name=mappo, which keeps "
                "each group's own reward",
                stacklevel=2,
            )
        return b, int(b.filled.sum())


def _group_reward_gap(
    reward: dict[str, Tensor], alive_before: dict[str, Tensor], active: Tensor
) -> Tensor:
    """The widest gap ``[]`` between two groups' mean rewards ``[E, n]`` of one step, over the
    envs still ``active``, each group's mean over its agents alive when they acted
    (``alive_before``; a group with none has no say: the rewards of the dead are zeros, not a
    group's view of the step)."""
    means, has = [], []
    for name, r in reward.items():
        alive = alive_before[name].float()
        count = alive.sum(1)
        means.append((r * alive).sum(1) / count.clamp(min=1.0))
        has.append(count > 0)
    m, h = torch.stack(means, 1), torch.stack(has, 1)
    top = torch.where(h, m, -torch.inf).amax(1)
    low = torch.where(h, m, torch.inf).amin(1)
    both = (h.sum(1) >= 2) & active
    return torch.where(both, top - low, 0.0).max()


COMPACT_FIELDS = ("obs", "state")
"""The :class:`EpisodeBatch` fields that :class:`EpisodeBuffer` stores as bytes for envs that
declare byte observations: the two that hold nearly all of a buffer's memory (Hanabi: 658
observation values per agent and 783 state values per step, against 20 action-mask bits)."""


class EpisodeBuffer:
    """A ring of ``capacity`` episodes on the device, sampled uniformly.

    With ``byte_observations`` the float fields of :data:`COMPACT_FIELDS` are stored as
    ``uint8`` and returned by :meth:`sample` in their own float dtype, the same values (see the
    module's docstring). ``state_dict`` holds the stored episodes in their stored dtype, so that
    a resumed run samples the same batches; either form loads into either buffer.
    """

    def __init__(
        self, template: EpisodeBatch, capacity: int, byte_observations: bool = False
    ) -> None:
        self.capacity = capacity
        self.wide: dict[tuple[str, str | None], torch.dtype] = {}
        """(field, group or ``None``) -> the float dtype of a tensor stored as bytes."""

        def allocate(name: str, key: str | None, x: Tensor) -> Tensor:
            shape = (capacity, x.shape[0], *x.shape[2:])
            if byte_observations and name in COMPACT_FIELDS and x.is_floating_point():
                self.wide[(name, key)] = x.dtype
                return x.new_zeros(shape, dtype=torch.uint8)
            return x.new_zeros(shape)

        fields: dict[str, Any] = {}
        for name, value in template.fields().items():
            if isinstance(value, dict):
                fields[name] = {k: allocate(name, k, v) for k, v in value.items()}
            else:
                fields[name] = allocate(name, None, value)
        self.storage = EpisodeBatch(**fields)  # [capacity, L + 1, ...]
        self.index = 0
        self.size = 0

    def _stored(self) -> list[tuple[str, str | None, Tensor]]:
        """Every stored tensor with its field and group (``None`` outside per-group fields)."""
        out: list[tuple[str, str | None, Tensor]] = []
        for name, dst in self.storage.fields().items():
            if isinstance(dst, dict):
                out.extend((name, k, v) for k, v in dst.items())
            else:
                out.append((name, None, dst))
        return out

    def add(self, episodes: EpisodeBatch) -> None:
        """Store the ``B`` episodes of a time-major batch ``[L + 1, B, ...]``."""
        B = episodes.filled.shape[1]
        dev = episodes.filled.device
        slots = (self.index + torch.arange(B, device=dev)) % self.capacity
        new = episodes.fields()
        for name, key, dst in self._stored():
            value = new[name] if key is None else new[name][key]
            if (name, key) in self.wide:
                check_bytes(value, name if key is None else f"{name} of {key}")
            dst[slots] = value.transpose(0, 1).to(dst.dtype)
        self.index = (self.index + B) % self.capacity
        self.size = min(self.size + B, self.capacity)

    def sample(self, batch_size: int, generator: torch.Generator) -> EpisodeBatch:
        """``batch_size`` distinct stored episodes, time-major ``[T + 1, B, ...]`` where ``T``
        is the longest of them; fields stored as bytes come back in their float dtype."""
        idx = torch.randperm(self.size, generator=generator)[:batch_size]
        idx = idx.to(self.storage.filled.device)
        filled = self.storage.filled[idx]  # [B, L + 1]
        T = int(filled.sum(1).max()) + 1
        batch = self.storage.map(lambda x: x[idx, :T].transpose(0, 1))
        for (name, key), dtype in self.wide.items():
            if key is None:
                setattr(batch, name, getattr(batch, name).to(dtype))
            else:
                getattr(batch, name)[key] = getattr(batch, name)[key].to(dtype)
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "size": self.size,
            # Copies: a view would save the whole preallocated storage.
            "episodes": self.storage.map(lambda x: x[: self.size].clone()).fields(),
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`'s episodes, stored as bytes or as floats (a checkpoint
        written before the byte storage); values outside 0-255 for byte storage raise
        :class:`ValueError`. ``None`` (a checkpoint saved without its buffer) leaves the buffer
        empty, with a warning: the run then learns other updates than an uninterrupted one."""
        if state is None:
            warnings.warn(
                "the checkpoint holds no replay buffer (algo.buffer_in_checkpoints=false), so "
                "the resumed run refills it from new episodes and does not continue as the "
                "uninterrupted run would",
                stacklevel=2,
            )
            return
        self.index, self.size = int(state["index"]), int(state["size"])
        stored = state["episodes"]
        for name, key, dst in self._stored():
            value = stored[name] if key is None else stored[name][key]
            if (name, key) in self.wide:
                check_bytes(value, name if key is None else f"{name} of {key}")
            dst[: self.size] = value.to(dst.dtype)
