"""Checkpoint files: atomic writing, safe reading, rotation and the newest of a run.

A checkpoint is one ``torch.save`` dict of tensors and plain values; every stateful part of a run
(the learner with its networks, optimisers, normalisers, collector, tracker and replay buffer)
contributes its own ``state_dict()``, and this module only writes, reads and rotates the files.
Reading uses ``weights_only=True``: opening a checkpoint never runs code from it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

FORMAT = 2
"""Layout version: ``{"format", "config", "spec", "progress", "learner"}``. Format 1 files (the
fields of a MAPPO run side by side) are read and converted by :func:`load_checkpoint`."""


class CheckpointError(ValueError):
    """A checkpoint or run directory that cannot be used; the message says why and what to do."""


class CheckpointWarning(UserWarning):
    """A checkpoint was passed over (unreadable or non-finite) in favour of an older one, or
    its random states could not be restored on this kind of device."""


def restore_generator(gen: torch.Generator, state: torch.Tensor, *key: object) -> None:
    """Put ``gen`` back into a saved ``state``, or, where the state is of another kind of
    device (a run trained on a GPU resumed on a CPU, or back: a CUDA generator's state is its
    seed and offset, a CPU one's the whole Mersenne Twister), seed it from ``key`` (the run's
    seed, its iteration and what the generator draws) and warn: the resumed run trains on, but
    does not replay what an uninterrupted run would have drawn on the first device (which no
    other device could anyway)."""
    if state.numel() == gen.get_state().numel():
        gen.set_state(state)
        return
    seed = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")
    gen.manual_seed(seed >> 1)
    # (one place of warning: the generators of one resume say it once, not each)
    warnings.warn(
        f"the checkpoint's random states are of another kind of device than {gen.device.type}; "
        "they are seeded afresh from the run's seed and iteration, so the resumed run does not "
        "draw what it would have on the device it was trained on",
        CheckpointWarning,
        stacklevel=1,
    )


def atomic_save(obj: Any, path: Path) -> None:
    """Write ``path`` so that it is either the old file or the complete new one, never half.

    A failed write (a full disk, a read-only folder) removes its temporary file and raises an
    ``OSError`` naming ``path``; the files already there are untouched."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        # torch.save wraps a failed write in a RuntimeError (its zip writer's own message, the
        # OS's error left in the chain); give the OS's reason and the file.
        cause = _os_cause(err) if isinstance(err, (OSError, RuntimeError)) else None
        if cause is not None:
            raise OSError(cause.errno, cause.strerror, str(path)) from err
        if isinstance(err, RuntimeError) and "write" in str(err).lower():
            raise OSError(errno.EIO, f"could not write a checkpoint ({err})", str(path)) from err
        raise


def _os_cause(err: BaseException) -> OSError | None:
    """The first ``OSError`` with an errno among the causes and contexts of ``err``."""
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError) and link.errno is not None:
            return link
        link = link.__cause__ or link.__context__
    return None


def save_rotating(state: dict[str, Any], run_dir: Path, iteration: int, keep: int) -> Path:
    """Write ``checkpoints/iter_<iteration>.pt`` under ``run_dir`` and keep the newest ``keep``."""
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"iter_{iteration:08d}.pt"
    atomic_save(state, path)
    for old in sorted(ckpt_dir.glob("iter_*.pt"))[:-keep]:
        old.unlink()
    return path


def _tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a nested dict/list, with its dotted name."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{prefix}.{i}" if prefix else str(i))


def first_nonfinite(tree: Any) -> str | None:
    """The name of the first floating-point tensor of ``tree`` holding NaN or inf, else None.

    One device synchronisation for the whole tree, however many tensors it holds."""
    floats = [(k, t) for k, t in _tensors(tree) if t.is_floating_point() and t.numel()]
    if not floats:
        return None
    ok = torch.stack([t.isfinite().all() for _, t in floats])
    if bool(ok.all()):
        return None
    return floats[int((~ok).nonzero()[0])][0]


_OLDER = "it may be truncated: use an older one in checkpoints/"
"""The fix a damaged checkpoint of a run names (when the run has older ones)."""


