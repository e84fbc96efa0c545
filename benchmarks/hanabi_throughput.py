"""Hanabi env throughput: ``hanabi/full-<P>p`` batched in torch beside JaxMARL's Hanabi.

Usage::

    python benchmarks/hanabi_throughput.py [--players 2] [--num-envs 4096 65536]
        [--device cpu|cuda] [--seconds 3] [--dtype uint8|float32] [--jaxmarl] [--jaxmarl-only]
        [--floor] [--json]

Both sides step every game with a random legal move of the player to act and compute every
player's observation and legal moves each step (what a trainer needs), with auto-reset.

- ours: ``mappo.envs.make("hanabi/full-<P>p", num_envs=N, device=..., dtype=...)`` (its
  observations and state as bytes, its default, or float32), actions picked on the device from
  pre-drawn noise and the step's masks (as ``mappo bench env``);
- JaxMARL (``--jaxmarl``, needs ``jaxmarl`` and JAX on the same device): its ``hanabi`` env,
  ``vmap`` over games and ``lax.scan`` over 100 steps in one jitted call (its own idiom), the
  random legal move drawn inside; the first call (compilation) is not timed.

``--jaxmarl-only`` skips ours (for an interpreter without torch). ``--floor`` adds a row of what
a step's outputs alone cost: every player's observation and the global state in the env's
dtype (``--dtype``: bytes by default, or float32 converted from byte views kept in a buffer),
and their pre-reset copies (``final_obs``, ``final_state``), fresh
tensors every step as the env returns them, nothing else; an upper bound, on that machine and
thread count, for any step that returns them. One JSON line per row
with ``--json``. Env steps per second count one step of one game as one env step.
"""

from __future__ import annotations

import argparse
import json
import time


def bench_ours(
    players: int, num_envs: int, seconds: float, device: str, dtype: str = "uint8"
) -> float:
    import torch

    from mappo.envs import make
    from mappo.envs.rendering import masked_choice

    # One torch thread, as `mappo bench env`: the second thread of a 2-core machine mostly adds
    # synchronisation, and collapses when another process shares the cores.
    torch.set_num_threads(1)
    env = make(f"hanabi/full-{players}p", num_envs=num_envs, device=device, seed=0, dtype=dtype)
    env.validate_actions = False
    gen = torch.Generator(device=env.device).manual_seed(0)
    spec = env.spec.groups["players"]
    ring = [
        torch.rand(num_envs, players, spec.action.total, device=env.device, generator=gen)
        for _ in range(16)
    ]
    step = env.reset()

    def sync() -> None:
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)

    for noise in ring[:3]:  # warm-up
        acts = masked_choice(noise, step.action_mask["players"], spec.action.nvec)
        step = env.step({"players": acts})
    sync()
    count, start = 0, time.perf_counter()
    while True:
        for noise in ring:
            acts = masked_choice(noise, step.action_mask["players"], spec.action.nvec)
            step = env.step({"players": acts})
            count += num_envs
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count / elapsed


def output_step(players: int, num_envs: int, device: str, dtype: str = "uint8"):
    """A function that makes what a step of ``hanabi/full-<P>p`` returns (observations and
    state in ``dtype``), and only that: ``(obs [N, P, obs], state [N, state], final_obs,
    final_state)``, fresh tensors, the observations copied or converted from byte views kept in
    a buffer."""
    import torch

    from mappo.envs import make

    spec = make(f"hanabi/full-{players}p", num_envs=1).spec
    n_obs, n_state = spec.groups["players"].obs_shape[0], spec.state_shape[0]
    views = torch.zeros(num_envs, players, n_obs, dtype=torch.uint8, device=device)
    views[:, :, ::3] = 1
    rows = torch.arange(num_envs, device=device)
    seat = rows % players
    out = getattr(torch, dtype)

    def step():
        obs = views.to(out, copy=True)
        state = torch.empty(num_envs, n_state, dtype=out, device=device)
        state[:, :n_obs] = views[rows, seat]
        state[:, n_obs:] = 0
        return obs, state, obs.clone(), state.clone()

    return step


def bench_output_floor(
    players: int, num_envs: int, seconds: float, device: str, dtype: str = "uint8"
) -> float:
    """Env steps per second of :func:`output_step` (see the module's docstring), one torch
    thread."""
    import torch

    torch.set_num_threads(1)
    step = output_step(players, num_envs, device, dtype)
    kept = [step() for _ in range(3)][-1:]  # warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    count, start = 0, time.perf_counter()
    while True:
        for _ in range(16):
            kept.append(step())
            kept.pop(0)  # a trainer holds the last step while it takes the next
            count += num_envs
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count / elapsed


def bench_jaxmarl(players: int, num_envs: int, seconds: float, steps: int = 100) -> float:
    import jax
    import jax.numpy as jnp
    import jaxmarl

    env = jaxmarl.make("hanabi", num_agents=players)
    agents = env.agents

    def one(carry, _):
        key, state = carry
        key, k_act, k_step = jax.random.split(key, 3)
        legal = env.get_legal_moves(state)
        keys = jax.random.split(k_act, len(agents))
        actions = {
            a: jax.random.categorical(k, jnp.where(legal[a], 0.0, -jnp.inf))
            for a, k in zip(agents, keys, strict=True)
        }
        obs, state, reward, done, info = env.step(k_step, state, actions)
        return (key, state), reward[agents[0]]

    def run(keys, states):
        (keys, states), rewards = jax.lax.scan(
            jax.vmap(one, in_axes=((0, 0), None)), (keys, states), None, length=steps
        )
        return keys, states, rewards.sum()

    run = jax.jit(run)
    keys = jax.random.split(jax.random.PRNGKey(0), num_envs)
    _, states = jax.vmap(env.reset)(keys)
    keys, states, total = run(keys, states)  # compile
    total.block_until_ready()
    count, start = 0, time.perf_counter()
    while True:
        keys, states, total = run(keys, states)
        total.block_until_ready()
        count += num_envs * steps
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--players", type=int, default=2)
    parser.add_argument("--num-envs", type=int, nargs="+", default=[4096])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument(
        "--dtype", choices=("uint8", "float32"), default="uint8", help="observations' dtype"
    )
    parser.add_argument("--jaxmarl", action="store_true", help="also time JaxMARL's Hanabi")
    parser.add_argument("--jaxmarl-only", action="store_true", help="time JaxMARL's alone")
    parser.add_argument("--floor", action="store_true", help="add the outputs-only row")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for n in args.num_envs:
        if not args.jaxmarl_only:
            sps = bench_ours(args.players, n, args.seconds, args.device, args.dtype)
            rows.append({"env": f"hanabi/full-{args.players}p", "num_envs": n, "sps": sps})
        if args.floor:
            sps = bench_output_floor(args.players, n, args.seconds, args.device, args.dtype)
            rows.append({"env": "outputs only (floor)", "num_envs": n, "sps": sps})
        if args.jaxmarl or args.jaxmarl_only:
            sps = bench_jaxmarl(args.players, n, args.seconds)
            rows.append({"env": f"jaxmarl hanabi {args.players}p", "num_envs": n, "sps": sps})
    for row in rows:
        if args.json:
            print(json.dumps({**row, "device": args.device}))
        else:
            print(f"{row['env']:24s} {row['num_envs']:>7d} games  {row['sps']:>14,.0f} env steps/s")


if __name__ == "__main__":
    main()
