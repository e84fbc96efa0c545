"""Worker processes that step slices of a batch of Python environments in shared memory.

Every array of the batch (observations, rewards, flags, actions...) lives in one
``multiprocessing.shared_memory`` block; the main process and the workers see it as numpy views.
A step is then one byte to each worker and one byte back: no observation is ever pickled. Workers
are started with ``forkserver`` where the platform has it (forks of a single-threaded server
process, not of the main process, whose torch threads make ``fork`` unsafe) and ``spawn``
elsewhere; they are daemons, ignore Ctrl-C (the main process ends them), and exit on their own
when the main process dies.

Faults are reported as :class:`EnvWorkerError` within the timeout: an exception in the env (with
its traceback text), a worker that dies (kill -9, segfault: with its exit signal), a worker that
does not answer (with the stack it was stuck in, where the platform has ``SIGUSR1``). After a
fault every worker of the pool is ended.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import pickle
import runpy
import signal
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing import shared_memory
from multiprocessing.connection import wait
from typing import Any

import numpy as np

from mappo.envs.adapters import _worker
from mappo.envs.base import EnvError


class EnvWorkerError(EnvError):
    """A wrapped environment failed: it raised, hung, or its worker process died.

    Attributes: ``env_name``; ``worker`` (index of the worker process, ``None`` in-process);
    ``env_index`` (the copy of the batch that failed, when known); ``remote_traceback`` (the
    traceback text of the original error, or the stack a hung worker was stuck in).
    """

    def __init__(
        self,
        message: str,
        *,
        env_name: str = "",
        worker: int | None = None,
        env_index: int | None = None,
        remote_traceback: str = "",
    ) -> None:
        super().__init__(message)
        self.env_name = env_name
        self.worker = worker
        self.env_index = env_index
        self.remote_traceback = remote_traceback


class EnvOutputError(EnvWorkerError):
    """A wrapped environment returned a malformed observation, reward, mask or state (wrong shape,
    NaN or inf); the message names the env and the agent. Nothing of that step is trained on."""


class SharedBuffers:
    """Named numpy arrays in one shared-memory block (or in private memory when not shared).

    The arrays are views; :meth:`close` drops them before releasing the block, because a block
    with live views cannot be closed.
    """

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], str]], shared: bool) -> None:
        self.layout, nbytes = _worker.buffer_layout(fields)
        self.shm: shared_memory.SharedMemory | None = None
        if shared:
            self.shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 64))
            buf: Any = self.shm.buf
        else:
            buf = bytearray(max(nbytes, 64))
        self.arrays: dict[str, np.ndarray] = _worker.buffer_views(buf, self.layout)
        for arr in self.arrays.values():
            arr.fill(0)
        self._finalizer = weakref.finalize(self, _release, self.arrays, self.shm)

    @property
    def name(self) -> str | None:
        return None if self.shm is None else self.shm.name

    def close(self) -> None:
        self._finalizer()


def _release(arrays: dict[str, np.ndarray], shm: shared_memory.SharedMemory | None) -> None:
    arrays.clear()
    if shm is None:
        return
    with contextlib.suppress(BufferError):  # a view still held elsewhere: freed with it
        shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


def display_hint(error: str) -> str:
    """Where an env's render() failed for want of a screen (pyglet's, which lbforaging and
    rware draw with), how to give it one; else empty."""
    if "display" not in error.lower():
        return ""
    return (
        " (it draws in a window, which needs a display: on a machine without one run the "
        "command under xvfb-run)"
    )


def default_start_method() -> str:
    """``forkserver`` where available (Linux and other POSIX systems), else ``spawn``; ``fork``
    is unsafe with torch. macOS gets ``spawn`` (its default since Python 3.8): the fork server
    imports torch, which loads system frameworks that start threads, and the Objective-C
    runtime aborts a forked child that then initialises a class (a worker that renders)."""
    if sys.platform == "darwin":
        return "spawn"
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def _start_fork_server() -> None:
    """Start the fork server (if it is not running yet) so that it imports torch once and
    outlives a SIGTERM sent to the whole process group.

    A worker re-imports the main module (multiprocessing's rule, so that objects defined there
    unpickle), and a training script imports torch: every worker would pay that import (1-2 s
    of CPU). Workers are forks of the fork server, so a module the server has imported costs
    them nothing. Only the default preload list is extended; a program's own setting is kept,
    and a server that is already running is left alone.

    ``timeout``, ``kill -- -PGID`` and batch schedulers (Slurm's preemption) send SIGTERM to
    every process of the job. The workers ignore it and the trainer answers it by finishing its
    update and checkpointing, but the fork server died of it, and multiprocessing then reports
    every worker as exited (code 255, read from the server's pipe): the run ended with an error
    instead of a checkpoint. An ignored signal survives ``exec``, so the server is started with
    SIGTERM ignored (it already ignores Ctrl-C).
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_preload_modules", None) == ["__main__"]:
        forkserver.set_forkserver_preload(["__main__", "torch", "gymnasium"])
    if threading.current_thread() is not threading.main_thread():
        return  # signal dispositions can only be changed here from the main thread
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        # (None: a handler installed outside Python, which cannot be put back from here)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


class WorkerPool:
    """``len(ranges)`` worker processes; worker ``w`` steps copies ``ranges[w][0] .. [1] - 1``.

    Args:
        env_name: name used in error messages.
        factory, wrap, config: how a worker builds its environments (see ``_worker``).
        buffers: the shared arrays of the whole batch.
        ranges: per worker ``(lo, hi)``, contiguous and covering the batch.
        timeout: seconds a command may take before the worker counts as hung.
        startup_timeout: seconds the workers may take to start and build their envs.
        start_method: ``"forkserver"`` or ``"spawn"`` (``None``: :func:`default_start_method`).
    """

    def __init__(
        self,
        *,
        env_name: str,
        factory: _worker.Factory,
        wrap: str,
        config: dict[str, Any],
        buffers: SharedBuffers,
        ranges: list[tuple[int, int]],
        timeout: float,
        startup_timeout: float,
        start_method: str | None = None,
    ) -> None:
        if buffers.name is None:
            raise ValueError("WorkerPool needs buffers in shared memory")
        self.env_name = env_name
        self.timeout = timeout
        self.ranges = ranges
        start_method = start_method or default_start_method()
        if start_method == "forkserver":
            _start_fork_server()
        ctx = mp.get_context(start_method)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.stack_files: list[str] = []
        self._finalizer = weakref.finalize(
            self, _shutdown, self.procs, self.conns, self.stack_files
        )
        for w, (lo, hi) in enumerate(ranges):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            fd, stack_file = tempfile.mkstemp(prefix=f"mappo-env-worker{w}-", suffix=".txt")
            os.close(fd)
            self.stack_files.append(stack_file)
            args = {
                "conn": child_conn,
                "shm_name": buffers.name,
                "layout": buffers.layout,
                "factory": factory,
                "wrap": wrap,
                "config": config,
                "lo": lo,
                "hi": hi,
                "stack_file": stack_file,
            }
            # The target is the stdlib's run_path: see the _worker module docstring for why.
            proc = ctx.Process(
                target=runpy.run_path,
                args=(_worker.__file__,),
                kwargs={"init_globals": {"WORKER_ARGS": args}, "run_name": _worker.WORKER_RUN_NAME},
                name=f"mappo-env-worker-{w}",
                daemon=True,
            )
            try:
                proc.start()
            except Exception as err:
                self.close()
                if "bootstrapping phase" in str(err):
                    # a spawned worker re-runs the main script, which started training again
                    raise EnvError(
                        f"{env_name}: the script that trains was run again by a worker process "
                        "as it started: put the code that trains under "
                        '`if __name__ == "__main__":` (worker processes import the main script)'
                    ) from None
                raise EnvError(
                    f"{env_name}: cannot start worker processes: {err}. The environment factory "
                    "must be picklable: pass an import path such as "
                    "'mpe2.simple_spread_v3:parallel_env', a module-level function or a "
                    "functools.partial of one, or use num_workers=0"
                ) from err
            finally:
                child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        self._gather(startup_timeout, "start")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def step(self) -> None:
        """Every worker steps its copies once; returns when all have written their output."""
        self._broadcast(_worker.STEP, "step")

    def reset(self, seed: int | None) -> None:
        """Every worker resets its copies (copy ``i`` with seed ``copy_seed(seed, i)``)."""
        self._broadcast(_worker.RESET + (b"" if seed is None else str(seed).encode()), "reset")

    def render(self, index: int) -> np.ndarray | None:
        """Copy ``index`` drawn by its env's ``render()`` in the worker that steps it."""
        w = next(w for w, (lo, hi) in enumerate(self.ranges) if lo <= index < hi)
        try:
            try:
                self.conns[w].send_bytes(_worker.RENDER + str(index).encode())
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._fail_died(w, "render")
            reply = self._gather(self.timeout, "render", [w], errors_close=False)[w]
        except BaseException:
            self.close()
            raise
        if reply[:1] == b"e":  # render() raised; the worker and its envs are fine
            info = pickle.loads(reply[1:])
            if info["type"] == "NotImplementedError":
                raise NotImplementedError(info["message"])
            raise EnvError(
                f"{self.env_name}: render() of copy {index} raised {info['type']}: "
                f"{info['message']}" + display_hint(f"{info['type']} {info['message']}")
            )
        payload = reply[len(_worker.FRAME) :]
        return np.load(io.BytesIO(payload), allow_pickle=False) if payload else None

    def close(self) -> None:
        """End the workers (politely, then by force) and release their resources; idempotent."""
        self._finalizer()

    # -- internals --------------------------------------------------------------------------
    def _broadcast(self, command: bytes, what: str) -> None:
        try:
            for w, conn in enumerate(self.conns):
                try:
                    conn.send_bytes(command)
                except (BrokenPipeError, ConnectionResetError, OSError):
                    self._fail_died(w, what)
            self._gather(self.timeout, what)
        except BaseException:
            # A fault, or Ctrl-C while the workers were mid-step: their state is unknown now.
            self.close()
            raise

    def _gather(
        self,
        timeout: float,
        what: str,
        workers: list[int] | None = None,
        errors_close: bool = True,
    ) -> dict[int, bytes]:
        """Wait for one reply from every worker (or from ``workers``), watching for death and
        for the deadline; returns the replies. An error reply ends the pool and raises, unless
        ``errors_close`` is false (then it is returned like any reply)."""
        pending = set(range(len(self.conns)) if workers is None else workers)
        replies: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout
        while pending:
            waitables: dict[Any, int] = {}
            for w in pending:
                waitables[self.conns[w]] = w
                waitables[self.procs[w].sentinel] = w
            ready = wait(list(waitables), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail_hung(min(pending), timeout, what)
            for obj in ready:
                w = waitables[obj]
                if w not in pending:
                    continue
                conn = self.conns[w]
                # A worker may have replied and then died: read the reply first.
                if obj is not conn and not conn.poll():
                    self._fail_died(w, what)
                try:
                    reply = conn.recv_bytes()
                except (EOFError, OSError):
                    self._fail_died(w, what)
                pending.discard(w)
                if reply[:1] == b"e" and errors_close:
                    self._fail_reported(w, reply, what)
                replies[w] = reply
        return replies

    def _where(self, w: int) -> str:
        lo, hi = self.ranges[w]
        return f"worker {w} (pid {self.procs[w].pid}, copies {lo}..{hi - 1})"

    def _fail_reported(self, w: int, reply: bytes, what: str) -> None:
        info = pickle.loads(reply[1:])
        self.close()
        if info["kind"] == "output":
            raise EnvOutputError(
                f"{info['message']} ({self._where(w)}); fix the environment: the adapter does "
                "not train on malformed output",
                env_name=self.env_name,
                worker=w,
                env_index=info["env_index"],
                remote_traceback=info["traceback"],
            )
        copy = "" if info["env_index"] is None else f" in copy {info['env_index']} of the batch"
        method = info.get("method") or what
        action = "while building its environments" if info["kind"] == "create" else f"in {method}"
        # One line, as an in-process env's error; the worker's traceback where asked for.
        where = (
            f"\nOriginal traceback:\n{info['traceback']}"
            if os.environ.get("MAPPO_DEBUG")
            else " (MAPPO_DEBUG=1 shows the traceback)"
        )
        if (
            info["kind"] == "create"
            and info["type"] == "AttributeError"
            and "module '__main__'" in info["message"]
        ):
            # A class of a notebook (or of `python -c`): the workers' __main__ is not the
            # caller's, and nothing else names the class.
            where = (
                "; a class defined in a notebook cannot reach worker processes: pass "
                "env.kwargs.num_workers=0, or move it into a module and name that"
            )
        raise EnvWorkerError(
            f"{self.env_name}: the environment raised {info['type']}: {info['message']} "
            f"{action}{copy} ({self._where(w)}){where}",
            env_name=self.env_name,
            worker=w,
            env_index=info["env_index"],
            remote_traceback=info["traceback"],
        )

    def _fail_died(self, w: int, what: str) -> None:
        proc = self.procs[w]
        proc.join(1.0)
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        where = self._where(w)
        self.close()
        hint = " (an error it printed before exiting is on stderr above)" if what == "start" else ""
        raise EnvWorkerError(
            f"{self.env_name}: {where} {how} during {what}{hint}; every worker has been stopped",
            env_name=self.env_name,
            worker=w,
        )

    def _fail_hung(self, w: int, timeout: float, what: str) -> None:
        stack = self._stack_of(w)
        where = self._where(w)
        self.procs[w].kill()  # it would not answer the polite request to stop
        self.close()
        detail = f"\nIt was stuck in:\n{stack}" if stack else ""
        raise EnvWorkerError(
            f"{self.env_name}: {where} did not finish {what} within {timeout:g} s; the "
            f"environment seems to hang (raise `timeout` if its steps are that slow). Every "
            f"worker has been stopped.{detail}",
            env_name=self.env_name,
            worker=w,
            remote_traceback=stack,
        )

    def _stack_of(self, w: int) -> str:
        """Ask a hung worker for its Python stack (faulthandler on SIGUSR1); best effort."""
        if not hasattr(signal, "SIGUSR1"):
            return ""
        path = self.stack_files[w]
        try:
            os.kill(self.procs[w].pid, signal.SIGUSR1)
        except OSError:
            return ""
        deadline = time.monotonic() + 1.0
        text = ""
        while time.monotonic() < deadline:
            time.sleep(0.05)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            if text.strip():
                break
        return text.strip()


def _shutdown(procs: list, conns: list, stack_files: list[str]) -> None:
    """Ask every worker to stop, wait a moment, then kill the ones still running."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send_bytes(_worker.CLOSE)
    deadline = time.monotonic() + 1.0
    for proc in procs:
        if proc.pid is not None:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.kill()
            proc.join(5.0)
    for conn in conns:
        conn.close()
    for path in stack_files:
        with contextlib.suppress(OSError):
            os.remove(path)
