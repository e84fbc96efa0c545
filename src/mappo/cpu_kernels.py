"""One C++ build per compiled graph's CPU kernels, instead of one per kernel.

Inductor writes each fused CPU kernel of a graph as its own C++ source and builds it into its
own shared library: one ``g++`` call per kernel, each paying about 0.9 s to load inductor's
precompiled header and 0.4 s to link, while the kernel itself compiles in a few tenths of a
second. The paper's recurrent Spread preset made 85 such builds for its four graphs; on a
2-core CPU its cold compile waited 51-54 s on them (BENCHMARKS.md, "Cold compile on the CPU").

:func:`install` changes how the kernels of a graph's generated module are built: the module
asks for its kernels one by one (``AsyncCompile.cpp_pybinding``) and then waits for them
(``AsyncCompile.wait``). The requests are collected instead and, at the wait, the kernels go
into as many C++ sources as inductor has compile workers, each kernel in a namespace of its own,
with one Python binding per kernel; each source is built once and its bindings handed to the
module. The kernels' code and build flags are inductor's own, so the graphs compute the same
thing at the same speed; only the number of compiler runs changes. The built libraries go to
inductor's on-disk cache under a key of their whole source, so a warm cache loads them without
building. Should a combined build fail, its kernels are built one by one as before.

This reaches into inductor's internals (``torch._inductor.async_compile`` and
``torch._inductor.codecache``, torch 2.13); where they do not look as expected, nothing is
installed and inductor builds as it always does.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
from typing import Any

ENABLED = True
"""Whether :func:`install` batches kernels (set ``False`` before the first compile to build
each kernel on its own, as inductor does)."""

_ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\s*\(')
"""A kernel source's entry point, as inductor writes it."""

_installed = False
_lock = threading.Lock()
_log = logging.getLogger(__name__)

built = {"libraries": 0, "kernels": 0, "fallbacks": 0}
"""Counts in this process: combined libraries started, kernels in them, and combined builds
that failed and left their kernels to be built one by one."""

_BINDING_PRELUDE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <type_traits>

// The tensor data-pointer reader lives in torch (dynamo's guards); its address arrives in an
// environment variable that inductor sets before loading a binding module.
static void* (*mappo_tensor_data)(PyObject*);

template <typename T> static inline T mappo_arg(PyObject* args, Py_ssize_t n) {
    static_assert(std::is_pointer_v<T>, "a kernel argument is a pointer or a scalar");
    return static_cast<T>(mappo_tensor_data(PyTuple_GET_ITEM(args, n)));
}
template <> inline int64_t mappo_arg<int64_t>(PyObject* args, Py_ssize_t n) {
    auto value = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if (value == -1 && PyErr_Occurred()) throw std::runtime_error("expected an int argument");
    return value;
}
template <> inline uintptr_t mappo_arg<uintptr_t>(PyObject* args, Py_ssize_t n) {
    auto value = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if (value == reinterpret_cast<void*>(-1) && PyErr_Occurred())
        throw std::runtime_error("expected an int argument");
    return reinterpret_cast<uintptr_t>(value);
}
template <> inline float mappo_arg<float>(PyObject* args, Py_ssize_t n) {
    auto value = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if (value == -1.0 && PyErr_Occurred()) throw std::runtime_error("expected a float argument");
    return static_cast<float>(value);
}
"""

_BINDING_MODULE = r"""
static PyMethodDef mappo_methods[] = {
%s
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef mappo_module = {PyModuleDef_HEAD_INIT, "kernel", NULL, -1, mappo_methods};

PyMODINIT_FUNC PyInit_kernel(void) {
    const char* address = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (address == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not set");
        return nullptr;
    }
    errno = 0;
    char* end = nullptr;
    uintptr_t value = std::strtoull(address, &end, 10);
    if (errno != 0 || end == address || value == 0) {
        PyErr_SetString(PyExc_RuntimeError, "the tensor data reader's address is not a number");
        return nullptr;
    }
    mappo_tensor_data = reinterpret_cast<decltype(mappo_tensor_data)>(value);
    return PyModule_Create(&mappo_module);
}
"""


def combined_source(kernels: list[tuple[list[str], str]]) -> str:
    """One C++ source for ``kernels`` (each its argument types, as inductor lists them, and its
    source): the ``#include`` lines once at the top, kernel ``i`` as ``mappo_k<i>::kernel`` (a
    namespace each, so that helpers of the same name in two kernels do not collide), and a
    Python module ``kernel`` with one function ``k<i>`` per kernel taking its arguments as
    inductor's own binding does (tensors by data pointer, ints, floats)."""
    includes: list[str] = []
    parts: list[str] = []
    methods: list[str] = []
    table: list[str] = []
    for i, (argtypes, source) in enumerate(kernels):
        body: list[str] = []
        for line in source.splitlines():
            if line.lstrip().startswith("#include"):
                if line.strip() not in includes:
                    includes.append(line.strip())
            else:
                body.append(line)
        text, found = _ENTRY.subn("void kernel(", "\n".join(body))
        if found != 1:
            raise ValueError(f"kernel {i} has {found} entry points, expected one")
        parts.append(f"namespace mappo_k{i} {{\n{text}\n}}  // namespace mappo_k{i}\n")
        args = ", ".join(
            f"mappo_arg<{t.replace('const ', '')}>(args, {n})" for n, t in enumerate(argtypes)
        )
        methods.append(
            f"static PyObject* k{i}(PyObject*, PyObject* args) {{\n"
            f"    try {{\n"
            f"        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {len(argtypes)})\n"
            f'            throw std::runtime_error("kernel {i} takes {len(argtypes)} arguments");\n'
            f"        mappo_k{i}::kernel({args});\n"
            f"        Py_RETURN_NONE;\n"
            f"    }} catch (std::exception const& e) {{\n"
            f"        PyErr_SetString(PyExc_RuntimeError, e.what());\n"
            f"        return nullptr;\n"
            f"    }} catch (...) {{\n"
            f'        PyErr_SetString(PyExc_RuntimeError, "kernel {i} failed");\n'
            f"        return nullptr;\n"
            f"    }}\n"
            f"}}\n"
        )
        table.append(f'    {{"k{i}", k{i}, METH_VARARGS, ""}},')
    return "\n".join(
        [*includes, "", *parts, _BINDING_PRELUDE, *methods, _BINDING_MODULE % "\n".join(table)]
    )


