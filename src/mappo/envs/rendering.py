"""Recording and saving episodes of any :class:`~mappo.envs.BatchedEnv` that can render itself.

Example::

    frames = record_episode(make("mpe/simple_spread"))  # random valid actions
    save_gif(frames, "spread.gif", fps=10)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from mappo.envs.base import ActionSpec, BatchedEnv, EnvError, EnvStep

ActFn = Callable[[EnvStep], dict[str, Tensor]]
"""``act_fn(step) -> actions``: per group ``[E, n, k]`` int64 (``[E, n, d]`` float32 for a box)
for the observations of ``step``."""


@torch.no_grad()
def random_actions(env: BatchedEnv, step: EnvStep, generator: torch.Generator) -> dict[str, Tensor]:
    """Uniformly random valid actions ``[E, n, k]`` per group, on the env's device
    (``[E, n, d]`` float32 inside the box for a continuous group, see :func:`random_box`).

    Groups with an action mask in ``step.action_mask`` draw each head uniformly among its allowed
    actions (the argmax of uniform noise times the mask); others draw uniform integers. All
    randomness comes from ``generator`` (on the env's device), never torch's global RNG.
    """
    actions = {}
    for name, group in env.spec.groups.items():
        mask = step.action_mask.get(name)
        shape = (env.num_envs, group.num_agents)
        if group.action.continuous:
            actions[name] = random_box(group.action, shape, env.device, generator)
        elif mask is None:
            heads = [
                torch.randint(0, size, shape, device=env.device, generator=generator)
                for size in group.action.nvec
            ]
            actions[name] = torch.stack(heads, dim=-1)
        else:
            noise = torch.rand(*mask.shape, device=env.device, generator=generator)
            actions[name] = masked_choice(noise, mask, group.action.nvec)
    return actions


def random_box(
    space: ActionSpec, shape: tuple[int, ...], device: torch.device, generator: torch.Generator
) -> Tensor:
    """``[*shape, d]`` float32 continuous actions: uniform on each bounded component, standard
    normal (clipped to the one finite bound, if any) on an unbounded one."""
    low = torch.tensor(space.low, device=device)
    high = torch.tensor(space.high, device=device)
    u = torch.rand(*shape, len(space.low), device=device, generator=generator)
    z = torch.randn(*shape, len(space.low), device=device, generator=generator)
    bounded = torch.isfinite(low) & torch.isfinite(high)
    uniform = torch.where(bounded, low, 0.0) + u * torch.where(bounded, high - low, 0.0)
    return torch.where(bounded, uniform, z.clamp(low, high))


def masked_choice(noise: Tensor, mask: Tensor, nvec: Sequence[int]) -> Tensor:
    """Actions ``[..., len(nvec)]`` (int64): per head, the allowed action with the largest
    ``noise``; ``noise`` and ``mask`` are ``[..., sum(nvec)]`` (uniform noise in [0, 1) gives a
    uniform draw among the allowed actions)."""
    scores = noise * mask
    if len(nvec) == 1:
        return scores.argmax(-1, keepdim=True)
    return torch.stack([part.argmax(-1) for part in scores.split(list(nvec), -1)], dim=-1)


def record_episode(
    env: BatchedEnv,
    act_fn: ActFn | None = None,
    env_index: int = 0,
    num_steps: int | None = None,
    seed: int | None = None,
) -> list[np.ndarray]:
    """Reset ``env`` (reseeded with ``seed`` when given) and render env ``env_index`` until its
    episode ends or ``num_steps`` steps have been taken; frames ``[H, W, 3]`` uint8.

    ``act_fn`` chooses the actions of the whole batch; by default they are random and valid
    (respecting action masks). The first frame is the initial state. An env resets itself inside
    the step that ends its episode, so the state that step reached is not drawn: an episode of
    ``T`` steps gives ``T`` frames, the states before each of its steps; except for an env that
    can keep its ended episodes to draw (``keep_ended`` and ``render_ended(env_index)``, as
    Hanabi does: there the ending is the point), whose last frame is the end.
    """
    return record_steps(env, act_fn, env_index, num_steps, seed)[0]


def record_steps(
    env: BatchedEnv,
    act_fn: ActFn | None = None,
    env_index: int = 0,
    num_steps: int | None = None,
    seed: int | None = None,
) -> tuple[list[np.ndarray], int, bool]:
    """:func:`record_episode`'s frames, with the steps taken and whether the episode ended."""
    if not 0 <= env_index < env.num_envs:
        raise EnvError(f"env_index {env_index} is out of range [0, {env.num_envs})")
    if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 0):
        raise EnvError(f"num_steps must be a non-negative integer or None, got {num_steps!r}")
    limit = env.spec.episode_limit if num_steps is None else num_steps
    generator = torch.Generator(device=env.device)
    generator.manual_seed(env.seed if seed is None else seed)
    step = env.reset(seed=seed)
    frames = [render_frame(env, env_index)]
    keeps = hasattr(env, "keep_ended") and hasattr(env, "render_ended")
    kept = keeps and env.keep_ended  # type: ignore[attr-defined]
    taken, ended = 0, False
    try:
        if keeps:
            env.keep_ended = True  # type: ignore[attr-defined]
        for _ in range(limit):
            actions = act_fn(step) if act_fn is not None else random_actions(env, step, generator)
            step = env.step(actions)
            taken += 1
            if bool(step.done[env_index]):
                ended = True
                if keeps:
                    last = env.render_ended(env_index)  # type: ignore[attr-defined]
                    frames.append(np.asarray(last, dtype=np.uint8))
                break
            frames.append(render_frame(env, env_index))
    finally:
        if keeps:
            env.keep_ended = kept  # type: ignore[attr-defined]
    return frames, taken, ended


