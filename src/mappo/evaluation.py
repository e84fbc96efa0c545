"""Greedy (or sampled) evaluation on separate environments, for every algorithm family."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mappo.acting import Acting, act
from mappo.envs.base import (
    BatchedEnv,
    EnvError,
    explained,
    is_users_env,
    refuse_living_without_actions,
)


class EvaluationStopped(Exception):
    """An evaluation given up between two steps because its ``stop`` said so (a signal)."""


def evaluate(
    policy: Acting,
    env: BatchedEnv,
    seed: int,
    deterministic: bool = True,
    generator: torch.Generator | None = None,
    stop: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """One episode in each of ``env.num_envs`` envs with greedy (or sampled) actions.

    Returns the mean and standard deviation of the per-agent episode return and the mean of
    each episode statistic, over the first episode of every env. ``stop``, asked before every
    step: when it returns True the evaluation raises :class:`EvaluationStopped` (an evaluation
    of long episodes may take minutes; a signal should not wait for it). A failure that a user's
    env's last output explains is that output's :class:`EnvError` (``explained``).
    """
    return explained([env], lambda: _evaluate(policy, env, seed, deterministic, generator, stop))


@torch.no_grad()
def _evaluate(
    policy: Acting,
    env: BatchedEnv,
    seed: int,
    deterministic: bool,
    generator: torch.Generator | None,
    stop: Callable[[], bool] | None,
) -> dict[str, float]:
    step = env.reset(seed=seed)
    E = env.num_envs
    states = policy.acting_states(E, env.device)
    starts = torch.ones(E, dtype=torch.bool, device=env.device)
    returns = torch.zeros(E, device=env.device)
    finished = torch.zeros(E, dtype=torch.bool, device=env.device)
    final_returns = torch.zeros(E, device=env.device)
    stats = {name: torch.zeros(E, device=env.device) for name in env.spec.stat_names}
    # (a user's env's masks, as a rollout's: an agent left no action got the argmax of nothing)
    users = is_users_env(env)
    for t in range(env.spec.episode_limit + 1):
        if stop is not None and stop():
            raise EvaluationStopped
        if users and step.action_mask:
            counted = {name: a & ~finished[:, None] for name, a in step.alive.items()}
            refuse_living_without_actions(env, step.action_mask, counted, "an evaluation", t)
        acted = act(
            policy, step.obs, step.action_mask, states, starts, deterministic, generator=generator
        )
        states = acted.states
        step = env.step(acted.env_actions)
        reward = torch.cat(list(step.reward.values()), dim=1).mean(1)
        returns += reward * (~finished)
        first = step.done & ~finished
        final_returns = torch.where(first, returns, final_returns)
        for name, held in stats.items():
            stats[name] = torch.where(first, step.stats[name].to(held.dtype), held)
        finished |= step.done
        starts = step.done
        if bool(finished.all()):
            break
    if not bool(finished.all()):
        # an unfinished episode would be counted with a return of 0: a spec that understates
        # the episode length gives silently wrong results
        raise EnvError(
            f"{env.name}: {int((~finished).sum())} of {E} episodes did not end within "
            f"spec.episode_limit={env.spec.episode_limit} steps; set episode_limit to the "
            "longest episode the env can play (and end every episode by then)"
        )
    out = {
        "eval_return_mean": float(final_returns.mean()),
        "eval_return_std": float(final_returns.std(unbiased=False)),
        "eval_episodes": float(E),
    }
    out.update({f"eval_{k}": float(v.mean()) for k, v in stats.items()})
    return out
