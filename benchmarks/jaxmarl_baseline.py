"""JaxMARL's own feed-forward IPPO on Spread, timed, for the ratio in BENCHMARKS.md.

Runs in a virtual environment of its own with ``jaxmarl`` from PyPI (and ``distrax``,
``hydra-core``, ``wandb``, ``matplotlib``, which its baseline script imports), against the
baseline script of a JaxMARL checkout (``baselines/IPPO/ippo_ff_mpe.py``, not part of the
wheel)::

    python -m venv jaxenv && jaxenv/bin/pip install jaxmarl distrax hydra-core wandb matplotlib
    git clone https://github.com/FLAIROx/JaxMARL
    jaxenv/bin/python benchmarks/jaxmarl_baseline.py JaxMARL/baselines/IPPO/ippo_ff_mpe.py \\
        [--updates 400] [--repeats 2] [--json]

The script's ``make_train`` at its own config's settings (16 envs x 128 steps, 4 epochs x 4
mini-batches) for ``--updates`` updates, one seed, with wandb's per-update log replaced by a
no-op (the training loop calls it from inside the jitted function). The first call compiles
and runs; the later ones are timed. Compare with ``mappo bench train
mpe/simple_spread_jaxmarl_ff compile=on threads=2`` run in the same script.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path


def load_baseline(path: Path):  # noqa: ANN201 - the module's make_train, typed by JaxMARL
    """Import JaxMARL's baseline script as a module (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(f"jaxmarl_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}: give the path of a JaxMARL baseline script")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # The training loop logs every update to wandb through a host callback; make it a no-op.
    module.wandb.log = lambda *args, **kwargs: None
    return module


def _number(value: object) -> object:
    """A config value as hydra reads it: YAML 1.1 (PyYAML) leaves ``2e-3`` a string."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


# The config each baseline script's hydra entry point names (in its folder's config/).
CONFIGS = {"ippo_ff_mpe": "ippo_ff_mpe.yaml", "mappo_rnn_mpe": "mappo_homogenous_rnn_mpe.yaml"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline", type=Path, help="a JaxMARL baseline script (see above)")
    parser.add_argument("--updates", type=int, default=400, help="PPO updates per call")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls after the first")
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="seeds trained together in one call (jax.vmap over the training function, as the "
        "baseline script's own main does); the rate is their env steps together",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import jax
    import yaml

    module = load_baseline(args.baseline)
    name = CONFIGS.get(args.baseline.stem, f"{args.baseline.stem}.yaml")
    config_path = args.baseline.parent / "config" / name
    config = {k: _number(v) for k, v in yaml.safe_load(config_path.read_text()).items()}
    per_seed = args.updates * config["NUM_ENVS"] * config["NUM_STEPS"]
    config["TOTAL_TIMESTEPS"] = per_seed
    steps = per_seed * args.seeds
    key = jax.random.PRNGKey(0)
    if args.seeds == 1:
        train = jax.jit(module.make_train(config))
    else:
        train = jax.jit(jax.vmap(module.make_train(config)))
        key = jax.random.split(key, args.seeds)

    t0 = time.perf_counter()
    jax.block_until_ready(train(key))
    first = time.perf_counter() - t0
    rates = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(train(key))
        rates.append(steps / (time.perf_counter() - t0))
    # Only the feed-forward script returns its metrics.
    metrics = out.get("metrics", {}) if isinstance(out, dict) else {}
    returns = metrics.get("returned_episode_returns")
    last = returns if returns is None or args.seeds == 1 else returns.swapaxes(0, 1)
    final = None if last is None else float(last[-1].mean())
    result = {
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "env_steps_per_call": steps,
        "first_call_seconds": first,
        "compile_seconds_estimate": first - steps / max(rates),
        "env_steps_per_second": rates,
        "final_training_return": final,
        "baseline": args.baseline.name,
        "seeds": args.seeds,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"JaxMARL {args.baseline.stem} ({steps:,} env steps per call): "
            + ", ".join(f"{r:,.0f}" for r in rates)
            + f" env steps/s; first call {first:.1f} s"
            + ("" if final is None else f"; final return {final:.1f}")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
