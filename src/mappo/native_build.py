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
import time
import warnings
from pathlib import Path


def cache_dir() -> Path:
    """Where compiled libraries are kept: ``$MAPPO_CACHE_DIR`` or ``~/.cache/mappo``."""
    root = os.environ.get("MAPPO_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "mappo"


def torch_uses_libgomp() -> bool:
    """Whether torch's OpenMP runtime in this process is GNU's ``libgomp`` (torch's Linux
    wheels ship one): a library built with ``-fopenmp`` then shares its threads."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
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


_noted: set[str] = set()


def note_fallback(what: str, why: str, cost: str) -> None:
    """Warn, once per process for each ``what``, that C code could not be built here and the
    slower torch code runs instead (``cost``): without a C compiler (Windows, a Mac without
    Xcode's tools) the fallback is otherwise silent."""
    if what in _noted:
        return
    _noted.add(what)
    warnings.warn(
        f"{what} could not be built ({why}); {cost}. A C compiler (cc, or one named by $CC) "
        "enables it",
        RuntimeWarning,
        stacklevel=3,
    )


def compiler_command() -> list[str]:
    """The C compiler's command (``$CC``, else ``cc``); raises ``RuntimeError`` where there is
    none to run. On a Mac without Xcode's command-line tools ``/usr/bin/cc`` is a stub that
    fails and opens an installer dialog; it is not run there."""
    command = shlex.split(os.environ.get("CC", "cc")) or ["cc"]  # e.g. CC="ccache gcc"
    found = shutil.which(command[0])
    if found is None:
        raise RuntimeError(f"no C compiler found ({command[0]!r}; set $CC to one)")
    if sys.platform == "darwin" and Path(found).parent == Path("/usr/bin") and _no_xcode_tools():
        raise RuntimeError(
            "no C compiler found (Xcode's command-line tools are not installed: run "
            "`xcode-select --install`, or set $CC to a compiler)"
        )
    return command


@functools.cache
def _no_xcode_tools() -> bool:
    """Whether macOS lacks the command-line tools behind ``/usr/bin/cc`` (``xcode-select -p``
    says where they are, quietly, and fails without them)."""
    try:
        done = subprocess.run(["xcode-select", "-p"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return True
    return done.returncode != 0


@functools.cache
def native_target() -> str:
    """What ``-march=native`` means to the C compiler here (its predefined macros, which name
    every instruction set it will use), as a key for a library built with it: hosts whose CPUs
    differ get libraries of their own even where they share a cache (and even where a
    virtualised ``/proc/cpuinfo`` looks the same). Raises ``RuntimeError`` where the compiler
    cannot say."""
    command = compiler_command()
    done = subprocess.run(
        [*command, "-march=native", "-E", "-dM", "-x", "c", os.devnull],
        capture_output=True,
        encoding="utf-8",
        errors="replace",
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
    command = compiler_command()
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
    # A build the compiler refused is remembered beside the libraries for a day, so that
    # callers that try flags best first (an option clang lacks, -fopenmp without OpenMP) do not
    # pay the failed compile again in every process. The compiler's files (every word of $CC
    # that names a program: ccache and the compiler behind it) are part of the marker's name,
    # so a changed or upgraded compiler tries afresh; what else a build needs (an OpenMP
    # runtime installed later) is tried again once the marker has expired.
    refused = f"{name[:-3]}-{_compiler_stamp(command)}.failed"
    if not rebuild:
        for folder in folders:
            if (folder / name).exists() and trusted(folder):
                return folder / name
            marker = folder / refused
            if marker.exists() and trusted(folder) and _fresh(marker):
                why = marker.read_text(encoding="utf-8", errors="replace").strip()
                raise RuntimeError(f"{why} (remembered for a day; delete {marker} to retry)")
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
            encoding="utf-8",
            errors="replace",
            timeout=120,
        )
        if done.returncode != 0:
            why = f"{command[0]} failed: {done.stderr.strip()[:500]}"
            if done.returncode > 0:  # refused; not a compiler killed by a signal
                _remember(folder / refused, why)
            raise RuntimeError(why)
        os.replace(partial, target)
        (folder / refused).unlink(missing_ok=True)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


REFUSED_SECONDS = 24 * 3600
"""How long a refused build is remembered (:func:`build`)."""


def _compiler_stamp(command: list[str]) -> str:
    """A short hash of the files of the words of ``command`` that name programs (resolved
    links), with their sizes and modification times."""
    parts = []
    for word in command:
        found = shutil.which(word)
        if found is not None:
            info = os.stat(found)  # follows links: the file itself
            parts.append(f"{os.path.realpath(found)} {info.st_size} {info.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:8]


def _fresh(marker: Path) -> bool:
    """Whether a refused build's marker is younger than :data:`REFUSED_SECONDS`."""
    try:
        return time.time() - marker.stat().st_mtime < REFUSED_SECONDS
    except OSError:
        return False


def _remember(marker: Path, why: str) -> None:
    """Write a refused build's reason to ``marker`` (whole or not at all: written beside it and
    renamed); a folder that cannot take it leaves the next process to try again."""
    partial = None
    try:
        fd, partial = tempfile.mkstemp(dir=marker.parent, suffix=".failed.partial")
        with os.fdopen(fd, "w") as f:
            f.write(why)
        os.replace(partial, marker)
    except OSError:
        pass
    finally:
        if partial is not None and os.path.exists(partial):
            os.unlink(partial)


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
