"""Training throughput: env steps per second of a config, split into rollout and update time.

The update's achieved FLOP rate (matrix-multiply FLOPs counted by torch's ``FlopCounterMode``
over one update, divided by the measured update time) is reported beside the machine's own
float32 matrix-multiply rate, measured in the same call, so the two can be compared directly.
"""

from __future__ import annotations

import platform
import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from mappo.algos.mappo import make_samples, update
from mappo.config import TrainConfig
from mappo.trainer import Trainer


def matmul_rate(size: int = 512, seconds: float = 1.0, device: str = "cpu") -> float:
    """Achieved float32 FLOP/s of a ``size x size`` matrix multiply on ``device``."""
    dev = torch.device(device)
    a = torch.randn(size, size, device=dev)
    b = torch.randn(size, size, device=dev)
    for _ in range(3):
        a @ b
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            a @ b
        reps += 10
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    return 2.0 * size**3 * reps / (time.perf_counter() - start)


def update_flops(trainer: Trainer) -> float:
    """Matrix-multiply FLOPs of one update (forward and backward), counted, not timed.

    Runs one extra update on a copy of the current state, so the benchmark's own parameters are
    left as they were.
    """
    import copy

    policy = copy.deepcopy(trainer.policy)
    from mappo.algos.mappo import Optimizers

    optim = Optimizers.create(policy, trainer.cfg.algo)
    recurrent = trainer.cfg.model.recurrent != "none"
    samples = make_samples(policy, trainer.collector.rollout, trainer.cfg.algo, recurrent)
    gen = torch.Generator().manual_seed(0)
    with FlopCounterMode(display=False) as counter:
        update(policy, samples, optim, trainer.cfg.algo, gen)
    return float(counter.get_total_flops())


def run_train_bench(cfg: TrainConfig, iterations: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Train ``warmup + iterations`` updates of ``cfg`` (no run directory) and time the last
    ``iterations``. Returns steps/s, the rollout/update split and the FLOP rates."""
    cfg.progress = False
    trainer = Trainer(cfg)
    for _ in range(warmup):
        trainer.iterate()
    rollout = upd = 0.0
    for _ in range(iterations):
        r = trainer.iterate()
        rollout += r["rollout_seconds"]
        upd += r["update_seconds"]
    steps = iterations * cfg.steps_per_update
    flops = update_flops(trainer)
    trainer.close()
    mm = matmul_rate(device=cfg.device)
    achieved = flops * iterations / upd if upd > 0 else 0.0
    return {
        "config": cfg.algo_name,
        "env": cfg.env.name,
        "device": cfg.device,
        "num_envs": cfg.env.num_envs,
        "rollout_length": cfg.rollout_length,
        "epochs": cfg.algo.epochs,
        "num_minibatches": cfg.algo.num_minibatches,
        "recurrent": cfg.model.recurrent,
        "hidden_sizes": list(cfg.model.hidden_sizes),
        "iterations": iterations,
        "steps_per_second": steps / (rollout + upd),
        "rollout_seconds_per_iteration": rollout / iterations,
        "update_seconds_per_iteration": upd / iterations,
        "rollout_share": rollout / (rollout + upd),
        "update_flops_per_iteration": flops,
        "update_flop_rate": achieved,
        "matmul_flop_rate": mm,
        "update_share_of_matmul_rate": achieved / mm if mm > 0 else 0.0,
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }


def format_report(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"{r['env']} {r['config']} ({r['num_envs']} envs x {r['rollout_length']} steps, "
            f"{r['epochs']} epochs x {r['num_minibatches']} mini-batches, {r['device']})",
            f"  env steps/s        {r['steps_per_second']:12,.0f}",
            f"  rollout / update   {r['rollout_seconds_per_iteration'] * 1e3:8.1f} ms / "
            f"{r['update_seconds_per_iteration'] * 1e3:8.1f} ms per iteration",
            f"  update FLOP rate   {r['update_flop_rate'] / 1e9:8.2f} GFLOP/s "
            f"({r['update_flops_per_iteration'] / 1e9:.2f} GFLOP per update)",
            f"  matmul FLOP rate   {r['matmul_flop_rate'] / 1e9:8.2f} GFLOP/s "
            f"(update reaches {100 * r['update_share_of_matmul_rate']:.1f}%)",
        ]
    )
