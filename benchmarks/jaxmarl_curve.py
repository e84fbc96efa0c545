"""A JaxMARL baseline's learning curve, one JSON line per update, for RESULTS.md.

Runs in the virtual environment of ``benchmarks/jaxmarl_baseline.py`` (``jaxmarl`` from PyPI and
the packages its baseline scripts import), against a baseline script of a JaxMARL checkout::

    jaxenv/bin/python benchmarks/jaxmarl_curve.py JaxMARL/baselines/IPPO/ippo_ff_hanabi.py \\
        curve.jsonl --steps 2.5e6 [--seed 0] [NUM_ENVS=64 ...]

The script's ``make_train`` at its own config, with ``TOTAL_TIMESTEPS`` set to ``--steps`` and
any ``KEY=VALUE`` replacing a config entry (of the entry's type). Its training loop reports each
update to wandb from inside the jitted function (an ``io_callback``); that report is written to
``OUT`` instead, with the wall seconds since the start, so that the curve survives a stop part
way. For the feed-forward scripts the report is the mean training return of the update's last
step over all agents (``returns``) and ``env_step``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jaxmarl_baseline import CONFIGS, _number, load_baseline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline", type=Path, help="a JaxMARL baseline script")
    parser.add_argument("out", type=Path, help="JSON-lines file the updates are appended to")
    parser.add_argument("--steps", type=float, required=True, help="env steps to train")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE entries of the script's config")
    args = parser.parse_intermixed_args(argv)

    import jax
    import yaml

    module = load_baseline(args.baseline)
    name = CONFIGS.get(args.baseline.stem, f"{args.baseline.stem}.yaml")
    config_path = args.baseline.parent / "config" / name
    config = {k: _number(v) for k, v in yaml.safe_load(config_path.read_text()).items()}
    for word in args.overrides:
        key, _, value = word.partition("=")
        if key not in config:
            raise SystemExit(f"{key!r} is not in {config_path.name}: {', '.join(config)}")
        kind = type(config[key])
        if kind is bool:
            config[key] = value.lower() in ("true", "1")
        else:
            config[key] = kind(_number(value))
    config["TOTAL_TIMESTEPS"] = args.steps

    start = time.perf_counter()
    with args.out.open("a") as out:

        def report(metrics: dict, *_: object, **__: object) -> None:
            row = {k: float(v) for k, v in metrics.items()}
            row["wall_seconds"] = time.perf_counter() - start
            out.write(json.dumps(row) + "\n")
            out.flush()

        module.wandb.log = report
        train = jax.jit(module.make_train(config))
        jax.block_until_ready(train(jax.random.PRNGKey(args.seed)))
    print(f"{args.steps:,.0f} env steps in {time.perf_counter() - start:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