def split(sizes: list[int], parts: int) -> list[list[int]]:
    """Indices ``0..len(sizes)-1`` in at most ``parts`` groups of about equal total size (the
    largest first, each to the lightest group so far), each group in ascending order; no empty
    groups."""
    parts = max(1, min(parts, len(sizes)))
    groups: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        lightest = totals.index(min(totals))
        groups[lightest].append(i)
        totals[lightest] += sizes[i]
    return [sorted(g) for g in groups if g]


def install() -> bool:
    """Batch the CPU kernels of every graph inductor compiles from now on in this process (see
    the module's docstring); returns whether it is installed. Idempotent; does nothing where
    :data:`ENABLED` is false or torch's internals differ from what it was written against."""
    global _installed
    with _lock:
        if _installed:
            return True
        if not ENABLED:
            return False
        try:
            import torch
            from torch._inductor import async_compile
            from torch._inductor.codecache import CodeCacheFuture, CppPythonBindingsCodeCache

            compiler = async_compile.AsyncCompile
            parameters = inspect.signature(CppPythonBindingsCodeCache.load_async).parameters
            usable = (
                callable(getattr(compiler, "cpp_pybinding", None))
                and callable(getattr(compiler, "wait", None))
                and callable(getattr(async_compile, "get_compile_threads", None))
                and "submit_fn" in parameters
                and hasattr(torch._C._dynamo.guards, "_torchinductor_pyobject_tensor_data_ptr")
            )
        except (ImportError, AttributeError, TypeError, ValueError):
            return False
        if not usable:
            return False
        _check_instruction_sets_early()
        _patch(
            compiler, async_compile.get_compile_threads, CodeCacheFuture, CppPythonBindingsCodeCache
        )
        _installed = True
        return True


