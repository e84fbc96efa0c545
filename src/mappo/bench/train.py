"""Training throughput: env steps per second of a config, split into the environment, acting
(the rest of data collection) and the learner's update, for every algorithm family.

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

from mappo import config as config_mod
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


def _timed_steps(env: Any) -> list[float]:
    """Time every ``env.step`` from now on; returns the running total (a one-element list). Only
    the benchmark does this: the training loop itself never times."""
    total = [0.0]
    step = env.step

    def timed(actions: Any) -> Any:
        t0 = time.perf_counter()
        out = step(actions)
        total[0] += time.perf_counter() - t0
        return out

    env.step = timed  # type: ignore[method-assign]
    return total


def _stacked_bench(
    cfg: TrainConfig, iterations: int, warmup: int
) -> tuple[float, float | None, float, float, int]:
    """:func:`run_train_bench` for ``num_seeds > 1`` (:mod:`mappo.learners.seeds`): returns
    compile seconds, env, rollout and update seconds over ``iterations``, and the env steps of
    all seeds together. The env's seconds are ``None`` where its step runs inside the stacked
    policy step's graph."""
    import dataclasses

    from mappo.config import check_device
    from mappo.learners.seeds import StackedPPOLearner, make_seed_envs

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfgs = [dataclasses.replace(cfg, seed=cfg.seed + k, num_seeds=1) for k in range(cfg.num_seeds)]
    blocks = make_seed_envs(cfgs, check_device(cfg.device))
    try:
        learner = StackedPPOLearner(cfgs, blocks)
        compiled = 0.0
        for it in range(warmup):
            compiled = learner.iterate(it, 0)[0].get("compile_seconds", 0.0)
        env_time = _timed_steps(learner.blocks)
        rollout = upd = 0.0
        for it in range(warmup, warmup + iterations):
            r = learner.iterate(it, 0)[0]
            compiled = r.get("compile_seconds", compiled)
            rollout += r["rollout_seconds"]
            upd += r["update_seconds"]
        fused = learner.collector.fused_fn is not None
    finally:
        blocks.close()
    steps = cfg.steps_per_update * iterations * cfg.num_seeds
    return compiled, None if fused else env_time[0], rollout, upd, steps


def _learns(trainer: Trainer) -> bool:
    """Whether the trainer's next iteration takes gradient steps: a value-family learner only
    once its replay buffer holds a batch of episodes."""
    buffer = getattr(trainer.learner, "buffer", None)
    return buffer is None or buffer.size >= trainer.cfg.algo.batch_size


