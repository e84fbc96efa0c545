"""The compiled path (``compile=on``) against eager, the reference: the same losses and
parameters after a few updates, no graph breaks (the functions are compiled with
``fullgraph=True``, so a break is an error), checkpoints that move between the two, and the
fused recurrent segments against the step loop.

The equality tests run on the CPU; ``MAPPO_TEST_DEVICE=cuda`` runs them on a GPU, where the
compiled functions are also replayed as CUDA graphs (BENCHMARKS.md records such runs)."""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import pytest
import torch

import mappo.nn.layers
from mappo import config as config_mod
from mappo.algos.mappo import gradient_step, make_samples, update
from mappo.compiled import CPU_OPTIONS, _copy_out, _known, compile_fn, wanted
from mappo.config import ConfigError
from mappo.nn.layers import RecurrentCore
from mappo.rollout import fused_steps
from mappo.trainer import Trainer, resume, train

# Compiled and eager round differently in the last bits (fused kernels, another summation
# order); after three updates of these small runs the parameters agree to about 1e-6.
ATOL = 2e-5

SMALL = {
    "env.num_envs": 8,
    "rollout_length": 16,
    "algo.epochs": 2,
    "algo.num_minibatches": 2,
    "threads": 1,
    "progress": False,
    "device": os.environ.get("MAPPO_TEST_DEVICE", "cpu"),
}


def _iterate(preset: str, compile_setting: str, overrides: dict, iterations: int = 3):
    cfg = config_mod.load(preset, {**SMALL, **overrides, "compile": compile_setting})
    trainer = Trainer(cfg)
    results = [trainer.iterate() for _ in range(iterations)]
    params = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
    trainer.close()
    return results, params


def _assert_same(eager: tuple, compiled: tuple) -> None:
    (res_e, par_e), (res_c, par_c) = eager, compiled
    for k in par_e:
        torch.testing.assert_close(par_c[k], par_e[k], rtol=0, atol=ATOL, msg=k)
    for k, v in res_e[-1].items():
        if k.endswith(("_loss", "entropy", "grad_norm")):
            assert res_c[-1][k] == pytest.approx(v, rel=1e-4, abs=1e-5), k


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        # feed-forward, one group, the preset of JaxMARL's settings
        ("mpe/simple_spread_jaxmarl_ff", {}),
        # recurrent actors and critics, two groups, PopArt, chunks that need padding (8 x 17
        # steps in 46 chunks of 3), states injected where a chunk enters the next env. Short
        # chunks: the compiled loss unrolls the recurrence, and every step of it adds kernels
        # to the cold compile (chunks of 10 took several minutes here). Mini-batches of one
        # size (23 chunks): each size is a graph of its own.
        (
            "mpe/simple_speaker_listener",
            {"algo.value_norm": "popart", "algo.data_chunk_length": 3, "rollout_length": 17},
        ),
        # a continuous group (tanh-squashed Gaussian)
        ("mpe/simple_spread_continuous", {"algo.data_chunk_length": 4}),
        # recurrent actors beside feed-forward critics (no critic state in the chunks)
        ("mpe/simple_spread", {"model.recurrent_critic": False, "algo.data_chunk_length": 3}),
        # convolutions over images, one set of filters per agent (a grouped convolution)
        ("grid/spread", {"model.share_params": False, "model.cnn_channels": [4]}),
    ],
)
def test_compiled_updates_equal_eager(preset, overrides):
    eager = _iterate(preset, "off", overrides)
    compiled = _iterate(preset, "on", overrides)
    assert "compile_seconds" in compiled[0][0] and "compile_seconds" not in eager[0][0]
    assert compiled[0][0]["compile_seconds"] > 0
    _assert_same(eager, compiled)


@pytest.mark.parametrize(
    ("preset", "overrides", "compiled"),
    [
        # recurrent, two groups, PopArt rescaling the value heads between steps; clipping on
        (
            "mpe/simple_speaker_listener",
            {"algo.value_norm": "popart", "algo.max_grad_norm": 0.05},
            False,
        ),
        # feed-forward, unclipped, weight decay, PopArt
        (
            "mpe/simple_spread_jaxmarl_ff",
            {"algo.max_grad_norm": None, "algo.weight_decay": 1e-3, "algo.value_norm": "popart"},
            False,
        ),
        # feed-forward, ValueNorm, clipping on; also compiled, as compile=on runs it
        ("mpe/simple_spread_jaxmarl_ff", {"algo.max_grad_norm": 0.05}, True),
    ],
)
def test_the_gradient_step_equals_autograd_and_adam(preset, overrides, compiled):
    """:func:`~mappo.algos.mappo.gradient_step` (the CPU's compiled step for feed-forward
    networks) makes the update that autograd, gradient clipping and ``torch.optim.Adam`` make:
    the same parameters, Adam moments and step counts, losses and gradient norms, over two
    updates at two learning rates; compiled, without compiling again for the second rate."""
    cfg = config_mod.load(preset, {**SMALL, **overrides})
    sides = [("eager", None), ("func", gradient_step)]
    if compiled:
        sides.append(("compiled", compile_fn(gradient_step)))
    runs = {}
    for name, step_fn in sides:
        trainer = Trainer(cfg)
        learner = trainer.learner
        losses = []
        graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for fraction in (0.5, 0.25):
            learner.optim.set_lr_fraction(fraction, cfg.algo)
            rollout = learner.collector.collect()
            samples = make_samples(learner.policy, rollout, cfg.algo, learner.recurrent)
            losses.append(
                update(
                    learner.policy,
                    samples,
                    learner.optim,
                    cfg.algo,
                    learner.shuffle_gen,
                    step_fn=step_fn,
                )
            )
        if name == "compiled":
            # Equal mini-batches: one graph, kept across the rate change.
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1
        runs[name] = (losses, learner.policy.state_dict(), learner.optim.state_dict())
        trainer.close()
    loss_e, par_e, opt_e = runs.pop("eager")
    for name, (loss_f, par_f, opt_f) in runs.items():
        tol = ATOL if name == "compiled" else 1e-6
        for k, v in par_e.items():
            torch.testing.assert_close(par_f[k], v, rtol=1e-5, atol=tol, msg=f"{name} {k}")
        for which in ("actor", "critic"):
            assert opt_f[which]["state"].keys() == opt_e[which]["state"].keys()
            for i, state in opt_e[which]["state"].items():
                assert opt_f[which]["state"][i].keys() == state.keys()
                for k, v in state.items():
                    got = opt_f[which]["state"][i][k]
                    torch.testing.assert_close(
                        got, v, rtol=1e-5, atol=tol / 10, msg=f"{name} {which} {i} {k}"
                    )
        for got, want in zip(loss_f, loss_e, strict=True):
            assert got.keys() == want.keys()
            for k, v in want.items():
                assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-5), f"{name} {k}"


