"""The build cache of the package's own C files (:mod:`mappo.native_build`)."""

from __future__ import annotations

import os
import stat
import time

import pytest

from mappo import native_build


def _fake_compiler(path, log, mode: str) -> None:
    """A stand-in for ``cc`` that records each call in ``log`` and then refuses the build
    (``refuse``), dies of a signal (``killed``) or writes its ``-o`` file (``build``)."""
    body = f'echo call >> "{log}"\n'
    if mode == "build":
        body += 'while [ "$1" != "-o" ]; do shift; done; echo built > "$2"\n'
    elif mode == "killed":
        body += "kill -9 $$\n"
    else:
        body += 'echo "error: unknown option" >&2; exit 1\n'
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _calls(log) -> int:
    return log.read_text().count("call") if log.exists() else 0


pytestmark = pytest.mark.skipif(not hasattr(os, "getuid"), reason="shell scripts as compilers")


def test_a_refused_build_is_remembered_until_the_compiler_changes(monkeypatch, tmp_path):
    """Flags a compiler refuses are tried once, not once per process: the failure is kept
    beside the libraries (and named in the error with how to retry); a different compiler
    file (upgraded, or another one) builds afresh, and so does ``rebuild``; a build that
    succeeds removes the marker."""
    source = tmp_path / "lib.c"
    source.write_text("int f(void) { return 1; }\n")
    cc, log = tmp_path / "cc", tmp_path / "calls"
    _fake_compiler(cc, log, "refuse")
    monkeypatch.setenv("MAPPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(RuntimeError, match="failed: error: unknown option$"):
        native_build.build(source, "t", ("-mfancy",))
    assert _calls(log) == 1
    with pytest.raises(RuntimeError, match=r"option \(remembered for a day; delete .* to retry\)"):
        native_build.build(source, "t", ("-mfancy",))
    assert _calls(log) == 1  # not compiled again
    # other flags are another build
    with pytest.raises(RuntimeError, match="unknown option$"):
        native_build.build(source, "t", ())
    assert _calls(log) == 2
    # a rebuild asks the compiler again
    with pytest.raises(RuntimeError, match="unknown option$"):
        native_build.build(source, "t", ("-mfancy",), rebuild=True)
    assert _calls(log) == 3
    # the compiler replaced by one that accepts the flags: built, and found from then on
    _fake_compiler(cc, log, "build")
    os.utime(cc, ns=(cc.stat().st_atime_ns, cc.stat().st_mtime_ns + 10**9))
    built = native_build.build(source, "t", ("-mfancy",))
    assert built.read_text() == "built\n" and _calls(log) == 4
    assert native_build.build(source, "t", ("-mfancy",)) == built
    assert _calls(log) == 4
    # the failure under this compiler is written, and removed again by a build that succeeds
    stamp = native_build._compiler_stamp([str(cc)])
    refused = built.with_name(built.name[:-3] + f"-{stamp}.failed")
    native_build._remember(refused, "cc failed: error: unknown option")
    assert native_build.build(source, "t", ("-mfancy",), rebuild=True) == built
    assert not refused.exists() and _calls(log) == 5


def test_a_refusal_expires_and_a_killed_compiler_is_not_remembered(monkeypatch, tmp_path):
    """A marker older than a day is ignored (what the build lacked may have been installed
    since); a compiler that died of a signal did not refuse anything. With a wrapper in $CC
    (``ccache gcc``), the compiler behind it is part of the stamp too."""
    source = tmp_path / "lib.c"
    source.write_text("int f(void) { return 1; }\n")
    wrapper, cc, log = tmp_path / "wrap", tmp_path / "cc", tmp_path / "calls"
    wrapper.write_text('#!/bin/sh\nexec "$@"\n')
    wrapper.chmod(0o700)
    _fake_compiler(cc, log, "refuse")
    monkeypatch.setenv("MAPPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", f"{wrapper} {cc}")
    for expected in (1, 1):
        with pytest.raises(RuntimeError, match="failed"):
            native_build.build(source, "t", ())
        assert _calls(log) == expected
    (marker,) = (tmp_path / "cache" / "native").glob("t-*.failed")
    old = time.time() - native_build.REFUSED_SECONDS - 60
    os.utime(marker, (old, old))
    with pytest.raises(RuntimeError, match="unknown option$"):  # tried again, remembered again
        native_build.build(source, "t", ())
    assert _calls(log) == 2
    # the compiler behind the wrapper changed: tried afresh
    _fake_compiler(cc, log, "killed")
    with pytest.raises(RuntimeError, match="failed"):
        native_build.build(source, "t", ())
    assert _calls(log) == 3
    with pytest.raises(RuntimeError, match="failed"):  # killed, not refused: not remembered
        native_build.build(source, "t", ())
    assert _calls(log) == 4


def test_a_mac_without_xcode_tools_is_not_asked_to_compile(monkeypatch, tmp_path):
    # There /usr/bin/cc is a stub that fails and opens an installer dialog in every process
    # that runs it; `xcode-select -p` says quietly that the tools are missing.
    import subprocess

    ran = []

    def fake_run(argv, **kwargs):
        ran.append(argv[0])
        return subprocess.CompletedProcess(argv, 2 if argv[0] == "xcode-select" else 0, "", "")

    monkeypatch.setattr(native_build.sys, "platform", "darwin")
    monkeypatch.setattr(native_build.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(native_build.subprocess, "run", fake_run)
    monkeypatch.delenv("CC", raising=False)
    native_build._no_xcode_tools.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="xcode-select --install"):
            native_build.compiler_command()
        with pytest.raises(RuntimeError, match="Xcode's command-line tools are not installed"):
            native_build.build(tmp_path / "x.c", "x", ())
        assert ran == ["xcode-select"]  # asked once, cc never run
        monkeypatch.setattr(native_build.shutil, "which", lambda name: f"/opt/llvm/bin/{name}")
        assert native_build.compiler_command() == ["cc"]  # a compiler of the user's own
    finally:
        native_build._no_xcode_tools.cache_clear()
