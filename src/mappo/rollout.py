"""Preallocated rollout storage and the collection loop.

Storage is time-major, per group: ``[T, E, n, ...]`` for agent tensors, ``[T, E, C, ...]`` for
critic tensors (``C`` = 1 when the critic's value is shared by a group's agents), ``[T, E]`` for
per-env flags. Everything stays on the env's device; nothing is copied to the host per step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from mappo.acting import Acted
from mappo.checkpoint import CheckpointWarning, restore_generator
from mappo.data import (
    EnvStep,
    GroupBuffer,
    Rollout,
    check_bytes,
    field_layout,
    step_from_dict,
    step_to_dict,
)
from mappo.envs.base import BatchedEnv, EnvError, is_users_env, refuse_living_without_actions
from mappo.nn.actor_critic import ActorCritic


@dataclass
class EpisodeTracker:
    """Running per-env episode returns and the sums of finished episodes (tensors, no sync)."""

    returns: Tensor  # [E] per-agent return of the running episode (mean over all agents)
    lengths: Tensor  # [E]
    finished: Tensor  # [] count of finished episodes since the last read
    return_sum: Tensor  # []
    length_sum: Tensor  # []
    stat_sums: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    def create(
        cls, num_envs: int, stat_names: tuple[str, ...], device: torch.device
    ) -> EpisodeTracker:
        z = torch.zeros((), device=device)
        return cls(
            torch.zeros(num_envs, device=device),
            torch.zeros(num_envs, device=device),
            z.clone(),
            z.clone(),
            z.clone(),
            {s: z.clone() for s in stat_names},
        )

    def record(self, step: EnvStep, active: Tensor | None = None) -> None:
        """Add a step's rewards; count the episodes it ended. ``active [E]`` bool, when given,
        limits both to the envs whose episode is being recorded."""
        # In-place methods, not ``+=``: ``self.x += y`` also stores the attribute again, which a
        # compiled rollout then returns from its graph for torch to rebuild as an alias of its
        # input after every call (eight such outputs per call of the rollout block; the
        # rollout at JaxMARL's feed-forward settings 1.06x faster without them).
        rewards = torch.cat([r for r in step.reward.values()], dim=1)  # [E, all agents]
        if active is None:
            self.returns.add_(rewards.mean(1))
            self.lengths.add_(1)
            done = step.done.to(self.returns.dtype)
        else:
            live = active.to(self.returns.dtype)
            self.returns.add_(rewards.mean(1) * live)
            self.lengths.add_(live)
            done = (step.done & active).to(self.returns.dtype)
        self.finished.add_(done.sum())
        self.return_sum.add_((self.returns * done).sum())
        self.length_sum.add_((self.lengths * done).sum())
        for name, total in self.stat_sums.items():  # (one the env left out: a KeyError)
            total.add_((step.stats[name] * done).sum())
        self.returns.mul_(1.0 - done)
        self.lengths.mul_(1.0 - done)

    def read(self) -> dict[str, float]:
        """Means over the episodes finished since the last read (empty if none); resets sums."""
        count = float(self.finished)
        out: dict[str, float] = {}
        if count > 0:
            out["episode_return"] = float(self.return_sum) / count
            out["episode_length"] = float(self.length_sum) / count
            for name, total in self.stat_sums.items():
                out[name] = float(total) / count
        out["episodes"] = count
        for t in (self.finished, self.return_sum, self.length_sum, *self.stat_sums.values()):
            t.zero_()
        return out

    def fresh_episodes(self) -> None:
        """Forget the running episodes (their envs start new ones); the finished episodes not
        yet read stay, so that the next log row still counts them."""
        self.returns.zero_()
        self.lengths.zero_()

    def state_dict(self) -> dict[str, Any]:
        """Every field (a field added later is saved too)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        dev = self.returns.device
        for f in fields(self):
            value = state[f.name]
            if isinstance(value, dict):
                setattr(self, f.name, {k: v.to(dev) for k, v in value.items()})
            else:
                setattr(self, f.name, value.to(dev))