def _damaged_member(path: Path) -> str | None:
    """The first member of the zip archive that ``torch.save`` wrote whose bytes fail their
    CRC-32; None for an intact archive, and for a file that is no zip archive at all (which
    ``torch.load`` then refuses in its own words)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError):
        return None
    except Exception:  # noqa: BLE001 - zipfile raises zlib.error and others on mangled data
        return "(unreadable)"


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint file safely (``weights_only=True``), in the current layout.

    Refuses (:class:`CheckpointError`) a file that is not a complete mappo checkpoint and one
    whose networks hold NaN or inf (saved after training diverged)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    if path.parent.name == "checkpoints" and path.name.startswith("iter_"):
        fix = _OLDER  # a run's own checkpoint, cut off while it was written
    else:
        fix = "give a run directory, or one of the checkpoints/iter_*.pt files in it"
    # torch.load does not check the archive's CRC-32s: a file with changed bytes inside a
    # tensor would load as other weights
    damaged = _damaged_member(path)
    if damaged is not None:
        raise CheckpointError(
            f"'{path}' is corrupt (its part '{damaged}' fails its checksum); "
            + fix.replace("it may be truncated: ", "")
        )
    try:
        with warnings.catch_warnings():
            # torch's advice to report a pickle protocol it was not written with: a file that
            # is no checkpoint of ours gets the refusal below, not a request to file an issue
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise CheckpointError(
            f"'{path}' is not a readable mappo checkpoint ({type(err).__name__}); {fix}"
        ) from err
    if isinstance(data, dict) and data.get("format") == 1:
        try:
            data = _from_format_1(data)
        except KeyError as err:
            raise CheckpointError(f"'{path}' is an incomplete mappo checkpoint ({err})") from None
    written = data.get("format") if isinstance(data, dict) else None
    if isinstance(written, int) and not isinstance(written, bool) and written > FORMAT:
        raise CheckpointError(
            f"'{path}' was written in checkpoint format {written} by a newer mappo; this one "
            f"reads format {FORMAT}: upgrade mappo to open it"
        )
    if not isinstance(data, dict) or written != FORMAT:
        raise CheckpointError(f"'{path}' is not a mappo checkpoint (format {FORMAT})")
    for key in ("config", "spec", "progress", "learner"):
        if not isinstance(data.get(key), dict):
            raise CheckpointError(f"'{path}' is an incomplete mappo checkpoint (no '{key}')")
    _check_readable_fields(path, data, fix)
    if not isinstance(data["learner"].get("policy"), dict):
        raise CheckpointError(f"'{path}' is an incomplete mappo checkpoint (no policy)")
    bad = first_nonfinite(data["learner"]["policy"])
    if bad is not None:
        raise CheckpointError(
            f"'{path}' holds non-finite parameters ({bad}): training had diverged when it was "
            "saved; use an older checkpoint"
        )
    return data


def _check_readable_fields(path: Path, data: dict[str, Any], fix: str) -> None:
    """Refuse a checkpoint whose counters or env spec cannot be read back (a file altered by
    hand or by another program): the spec is rebuilt as the networks will rebuild it, and the
    counters must be whole numbers, so that nothing fails later in a traceback."""
    from mappo.data import spec_from_dict

    for key in ("iteration", "env_steps"):
        value = data["progress"].get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(
                f"'{path}' is a damaged mappo checkpoint (progress '{key}' is {value!r}); "
                + fix.replace("it may be truncated: ", "")
            )
    try:
        spec = spec_from_dict(data["spec"])
        for group in spec.groups.values():  # (shapes of whole numbers, as networks read them)
            sizes = (*group.obs_shape, *spec.state_shape, *group.action.nvec)
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes):
                raise ValueError("a shape or action count that is no whole number")
    except Exception as err:  # noqa: BLE001 - any failure to rebuild it means the same
        raise CheckpointError(
            f"'{path}' is a damaged mappo checkpoint (its env spec: {type(err).__name__}); "
            + fix.replace("it may be truncated: ", "")
        ) from None


def _checkpoint_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("iter_*.pt"))


def tidy_for_resume(run_dir: Path, resumed_from: Path) -> None:
    """Before a run resumes from ``resumed_from``: remove the temporary file of a write that a
    kill cut off, and move newer checkpoints that could not be used aside (kept, renamed
    ``*.pt.unusable``, or ``*.pt.unusable2``... where that name is taken) so that rotation never
    counts them among the ones to keep."""
    for stale in (run_dir / "checkpoints").glob("*.pt.tmp"):
        stale.unlink()
    for path in _checkpoint_files(run_dir):
        if path.name > resumed_from.name:
            # a second resume from further back may set aside a file of the same name again:
            # number it rather than overwrite the first (or fail, as a rename does on Windows)
            aside = path.with_name(path.name + ".unusable")
            n = 1
            while aside.exists():
                n += 1
                aside = path.with_name(f"{path.name}.unusable{n}")
            path.rename(aside)


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest checkpoint file of a run directory (not opened: see :func:`load_latest`)."""
    run_dir = Path(run_dir)
    ckpts = _checkpoint_files(run_dir)
    if not ckpts:
        raise CheckpointError(_no_checkpoint_message(run_dir))
    return ckpts[-1]


