"""Console progress, CSV (always), TensorBoard (by default) and Weights & Biases (when asked)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

PLAIN_COLUMNS = (
    "env_steps",
    "iteration",
    "wall_seconds",
    "steps_per_second",
    "threads",
    "actor_lr",
    "critic_lr",
    "lr",
    "epsilon",
    "buffer_fill",
)
"""The columns of a run's ``metrics.csv`` without a section prefix (counters, the clock and
the learners' schedules)."""
COLUMN_PREFIXES = ("train/", "time/", "loss/", "eval/")
"""The sections of every other column: training episodes' statistics, timings, losses and the
greedy evaluations (``eval/eval_return_mean``, env statistics as ``eval/eval_<name>``)."""


def is_column_name(name: str) -> bool:
    """Whether ``name`` has the form of a column a run may log (before any run has logged it)."""
    if name in PLAIN_COLUMNS:
        return True
    return any(name.startswith(p) and len(name) > len(p) for p in COLUMN_PREFIXES)


class ProgressBar:
    """A one-line progress display: env steps, steps/s, ETA and the latest return.

    On a terminal the line is redrawn in place; otherwise (a log file, CI) a line is printed at
    most every ``plain_every`` seconds.
    """

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        plain_every: float = 10.0,
        time_limit: float = 0.0,
    ) -> None:
        """``time_limit``: seconds from now after which the run stops (``max_wall_seconds``;
        0 = none): where it comes before the budget, the line counts down to it instead."""
        self.total = total
        self.deadline = time.monotonic() + time_limit if time_limit > 0 else math.inf
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.plain_every = plain_every
        self._last_print = -math.inf

    def update(
        self, steps: int, steps_per_second: float, latest_return: float | None, final: bool = False
    ) -> None:
        now = time.monotonic()
        if not self.tty and not final and now - self._last_print < self.plain_every:
            return
        self._last_print = now
        frac = min(1.0, steps / max(1, self.total))
        width = 24
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        # The last update may overshoot the total (a rollout is never cut short): no time left.
        left = max(0, self.total - steps)
        eta = left / steps_per_second if steps_per_second > 0 else float("nan")
        label = "ETA"
        if self.deadline - now < eta or (math.isnan(eta) and math.isfinite(self.deadline)):
            label, eta = "stop", max(0.0, self.deadline - now)  # (at max_wall_seconds)
        ret = "   n/a" if latest_return is None else f"{latest_return:8.2f}"
        line = (
            f"[{bar}] {steps:>11,}/{self.total:,} steps  {steps_per_second:8,.0f} steps/s  "
            f"{label} {_fmt_time(eta)}  return {ret}"
        )
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--:--"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class MetricsError(ValueError):
    """A run's ``metrics.csv`` that cannot be read back on resume; the message says the fix."""


def complete_rows(path: Path) -> str:
    """The text of ``path`` up to its last line end: a row without its line end is one being
    written (a run still training, or killed in the write), and half a number would read as a
    wrong one."""
    # (utf-8-sig: a file saved by a spreadsheet starts with a byte-order mark)
    with path.open(newline="", encoding="utf-8-sig") as f:
        text = f.read()
    return text[: text.rfind("\n") + 1]


def _read_rows(path: Path, up_to_step: int) -> tuple[list[str], list[dict[str, Any]]]:
    """The columns and the rows up to ``up_to_step`` of a metrics file, or :class:`MetricsError`.
    A last row cut off in its write (no line end: a kill while it was appended) is left out: it
    is after the checkpoint's step (a row is logged before its iteration's checkpoint) and will
    be written again, while its cut-off numbers would read as other ones."""
    try:
        reader = csv.DictReader(io.StringIO(complete_rows(path), newline=""))
        columns = list(reader.fieldnames or [])
        if "env_steps" not in columns:
            raise ValueError("no env_steps column")
        rows = [r for r in reader if int(float(r["env_steps"])) <= up_to_step]
    except (ValueError, TypeError, OverflowError, UnicodeDecodeError, csv.Error) as err:
        raise MetricsError(
            f"'{path}' is not a readable metrics file ({err}); move it aside (it is left as it "
            "is) and resume again to start a new one"
        ) from None
    return columns, rows