def stored_dtypes(env: BatchedEnv, critic_source: str) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes a rollout stores a group's observations and critic inputs in: bytes where
    the env declares byte observations (:attr:`~mappo.envs.base.BatchedEnv.byte_observations`)
    and the critic's input is made of them (its global state or the observations, with 0/1
    death masks and agent ids), float32 otherwise. The networks convert bytes back to float32
    at their input, so training is unchanged; Hanabi's rollouts take a quarter of the memory."""
    if not env.byte_observations:
        return torch.float32, torch.float32
    return torch.uint8, (
        torch.uint8 if critic_source in ("state", "local", "concat_obs") else torch.float32
    )


def allocate(policy: ActorCritic, env: BatchedEnv, length: int, bootstrap: bool) -> Rollout:
    """Preallocate a rollout of ``length`` steps for ``env`` and ``policy``."""
    E, dev = env.num_envs, env.device
    spec = env.spec
    groups: dict[str, GroupBuffer] = {}
    for name, group in spec.groups.items():
        n = group.num_agents
        actor, critic = policy.actors[name], policy.critics[name]
        ci = policy.critic_inputs[name]
        c = ci.copies
        obs_dtype, x_dtype = stored_dtypes(env, ci.source)
        groups[name] = GroupBuffer(
            obs=torch.zeros(length, E, n, *group.obs_shape, dtype=obs_dtype, device=dev),
            critic_x=torch.zeros(length, E, c, critic.in_features, dtype=x_dtype, device=dev),
            actor_state=torch.zeros(length, E, n, actor.state_size, device=dev),
            critic_state=torch.zeros(length, E, c, critic.state_size, device=dev),
            actions=torch.zeros(
                length, E, n, group.action.num_heads, dtype=group.action.dtype, device=dev
            ),
            log_probs=torch.zeros(length, E, n, device=dev),
            values=torch.zeros(length + 1, E, c, device=dev),
            rewards=torch.zeros(length, E, n, device=dev),
            alive=torch.zeros(length, E, n, dtype=torch.bool, device=dev),
            action_mask=(
                torch.zeros(length, E, n, group.action.total, dtype=torch.bool, device=dev)
                if group.has_action_mask
                else None
            ),
            final_values=torch.zeros(length, E, c, device=dev) if bootstrap else None,
            agent_terminated=(
                torch.zeros(length, E, n, dtype=torch.bool, device=dev)
                if env.agent_terminations
                else None
            ),
        )
    flags = [torch.zeros(length, E, dtype=torch.bool, device=dev) for _ in range(3)]
    return Rollout(groups, *flags)