def test_compile_on_takes_the_whole_gradient_step_as_one_graph_on_the_cpu():
    """On the CPU (and on CUDA, ``MAPPO_TEST_DEVICE=cuda``) ``compile=on`` runs a feed-forward
    network's gradient step as one graph (recurrent losses keep the compiled loss, where the
    step gained nothing); the env's step joins the rollout's graph only for an env that offers
    traced steps (so that the bench still times the env apart for the others) and where the
    device's rule says so (recurrent networks on CUDA keep the policy step's CUDA graph);
    rollout blocks of several steps only for feed-forward networks in runs long enough to
    repay their compile."""
    from mappo.compiled import BLOCK_MIN_ROLLOUT_STEPS, compiles_gradient_step, fuses_env_step

    dev = torch.device(SMALL["device"])
    short = {"total_env_steps": BLOCK_MIN_ROLLOUT_STEPS * SMALL["env.num_envs"] - 1}
    # preset, overrides, recurrent, the env's step traceable, a run long enough for blocks
    cases = [
        ("mpe/simple_spread_jaxmarl_ff", {}, False, True, True),
        ("mpe/simple_spread_jaxmarl_ff", short, False, True, False),
        ("smac/3m", {"model.recurrent": "none"}, False, False, False),
        ("mpe/simple_spread", {}, True, True, False),
    ]
    for preset, over, recurrent, traced, long_run in cases:
        whole_step = compiles_gradient_step(dev, recurrent)
        fused = traced and fuses_env_step(dev, recurrent)
        blocks = fused and long_run
        cfg = config_mod.load(preset, {**SMALL, **over, "compile": "on"})
        trainer = Trainer(cfg)
        learner = trainer.learner
        assert (learner.step_fn is not None) == whole_step, preset
        assert (learner.terms_fn is None) == whole_step, preset
        assert (learner.collector.fused_fn is not None) == fused, preset
        assert (learner.collector.block_fn is not None) == blocks, (preset, over)
        trainer.close()


@dataclasses.dataclass
class _Pair:
    a: torch.Tensor
    b: dict[str, torch.Tensor]


class _Named(NamedTuple):
    x: torch.Tensor
    n: int


