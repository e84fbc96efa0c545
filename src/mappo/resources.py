"""What a run needs of the machine: an estimate of its memory, checked before it starts, and
torch threads that follow the cores other processes leave free.

A run sized beyond the machine (``env.num_envs=1e9``) would otherwise fail deep inside the first
allocation, or swap the machine to a halt. The estimate is a lower bound built from the env's
spec: the simulator state of one copy, the tensors of one step, and how many steps the algorithm
keeps (MAPPO's rollout, the value family's episode collection and replay buffer, evaluation).
"""

from __future__ import annotations

import math
import os
import platform
import time
from typing import Any

import torch

from mappo.data import EnvSpec

_FLOAT = 4  # bytes per stored number: float32 / int32 / bools padded into the step tensors
# Copies of a rollout alive at once during a MAPPO update: the rollout itself, the flattened
# samples and the mini-batch views with their activations.
_PPO_COPIES = 3
# Of the memory reported free, how much a run may plan to use (the rest: the OS, torch itself).
_USABLE = 0.9


def step_bytes(spec: EnvSpec, byte_observations: bool = False) -> int:
    """Bytes of one env's step record: observations, agent states, action masks, rewards,
    flags and the global state; with ``byte_observations`` (the env's declaration) the
    observations and the global state a byte each, as MAPPO's rollout stores them."""
    value = 1 if byte_observations else _FLOAT
    total = value * math.prod(spec.state_shape) + 4 * _FLOAT
    for g in spec.groups.values():
        per_agent = (g.action.total + g.action.num_heads + 4) * _FLOAT
        per_agent += value * math.prod(g.obs_shape)
        if g.agent_state_shape is not None:
            per_agent += math.prod(g.agent_state_shape) * _FLOAT
        total += g.num_agents * per_agent
    return total


def env_state_bytes(env: Any) -> int:
    """Bytes of one copy's simulator state (0 for envs that cannot export it, e.g. adapters).
    An env with no state before its first reset (Hanabi's games) is reset first: ``env`` is a
    probe, made for this."""
    from mappo.envs.base import EnvError

    try:
        state = env.get_state()
    except NotImplementedError:
        return 0
    except EnvError:
        env.reset()
        state = env.get_state()
    return sum(t.numel() * t.element_size() for t in state.values()) // max(env.num_envs, 1)


def buffer_step_bytes(spec: EnvSpec, byte_observations: bool = False) -> int:
    """Bytes of one step of one stored episode (:class:`~mappo.data.EpisodeBatch`): float32
    observations and state (one byte each where the env declares ``byte_observations`` and the
    replay buffer stores them as bytes), bool masks and flags, int64 actions; no agent-specific
    state."""
    value = 1 if byte_observations else 4
    total = value * math.prod(spec.state_shape) + 4 + 3  # state, reward, term./trunc./filled
    for g in spec.groups.values():
        per_agent = value * math.prod(g.obs_shape) + 1 + 8 * g.action.num_heads  # obs, alive, act.
        if g.has_action_mask:
            per_agent += g.action.total
        total += g.num_agents * per_agent
    return total


def _eval_episode_bytes(spec: EnvSpec, state_bytes: int) -> int:
    """Estimated bytes of one evaluation episode played in an env of its own: the env's state
    and two steps of outputs."""
    return state_bytes + 2 * step_bytes(spec)


def estimate_bytes(
    cfg: Any, spec: EnvSpec, state_bytes: int, byte_observations: bool = False
) -> dict[str, int]:
    """Estimated bytes per part of a run of ``cfg``: ``{"env.num_envs": ..., "eval_episodes":
    ..., "algo.buffer_size": ..., "algo.batch_size": ...}`` (the keys name the config field
    that sizes each part; the last two for the value family).
    ``byte_observations``: the env's declaration (:class:`~mappo.envs.base.BatchedEnv`), with
    which MAPPO's rollout and the replay buffer keep observations and states in a byte each."""
    episode = (spec.episode_limit + 1) * buffer_step_bytes(spec)
    num_envs = cfg.env.num_envs
    if cfg.family == "ppo":
        stored = step_bytes(spec, byte_observations)
        train = num_envs * (state_bytes + (cfg.rollout_length + 1) * stored * _PPO_COPIES)
    else:  # whole episodes are collected, then copied into the buffer
        train = num_envs * (state_bytes + 2 * episode)
    parts = {
        "env.num_envs": train,
        "eval_episodes": cfg.eval_episodes * _eval_episode_bytes(spec, state_bytes),
    }
    replay = cfg.family in ("value", "maddpg")
    buffer_size = getattr(cfg.algo, "buffer_size", 0) if replay else 0
    if buffer_size:
        stored = (spec.episode_limit + 1) * buffer_step_bytes(spec, byte_observations)
        parts["algo.buffer_size"] = buffer_size * stored
        parts["algo.batch_size"] = cfg.algo.batch_size * _batch_episode_bytes(cfg, spec)
    return parts