def policy_step(
    policy: ActorCritic,
    step: EnvStep,
    actor_states: dict[str, Tensor],
    critic_states: dict[str, Tensor],
    starts: Tensor,
    noise: dict[str, Tensor],
) -> tuple[Acted, dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """One step of data collection for every group, a pure function of its inputs (the compiled
    path compiles it as one graph): actions sampled with ``noise``
    (:meth:`~mappo.nn.actor_critic.ActorCritic.draw_noise`), the critic inputs ``[E, C, in]``
    and, for recurrent critics, their values ``[E, C]`` and next states (other critics' states
    pass through; their values are computed after the rollout in one call).

    ``starts [E]`` bool marks envs whose episode begins at this step.
    """
    acted = Acted({}, {}, {}, {})
    critic_x, values, new_critic = {}, {}, {}
    for name, state in actor_states.items():
        out = policy.act_group(
            name,
            step.obs[name],
            state,
            starts,
            step.action_mask.get(name),
            False,
            None,
            noise=noise[name],
        )
        acted.actions[name] = out.actions
        acted.env_actions[name] = out.actions if out.env_actions is None else out.env_actions
        acted.states[name] = out.state
        acted.log_probs[name] = out.log_prob
        x = policy.critic_input(name, step)
        critic_x[name] = x
        critic = policy.critics[name]
        if critic.state_size > 0:
            value, new_critic[name] = critic(x.unsqueeze(0), critic_states[name], starts[None])
            values[name] = value[0]
        else:
            new_critic[name] = critic_states[name]
    return acted, critic_x, values, new_critic


def fused_step(
    policy: ActorCritic,
    env_step: Callable[[dict[str, Tensor]], EnvStep],
    step: EnvStep,
    actor_states: dict[str, Tensor],
    critic_states: dict[str, Tensor],
    starts: Tensor,
    noise: dict[str, Tensor],
    tracker: EpisodeTracker,
    step_fn: Callable[..., Any] = policy_step,
) -> tuple[Acted, dict[str, Tensor], dict[str, Tensor], dict[str, Tensor], EnvStep]:
    """:func:`policy_step`, then the env's step on its actions
    (:meth:`~mappo.envs.base.BatchedEnv.claim_traced_step`) and the episode tracker's record of
    it: one env step of data collection as one function, which the compiled path compiles as
    one graph (one call and a few fused kernels instead of about a hundred small ops). Returns
    :func:`policy_step`'s results and the env's :class:`EnvStep`. ``step_fn`` replaces
    :func:`policy_step` with a function of the same arguments and results (stacked seeds pass
    their vmapped step)."""
    acted, critic_x, values, new_critic = step_fn(
        policy, step, actor_states, critic_states, starts, noise
    )
    next_step = env_step(acted.env_actions)
    tracker.record(next_step)
    return acted, critic_x, values, new_critic, next_step


def _require_final_fields(env: BatchedEnv, step: EnvStep) -> None:
    """Refuse a ``step()`` without ``final_obs`` or ``final_state`` where truncated episodes are
    bootstrapped, which reads them at every step (a user's env that leaves them out would fail
    where the critic reads them, in a traceback). The lazy final state is not made here."""
    for name, value in (
        ("final_obs", step.final_obs),
        ("final_state", step.__dict__.get("_final_state")),
    ):
        if value is None:
            raise EnvError(
                f"{env.name}: step() returned {name}=None, which bootstrapping truncated "
                "episodes (algo.bootstrap_truncation=true) reads at every step; set final_obs "
                "and final_state (the observations and state before the auto-reset, equal to "
                "obs and state where no episode ended), or set algo.bootstrap_truncation=false"
            )


def final_critic(
    policy: ActorCritic, name: str, step: EnvStep, critic_states: dict[str, Tensor]
) -> Tensor:
    """For bootstrapping at a time limit: a recurrent critic's value ``[E, C]`` of the final
    (pre-reset) observation, with the state that would have continued the episode; for a
    feed-forward critic its input ``[E, C, in]`` (valued after the rollout in one call)."""
    x = policy.critic_input(name, step, final=True)
    critic = policy.critics[name]
    if critic.state_size == 0:
        return x
    no_starts = torch.zeros(1, x.shape[0], dtype=torch.bool, device=x.device)
    value, _ = critic(x.unsqueeze(0), critic_states[name], no_starts)
    return value[0]


def rollout_values(
    policy: ActorCritic,
    groups: dict[str, GroupBuffer],
    step: EnvStep,
    critic_states: dict[str, Tensor],
    finals: dict[str, Tensor],
) -> None:
    """The feed-forward critics' values of a whole rollout, after its last step, written into
    each of ``groups``' buffers: ``values [T + 1, E, C]`` (the stored critic inputs, then the
    inputs of ``step``, the one the agents act on next) and, for the groups in ``finals``
    (their final-observation critic inputs ``[T, E, C, in]``, for bootstrapping at time
    limits), ``final_values [T, E, C]``. One batched call per group instead of one per step;
    the compiled path compiles it as one graph (its eager form spent most of its time in
    ``tanh``, which the graph computes from ``exp``, :data:`mappo.compiled.CPU_OPTIONS`).
    ``critic_states``: the critics' (empty) states, passed through."""
    for name, buf in groups.items():
        critic = policy.critics[name]
        T, E = buf.critic_x.shape[:2]
        x = policy.critic_input(name, step).unsqueeze(0)
        no_state = critic_states[name]
        no_starts = torch.zeros(1, E, dtype=torch.bool, device=x.device)
        buf.values[:T] = critic(buf.critic_x, no_state, no_starts.expand(T, -1))[0]
        buf.values[T] = critic(x, no_state, no_starts)[0][0]
        if name in finals:
            buf.final_values.copy_(critic(finals[name], no_state, no_starts.expand(T, -1))[0])


def fused_steps(
    policy: ActorCritic,
    env_step: Callable[[dict[str, Tensor]], EnvStep],
    step: EnvStep,
    actor_states: dict[str, Tensor],
    critic_states: dict[str, Tensor],
    starts: Tensor,
    noises: dict[str, Tensor],
    tracker: EpisodeTracker,
    bootstrap: bool,
    step_fn: Callable[..., Any] = policy_step,
    out: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Tensor], dict[str, Tensor], EnvStep, Tensor]:
    """``K`` consecutive steps of :func:`fused_step` (the env's traced step each time) as one
    function, which the compiled path compiles as one graph: one call per ``K`` steps instead
    of ``K``, with what the rollout records of each step. ``noises``: each group's sampling
    noise of the ``K`` steps, ``[K, 1, E, ...]``
    (:meth:`~mappo.nn.actor_critic.ActorCritic.draw_noises`: one tensor per group rather than
    one per step, fewer inputs for the compiled call to check).

    Returns one record per step: ``starts``, ``terminated``, ``truncated`` ``[E]`` and under
    ``groups``, per group, tensors keyed as :class:`GroupBuffer`'s fields (``obs``, ``alive``,
    ``action_mask`` where the group has masks, ``actor_state``, ``critic_state`` and ``values``
    for recurrent critics, ``actions``, ``log_probs``, ``critic_x``, ``rewards``, and ``final``
    (:func:`final_critic`) when ``bootstrap``); then the actor and critic states, the env step
    and the ``starts [E]`` after the last step. ``step_fn`` as in :func:`fused_step`.

    ``out``: where the records go instead, keyed as a record, each a ``[K, ...]`` slice of the
    rollout buffer (step ``k``'s record written into index ``k`` as an assignment would); the
    records returned then hold only what ``out`` has no place for. The compiled block writes
    the rollout this way: its graph returns four things rather than a hundred, several of
    which alias its inputs or one another, which torch rebuilds after each call.
    """
    rows: list[dict[str, Any]] = []
    for k in range(next(iter(noises.values())).shape[0]):
        noise = {name: x[k] for name, x in noises.items()}
        row: dict[str, Any] = {"starts": starts, "groups": {}}
        for name in actor_states:
            rec = {"obs": step.obs[name], "alive": step.alive[name]}
            if name in step.action_mask:
                rec["action_mask"] = step.action_mask[name]
            rec["actor_state"] = actor_states[name]
            if policy.critics[name].state_size > 0:
                rec["critic_state"] = critic_states[name]
            row["groups"][name] = rec
        acted, critic_x, values, critic_states, step = fused_step(
            policy, env_step, step, actor_states, critic_states, starts, noise, tracker, step_fn
        )
        actor_states = acted.states
        for name, rec in row["groups"].items():
            rec["actions"] = acted.actions[name]
            rec["log_probs"] = acted.log_probs[name]
            rec["critic_x"] = critic_x[name]
            if name in values:
                rec["values"] = values[name]
            rec["rewards"] = step.reward[name]
            if bootstrap:
                rec["final"] = final_critic(policy, name, step, critic_states)
        row["terminated"] = step.terminated
        row["truncated"] = step.truncated
        starts = step.done
        rows.append(row if out is None else _write_row(row, out, k))
    return rows, actor_states, critic_states, step, starts


