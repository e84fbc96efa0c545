"""What a run will need before it starts: an estimate of its memory, checked against the machine.

A run sized beyond the machine (``env.num_envs=1e9``) would otherwise fail deep inside the first
allocation, or swap the machine to a halt. The estimate is a lower bound built from the env's
spec: the simulator state of one copy, the tensors of one step, and how many steps the algorithm
keeps (MAPPO's rollout, the value family's episode collection and replay buffer, evaluation).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from mappo.data import EnvSpec

_FLOAT = 4  # bytes per stored number: float32 / int32 / bools padded into the step tensors
# Copies of a rollout alive at once during a MAPPO update: the rollout itself, the flattened
# samples and the mini-batch views with their activations.
_PPO_COPIES = 3
# Of the memory reported free, how much a run may plan to use (the rest: the OS, torch itself).
_USABLE = 0.9


def step_bytes(spec: EnvSpec) -> int:
    """Bytes of one env's step record: observations, agent states, action masks, rewards,
    flags and the global state."""
    numbers = math.prod(spec.state_shape) + 4
    for g in spec.groups.values():
        per_agent = math.prod(g.obs_shape) + g.action.total + g.action.num_heads + 4
        if g.agent_state_shape is not None:
            per_agent += math.prod(g.agent_state_shape)
        numbers += g.num_agents * per_agent
    return numbers * _FLOAT


def env_state_bytes(env: Any) -> int:
    """Bytes of one copy's simulator state (0 for envs that cannot export it, e.g. adapters)."""
    try:
        state = env.get_state()
    except NotImplementedError:
        return 0
    return sum(t.numel() * t.element_size() for t in state.values()) // max(env.num_envs, 1)


def estimate_bytes(cfg: Any, spec: EnvSpec, state_bytes: int) -> dict[str, int]:
    """Estimated bytes per part of a run of ``cfg``: ``{"env.num_envs": ..., "eval_episodes":
    ..., "algo.buffer_size": ...}`` (the keys name the config field that sizes each part)."""
    step = step_bytes(spec)
    episode = (spec.episode_limit + 1) * step
    num_envs = cfg.env.num_envs
    if cfg.family == "ppo":
        train = num_envs * (state_bytes + (cfg.rollout_length + 1) * step * _PPO_COPIES)
    else:  # whole episodes are collected, then copied into the buffer
        train = num_envs * (state_bytes + 2 * episode)
    parts = {
        "env.num_envs": train,
        "eval_episodes": cfg.eval_episodes * (state_bytes + 2 * step),
    }
    buffer_size = getattr(cfg.algo, "buffer_size", 0) if cfg.family == "value" else 0
    if buffer_size:
        parts["algo.buffer_size"] = buffer_size * episode
    return parts


def available_bytes(device: torch.device) -> int | None:
    """Memory free for a new run on ``device`` (None where this platform does not say)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KB"`` (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def memory_problem(cfg: Any, spec: EnvSpec, state_bytes: int, free: int | None) -> str | None:
    """A one-line refusal if the run's estimate exceeds the free memory, else None."""
    if free is None:
        return None
    parts = estimate_bytes(cfg, spec, state_bytes)
    total = sum(parts.values())
    if total <= _USABLE * free:
        return None
    biggest = max(parts, key=parts.__getitem__)
    value = {
        "env.num_envs": cfg.env.num_envs,
        "eval_episodes": cfg.eval_episodes,
        "algo.buffer_size": getattr(cfg.algo, "buffer_size", 0),
    }[biggest]
    return (
        f"this run needs about {format_bytes(total)} of memory (an estimate; {biggest}={value:,} "
        f"takes {format_bytes(parts[biggest])}) but {format_bytes(free)} is free on "
        f"{cfg.device}; lower {biggest}"
    )