def _batch_episode_bytes(cfg: Any, spec: EnvSpec) -> int:
    """Bytes of one episode of a value-family or MADDPG gradient step, a lower bound: the
    sampled steps in float32, and for every agent step the agent network's hidden activations,
    which the online pass keeps for its backward (and its gradients as many) beside the target
    pass's; for MADDPG also its actor loss's per-agent critic inputs."""
    hidden = list(cfg.model.hidden_sizes)
    width = sum(hidden) + (4 * hidden[-1] if hidden and cfg.model.recurrent != "none" else 0)
    agents = sum(g.num_agents for g in spec.groups.values())
    per_step = buffer_step_bytes(spec) + 3 * agents * width * _FLOAT
    if cfg.algo.name == "facmac":
        # FACMAC's utilities read each agent's observation and action (the actor loss's pass
        # kept for its backward, about three times over as MADDPG's) and their activations
        reads = sum(
            g.num_agents * (math.prod(g.obs_shape) + g.action.total) for g in spec.groups.values()
        )
        per_step += (3 * reads + 3 * agents * sum(hidden)) * _FLOAT
    elif cfg.family == "maddpg":
        # MADDPG's actor loss reads the critic once per agent: [n, state + joint action] per
        # step, kept about three times over for its backward (the input, its LayerNorm's
        # output, the first layer's input gradient), and the critic's hidden activations
        # beside them (measured: 624 MB for one step on 4 episodes of smac/27m_vs_30m,
        # estimated 619 MB)
        joint = math.prod(spec.state_shape)
        joint += sum(g.num_agents * g.action.total for g in spec.groups.values())
        per_step += agents * (3 * joint + 3 * sum(hidden)) * _FLOAT
    return (spec.episode_limit + 1) * per_step


