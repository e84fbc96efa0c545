"""The build cache of the package's own C files (:mod:`mappo.native_build`)."""

from __future__ import annotations

import os
import stat

import pytest

from mappo import native_build


def _fake_compiler(path, log, succeed: bool) -> None:
    """A stand-in for ``cc`` that records each call in ``log`` and fails (or writes its
    ``-o`` file)."""
    body = f'echo call >> "{log}"\n'
    if succeed:
        body += 'while [ "$1" != "-o" ]; do shift; done; echo built > "$2"\n'
    else:
        body += 'echo "error: unknown option" >&2; exit 1\n'
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX shell scripts as compilers")
def test_a_refused_build_is_remembered_until_the_compiler_changes(monkeypatch, tmp_path):
    """Flags a compiler refuses are tried once, not once per process: the failure is kept
    beside the libraries (and named in the error with how to retry); a different compiler
    file (upgraded, or another one) builds afresh, and so does ``rebuild``."""
    source = tmp_path / "lib.c"
    source.write_text("int f(void) { return 1; }\n")
    cc, log = tmp_path / "cc", tmp_path / "calls"
    _fake_compiler(cc, log, succeed=False)
    monkeypatch.setenv("MAPPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(RuntimeError, match="failed: error: unknown option$"):
        native_build.build(source, "t", ("-mfancy",))
    assert log.read_text().count("call") == 1
    with pytest.raises(RuntimeError, match=r"unknown option \(remembered; delete .* to retry\)"):
        native_build.build(source, "t", ("-mfancy",))
    assert log.read_text().count("call") == 1  # not compiled again
    # other flags are another build
    with pytest.raises(RuntimeError, match="unknown option$"):
        native_build.build(source, "t", ())
    assert log.read_text().count("call") == 2
    # a rebuild asks the compiler again
    with pytest.raises(RuntimeError, match="unknown option$"):
        native_build.build(source, "t", ("-mfancy",), rebuild=True)
    assert log.read_text().count("call") == 3
    # the compiler replaced by one that accepts the flags: built, and found from then on
    _fake_compiler(cc, log, succeed=True)
    os.utime(cc, ns=(cc.stat().st_atime_ns, cc.stat().st_mtime_ns + 10**9))
    built = native_build.build(source, "t", ("-mfancy",))
    assert built.read_text() == "built\n" and log.read_text().count("call") == 4
    assert native_build.build(source, "t", ("-mfancy",)) == built
    assert log.read_text().count("call") == 4