def test_cpu_graphs_compute_tanh_within_rounding_of_the_library() -> None:
    """The CPU graphs' tanh (from exp where this torch offers it) stays within 5e-7 of float64's
    across the range a network sees, saturates to exactly +-1 and keeps NaN."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    x = torch.cat([torch.linspace(-12, 12, 4801), torch.tensor([1e-30, -1e-7, 40.0, -40.0])])
    got = compile_fn(fn)(x)
    assert (got.double() - torch.tanh(x.double())).abs().max() <= 5e-7
    assert got[-2] == 1.0 and got[-1] == -1.0
    assert torch.isnan(compile_fn(fn)(torch.tensor([float("nan"), 0.0])))[0]
    # keys an older inductor lacks are dropped rather than refused by torch.compile
    assert _known({**CPU_OPTIONS, "cpp.no_such_option": 1, "no_such_section.x": 2}) == _known(
        CPU_OPTIONS
    )


def test_cuda_graph_outputs_are_copied_out_of_the_pool():
    """What a CUDA-graph replay hands out is copied, through every container the compiled
    functions return (the dataclass of actions, dicts of states, tuples), so the next replay
    cannot overwrite what the collector or autograd still holds."""
    t = torch.arange(3.0, requires_grad=True)
    out = _copy_out((_Pair(t * 2, {"s": t + 1}), [t], _Named(t, 4), None))
    pair, listed, named, none = out
    assert listed[0].data_ptr() != t.data_ptr() and named.x.data_ptr() != t.data_ptr()
    assert named.n == 4 and none is None
    assert isinstance(pair, _Pair) and isinstance(named, _Named)
    torch.testing.assert_close(listed[0], t)
    # gradients flow through the copies back to the graph's inputs
    (pair.a.sum() + listed[0].sum()).backward()
    torch.testing.assert_close(t.grad, torch.full((3,), 3.0))


def test_the_cuda_graph_wrapper_equals_the_function():
    """The replaying wrapper (new step, copies out) computes the function; on the CPU torch
    compiles it without CUDA graphs, on a GPU (``MAPPO_TEST_DEVICE=cuda``) it replays one."""
    dev = SMALL["device"]

    def f(x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(x @ w)
        return {"h": h, "s": h.sum(-1)}

    g = compile_fn(f, cuda_graphs=True)
    w = torch.randn(4, 5, device=dev, requires_grad=True)
    first = None
    for i in range(3):
        x = torch.randn(2, 4, device=dev) + i
        got, want = g(x, w), f(x, w)
        torch.testing.assert_close(got["h"], want["h"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["s"], want["s"], rtol=1e-5, atol=1e-6)
        if first is None:
            first = got
            kept = got["h"].detach().clone()
    # backward runs before the next replay (as in the update), through the copies
    got["s"].sum().backward()
    want_grad = torch.autograd.grad(f(x, w)["s"].sum(), w)[0]
    torch.testing.assert_close(w.grad, want_grad, rtol=1e-5, atol=1e-6)
    # the first call's outputs survive the later replays
    g(torch.randn(2, 4, device=dev), w)
    torch.testing.assert_close(first["h"].detach(), kept)


def test_checkpoints_move_between_compiled_and_eager(tmp_path):
    """A compiled run resumes eagerly and an eager run resumes compiled, each landing where an
    uninterrupted eager run lands."""
    common = {
        **SMALL,
        "total_env_steps": 8 * 16 * 4,
        "checkpoint_interval": 2,
        "eval_interval": 0,
        "eval_episodes": 2,
    }
    whole = train(
        "mpe/simple_spread_jaxmarl_ff", {**common, "compile": "off", "run_dir": str(tmp_path / "w")}
    )
    results = {"whole": {k: v.detach() for k, v in whole.policy.state_dict().items()}}
    for first, second in (("on", "off"), ("off", "on")):
        part = train(
            "mpe/simple_spread_jaxmarl_ff",
            {**common, "compile": first, "run_dir": str(tmp_path / first)},
        )
        for p in sorted((part.dir / "checkpoints").glob("iter_*.pt")):
            if p.name > "iter_00000002.pt":
                p.unlink()
        resumed = resume(part.dir, {"compile": second})
        assert resumed.config.compile == second
        results[first] = {k: v.detach() for k, v in resumed.policy.state_dict().items()}
    for k in results["whole"]:
        for first in ("on", "off"):
            torch.testing.assert_close(results[first][k], results["whole"][k], rtol=0, atol=ATOL)


def test_noise_drawn_outside_gives_the_actions_drawn_inside():
    """The compiled path draws the sampling noise before the policy step; the actions,
    log-probabilities and the generator's state afterwards equal drawing inside the sampler,
    for heads of different sizes (Reference: move 5, message 10) and for a box."""
    for preset in ("mpe/simple_reference", "mpe/simple_spread_continuous"):
        cfg = config_mod.load(preset, {"env.num_envs": 4})
        trainer = Trainer(cfg)
        policy, step = trainer.policy, trainer.learner.collector.step
        states = policy.acting_states(4, torch.device("cpu"))
        starts = torch.ones(4, dtype=torch.bool)
        inside, outside = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
        noise = policy.draw_noise(4, outside)
        with torch.no_grad():
            for name in states:
                mask = step.action_mask.get(name)
                a = policy.act_group(
                    name, step.obs[name], states[name], starts, mask, False, inside
                )
                b = policy.act_group(
                    name, step.obs[name], states[name], starts, mask, False, None, noise=noise[name]
                )
                torch.testing.assert_close(a.actions, b.actions, rtol=0, atol=0)
                torch.testing.assert_close(a.log_prob, b.log_prob, rtol=0, atol=0)
        assert torch.equal(inside.get_state(), outside.get_state())
        trainer.close()


@pytest.mark.parametrize(
    "preset",
    [
        "mpe/simple_spread",
        "mpe/simple_reference",
        "mpe/simple_speaker_listener",
        "mpe/simple_spread_continuous",
    ],
)
def test_a_blocks_noise_drawn_at_once_is_its_steps_noise(preset):
    """The noise of a block of steps, stacked (drawn in one call for one group of categorical
    heads), equals the block's steps drawn one after another, and leaves the generator where
    they leave it: one group or two, one head or two, a box."""
    cfg = config_mod.load(preset, {"env.num_envs": 4})
    trainer = Trainer(cfg)
    policy = trainer.policy
    once, stepwise = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    block = policy.draw_noises(5, 4, once)
    steps = [policy.draw_noise(4, stepwise) for _ in range(5)]
    assert set(block) == set(steps[0]) == set(trainer.env.spec.groups)
    for name, x in block.items():
        assert x.shape == (5, *steps[0][name].shape)
        for k in range(5):
            assert torch.equal(x[k], steps[k][name]), (name, k)
    assert torch.equal(once.get_state(), stepwise.get_state())
    trainer.close()


def test_an_unfused_adam_checkpoint_resumes_fused():
    """Optimiser states saved by torch's default Adam load into the fused one this process
    uses, with the step counters where fused Adam wants them, and update alike."""
    from mappo.algos.mappo import Optimizers

    cfg = config_mod.load("mpe/simple_spread_jaxmarl_ff", {"env.num_envs": 4})
    trainer = Trainer(cfg)
    policy = trainer.policy
    a = cfg.algo  # (the settings come from the config, the moments from the checkpoint)
    plain = Optimizers(
        torch.optim.Adam(policy.actors.parameters(), lr=a.actor_lr, eps=a.adam_eps),
        torch.optim.Adam(policy.critics.parameters(), lr=a.critic_lr, eps=a.adam_eps),
    )
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    plain.actor.step()
    plain.critic.step()
    fused = Optimizers.create(policy, cfg.algo)
    fused.load_state_dict(plain.state_dict())
    for opt in (fused.actor, fused.critic):
        assert all(g["fused"] is True for g in opt.param_groups)
        for p, st in opt.state.items():
            assert st["step"].device == p.device
    before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    fused.actor.step()
    after_fused = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    policy.load_state_dict(before)
    plain.actor.step()
    for k, v in policy.state_dict().items():
        torch.testing.assert_close(after_fused[k], v, rtol=1e-6, atol=1e-7)
    trainer.close()


def test_compile_setting_is_checked_and_read_from_yaml(tmp_path):
    assert wanted("off", torch.device("cpu")) is False
    assert wanted("on", torch.device("cpu")) is True
    assert wanted("auto", torch.device("cpu")) is False
    assert wanted("auto", torch.device("cpu"), cpu_pays=True) is True
    assert wanted("off", torch.device("cpu"), cpu_pays=True) is False
    assert wanted("auto", torch.device("cuda")) is True
    # YAML 1.1 reads on/off as booleans; the setting takes them as the words.
    path = tmp_path / "c.yaml"
    path.write_text("base: mpe/simple_spread\ncompile: on\n")
    assert config_mod.load(str(path)).compile == "on"
    assert config_mod.load("mpe/simple_spread", ["compile=off"]).compile == "off"
    with pytest.raises(ConfigError, match="compile"):
        config_mod.load("mpe/simple_spread", ["compile=fast"])
    with pytest.raises(ConfigError, match="covers algo.name=mappo only"):
        config_mod.load("mpe/simple_spread_qmix", ["compile=on"])
    assert config_mod.load("mpe/simple_spread_qmix", ["compile=auto"]).compile == "auto"
    with pytest.raises(ConfigError, match="not on mps; set compile=off"):
        config_mod.load("mpe/simple_spread", ["compile=on", "device=mps"])


@pytest.mark.parametrize(
    "kind, max_step, native",
    # 0: no step is small enough for SequenceGRU; native: its loops in C or in torch
    [("gru", None, True), ("gru", None, False), ("gru", 0, True), ("lstm", None, True)],
)
def test_fused_segments_equal_the_step_loop(kind, max_step, native, monkeypatch):
    """Eager training runs a GRU on small steps in :class:`SequenceGRU` (its backward written
    out, its loops in C or in torch), and otherwise the recurrence in torch's fused kernel
    between the steps where some sequence resets or has a state injected; outputs, final state
    and gradients match the step-by-step loop (which the compiled path and acting use)."""
    from mappo.nn import gru_sequence

    monkeypatch.setattr(gru_sequence, "NATIVE", native)
    if native:
        assert gru_sequence.native_library(torch.float32) is not None, (
            gru_sequence.unavailable_reason()
        )
    if max_step is not None:
        monkeypatch.setattr(mappo.nn.layers, "SEQUENCE_MAX_STEP", max_step)
        monkeypatch.setattr(mappo.nn.layers, "SEQUENCE_NATIVE_MAX_STEP", max_step)
    torch.manual_seed(0)
    core = RecurrentCore(16, kind, 1, layer_norm=True)
    L, B = 12, 5
    x = torch.randn(L, B, 3, 16, requires_grad=True)
    state = torch.randn(B, 3, core.state_size)
    starts = torch.zeros(L, B, dtype=torch.bool)
    starts[4, 1] = True
    starts[9, :] = True
    inject = torch.zeros(L, B, 3, core.state_size)
    inject[4, 2] = torch.randn(3, core.state_size)
    starts[4, 2] = True  # an injected state replaces the stored one, as at a start

    def run():
        out, final = core(x, state, starts, inject)
        loss = out.square().sum() + final.sum()
        return out, final, torch.autograd.grad(loss, [x, *core.parameters()])

    sequences = []
    written_out = RecurrentCore._sequence
    monkeypatch.setattr(
        RecurrentCore, "_sequence", lambda *a: sequences.append(1) or written_out(*a)
    )
    fused = run()
    assert len(sequences) == (kind == "gru" and max_step is None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # forces the loop
    loop = run()
    assert len(sequences) == (kind == "gru" and max_step is None)
    torch.testing.assert_close(fused[0], loop[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(fused[1], loop[1], rtol=0, atol=1e-5)
    for a, b in zip(fused[2], loop[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "preset, bootstrap",
    [
        ("mpe/simple_spread_jaxmarl_ff", True),  # feed-forward, Spread's contact forces
        ("mpe/simple_reference", False),  # recurrent, messages, goal colours
        ("mpe/simple_speaker_listener", False),  # two groups, one that only speaks
    ],
)
def test_the_fused_rollout_step_equals_the_eager_one(preset, bootstrap):
    """On the CPU the compiled rollout traces the env's step, the policy and the episode tracker
    into one graph on every step (the particle world's ``claim_traced_step``), feed-forward
    networks eight steps per graph (``claim_traced_steps``), episode ends included: the resets'
    random numbers are drawn when the steps are claimed. Two rollouts of 30 steps cross the time
    limit twice (25 and 50): buffers (with the time-limit bootstrap's inputs for the
    feed-forward case, and the feed-forward critics' values, which a graph of their own computes
    after the loop), tracker, env state and the step to act on next equal those of eager
    collection."""
    from mappo.compiled import fuses_env_step

    overrides = {**SMALL, "rollout_length": 30, "env.num_envs": 4}
    overrides["algo.bootstrap_truncation"] = bootstrap
    trainers = {
        mode: Trainer(config_mod.load(preset, {**overrides, "compile": mode}))
        for mode in ("off", "on")
    }
    compiled = trainers["on"].collector
    assert trainers["off"].collector.fused_fn is None
    recurrent = trainers["on"].cfg.model.recurrent != "none"
    if not fuses_env_step(torch.device(SMALL["device"]), recurrent):
        # (CUDA, recurrent: the policy step's CUDA graph and the eager env step instead,
        # which test_compiled_updates_equal_eager compares)
        assert compiled.fused_fn is None and compiled.block_fn is None
        for t in trainers.values():
            t.close()
        return
    assert compiled.fused_fn is not None
    blocks = trainers["on"].cfg.model.recurrent == "none"
    assert (compiled.block_fn is not None) == blocks and compiled.block == (8 if blocks else 0)
    claims = {"traced": 0, "eager": 0, "blocks": 0}
    claim, claim_block = compiled.env.claim_traced_step, compiled.env.claim_traced_steps

    def counted():
        fn = claim()
        claims["eager" if fn is None else "traced"] += 1
        return fn

    def counted_block(count):
        fn = claim_block(count)
        claims["blocks"] += fn is not None
        return fn

    compiled.env.claim_traced_step = counted
    compiled.env.claim_traced_steps = counted_block
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(2):
        rollouts = {mode: t.collector.collect() for mode, t in trainers.items()}
        eager, fused = rollouts["off"], rollouts["on"]
        for name in ("starts", "terminated", "truncated"):
            assert torch.equal(getattr(eager, name), getattr(fused, name)), name
        for group, buf in eager.groups.items():
            for f in dataclasses.fields(buf):
                want, got = getattr(buf, f.name), getattr(fused.groups[group], f.name)
                if want is None:
                    assert got is None
                    continue
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f.name)
    if blocks:
        # Per rollout of 30 steps, three blocks (the second crosses the end at step 25, the
        # fifth the one at 50) and six single steps; nothing eager.
        assert claims == {"traced": 12, "eager": 0, "blocks": 6}
    else:
        assert claims == {"traced": 60, "eager": 0, "blocks": 0}
    collectors = {mode: t.collector for mode, t in trainers.items()}
    want_env, got_env = (c.env.get_state() for c in collectors.values())
    for k, v in want_env.items():
        torch.testing.assert_close(got_env[k], v, rtol=1e-5, atol=1e-5, msg=k)
    want_track = collectors["off"].tracker.state_dict()
    got_track = collectors["on"].tracker.state_dict()
    for k, v in want_track.items():
        if isinstance(v, dict):
            for s, x in v.items():
                torch.testing.assert_close(got_track[k][s], x, rtol=1e-5, atol=1e-5, msg=s)
        else:
            torch.testing.assert_close(got_track[k], v, rtol=1e-5, atol=1e-5, msg=k)
    for group, obs in collectors["off"].step.obs.items():
        torch.testing.assert_close(collectors["on"].step.obs[group], obs, rtol=1e-5, atol=1e-5)
    # One graph for the single fused step and one for the block, whether or not an episode
    # ends in them, and one for the feed-forward critics' values after the loop, also after a
    # checkpoint round trip: nothing recompiles per step (and the policy step alone, for eager
    # env steps, is never compiled).
    assert (compiled.values_fn is not None) == (SMALL["device"] == "cpu")
    compiled.load_state_dict(compiled.state_dict(), fallback_seed=0)
    compiled.env.claim_traced_step, compiled.env.claim_traced_steps = claim, claim_block
    trainers["on"].collector.collect()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    values_graph = blocks and compiled.values_fn is not None  # feed-forward critics here
    assert graphs == 1 + blocks + values_graph
    for t in trainers.values():
        t.close()


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("mpe/simple_spread_jaxmarl_ff", {"algo.bootstrap_truncation": True}),  # feed-forward
        ("mpe/simple_reference", {"algo.bootstrap_truncation": True}),  # recurrent critic
        ("mpe/simple_speaker_listener", {}),  # two groups
    ],
)
def test_rollout_blocks_record_what_single_steps_record(preset, overrides):
    """:func:`fused_steps` (eight steps per call, eager here) fills the rollout exactly as the
    step loop does, time-limit bootstraps included (a recurrent critic's values inside the
    block, a feed-forward critic's inputs valued after the loop), and leaves the collector,
    the env and the tracker where the loop leaves them."""
    over = {**SMALL, "rollout_length": 30, "env.num_envs": 4, "compile": "off", **overrides}
    over["device"] = "cpu"
    trainers = [Trainer(config_mod.load(preset, over)) for _ in range(2)]
    loop, blocked = (t.collector for t in trainers)
    calls = []
    blocked.block_fn = lambda *args: calls.append(1) or fused_steps(*args)
    blocked.block = 8
    for _ in range(2):
        want, got = loop.collect(), blocked.collect()
        for name in ("starts", "terminated", "truncated"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for group, buf in want.groups.items():
            for f in dataclasses.fields(buf):
                a, b = getattr(buf, f.name), getattr(got.groups[group], f.name)
                assert (a is None and b is None) or torch.equal(a, b), (group, f.name)
    assert len(calls) == 6  # as in the compiled test above: 1-24, 31-46, 51-58
    for k, v in loop.env.get_state().items():
        assert torch.equal(blocked.env.get_state()[k], v), k
    want_track, got_track = loop.tracker.state_dict(), blocked.tracker.state_dict()
    assert want_track.keys() == got_track.keys()
    for k, v in want_track.items():
        if isinstance(v, dict):
            assert v.keys() == got_track[k].keys(), k
            assert all(torch.equal(got_track[k][s], x) for s, x in v.items()), k
        else:
            assert torch.equal(got_track[k], v), k
    assert torch.equal(blocked.starts, loop.starts)
    for group, obs in loop.step.obs.items():
        assert torch.equal(blocked.step.obs[group], obs)
        assert torch.equal(blocked.actor_states[group], loop.actor_states[group])
        assert torch.equal(blocked.critic_states[group], loop.critic_states[group])
    for t in trainers:
        t.close()


def test_block_records_are_written_as_single_assignments_would_be():
    """A block writes step ``k``'s records into index ``k`` of the rollout's slices as ``buf[t]
    = record`` would (broadcast and cast: an env may return a reward of another shape or dtype
    than its spec's), and hands back only what has no place there."""
    from mappo.rollout import _write_row

    dest = torch.zeros(5, 3, 2)
    flags = torch.zeros(5, 3, dtype=torch.bool)
    out = {"terminated": flags[1:4], "groups": {"g": {"rewards": dest[1:4]}}}
    want = torch.zeros(5, 3, 2)
    odd = [torch.tensor([1, 2]), torch.tensor(3.5, dtype=torch.float64), torch.ones(1, 2)]
    for k, r in enumerate(odd):
        want[1 + k] = r
        row = {
            "terminated": torch.tensor([True, False, k == 1]),
            "groups": {"g": {"rewards": r, "final": torch.full((3,), float(k))}},
            "other": k,
        }
        left = _write_row(row, out, k)
        assert left["other"] == k and list(left["groups"]["g"]) == ["final"]
        assert torch.equal(left["groups"]["g"]["final"], torch.full((3,), float(k)))
    assert torch.equal(dest, want) and dest.dtype == torch.float32
    assert (
        flags[1:4, 0].all()
        and not flags[1:4, 1].any()
        and flags[:, 2].tolist() == [False, False, True, False, False]
    )


@pytest.mark.parametrize(
    "name,time_feature",
    [
        ("mpe/simple_spread", False),
        ("mpe/simple_reference", False),
        ("mpe/simple_speaker_listener", False),
        ("mpe/simple_spread", True),
    ],
)
def test_claimed_steps_cross_episode_ends_as_eager_steps_do(name, time_feature):
    """``claim_traced_steps(k)`` hands out the next ``k`` steps, time-limit ends included: the
    episodes that start within them are drawn when they are claimed, in the order an eager step
    would draw them, so claimed steps (run eagerly here, as the compiled graph would trace them)
    give exactly what ``step`` gives: observations, rewards, ends, final observations and
    state, with the envs in phase and after they are set to end on different steps (and with
    the time feature, whose clock the claimed steps must carry across the ends too)."""
    from mappo.envs.registry import make

    kw = {"time_feature": True} if time_feature else {}
    envs = [make(name, num_envs=3, episode_length=5, seed=4, **kw) for _ in range(2)]
    claimed, eager = envs
    for e in envs:
        e.reset(seed=0)
        e.validate_actions = False
    gen = torch.Generator().manual_seed(0)

    def actions() -> dict[str, torch.Tensor]:
        return {
            g: torch.stack([torch.randint(0, n, (3, spec.num_agents), generator=gen)
                            for n in spec.action.nvec], -1)
            for g, spec in claimed.spec.groups.items()
        }  # fmt: skip

    ends = 0
    for phase in ("together", "staggered"):
        if phase == "staggered":
            for e in envs:
                e.set_state({"step": torch.tensor([1, 0, 3])})
        for count in (4, 2, 1, 8, 3, 7, 1, 1, 5):
            fn = claimed.claim_traced_steps(count)
            assert fn is not None
            for _ in range(count):
                a = actions()
                got, want = fn(a), eager.step(a)
                ends += int(want.truncated.sum())
                assert torch.equal(got.truncated, want.truncated)
                for g in want.obs:
                    assert torch.equal(got.obs[g], want.obs[g]), (phase, g)
                    assert torch.equal(got.final_obs[g], want.final_obs[g]), (phase, g)
                    assert torch.equal(got.reward[g], want.reward[g]), (phase, g)
                assert torch.equal(got.state, want.state)
                for k, v in want.stats.items():
                    got_k = got.stats[k]
                    assert torch.equal(got_k[want.truncated], v[want.truncated]), k
            mine, theirs = claimed.get_state(), eager.get_state()
            for k, v in theirs.items():
                assert torch.equal(mine[k], v), (phase, k)
    assert ends > 12


def test_which_envs_hand_out_traced_steps():
    """A particle world hands out traced steps only where actions are not checked; a subclass
    with its own ``_step`` never, one that overrides ``claim_traced_step`` alone is asked one
    step at a time; envs without traced steps (SMAC) none."""
    from mappo.envs.mpe.simple_spread import SimpleSpread
    from mappo.envs.registry import make

    env = make("mpe/simple_spread", num_envs=2, episode_length=3)
    env.reset(seed=0)
    assert env.claim_traced_step() is None  # actions are checked: every step goes through step
    env.validate_actions = False
    assert env.claim_traced_step() is not None and env.claim_traced_steps(8) is not None
    smac = make("smac/3m", num_envs=2)
    smac.validate_actions = False
    assert smac.claim_traced_steps(1) is None and smac.claim_traced_steps(8) is None

    class Untraced(SimpleSpread):  # opts out of tracing through claim_traced_step alone
        def claim_traced_step(self):
            return None

    class OneAtATime(SimpleSpread):  # traces, but only through its own one-step claim
        def claim_traced_step(self):
            return super().claim_traced_step()

    class Terminating(SimpleSpread):  # another way to end episodes: never traced
        def _step(self, actions):
            return super()._step(actions)

    for cls, single in ((Untraced, False), (OneAtATime, True), (Terminating, False)):
        own = cls(num_envs=2)
        own.reset(seed=0)
        own.validate_actions = False
        assert own.claim_traced_steps(4) is None, cls.__name__
        assert (own.claim_traced_steps(1) is not None) == single, cls.__name__


def test_auto_compiles_long_particle_world_runs_on_the_cpu():
    """``compile=auto`` on the CPU: compiled for runs of at least AUTO_CPU_STEPS of an env whose
    step is traced with the policy, eager for shorter runs and for other envs."""
    from mappo.compiled import AUTO_CPU_STEPS

    def compiled(preset: str, steps: int, **extra) -> bool:
        over = {**SMALL, "device": "cpu", "compile": "auto", "total_env_steps": steps, **extra}
        trainer = Trainer(config_mod.load(preset, over))
        try:
            return trainer.learner.compiled
        finally:
            trainer.close()

    assert compiled("mpe/simple_spread_fast", AUTO_CPU_STEPS) is True
    over = {**SMALL, "device": "cpu", "compile": "auto", "total_env_steps": AUTO_CPU_STEPS}
    trainer = Trainer(config_mod.load("mpe/simple_spread_fast", over))
    assert trainer.learner.collector.fused_fn is not None  # the env step joins the graph
    trainer.close()
    assert compiled("mpe/simple_spread_fast", AUTO_CPU_STEPS - 1) is False
    assert compiled("mpe/simple_spread_fast", AUTO_CPU_STEPS, compile="off") is False
    assert compiled("smac/3m", AUTO_CPU_STEPS) is False  # its step is not traced


def test_auto_falls_back_to_eager_when_compiling_fails(monkeypatch):
    """Where torch cannot compile (no C++ compiler, an unsupported op), ``compile=auto`` warns
    once per function and trains eagerly, learning exactly what ``compile=off`` learns;
    ``compile=on`` raises the error."""

    def broken(fn, **kwargs):
        def fail(*args, **kw):
            # what torch raises without a C++ compiler (an InductorError is one of these)
            raise torch._dynamo.exc.TorchDynamoException("no C++ compiler found")

        return fail

    over = {**SMALL, "device": "cpu", "total_env_steps": 2_000_000}
    eager = _iterate("mpe/simple_spread_jaxmarl_ff", "off", over, iterations=2)
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(RuntimeWarning, match="compile=auto: compiling .* failed") as caught:
        auto = _iterate("mpe/simple_spread_jaxmarl_ff", "auto", over, iterations=2)
    names = sorted(str(w.message).split()[2] for w in caught)
    # (the single fused step and the policy step alone are compiled for steps outside blocks
    # and for eager env steps, which these rollouts have none of)
    # 16-step rollouts: two blocks
    assert names == ["fused_steps", "gradient_step", "rollout_values"], names
    for k, v in eager[1].items():
        assert torch.equal(auto[1][k], v), k
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        _iterate("mpe/simple_spread_jaxmarl_ff", "on", over, iterations=1)


def test_without_a_cpp_compiler_auto_warns_once_and_on_is_a_one_line_error(
    monkeypatch, tmp_path, capsys
):
    """Windows, or a Mac without Xcode's tools: the first compiled function to build finds no
    compiler; the others run eagerly without trying (each attempt spends seconds of lowering
    on the same failure) and without a warning of their own. ``compile=on`` says what to
    install, in one line."""
    from mappo import compiled as compiled_mod
    from mappo.cli import main

    monkeypatch.setattr(compiled_mod, "_compiler_broken", None)
    tried = []

    def no_compiler(fn, **kwargs):
        def fail(*args, **kw):
            tried.append(fn.__name__)
            missing = torch._inductor.exc.InvalidCxxCompiler()
            raise torch._inductor.exc.InductorError(missing, None)

        return fail

    over = {**SMALL, "device": "cpu", "total_env_steps": 2_000_000}
    eager = _iterate("mpe/simple_spread_jaxmarl_ff", "off", over, iterations=2)
    monkeypatch.setattr(torch, "compile", no_compiler)
    with pytest.warns(RuntimeWarning) as caught:
        auto = _iterate("mpe/simple_spread_jaxmarl_ff", "auto", over, iterations=2)
    said = [str(w.message) for w in caught if "compile=auto" in str(w.message)]
    assert len(said) == 1 and "no working C++ compiler was found" in said[0], said
    assert "xcode-select --install" in said[0]
    assert len(tried) == 1, tried
    for k, v in eager[1].items():
        assert torch.equal(auto[1][k], v), k
    monkeypatch.setattr(compiled_mod, "_compiler_broken", None)
    argv = ["train", "mpe/simple_spread_jaxmarl_ff", "compile=on", f"run_dir={tmp_path}"]
    argv += [f"{k}={v}" for k, v in over.items()] + ["total_env_steps=128"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compiling needs a compiler" in err, err
    assert "compile=off" in err


def test_only_a_missing_or_unusable_compiler_counts_as_one():
    # A compiler that rejects inductor's own code is torch's bug, not a missing toolchain:
    # that function falls back alone, the others still compile.
    from torch._inductor.exc import CppCompileError, InductorError, InvalidCxxCompiler

    from mappo.compiled import compiler_failure

    def wrapped(inner):
        return InductorError(inner, None)

    no_omp = CppCompileError(["clang++"], "clang: error: unsupported option '-fopenmp'")
    assert "unsupported option '-fopenmp'" in compiler_failure(wrapped(no_omp))
    assert "no working C++ compiler" in compiler_failure(wrapped(InvalidCxxCompiler()))
    triton = RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")
    assert "Triton" in compiler_failure(wrapped(triton))
    codegen = CppCompileError(["g++"], "kernel.cpp:12: error: 'tmp3' was not declared")
    assert compiler_failure(wrapped(codegen)) is None
    # an error raised while handling a compile failure is not one
    try:
        try:
            raise wrapped(InvalidCxxCompiler())
        except InductorError:
            raise ValueError("a later, unrelated error") from None
    except ValueError as later:
        assert compiler_failure(later) is None


def test_auto_does_not_rerun_a_step_that_failed_while_updating_its_inputs(monkeypatch):
    """The fused env steps and the whole gradient step update their inputs in place (the env's
    state, the parameters, Adam's moments). A failure while such a graph runs (not a failure to
    compile) may leave them half updated; ``compile=auto`` must raise it rather than run the
    step again eagerly, which would apply it twice. Functions that update nothing still fall
    back."""
    from mappo.compiled import compile_fn

    def broken(fn, **kwargs):
        def fail(*args, **kw):
            raise RuntimeError("CUDA error: an illegal memory access")

        return fail

    monkeypatch.setattr(torch, "compile", broken)
    counts = torch.zeros(3)

    def bump(x: torch.Tensor) -> torch.Tensor:
        x += 1
        return x

    safe = compile_fn(bump, fallback=True)
    with pytest.warns(RuntimeWarning, match="compiling bump failed"):
        safe(counts)
    assert counts.tolist() == [1.0, 1.0, 1.0]
    mutating = compile_fn(bump, fallback=True, mutates=True)
    with pytest.raises(RuntimeError, match="failed while running .* not run again eagerly"):
        mutating(counts)
    assert counts.tolist() == [1.0, 1.0, 1.0]  # not stepped a second time
    over = {**SMALL, "device": "cpu", "total_env_steps": 2_000_000}
    with pytest.raises(RuntimeError, match="compiled fused_step.? failed while running"):
        _iterate("mpe/simple_spread_jaxmarl_ff", "auto", over, iterations=1)


@pytest.mark.parametrize("num_seeds", [1, 2])
def test_the_bench_does_not_split_off_an_env_step_compiled_with_the_policy(num_seeds):
    """`mappo bench train` times the env by wrapping its ``step``; with the env's step inside
    the fused graph (one seed or stacked seeds) it reports the rollout whole instead of a wrong
    env / acting split."""
    from mappo.bench.train import format_report, run_train_bench

    # A short run: the env step is fused with the policy step all the same, without the
    # rollout blocks that only long runs compile (BLOCK_MIN_ROLLOUT_STEPS).
    over = {**SMALL, "device": "cpu", "num_seeds": num_seeds, "total_env_steps": 100_000}
    for setting in ("off", "on"):
        cfg = config_mod.load("mpe/simple_spread_jaxmarl_ff", {**over, "compile": setting})
        report = run_train_bench(cfg, iterations=1)
        text = format_report(report)
        if setting == "off":
            assert 0 < report["env_seconds_per_iteration"] < report["rollout_seconds_per_iteration"]
            assert "env / acting / update" in text
        else:
            assert report["env_seconds_per_iteration"] is None
            assert report["acting_seconds_per_iteration"] is None
            assert "env step compiled with the policy" in text
        # FLOPs are counted for one seed; for stacked seeds they are absent, not zero
        assert (report["update_flops_per_iteration"] is None) == (num_seeds > 1)
        assert (report["update_flop_rate"] is None) == (num_seeds > 1)


def test_the_env_step_is_fused_on_the_cpu_and_for_feed_forward_networks_on_cuda():
    from mappo.compiled import fuses_env_step

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fuses_env_step(cpu, recurrent=False) and fuses_env_step(cpu, recurrent=True)
    assert fuses_env_step(cuda, recurrent=False)
    assert not fuses_env_step(cuda, recurrent=True)  # keeps the policy step's CUDA graph
    assert not fuses_env_step(torch.device("mps"), recurrent=False)  # not measured there


def test_the_whole_gradient_step_is_one_graph_for_feed_forward_networks_on_cpu_and_cuda():
    from mappo.compiled import compiles_gradient_step

    for dev in ("cpu", "cuda"):
        assert compiles_gradient_step(torch.device(dev), recurrent=False)
        assert not compiles_gradient_step(torch.device(dev), recurrent=True)
    assert not compiles_gradient_step(torch.device("mps"), recurrent=False)


def _shifted(x: torch.Tensor, shift: float, flag: bool) -> torch.Tensor:
    return x * 2.0 + (shift if flag else -shift)


def test_direct_calls_skip_torchs_guards_once_a_kind_of_call_is_compiled(monkeypatch):
    """``compile_fn(..., direct=key)``: the first call of each kind (the key's value) goes
    through torch's guarded call, later ones call the graph directly and give the same results;
    a new kind compiles its own graph. A change the key misses (``shift``, a constant in the
    graph) fails the guard check: an error where every call is checked (the tests' setting),
    otherwise a warning at the next periodic check, after which the calls are guarded again and
    right. Under ``compile=auto`` such a miss is raised as it is, not taken for a failure to
    compile."""
    from mappo import compiled as compiled_mod

    fn = compile_fn(_shifted, direct=lambda x, shift, flag: (x.shape, flag))
    assert isinstance(fn, compiled_mod.DirectCalls)
    guarded = fn.compiled
    through_torch = []

    def counted(*args, **kwargs):
        through_torch.append(args[0].shape)
        return guarded(*args, **kwargs)

    fn.compiled = counted
    a, b = torch.arange(4.0), torch.arange(6.0)
    for x, flag in [(a, True), (a, True), (b, True), (a, False), (b, True), (a, False)]:
        assert torch.equal(fn(x, 1.5, flag), _shifted(x, 1.5, flag))
    assert through_torch == [(4,), (6,), (4,)]  # once per kind
    assert len(fn.kinds) == 3

    fn.check_every = 1
    with pytest.raises(compiled_mod.GuardCheckFailed, match="compiled _shifted: torch's guard"):
        fn(a, 2.5, True)

    fn.check_every = 3  # checks its direct calls 0, 3, 6...: after 2, the second call from here
    with pytest.warns(RuntimeWarning, match="guarded from here on"):
        for _ in range(3):
            fn(a, 2.5, True)
    assert fn.guarded
    assert torch.equal(fn(a, 2.5, True), _shifted(a, 2.5, True))

    monkeypatch.setenv("MAPPO_GUARD_CHECK_EVERY", "1")
    auto = compile_fn(_shifted, fallback=True, direct=lambda x, shift, flag: flag)
    for _ in range(2):  # through torch, then directly
        assert torch.equal(auto(a, 1.5, True), _shifted(a, 1.5, True))
    with pytest.raises(compiled_mod.GuardCheckFailed):
        auto(a, 2.5, True)
    for bad in ("0", "often"):
        monkeypatch.setenv("MAPPO_GUARD_CHECK_EVERY", bad)
        with pytest.raises(ConfigError, match=f"MAPPO_GUARD_CHECK_EVERY='{bad}' is not a positive"):
            compile_fn(_shifted, direct=lambda x, shift, flag: flag)


def test_a_compiled_trainer_calls_its_cpu_graphs_directly():
    """At JaxMARL's feed-forward settings on the CPU the rollout block, the critics' values and
    the gradient step are called without torch's guards after their first call (this test run
    checks the guards before every call anyway, and would fail if a key missed a change). The
    rollout block has two kinds of call: the first acts on the env's reset, which has no final
    observations."""
    from mappo.compiled import DirectCalls

    if SMALL["device"] != "cpu":
        pytest.skip("the direct calls are compiled for the CPU graphs")
    over = {**SMALL, "total_env_steps": 2_000_000, "algo.num_minibatches": 4}
    trainer = Trainer(config_mod.load("mpe/simple_spread_jaxmarl_ff", {**over, "compile": "on"}))
    for _ in range(3):
        trainer.iterate()
    learner = trainer.learner
    fns = {
        "block": learner.collector.block_fn,
        "values": learner.collector.values_fn,
        "gradient": learner.step_fn,
    }
    assert all(isinstance(f, DirectCalls) for f in fns.values())
    assert {name: len(f.kinds) for name, f in fns.items()} == {
        "block": 2,
        "values": 1,
        "gradient": 1,
    }
    # Direct calls in 3 iterations: 2 blocks a rollout, 2 epochs of 4 mini-batches, less the
    # first call of each kind
    assert fns["block"].calls == 3 * 2 - 2 and fns["gradient"].calls == 3 * 8 - 1
    # the block's key holds its steps per call: a block of another size is another kind of call
    assert {key[1][-1] for key in fns["block"].kinds} == {learner.collector.block}
    trainer.close()