def available_bytes(device: torch.device) -> int | None:
    """Memory free for a new run on ``device`` (None where this platform does not say)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def bf16_is_emulated(device: torch.device) -> bool:
    """Whether bfloat16 matrix products on ``device`` are emulated: an x86 CPU with neither
    AMX tiles nor AVX512-BF16 (an AVX2 CPU ran ``hanabi/full-2p_fast``'s update 18x slower in
    bf16 than in float32), or a GPU older than Ampere. Other CPUs (ARM, whose bf16 support
    torch does not report) and devices torch cannot query count as native."""
    if device.type == "cuda":
        try:
            return not torch.cuda.is_bf16_supported(including_emulation=False)
        except (TypeError, RuntimeError, AssertionError):  # an older torch, no usable GPU
            return False
    if device.type != "cpu" or platform.machine().lower() not in _X86:
        return False
    names = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    probes = [getattr(torch.cpu, n, None) for n in names]
    if any(probe is None for probe in probes):
        return False
    return not any(probe() for probe in probes)


_X86 = ("x86_64", "amd64", "i386", "i686")


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KB"`` (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def memory_problem(
    cfg: Any, spec: EnvSpec, state_bytes: int, free: int | None, byte_observations: bool = False
) -> str | None:
    """A one-line refusal if the run's estimate (:func:`estimate_bytes`) exceeds the free
    memory, else None."""
    if free is None:
        return None
    parts = estimate_bytes(cfg, spec, state_bytes, byte_observations)
    total = sum(parts.values())
    if total <= _USABLE * free:
        return None
    biggest = max(parts, key=parts.__getitem__)
    value = {
        "env.num_envs": cfg.env.num_envs,
        "eval_episodes": cfg.eval_episodes,
        "algo.buffer_size": getattr(cfg.algo, "buffer_size", 0),
        "algo.batch_size": getattr(cfg.algo, "batch_size", 0),
    }[biggest]
    what, fix = f"{biggest}={value:,}", biggest
    if biggest == "env.num_envs" and cfg.family == "ppo":
        # MAPPO's rollout holds rollout_length steps of every env: either may be the culprit
        what += f" x rollout_length={cfg.rollout_length:,}"
        fix = "env.num_envs or rollout_length"
    return (
        f"this run needs about {format_bytes(total)} of memory (an estimate; {what} "
        f"takes {format_bytes(parts[biggest])}) but {format_bytes(free)} is free on "
        f"{cfg.device}; lower {fix}"
    )


def evaluation_memory_problem(
    episodes: int, spec: EnvSpec, state_bytes: int, free: int | None, device: Any
) -> str | None:
    """A one-line refusal if an evaluation of ``episodes`` episodes at once (one env each, as
    ``mappo eval`` plays them) would exceed the free memory, else None."""
    if free is None:
        return None
    each = _eval_episode_bytes(spec, state_bytes)
    need = episodes * each
    if need <= _USABLE * free:
        return None
    fits = max(int(_USABLE * free) // max(each, 1), 1)
    return (
        f"evaluating {episodes:,} episodes at once needs about {format_bytes(need)} of memory "
        f"(an estimate) but {format_bytes(free)} is free on {device}; lower --episodes (about "
        f"{fits:,} fit)"
    )


class ThreadGovernor:
    """``threads=0``: torch's CPU threads follow the cores that other processes leave free.

    Torch's intra-op threads wait for each other at the end of every operation. When another
    process holds a core, the thread sharing it runs only part of the time and every small
    operation waits for it: small-batch training then runs several times slower than on one
    thread. The governor reads the CPU time of the CPUs this process may run on (Linux
    ``/proc/stat`` and the affinity mask), subtracts this process's own, and sets as many threads
    as cores are free (never more than torch's own default), at the start and then at most every
    ``interval`` seconds. Where ``/proc/stat`` does not exist, torch's default is kept.

    A different thread count can round a few operations differently, so a run that must
    replay bit for bit (a resume compared with an uninterrupted run) fixes ``threads=N``.
    """

    def __init__(self, interval: float = 5.0, probe: float = 0.2) -> None:
        self.interval = interval
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self.cores = len(self.cpus) if self.cpus else None
        # Never more than torch would use by itself (physical cores, OMP_NUM_THREADS...).
        self.most = torch.get_num_threads()
        self.ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last = self._sample()
        self.threads: int | None = None
        if self.last is not None and self.cores:
            time.sleep(probe)  # how busy the machine is before this process adds to it
            self.update(force=True)

    def _sample(self) -> tuple[float, float, float] | None:
        """(wall seconds, busy CPU seconds of the CPUs this process may use, CPU seconds of
        this process)."""
        if not self.cpus:
            return None
        busy = 0
        names = {f"cpu{i}" for i in self.cpus}
        try:
            with open("/proc/stat", encoding="ascii") as f:
                for line in f:
                    name, *rest = line.split()
                    if name in names:
                        fields = [int(x) for x in rest]
                        busy += sum(fields[:8]) - fields[3] - (fields[4] if len(fields) > 4 else 0)
        except (OSError, ValueError, IndexError):
            return None
        own = os.times()
        return time.monotonic(), busy / self.ticks, own.user + own.system

    def free_cores(self) -> float | None:
        """Cores not used by other processes since the last sample (None without a sample)."""
        now = self._sample()
        if now is None or self.last is None or now[0] - self.last[0] <= 0 or not self.cores:
            return None
        elapsed = now[0] - self.last[0]
        others = max(0.0, (now[1] - self.last[1]) - (now[2] - self.last[2])) / elapsed
        self.last = now
        return self.cores - others

    def update(self, force: bool = False) -> int | None:
        """Re-measure (at most every ``interval`` s) and set torch's threads; returns them."""
        if self.last is None or (not force and time.monotonic() - self.last[0] < self.interval):
            return self.threads
        free = self.free_cores()
        if free is None:
            return self.threads
        # A core counts as free when others use less than about a third of it.
        threads = max(1, min(self.cores or 1, self.most, math.floor(free + 0.3)))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return self.threads