def _write_row(row: dict[str, Any], out: dict[str, Any], k: int) -> dict[str, Any]:
    """Write ``row``'s records into index ``k`` of ``out``'s slices (:func:`fused_steps`);
    returns what has no place there."""
    left: dict[str, Any] = {"groups": {}}
    for key, value in row.items():
        if key == "groups":
            for name, rec in value.items():
                dests = out["groups"][name]
                left["groups"][name] = {f: x for f, x in rec.items() if f not in dests}
                for f, x in rec.items():
                    if f in dests:
                        dests[f][k].copy_(x)
        elif key in out:
            out[key][k].copy_(value)
        else:
            left[key] = value
    return left


def policy_step_key(policy: ActorCritic, step: EnvStep, *rest: Any) -> Hashable:
    """What tells the compiled calls of :func:`policy_step` apart
    (:class:`mappo.compiled.DirectCalls`): the layout of the env step acted on (with or without
    final observations, the groups with masks). Everything else it reads is the same on every
    call of a trainer: its networks and the shapes of the states and the noise."""
    return field_layout(step)


def fused_step_key(
    policy: ActorCritic, env_step: Callable[[dict[str, Tensor]], EnvStep], step: EnvStep, *rest: Any
) -> Hashable:
    """What tells the compiled calls of :func:`fused_step` apart: as
    :func:`policy_step_key` (the env, whose steps are traced, is the trainer's own on every
    call). The step acted on comes from the env's reset or from
    the previous traced step; an env that hands out traced steps only some of the time would
    mix in its eager steps' outputs, whose tensors may alias differently (the particle world,
    the only such env, hands out every step)."""
    return field_layout(step)