class MetricsLogger:
    """Writes one row per logged update to ``metrics.csv`` and the same scalars to TensorBoard
    and, optionally, Weights & Biases.

    On resume, rows after the checkpoint's step are dropped from the CSV (they are recomputed
    identically) and TensorBoard purges events after that step. A Weights & Biases run keeps
    one W&B run id for its folder (``wandb_id`` in it), so that a resume continues the same W&B
    run; W&B keeps the steps it already has, so after a resume from an older checkpoint it
    shows the steps past the newest one it received. ``wandb_group`` groups the seeds of one
    configuration.
    """

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool,
        wandb_project: str | None,
        config: dict[str, Any],
        resume_step: int | None = None,
        wandb_group: str | None = None,
    ) -> None:
        self.path = run_dir / "metrics.csv"
        # Every row, while metrics.csv cannot be written (Windows: another program holds it
        # open): a kill or a resume then loses none of them.
        self.pending = run_dir / PENDING_FILE
        self.columns: list[str] = []
        self.rows: list[dict[str, Any]] = []
        source = _further(self.pending, self.path)
        if resume_step is not None and source.exists():
            self.columns, self.rows = _read_rows(source, resume_step)  # (checked, not yet cut)
        self.tb = None
        self.wandb = None
        self.wandb_started = False  # (a W&B run now exists for this folder: keep its record)
        self.behind = False  # (rows not yet in metrics.csv: another program had it locked)
        if wandb_project:
            # First: W&B is what most often fails to start (no login, no network), and a
            # resume that fails must leave the run's files as they were.
            self.wandb = _start_wandb(
                run_dir, wandb_project, config, wandb_group, resume_step is not None
            )
            self.wandb_started = True
        try:
            if resume_step is not None and source.exists():
                self._write_all()
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                # TensorBoard purges the steps >= purge_step; the CSV keeps the checkpoint's own.
                purge = None if resume_step is None else resume_step + 1
                self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)
        except BaseException:
            self.close(exit_code=1)
            raise

    def exit(self, exc_type: type[BaseException] | None, *_: Any) -> bool:
        """An exit callback (``contextlib.ExitStack.push``): close, telling W&B whether the run
        stopped on an error or an interruption (shown as failed, not finished)."""
        self.close(exit_code=0 if exc_type is None else 1)
        return False

    def _rewrite(self, path: Path | None = None) -> None:
        """Write every row to ``path`` (metrics.csv), whole or not at all."""
        path = path or self.path
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(self.rows)
        tmp.replace(path)

    def _write_all(self) -> None:
        """Rewrite metrics.csv with every row; where it cannot be written, hold them."""
        try:
            self._rewrite()
        except PermissionError as err:
            self._hold(err)
            return
        self._written()

    def _written(self) -> None:
        """metrics.csv has every row again: the rows held beside it are not needed (a pending
        file that cannot be removed, open elsewhere too, is left: a resume takes whichever of
        the two goes further)."""
        if self.behind or self.pending.exists():
            with contextlib.suppress(PermissionError):
                self.pending.unlink(missing_ok=True)
        self.behind = False

    def _hold(self, err: PermissionError) -> None:
        """metrics.csv cannot be written (Windows refuses to write a file another program holds
        open, a spreadsheet showing it): every row goes to the pending file beside it, which a
        resume reads, and the next row that can be written rewrites metrics.csv whole."""
        if not self.behind:
            warnings.warn(
                f"'{self.path}' cannot be written now ({err.strerror or err}: another program "
                f"may hold it open); its rows are kept in '{self.pending}' and written to it "
                "when it can be",
                RuntimeWarning,
                stacklevel=3,
            )
        self.behind = True
        # (a pending file open elsewhere as well: the rows stay in memory until one can be
        # written; training goes on)
        with contextlib.suppress(PermissionError):
            self._rewrite(self.pending)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"env_steps": step, **metrics}
        self.rows.append(row)
        new_columns = [k for k in row if k not in self.columns]
        self.columns += new_columns
        try:
            if new_columns or self.behind or not self.path.exists():
                self._rewrite()
            else:
                with self.path.open("a", newline="", encoding="utf-8") as f:
                    writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
                    writer.writerow(row)
        except PermissionError as err:
            self._hold(err)
        else:
            self._written()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def close(self, exit_code: int = 0) -> None:
        if self.behind:  # the rows the CSV still lacks: once more
            try:
                self._rewrite()
            except PermissionError:
                warnings.warn(
                    f"'{self.path}' could still not be written; its complete rows are in "
                    f"'{self.pending}', which a resume reads (or move it over metrics.csv)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            else:
                self._written()
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
            self.wandb = None


def _further(pending: Path, path: Path) -> Path:
    """Of a run's pending rows and its metrics.csv, the file whose last row is the later one
    (the pending file where it holds rows metrics.csv lacks; metrics.csv where a stale pending
    file could not be removed)."""
    if not pending.exists():
        return path
    if not path.exists():
        return pending
    try:
        last = [_last_step(p) for p in (pending, path)]
    except (OSError, ValueError, KeyError, IndexError, csv.Error):
        return path
    return pending if last[0] > last[1] else path


def _last_step(path: Path) -> float:
    rows = list(csv.DictReader(io.StringIO(complete_rows(path), newline="")))
    return float(rows[-1]["env_steps"]) if rows else -1.0


PENDING_FILE = "metrics.pending.csv"
"""Every row of a run whose ``metrics.csv`` could not be written (another program held it)."""

WANDB_ID_FILE = "wandb_id"
"""The file in a run folder that holds its W&B run id and the folder it was made for."""


def _wandb_id(run_dir: Path, resuming: bool) -> tuple[str, str | None, bool]:
    """The W&B run id for ``run_dir``, the group it started in (None for a new run) and whether
    it is new: the folder's own on a resume, a new one on a fresh start, or where the folder is
    a copy of another run's (its id was made for another path: both would write into one W&B
    run), with a warning where a resume starts a new W&B run."""
    import secrets

    path = run_dir / WANDB_ID_FILE
    if resuming and path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            if saved.get("folder") == str(run_dir.resolve()):
                return str(saved["id"]), saved.get("group"), False
            why = f"its {WANDB_ID_FILE} was made for the folder '{saved.get('folder')}'"
        except (OSError, ValueError, AttributeError, KeyError):
            why = f"its {WANDB_ID_FILE} cannot be read"
        warnings.warn(
            f"'{run_dir}' continues in a new Weights & Biases run: {why} (a copied or moved run)",
            stacklevel=4,
        )
    return secrets.token_hex(4), None, True  # (W&B's own ids are 8 characters of [a-z0-9])


def _start_wandb(
    run_dir: Path, project: str, config: dict[str, Any], group: str | None, resuming: bool
) -> Any:
    """A W&B run for ``run_dir``: the folder's own id (made on its first start, read on a
    resume), a run object of its own (``reinit="create_new"``, wandb >= 0.19.10: stacked seeds
    log to one run each in one process). Raises :class:`MetricsError` in one line where W&B
    cannot start (no login, no network), removing the ``wandb`` folder it began."""
    import wandb  # presence and version checked with the config, before the run started

    run_id, first_group, new = _wandb_id(run_dir, resuming)
    group = first_group or group  # (a resume stays in its group, whatever the settings now)
    began = (run_dir / "wandb").exists()
    try:
        run = wandb.init(
            project=project,
            config=config,
            dir=str(run_dir),
            name=run_dir.name,
            group=group,
            id=run_id,
            resume="allow",
            reinit="create_new",
        )
    except Exception as err:  # wandb's own errors (login, network, settings) have no common base
        if not began:
            shutil.rmtree(run_dir / "wandb", ignore_errors=True)
        # (a settings error's first line only counts its errors: the next ones say which)
        said = " ".join(line.strip() for line in str(err).strip().splitlines()[:3])[:300]
        raise MetricsError(
            f"Weights & Biases could not start a run ({type(err).__name__}: {said}); "
            "`wandb login`, WANDB_MODE=offline to log locally, or wandb=false"
        ) from None
    if new:
        record = {"id": run_id, "folder": str(run_dir.resolve()), "group": group}
        (run_dir / WANDB_ID_FILE).write_text(json.dumps(record) + "\n", encoding="utf-8")
    return run