def run_train_bench(cfg: TrainConfig, iterations: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Train ``warmup + iterations`` iterations of ``cfg`` (no run directory) and time the last
    ``iterations``. Returns env steps/s, the environment / acting / update split and, for mappo,
    the update's FLOP rate. The value family warms up for as long as its replay buffer holds
    less than a batch besides (it takes no gradient step before), so that every timed iteration
    learns; ``warmup_iterations`` in the result counts them all."""
    config_mod.check(cfg)  # (a config edited in code: a batch the buffer cannot hold never learns)
    cfg.progress = False
    if cfg.num_seeds > 1:
        stacked = _stacked_bench(cfg, iterations, warmup)
        compiled, env_seconds, rollout, upd, steps = stacked
        flops = None  # (not counted for stacked seeds)
        mm, threads = matmul_rate(device=cfg.device), torch.get_num_threads()
    else:
        trainer = Trainer(cfg)
        compiled = 0.0
        warmed = 0
        while warmed < warmup or not _learns(trainer):
            compiled = trainer.iterate().get("compile_seconds", 0.0)
            warmed += 1
        warmup = warmed
        env_time = _timed_steps(trainer.env)
        rollout = upd = 0.0
        steps_before = trainer.env_steps
        for _ in range(iterations):
            r = trainer.iterate()
            compiled = r.get("compile_seconds", compiled)
            rollout += r["rollout_seconds"]
            upd += r["update_seconds"]
        steps = trainer.env_steps - steps_before
        # With one compiled graph per env step (mappo.rollout.fused_step) the env's step runs
        # inside the policy's graph and cannot be timed apart from it.
        fused = getattr(getattr(trainer.learner, "collector", None), "fused_fn", None)
        env_seconds = None if fused is not None else env_time[0]
        flops = update_flops(trainer) if cfg.family == "ppo" else None
        # (at the run's thread count: closing the trainer gives the caller's back)
        mm, threads = matmul_rate(device=cfg.device), torch.get_num_threads()
        trainer.close()
    # None where the update's FLOPs were not counted (stacked seeds, the value family)
    achieved = None if flops is None else (flops * iterations / upd if upd > 0 else 0.0)
    total = rollout + upd
    return {
        "preset": cfg.preset or None,
        "config": cfg.algo_name,  # (the algorithm's label, as the run folders name it)
        "env": cfg.env.name,
        "device": cfg.device,
        "num_envs": cfg.env.num_envs,
        "num_seeds": cfg.num_seeds,
        "rollout_length": cfg.rollout_length if cfg.family == "ppo" else None,
        "epochs": getattr(cfg.algo, "epochs", None),
        "num_minibatches": getattr(cfg.algo, "num_minibatches", None),
        "batch_size": getattr(cfg.algo, "batch_size", None),
        "recurrent": cfg.model.recurrent,
        "hidden_sizes": list(cfg.model.hidden_sizes),
        "precision": cfg.model.precision,
        "iterations": iterations,
        "warmup_iterations": warmup,
        "env_steps": steps,
        "steps_per_second": steps / total,
        "rollout_seconds_per_iteration": rollout / iterations,
        "update_seconds_per_iteration": upd / iterations,
        # None where the env step is compiled into the policy's graph (see above).
        "env_seconds_per_iteration": None if env_seconds is None else env_seconds / iterations,
        "acting_seconds_per_iteration": (
            None if env_seconds is None else (rollout - env_seconds) / iterations
        ),
        "rollout_share": rollout / total,
        "env_share": None if env_seconds is None else env_seconds / total,
        "update_flops_per_iteration": flops,
        "update_flop_rate": achieved,
        "matmul_flop_rate": mm,
        "update_share_of_matmul_rate": None if achieved is None or mm <= 0 else achieved / mm,
        "compile": cfg.compile,
        "compile_seconds": compiled,
        "torch_threads": threads,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }


def format_report(r: dict[str, Any]) -> str:
    if r["rollout_length"] is not None:
        shape = (
            f"{r['num_envs']} envs x {r['rollout_length']} steps, {r['epochs']} epochs x "
            f"{r['num_minibatches']} mini-batches"
        )
    else:
        shape = f"{r['num_envs']} episodes per iteration, batches of {r['batch_size']} episodes"
    ms = 1e3
    seeds = r.get("num_seeds") or 1
    if seeds > 1:
        shape += f", {seeds} seeds stacked"
    lines = [
        f"{r.get('preset') or r['env']} {r['config']} ({shape}, {r['device']})",
        f"  env steps/s        {r['steps_per_second']:12,.0f}"
        + (" (all seeds together)" if seeds > 1 else ""),
    ]
    if r["env_seconds_per_iteration"] is None:
        lines.append(
            f"  rollout / update   {r['rollout_seconds_per_iteration'] * ms:8.1f} / "
            f"{r['update_seconds_per_iteration'] * ms:8.1f} ms per iteration "
            "(env step compiled with the policy)"
        )
    else:
        lines.append(
            f"  env / acting / update  {r['env_seconds_per_iteration'] * ms:8.1f} / "
            f"{r['acting_seconds_per_iteration'] * ms:8.1f} / "
            f"{r['update_seconds_per_iteration'] * ms:8.1f} ms per iteration"
        )
    if r["update_flops_per_iteration"]:
        lines += [
            f"  update FLOP rate   {r['update_flop_rate'] / 1e9:8.2f} GFLOP/s "
            f"({r['update_flops_per_iteration'] / 1e9:.2f} GFLOP per update)",
            f"  matmul FLOP rate   {r['matmul_flop_rate'] / 1e9:8.2f} GFLOP/s "
            f"(update reaches {100 * r['update_share_of_matmul_rate']:.1f}%)",
        ]
    if r.get("compile") not in (None, "off"):
        lines.append(f"  compile={r['compile']}: {r['compile_seconds']:.1f} s compiling")
    return "\n".join(lines)
