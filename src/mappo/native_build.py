"""Building and caching the library's own small C files (Hanabi's step, the GRU's loop).

A C file of this package is compiled on first use with the system's C compiler (``$CC``, else
``cc``) into a shared library cached under ``$MAPPO_CACHE_DIR`` (default ``~/.cache/mappo``),
named by a hash of the source, the flags and the machine, and loaded with ``ctypes`` by its
caller; nothing outside this package's own source is compiled or loaded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where compiled libraries are kept: ``$MAPPO_CACHE_DIR`` or ``~/.cache/mappo``."""
    root = os.environ.get("MAPPO_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "mappo"


def torch_uses_libgomp() -> bool:
    """Whether torch's OpenMP runtime in this process is GNU's ``libgomp`` (torch's Linux
    wheels ship one): a library built with ``-fopenmp`` then shares its threads."""
    try:
        with open("/proc/self/maps") as maps:
            return any("/libgomp" in line for line in maps)
    except OSError:  # not Linux
        return False


_forked = False


def forked() -> bool:
    """Whether this process is a forked child: its OpenMP team is its parent's, so a library
    built with ``-fopenmp`` runs on one thread there."""
    return _forked


def _after_fork() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


@functools.cache
def native_target() -> str:
    """What ``-march=native`` means to the C compiler here (its predefined macros, which name
    every instruction set it will use), as a key for a library built with it: hosts whose CPUs
    differ get libraries of their own even where they share a cache (and even where a
    virtualised ``/proc/cpuinfo`` looks the same). Raises ``RuntimeError`` where the compiler
    cannot say."""
    command = shlex.split(os.environ.get("CC", "cc")) or ["cc"]
    if shutil.which(command[0]) is None:
        raise RuntimeError(f"no C compiler found ({command[0]!r}; set $CC to one)")
    done = subprocess.run(
        [*command, "-march=native", "-E", "-dM", "-x", "c", os.devnull],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} -march=native failed: {done.stderr.strip()[:300]}")
    return hashlib.sha256(done.stdout.encode()).hexdigest()


def build(
    source: Path, stem: str, flags: tuple[str, ...], rebuild: bool = False, key: str = ""
) -> Path:
    """The path of ``source`` compiled with ``flags`` (a library named ``stem-<hash>.so``),
    compiling it first if no cached copy exists (or always, with ``rebuild``); ``key`` is
    anything else the build depends on. Raises ``RuntimeError`` naming what failed."""
    command = shlex.split(os.environ.get("CC", "cc")) or ["cc"]  # e.g. CC="ccache gcc"
    if shutil.which(command[0]) is None:
        raise RuntimeError(f"no C compiler found ({command[0]!r}; set $CC to one)")
    text = source.read_bytes()
    # the machine too: a home shared between x86-64 and ARM hosts keeps one library per kind
    parts = (*command, *flags, sys.platform, platform.machine(), *([key] if key else []))
    what = " ".join(parts).encode()
    name = f"{stem}-{hashlib.sha256(text + what).hexdigest()[:16]}.so"
    # the user's cache, else (a read-only home, as on some clusters) a folder of the user's own
    # in the temporary directory
    folders = []
    try:
        folders.append(cache_dir() / "native")
    except RuntimeError:  # no home directory to be found
        pass
    if hasattr(os, "getuid"):
        folders.append(Path(tempfile.gettempdir()) / f"mappo-{os.getuid()}")
    # a build this compiler refused is remembered beside the libraries, so that callers that
    # try flags best first (an option clang lacks, -fopenmp without OpenMP) do not pay the
    # failed compile again in every process; the compiler's own file is part of the marker's
    # name, so a changed or upgraded compiler tries afresh
    refused = f"{name[:-3]}-{_compiler_stamp(command[0])}.failed"
    if not rebuild:
        for folder in folders:
            if (folder / name).exists() and trusted(folder):
                return folder / name
            if (folder / refused).exists() and trusted(folder):
                why = (folder / refused).read_text(errors="replace").strip()
                raise RuntimeError(f"{why} (remembered; delete {folder / refused} to retry)")
    for folder in folders:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK) and trusted(folder):
            break
    else:
        raise RuntimeError(
            "no folder of this user's to write the compiled library to (tried "
            f"{', '.join(map(str, folders)) or 'none'}; set MAPPO_CACHE_DIR)"
        )
    target = folder / name
    # compile beside the target and rename: processes starting together never load half a file
    fd, partial = tempfile.mkstemp(dir=folder, suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run(
            [*command, *flags, "-o", partial, str(source)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            why = f"{command[0]} failed: {done.stderr.strip()[:500]}"
            try:
                (folder / refused).write_text(why)
            except OSError:  # not remembered: the next process tries again
                pass
            raise RuntimeError(why)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _compiler_stamp(program: str) -> str:
    """A short hash of the compiler's resolved file, its size and modification time."""
    found = shutil.which(program)
    if found is None:
        return "none"
    real = os.path.realpath(found)
    info = os.stat(real)
    return hashlib.sha256(f"{real} {info.st_size} {info.st_mtime_ns}".encode()).hexdigest()[:8]


def trusted(folder: Path) -> bool:
    """Whether a library in ``folder`` may be loaded: the folder is this user's and nobody else
    can write into it (a shared temporary directory could hold someone else's file)."""
    if not hasattr(os, "getuid"):
        return True
    info = folder.stat()
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def load_first(
    source: Path, stem: str, candidates: list[tuple[tuple[str, ...], str]]
) -> tuple[ctypes.CDLL | None, str]:
    """``source`` built (:func:`build`) and loaded with the first of ``candidates`` (flags and
    key, best first) that works, and ``""``; or ``None`` and why the last one failed. A cached
    library that does not load (truncated, built for another CPU) is rebuilt once."""
    why = ""
    for flags, key in candidates:
        try:
            try:
                return ctypes.CDLL(str(build(source, stem, flags, key=key))), ""
            except OSError:
                return ctypes.CDLL(str(build(source, stem, flags, True, key))), ""
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            why = str(err)
    return None, why
