"""The time that the matrix products of one training iteration take on their own.

One trainer of ``PRESET`` (eager) runs ``--warmup`` iterations, then one more under a
``TorchDispatchMode`` that records every ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` call (shapes,
strides, dtypes). Those calls are then replayed back to back on random tensors of the same
layout, ``--replays`` times; the median replay is a lower bound on what any implementation of the
same arithmetic with this BLAS spends per iteration, whatever it does with the rest (the env,
the elementwise kernels, Python). ``--autograd`` trains recurrent networks through autograd's
unrolled steps (what ``compile=on`` traces) instead of ``SequenceGRU``, whose loops in C make
their own products. ``--compiled`` also builds a ``compile=on`` trainer of the same preset and
times its iterations alternating with the replays, so that the bound is stated as a share of
a compiled iteration measured in the same minutes (this VM's speed wanders by 1.5x within an
hour).

    python benchmarks/matmul_floor.py mpe/simple_spread [--autograd] [--compiled] [--threads 2]
        [--replays 7] [--shapes 20] [--json] [OVERRIDES ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_OPS = torch.ops.aten
PRODUCTS = (_OPS.mm.default, _OPS.addmm.default, _OPS.bmm.default, _OPS.baddbmm.default)
"""The ATen products recorded: plain and batched, with and without an added input."""

Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
Call = tuple[Any, list[Any]]


class Recorder(TorchDispatchMode):
    """Records each product's operator and arguments: a tensor as its layout (shape, strides,
    dtype), anything else as its value."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func in PRODUCTS:
            layout = [
                (tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                for a in args
            ]
            self.calls.append((func, layout))
        return func(*args, **(kwargs or {}))


def record(fn: Callable[[], Any]) -> tuple[Any, list[Call]]:
    """``fn()``'s result and the products it ran."""
    recorder = Recorder()
    with recorder:
        out = fn()
    return out, recorder.calls


def materialise(calls: list[Call]) -> list[Call]:
    """The recorded calls with random tensors of the recorded layouts in place of theirs."""

    def tensor(spec: Any) -> Any:
        if not isinstance(spec, tuple):
            return spec
        shape, stride, dtype = spec
        size = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
        return torch.randn(size, dtype=dtype).as_strided(shape, stride)

    return [(f, [tensor(a) for a in layout]) for f, layout in calls]


def flops(calls: list[Call]) -> int:
    """Floating-point operations of the materialised ``calls``: 2 M K N per product (the added
    input of ``addmm`` and ``baddbmm`` not counted)."""
    total = 0
    for f, a in calls:
        x, y = (a[1], a[2]) if f in (_OPS.addmm.default, _OPS.baddbmm.default) else (a[0], a[1])
        total += 2 * x.numel() * y.shape[-1]
    return total


def replay(calls: list[Call]) -> float:
    """Seconds to run the materialised ``calls`` once, back to back."""
    start = time.perf_counter()
    for f, a in calls:
        f(*a)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    parser.add_argument("--autograd", action="store_true", help="the GRU through autograd")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--replays", type=int, default=7)
    parser.add_argument("--shapes", type=int, default=0, help="print the N commonest shapes")
    parser.add_argument("--compiled", action="store_true", help="time compiled iterations too")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from mappo import config as config_mod
    from mappo.nn import layers
    from mappo.trainer import Trainer

    if args.autograd:
        layers.SEQUENCE_MAX_STEP = 0
        layers.SEQUENCE_NATIVE_MAX_STEP = 0

    def trainer_of(compile_setting: str) -> Trainer:
        cfg = config_mod.load(
            args.preset,
            [
                *args.overrides,
                f"compile={compile_setting}",
                f"threads={args.threads}",
                "total_env_steps=1000000000",
            ],
        )
        cfg.progress = False
        return Trainer(cfg)

    trainer = trainer_of("off")
    for _ in range(args.warmup):
        trainer.iterate()

    out, recorded = record(trainer.iterate)
    calls = materialise(recorded)
    total = flops(calls)
    compiled = trainer_of("on") if args.compiled else None
    if compiled is not None:
        for _ in range(args.warmup):
            compiled.iterate()
    times, iterations = [], []
    for i in range(args.replays + 1):
        seconds = replay(calls)
        if i:  # the first replay warms the caches and the BLAS's buffers
            times.append(seconds)
            if compiled is not None:
                r = compiled.iterate()
                iterations.append(r["rollout_seconds"] + r["update_seconds"])
    median = statistics.median(times)
    result = {
        "preset": args.preset,
        "gru_path": "autograd" if args.autograd else "library",
        "iteration_seconds": out["rollout_seconds"] + out["update_seconds"],
        "products": len(calls),
        "gflop": total / 1e9,
        "products_seconds_median": median,
        "products_seconds_range": [min(times), max(times)],
        "gflop_per_second": total / median / 1e9,
    }
    trainer.close()  # (after the replays: closing gives the process's thread count back)
    if compiled is not None:
        compiled.close()
        result["compiled_iteration_seconds_median"] = statistics.median(iterations)
        result["products_share_of_compiled_iteration"] = median / statistics.median(iterations)
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{args.preset} ({result['gru_path']} GRU path): {len(calls)} products, "
        f"{result['gflop']:.2f} GFLOP per iteration; alone {median * 1e3:.1f} ms "
        f"({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}), {result['gflop_per_second']:.0f} "
        f"GFLOP/s; the recorded eager iteration took {result['iteration_seconds'] * 1e3:.0f} ms"
    )
    if compiled is not None:
        print(
            f"compiled iterations alternating with the replays: "
            f"{result['compiled_iteration_seconds_median'] * 1e3:.1f} ms (median); the products "
            f"alone are {result['products_share_of_compiled_iteration']:.2f} of it"
        )
    if args.shapes:
        counts = Counter(
            (f.__name__, tuple(s[0] for s in layout if isinstance(s, tuple)))
            for f, layout in recorded
        )
        for (name, shapes), n in counts.most_common(args.shapes):
            print(f"  {n:5d} x {name} {' by '.join('x'.join(map(str, s)) for s in shapes)}")


if __name__ == "__main__":
    main()
