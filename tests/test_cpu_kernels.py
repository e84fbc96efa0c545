"""A compiled graph's CPU kernels built as one library (``mappo.cpu_kernels``): the same
results as inductor's one build per kernel, the kernels really batched, a warm cache that
loads without building, and a failed combined build that falls back to one build per kernel."""

from __future__ import annotations

import pytest
import torch

from mappo import cpu_kernels
from mappo.compiled import compile_fn


def _several_kernels(x: torch.Tensor, w: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """A function that inductor splits into several C++ kernels (reductions over different
    dimensions, a matrix product between them, an int64 output)."""
    y = torch.tanh(x @ w) * scale + 1.0
    z = y.softmax(-1) * x.sum(-1, keepdim=True)
    return z.mean(0), y.cumsum(0), (x.exp() @ w).sigmoid().amax(1), (x > 0).sum(0)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty inductor cache and no graphs compiled before, so that kernels are built."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _forget_compiled()
    yield tmp_path / "inductor"
    _forget_compiled()


def _forget_compiled() -> None:
    """Drop the compiled graphs and inductor's in-memory caches of modules and libraries, so
    that only what is on disk in the cache directory is found."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache, PyCodeCache

    torch._dynamo.reset()
    CppPythonBindingsCodeCache.cache_clear()
    PyCodeCache.cache_clear()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(48, 24, generator=g), torch.randn(24, 24, generator=g) / 5


def test_split_balances_sizes_and_keeps_every_index_once() -> None:
    groups = cpu_kernels.split([10, 1, 7, 3, 3], 2)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]
    assert all(g == sorted(g) for g in groups)
    totals = sorted(sum([10, 1, 7, 3, 3][i] for i in g) for g in groups)
    assert totals == [11, 13]
    assert cpu_kernels.split([5, 5], 8) == [[0], [1]]
    assert cpu_kernels.split([5, 5, 5], 1) == [[0, 1, 2]]


def test_the_combined_source_puts_each_kernel_in_its_namespace() -> None:
    a = '#include "prefix.h"\nextern "C"  void  kernel(const float* in_ptr0, float* out_ptr0)\n{}'
    b = '#include "prefix.h"\nextern "C" void kernel(float* in_out_ptr0, const int64_t ks0)\n{}'
    source = cpu_kernels.combined_source(
        [(["const float*", "float*"], a), (["float*", "const int64_t"], b)]
    )
    assert source.count('#include "prefix.h"') == 1
    assert source.index('#include "prefix.h"') < source.index("namespace mappo_k0")
    assert 'extern "C"' not in source.split("PY_SSIZE_T_CLEAN")[0]
    assert "mappo_k0::kernel(mappo_arg<float*>(args, 0), mappo_arg<float*>(args, 1))" in source
    assert "mappo_k1::kernel(mappo_arg<float*>(args, 0), mappo_arg<int64_t>(args, 1))" in source
    assert '{"k1", k1, METH_VARARGS, ""}' in source
    with pytest.raises(ValueError, match="entry points"):
        cpu_kernels.combined_source([([], "void other() {}")])


def test_batched_kernels_give_what_kernels_built_one_by_one_give(fresh_cache, monkeypatch):
    assert cpu_kernels.install()
    x, w = _inputs()
    expected = _several_kernels(x, w, 2.0)

    monkeypatch.setattr(cpu_kernels, "ENABLED", False)
    alone = compile_fn(_several_kernels)(x, w, 2.0)
    monkeypatch.setattr(cpu_kernels, "ENABLED", True)
    before = dict(cpu_kernels.built)
    batched = compile_fn(_several_kernels)(x, w, 3.0)  # another constant: another graph
    batched_same = compile_fn(_several_kernels)(x, w, 2.0)

    assert cpu_kernels.built["kernels"] - before["kernels"] >= 4
    assert cpu_kernels.built["fallbacks"] == before["fallbacks"]
    # Fewer libraries than kernels: what the batching is for.
    assert cpu_kernels.built["libraries"] - before["libraries"] < (
        cpu_kernels.built["kernels"] - before["kernels"]
    )
    for got, one_by_one, eager in zip(batched_same, alone, expected, strict=True):
        torch.testing.assert_close(got, one_by_one, rtol=0, atol=0)  # the same machine code
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
    for got, eager in zip(batched, _several_kernels(x, w, 3.0), strict=True):
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)


def test_a_warm_cache_loads_the_libraries_without_building(fresh_cache, monkeypatch):
    assert cpu_kernels.install()
    x, w = _inputs()
    first = compile_fn(_several_kernels)(x, w, 1.5)
    _forget_compiled()
    compiled_files = {p for p in fresh_cache.rglob("*.so")}
    again = compile_fn(_several_kernels)(x, w, 1.5)
    assert {p for p in fresh_cache.rglob("*.so")} == compiled_files
    for a, b in zip(first, again, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_failed_combined_build_falls_back_to_one_build_per_kernel(fresh_cache, monkeypatch):
    assert cpu_kernels.install()
    monkeypatch.setattr(cpu_kernels, "combined_source", lambda kernels: "#error broken\n")
    x, w = _inputs()
    before = cpu_kernels.built["fallbacks"]
    got = compile_fn(_several_kernels)(x, w, 0.5)
    assert cpu_kernels.built["fallbacks"] > before
    for a, b in zip(got, _several_kernels(x, w, 0.5), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_instruction_set_check_runs_once_behind_a_lock() -> None:
    """The early check replaces inductor's list function by one that holds a lock around the
    original (two checks at once could leave an instruction set's flags changed): calls give
    inductor's own answer, and installing again does not wrap it twice."""
    from torch._inductor import cpu_vec_isa

    assert cpu_kernels.install()
    wrapped = cpu_vec_isa.valid_vec_isa_list
    assert getattr(wrapped, "_mappo_locked", False)
    first = wrapped()
    assert wrapped() is first  # inductor's cached result, computed once
    assert str(cpu_vec_isa.pick_vec_isa()) in {str(isa) for isa in first} or not first
    cpu_kernels._check_instruction_sets_early()
    assert cpu_vec_isa.valid_vec_isa_list is wrapped
