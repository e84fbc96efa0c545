"""Checkpoint files: atomic writing, safe reading, rotation and the newest of a run.

A checkpoint is one ``torch.save`` dict of tensors and plain values; every stateful part of a run
(the learner with its networks, optimisers, normalisers, collector, tracker and replay buffer)
contributes its own ``state_dict()``, and this module only writes, reads and rotates the files.
Reading uses ``weights_only=True``: opening a checkpoint never runs code from it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

FORMAT = 2
"""Layout version: ``{"format", "config", "spec", "progress", "learner"}``. Format 1 files (the
fields of a MAPPO run side by side) are read and converted by :func:`load_checkpoint`."""


class CheckpointError(ValueError):
    """A checkpoint or run directory that cannot be used; the message says why and what to do."""


def atomic_save(obj: Any, path: Path) -> None:
    """Write ``path`` so that it is either the old file or the complete new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_rotating(state: dict[str, Any], run_dir: Path, iteration: int, keep: int) -> Path:
    """Write ``checkpoints/iter_<iteration>.pt`` under ``run_dir`` and keep the newest ``keep``."""
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"iter_{iteration:08d}.pt"
    atomic_save(state, path)
    for old in sorted(ckpt_dir.glob("iter_*.pt"))[:-keep]:
        old.unlink()
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint file safely (``weights_only=True``), in the current layout."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise CheckpointError(
            f"'{path}' is not a readable mappo checkpoint ({type(err).__name__}); "
            "pick another file in checkpoints/"
        ) from err
    if isinstance(data, dict) and data.get("format") == 1:
        try:
            data = _from_format_1(data)
        except KeyError as err:
            raise CheckpointError(f"'{path}' is an incomplete mappo checkpoint ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' is not a mappo checkpoint (format {FORMAT})")
    return data


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest complete checkpoint of a run directory."""
    run_dir = Path(run_dir)
    ckpts = sorted((run_dir / "checkpoints").glob("iter_*.pt"))
    if not ckpts:
        raise CheckpointError(
            f"no checkpoint in '{run_dir / 'checkpoints'}'; is '{run_dir}' a mappo run directory?"
        )
    return ckpts[-1]


def _from_format_1(d: dict[str, Any]) -> dict[str, Any]:
    """The format-1 layout (a MAPPO run's fields side by side) in the current one."""
    env = None
    if d["env_state"] is not None:
        env = {"state": d["env_state"], "rng": d["rng"]["env"]}
    return {
        "format": FORMAT,
        "config": d["config"],
        "spec": d["spec"],
        "progress": {
            k: d[k] for k in ("iteration", "env_steps", "wall_seconds", "eval_count", "last_eval")
        },
        "learner": {
            "policy": d["policy"],
            "optim": {"actor": d["optim_actor"], "critic": d["optim_critic"]},
            "rng": {"sample": d["rng"]["sample"], "shuffle": d["rng"]["shuffle"]},
            "collector": {
                "env": env,
                "step": d["step"],
                "actor_states": d["actor_states"],
                "critic_states": d["critic_states"],
                "starts": d["starts"],
                "tracker": d["tracker"],
            },
        },
    }