def _no_checkpoint_message(run_dir: Path) -> str:
    if (run_dir / "config.yaml").is_file():
        return (
            f"run '{run_dir}' has no checkpoint: it stopped before its first one was written; "
            "start it again (nothing of it can be resumed)"
        )
    if run_dir.name == "checkpoints" and (run_dir.parent / "config.yaml").is_file():
        return (
            f"'{run_dir}' is a run's checkpoints folder: give the run directory "
            f"'{run_dir.parent}' (or one checkpoint file in this folder)"
        )
    below = _runs_below(run_dir)
    if below:
        newest = max(below, key=lambda d: d.stat().st_mtime)
        count = f"{len(below)} runs" if len(below) > 1 else "a run"
        return (
            f"'{run_dir}' is not a run directory but holds {count} below it; give one run "
            f"directory, e.g. '{newest}'"
        )
    return f"no checkpoint in '{run_dir / 'checkpoints'}'; is '{run_dir}' a mappo run directory?"


RUNS_BELOW_DEPTH = 7
"""How deep :func:`_runs_below` looks: ``runs/<task>/<algo>/<time>_seed<k>/checkpoints``, with
a task name of up to three parts (``python/my_envs/MyEnv``), from the folder above ``runs``."""
RUNS_BELOW_FOLDERS = 2_000
"""How many folders :func:`_runs_below` visits at most (a home directory given by mistake
must not turn an error message into a long search)."""


def _runs_below(folder: Path) -> list[Path]:
    """Run directories (a ``checkpoints`` folder holding ``iter_*.pt``) below ``folder``,
    breadth first to :data:`RUNS_BELOW_DEPTH` levels, for the hint of a user who named a folder
    of runs instead of one run."""
    found: list[Path] = []
    level, visited = [folder], 0
    for _ in range(RUNS_BELOW_DEPTH + 1):
        below: list[Path] = []
        for path in level:
            visited += 1
            if visited > RUNS_BELOW_FOLDERS:
                return found
            if path is not folder and path.name == "checkpoints":
                if _checkpoint_files(path.parent):
                    found.append(path.parent)
                continue
            try:
                below += sorted(
                    p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")
                )
            except OSError:  # unreadable folders are not searched
                continue
        level = below
    return found


def load_latest(run_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """The newest usable checkpoint of a run directory and its contents.

    A newer file that cannot be used (truncated, corrupt, empty, non-finite) is passed over with
    a :class:`CheckpointWarning`, so that a run killed while writing, or one that diverged, goes
    on from the newest good state."""
    run_dir = Path(run_dir)
    ckpts = _checkpoint_files(run_dir)
    if not ckpts:
        raise CheckpointError(_no_checkpoint_message(run_dir))
    reasons = []
    for path in reversed(ckpts):
        try:
            data = load_checkpoint(path)
        except CheckpointError as err:
            reasons.append(str(err))
            continue
        for reason in reasons:
            warnings.warn(
                f"skipped a checkpoint: {reason.removesuffix(f'; {_OLDER}')}; using '{path}'",
                CheckpointWarning,
                stacklevel=2,
            )
        return path, data
    newest = reasons[0].removesuffix(f"; {_OLDER}")
    raise CheckpointError(
        f"no usable checkpoint in '{run_dir / 'checkpoints'}' ({len(ckpts)} "
        f"{'file' if len(ckpts) == 1 else 'files'}, none readable; the newest: {newest}): "
        "the run cannot be resumed or evaluated, start it again"
    )


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