def render_frame(env: BatchedEnv, env_index: int = 0) -> np.ndarray:
    """``env.render(env_index)`` checked to be a frame ``[H, W, 3]`` uint8.

    An env that cannot draw itself (``render`` not implemented, raising
    :class:`NotImplementedError`, or returning ``None`` or something that is not an RGB image)
    raises :class:`EnvError` in one line, which the CLI reports without a traceback, instead of
    failing later inside the GIF writer.
    """
    try:
        frame = env.render(env_index)
    except NotImplementedError as err:
        if type(env).render is BatchedEnv.render:
            reason = f"{type(env).__name__} does not implement render()"
        else:
            reason = str(err).strip() or "render() raised NotImplementedError"
        raise _cannot_render(env, reason) from err
    if frame is None:
        raise _cannot_render(env, "render() returned None")
    array = np.asarray(frame)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        reason = (
            f"render() returned shape {array.shape} and dtype {array.dtype}, not [H, W, 3] uint8"
        )
        raise _cannot_render(env, reason)
    return array


def _cannot_render(env: BatchedEnv, reason: str) -> EnvError:
    """The error for an env that gives no frames; ``reason`` is cut to its first line so that
    the CLI's message stays one line."""
    first_line = reason.strip().splitlines()[0]
    return EnvError(
        f"environment '{env.name}' cannot render frames ({first_line}); no GIF can be made of "
        "it (`mappo eval` evaluates it without one)"
    )


def save_gif(frames: Sequence[np.ndarray], path: str | Path, fps: float = 10) -> Path:
    """Write ``frames`` (each ``[H, W, 3]`` uint8, all the same size) as a looping GIF."""
    if len(frames) == 0:
        raise ValueError("save_gif needs at least one frame")
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    shape = np.asarray(frames[0]).shape
    images = []
    for k, frame in enumerate(frames):
        array = np.asarray(frame)
        if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
            raise ValueError(
                f"frame {k} has shape {array.shape} and dtype {array.dtype}; "
                "expected [H, W, 3] uint8"
            )
        if array.shape != shape:
            raise ValueError(f"frame {k} has shape {array.shape}, frame 0 has {shape}")
        images.append(Image.fromarray(array))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed over it: an interrupt or a full disk leaves the
    # file that was there, never a truncated GIF in its place.
    partial = path.with_name(path.name + ".part")
    try:
        with partial.open("wb") as out:
            images[0].save(
                out,
                format="GIF",
                save_all=True,
                append_images=images[1:],
                duration=max(1, round(1000 / fps)),
                loop=0,
            )
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path