def fused_steps_key(
    policy: ActorCritic, env_step: Callable[[dict[str, Tensor]], EnvStep], step: EnvStep, *rest: Any
) -> Hashable:
    """What tells the compiled calls of :func:`fused_steps` apart: :func:`fused_step_key` and
    the steps per call (the leading size of the noise, ``rest[3]``; a collector keeps one block
    size, but a graph of another size must not be called in its place). The block's flags are
    the trainer's own on every call."""
    noises: dict[str, Tensor] = rest[3]
    return fused_step_key(policy, env_step, step), next(iter(noises.values())).shape[0]


def values_key(
    policy: ActorCritic,
    groups: dict[str, GroupBuffer],
    step: EnvStep,
    critic_states: dict[str, Tensor],
    finals: dict[str, Tensor],
) -> Hashable:
    """What tells the compiled calls of :func:`rollout_values` apart: the groups valued, those
    with final observations and the layout of the last env step."""
    return tuple(groups), tuple(finals), field_layout(step)


@dataclass
class Collector:
    """Steps an env with a policy and fills a :class:`Rollout`; keeps the state between calls.

    ``step`` is the last :class:`EnvStep` (what the agents act on next); ``actor_states`` /
    ``critic_states`` the recurrent states after the last step (pre-reset); ``starts`` marks
    envs whose next step begins an episode.
    """

    env: BatchedEnv
    policy: ActorCritic
    rollout: Rollout
    generator: torch.Generator
    step: EnvStep
    actor_states: dict[str, Tensor]
    critic_states: dict[str, Tensor]
    starts: Tensor
    tracker: EpisodeTracker
    bootstrap: bool = False
    step_fn: Callable[..., Any] | None = None
    """:func:`policy_step` or its compiled form (``None``: the function itself)."""
    fused_fn: Callable[..., Any] | None = None
    """The compiled :func:`fused_step`, used on the steps the env lets it trace (``None``:
    policy and env step separately, always)."""
    block_fn: Callable[..., Any] | None = None
    """The compiled :func:`fused_steps`, for runs of ``block`` steps that the env lets it
    trace (:meth:`~mappo.envs.base.BatchedEnv.claim_traced_steps`); ``None``: never."""
    values_fn: Callable[..., Any] | None = None
    """:func:`rollout_values` or its compiled form (``None``: the function itself)."""
    block: int = 0
    """Steps per :attr:`block_fn` call (used only where ``block_fn`` is set)."""
    traced_step_fn: Callable[..., Any] = policy_step
    """The policy step that :attr:`fused_fn` and :attr:`block_fn` trace with the env's step
    (:func:`policy_step`, or the stacked seeds' uncompiled vmapped step)."""

    @torch.no_grad()
    def collect(self) -> Rollout:
        """Fill the rollout with ``T`` steps and the bootstrap values after the last one.

        A feed-forward critic's values do not feed back into acting, so they are computed after
        the loop in one batched call over all ``T + 1`` steps instead of ``T + 1`` small ones.
        """
        ro, policy = self.rollout, self.policy
        T, E = ro.starts.shape
        stepwise = {name: policy.critics[name].state_size > 0 for name in ro.groups}
        final_x: dict[str, list[Tensor]] = {name: [] for name in ro.groups}
        step_fn = self.step_fn or policy_step
        t = 0
        while t < T:
            if self._block(t, T, final_x):
                t += self.block
                continue
            ro.starts[t] = self.starts
            for name, buf in ro.groups.items():
                if t == 0 and not buf.obs.is_floating_point():
                    _check_bytes(self.env, self.step.obs[name], f"group '{name}' observations")
                buf.obs[t] = self.step.obs[name]
                buf.alive[t] = self.step.alive[name]
                if buf.action_mask is not None:
                    buf.action_mask[t] = self.step.action_mask[name]
                buf.actor_state[t] = self.actor_states[name]
                if stepwise[name]:
                    buf.critic_state[t] = self.critic_states[name]
            noise = policy.draw_noise(E, self.generator)
            traced = self.env.claim_traced_step() if self.fused_fn is not None else None
            if traced is not None:
                acted, critic_x, values, self.critic_states, self.step = self.fused_fn(
                    policy,
                    traced,
                    self.step,
                    self.actor_states,
                    self.critic_states,
                    self.starts,
                    noise,
                    self.tracker,
                    self.traced_step_fn,
                )
            else:
                acted, critic_x, values, self.critic_states = step_fn(
                    policy, self.step, self.actor_states, self.critic_states, self.starts, noise
                )
                self.step = self.env.step(acted.env_actions)
                self.tracker.record(self.step)
                if self.bootstrap:
                    _require_final_fields(self.env, self.step)
            self.actor_states = acted.states
            for name, buf in ro.groups.items():
                buf.actions[t] = acted.actions[name]
                buf.log_probs[t] = acted.log_probs[name]
                if t == 0 and not buf.critic_x.is_floating_point():
                    _check_bytes(self.env, critic_x[name], f"group '{name}' critic inputs")
                buf.critic_x[t] = critic_x[name]
                if stepwise[name]:
                    buf.values[t] = values[name]
                buf.rewards[t] = self.step.reward[name]
                if buf.agent_terminated is not None:
                    buf.agent_terminated[t] = self.step.agent_terminated[name]
                if self.bootstrap:
                    # V(final observation) with the recurrent state that would have continued
                    # the episode; only used where the env was truncated.
                    final = final_critic(policy, name, self.step, self.critic_states)
                    if stepwise[name]:
                        buf.final_values[t] = final
                    else:
                        final_x[name].append(final)
            ro.terminated[t] = self.step.terminated
            ro.truncated[t] = self.step.truncated
            self.starts = self.step.done
            t += 1
        if is_users_env(self.env):
            _check_stored_masks(self.env, ro)
        starts = self.starts.unsqueeze(0)
        later: dict[str, GroupBuffer] = {}
        finals: dict[str, Tensor] = {}
        for name, buf in ro.groups.items():
            if stepwise[name]:
                x = policy.critic_input(name, self.step).unsqueeze(0)
                critic = policy.critics[name]
                buf.values[T] = critic(x, self.critic_states[name], starts)[0][0]
                continue
            later[name] = buf
            if self.bootstrap:
                finals[name] = torch.stack(final_x[name])
        if later:
            values = self.values_fn or rollout_values
            values(policy, later, self.step, self.critic_states, finals)
        return ro

    def _block(self, t: int, T: int, final_x: dict[str, list[Tensor]]) -> bool:
        """Collect steps ``t .. t + block - 1`` with :attr:`block_fn` where the rollout has that
        many left and the env lets all of them be traced; returns whether it did."""
        K = self.block
        if self.block_fn is None or t + K > T:
            return False
        traced = self.env.claim_traced_steps(K)
        if traced is None:
            return False
        ro, E = self.rollout, self.rollout.starts.shape[1]
        span = slice(t, t + K)
        out: dict[str, Any] = {key: getattr(ro, key)[span] for key in _STEP_RECORDS}
        out["groups"] = {}
        for name, buf in ro.groups.items():
            recurrent_critic = self.policy.critics[name].state_size > 0
            dests = {key: getattr(buf, key)[span] for key in _GROUP_RECORDS}
            if buf.action_mask is not None and name in self.step.action_mask:
                dests["action_mask"] = buf.action_mask[span]
            if recurrent_critic:
                dests["critic_state"], dests["values"] = buf.critic_state[span], buf.values[span]
                if self.bootstrap:
                    dests["final"] = buf.final_values[span]
            out["groups"][name] = dests
            if t == 0 and buf.obs.dtype == torch.uint8:  # what a byte rollout cannot hold
                _check_bytes(self.env, self.step.obs[name], f"group '{name}' obs")
            if t == 0 and buf.critic_x.dtype == torch.uint8:
                x = self.policy.critic_input(name, self.step)
                _check_bytes(self.env, x, f"group '{name}' critic_x")
        noises = self.policy.draw_noises(K, E, self.generator)
        rows, self.actor_states, self.critic_states, self.step, starts = self.block_fn(
            self.policy,
            traced,
            self.step,
            self.actor_states,
            self.critic_states,
            self.starts,
            noises,
            self.tracker,
            self.bootstrap,
            self.traced_step_fn,
            out,
        )
        for name in ro.groups:  # a feed-forward critic's final inputs, valued after the loop
            unplaced = set(rows[0]["groups"][name]) - {"final"}
            if unplaced:  # a record the rollout has no buffer for would be lost
                raise RuntimeError(f"group '{name}': the rollout has no place for {unplaced}")
            if "final" in rows[0]["groups"][name]:
                final_x[name].extend(row["groups"][name]["final"] for row in rows)
        self.starts = starts
        return True

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where every env stands: the env's snapshot and generator (None for an env that cannot
        be snapshotted), the step to act on, recurrent states, episode starts and the tracker."""
        try:
            env: dict[str, Any] | None = {
                "state": self.env.get_state(),
                "rng": self.env.generator.get_state(),
            }
        except NotImplementedError:
            env = None
        return {
            "env": env,
            "step": step_to_dict(self.step),
            "actor_states": self.actor_states,
            "critic_states": self.critic_states,
            "starts": self.starts,
            "tracker": self.tracker.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], fallback_seed: int) -> None:
        """Restore :meth:`state_dict`. An env that could not be snapshotted (e.g. a third-party
        one in worker processes) starts fresh episodes from ``fallback_seed`` instead."""
        dev = self.env.device
        if state["env"] is None:
            warn_fresh_episodes(self.env)
            self.step = self.env.reset(seed=fallback_seed)
            self.tracker.load_state_dict(state["tracker"])
            self.tracker.fresh_episodes()
            return
        self.env.set_state({k: v.to(dev) for k, v in state["env"]["state"].items()})
        restore_generator(self.env.generator, state["env"]["rng"], fallback_seed, "env")
        self.step = step_from_dict(state["step"], dev)
        self.actor_states = {k: v.to(dev) for k, v in state["actor_states"].items()}
        self.critic_states = {k: v.to(dev) for k, v in state["critic_states"].items()}
        self.starts = state["starts"].to(dev)
        self.tracker.load_state_dict(state["tracker"])


def warn_fresh_episodes(env: BatchedEnv) -> None:
    """Say that a resumed run's env, which could not be snapshotted, starts fresh episodes."""
    warnings.warn(
        f"{env.name} keeps its state in Python objects, which a checkpoint that runs no code "
        "cannot hold: its episodes start afresh at this resume, so the run goes on from there "
        "as a run never stopped would not, step for step",
        CheckpointWarning,
        stacklevel=2,
    )


_STEP_RECORDS = ("starts", "terminated", "truncated")
"""What a block records of each step for all groups (:func:`fused_steps`)."""
_GROUP_RECORDS = ("obs", "alive", "actor_state", "actions", "log_probs", "critic_x", "rewards")
"""What it records of each step for every group; ``action_mask``, ``critic_state``, ``values``
and ``final`` where the group has them."""


def _check_stored_masks(env: BatchedEnv, ro: Rollout) -> None:
    """Refuse a rollout in which a user's env gave an agent it marks alive an action mask that
    allows nothing (one check per rollout)."""
    masks = {name: buf.action_mask for name, buf in ro.groups.items()}
    alive = {name: buf.alive for name, buf in ro.groups.items()}
    refuse_living_without_actions(env, masks, alive, "a rollout")


def _check_bytes(env: BatchedEnv, x: Tensor, what: str) -> None:
    """Refuse values a byte rollout cannot hold (one check per rollout, on its first step: the
    env's declaration is trusted for the rest)."""
    try:
        check_bytes(x, what, whole=True)
    except ValueError as err:
        raise EnvError(f"{env.name}: {err}") from err