def _check_instruction_sets_early() -> None:
    """Start inductor's check of which vector instruction sets this CPU's compiler can build for
    in a background thread.

    Inductor runs it on the first graph's code generation: a test build and a child process
    loading it per candidate (avx512 with and without VNNI, avx2 on a recent x86 CPU), about
    2.7 s each on a 2-core CPU with an empty cache, while the main thread waits. Started when the
    first function is compiled, it runs while dynamo traces. Inductor's list function is
    replaced by one that holds a lock around it, so code generation waits for the background
    check (or runs it itself, if first) rather than running it at the same time: the checks
    change an instruction set's compiler flags while they run, and two at once could leave
    them changed."""
    try:
        from torch._inductor import cpu_vec_isa

        original = cpu_vec_isa.valid_vec_isa_list
        if not callable(original) or getattr(original, "_mappo_locked", False):
            return
    except Exception:  # noqa: BLE001 - another torch: its checks run as they always do
        return
    lock = threading.Lock()

    def valid_vec_isa_list() -> Any:
        with lock:
            return original()

    valid_vec_isa_list._mappo_locked = True  # type: ignore[attr-defined]
    if hasattr(original, "cache_clear"):
        valid_vec_isa_list.cache_clear = original.cache_clear  # type: ignore[attr-defined]
    cpu_vec_isa.valid_vec_isa_list = valid_vec_isa_list
    threading.Thread(target=_check, args=(valid_vec_isa_list,), daemon=True).start()


def _check(valid_vec_isa_list: Any) -> None:
    try:
        valid_vec_isa_list()  # runs and caches inductor's checks
    except Exception:  # noqa: BLE001 - inductor repeats them and reports the error itself
        pass


def _patch(compiler: Any, compile_threads: Any, future_type: type, bindings: Any) -> None:
    """Replace ``compiler``'s (inductor's ``AsyncCompile``) ``cpp_pybinding`` and ``wait``."""
    one_by_one = compiler.cpp_pybinding
    wait = compiler.wait

    class Pending(future_type):  # type: ignore[misc, valid-type]
        """A kernel asked for and not yet built; the module's ``wait`` replaces it with the
        built function (calling it also works, for a module that never waits)."""

        def __init__(self, argtypes: list[str], source: str) -> None:
            self.argtypes = argtypes
            self.source = source
            self.resolve: Any = None
            self.function: Any = None

        def result(self, timeout: float | None = None) -> Any:
            if self.function is None:
                if self.resolve is None:  # never batched: built on its own
                    self.function = bindings.load_pybinding(self.argtypes, self.source)
                else:
                    self.function = self.resolve()
            return self.function

        def __call__(self, *args: Any) -> Any:
            return self.result()(*args)

    def cpp_pybinding(self: Any, argtypes: Any, source_code: str) -> Any:
        if not ENABLED or len(_ENTRY.findall(source_code)) != 1:
            return one_by_one(self, argtypes, source_code)
        pending = Pending(list(argtypes), source_code)
        self.__dict__.setdefault("_mappo_pending", []).append(pending)
        return pending

    def batched_wait(self: Any, scope: dict[str, Any]) -> None:
        pending: list[Pending] = self.__dict__.pop("_mappo_pending", [])
        if pending:
            threads = compile_threads()
            submit = self.submit if threads > 1 else None
            for group in split([len(p.source) for p in pending], threads):
                _build([pending[i] for i in group], submit, bindings)
            for key, value in list(scope.items()):
                if isinstance(value, Pending):
                    scope[key] = value.result()
        wait(self, scope)

    compiler.cpp_pybinding = cpp_pybinding
    compiler.wait = batched_wait


def _build(kernels: list[Any], submit: Any, bindings: Any) -> None:
    """Start building ``kernels`` (``Pending`` requests) as one library and give each the way to
    its function; if the combined build or load fails, the kernels are built one by one as
    inductor builds them (in parallel where it has compile workers)."""
    library: dict[str, Any] = {}

    def one_by_one(err: Exception) -> None:
        built["fallbacks"] += 1
        if built["fallbacks"] == 1:
            _log.warning(
                "building %d kernels one by one: combined build failed: %s", len(kernels), err
            )
        library["module"] = None
        library["each"] = [
            bindings.load_pybinding_async(k.argtypes, k.source, submit_fn=submit) for k in kernels
        ]

    try:
        source = combined_source([(k.argtypes, k.source) for k in kernels])
        load = bindings.load_async(source, "cpu", submit_fn=submit)
    except Exception as err:  # noqa: BLE001 - any failure leaves the kernels to inductor's way
        one_by_one(err)
    else:
        built["libraries"] += 1
        built["kernels"] += len(kernels)

    def module() -> Any:
        if "module" not in library:
            try:
                library["module"] = load()
            except Exception as err:  # noqa: BLE001 - as above
                one_by_one(err)
        return library["module"]

    for i, kernel in enumerate(kernels):

        def resolve(i: int = i) -> Any:
            loaded = module()
            return library["each"][i]() if loaded is None else getattr(loaded, f"k{i}")

        kernel.resolve = resolve
