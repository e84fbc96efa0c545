"""Layers and actor-critic networks: batched per-agent parameters, init, recurrent chunks."""

from __future__ import annotations

import pytest
import torch

from mappo.config import AlgoConfig, ModelConfig
from mappo.envs.base import ActionSpec, EnvSpec, EnvStep, GroupSpec
from mappo.nn.actor_critic import ActorCritic
from mappo.nn.layers import MLP, AgentLayerNorm, AgentLinear, RecurrentCore


def test_per_agent_linear_equals_a_loop_over_agents() -> None:
    torch.manual_seed(0)
    layer = AgentLinear(5, 7, copies=3)
    x = torch.randn(4, 6, 3, 5)
    y = layer(x)
    for c in range(3):
        expected = x[..., c, :] @ layer.weight[c] + layer.bias[c]
        torch.testing.assert_close(y[..., c, :], expected)


def test_shared_linear_is_one_linear_map() -> None:
    torch.manual_seed(0)
    layer = AgentLinear(5, 7, copies=1)
    x = torch.randn(4, 3, 5)
    torch.testing.assert_close(layer(x), x @ layer.weight[0] + layer.bias[0])


def test_orthogonal_init_with_gain() -> None:
    layer = AgentLinear(64, 64, copies=2)
    layer.reset_parameters(gain=0.01)
    for w in layer.weight:
        torch.testing.assert_close(w.T @ w, 1e-4 * torch.eye(64), atol=1e-6, rtol=0)
    assert torch.all(layer.bias == 0)


def test_agent_layer_norm_per_copy_affine() -> None:
    norm = AgentLayerNorm(4, copies=2)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([[1.0] * 4, [2.0] * 4]))
    x = torch.randn(3, 2, 4)
    y = norm(x)
    base = torch.nn.functional.layer_norm(x, (4,))
    torch.testing.assert_close(y[:, 0], base[:, 0])
    torch.testing.assert_close(y[:, 1], 2 * base[:, 1])


def test_mlp_structure_matches_the_paper() -> None:
    mlp = MLP(10, [64, 64], "tanh", copies=1, feature_norm=True, layer_norm=True)
    kinds = [type(m).__name__ for m in mlp.net]
    assert kinds == [
        "AgentLayerNorm",
        "AgentLinear",
        "Tanh",
        "AgentLayerNorm",
        "AgentLinear",
        "Tanh",
        "AgentLayerNorm",
    ]


def _gru_reference(core: RecurrentCore, x, h, starts):
    """Step-by-step GRU with torch's GRUCell maths, one time step and one agent at a time."""
    cell = torch.nn.GRUCell(core.size, core.size)
    outs = []
    for t in range(x.shape[0]):
        h = h * (1 - starts[t].float())[..., None, None]
        per_agent = []
        for c in range(x.shape[-2]):
            w = c if core.input_proj.copies > 1 else 0
            with torch.no_grad():
                cell.weight_ih.copy_(core.input_proj.weight[w].T)
                cell.bias_ih.copy_(core.input_proj.bias[w])
                cell.weight_hh.copy_(core.hidden_proj.weight[w].T)
                cell.bias_hh.copy_(core.hidden_proj.bias[w])
            per_agent.append(cell(x[t, :, c], h[:, c]))
        h = torch.stack(per_agent, 1)
        outs.append(h)
    return core.norm(torch.stack(outs)), h


def test_gru_matches_torch_gru_cell_with_resets() -> None:
    torch.manual_seed(0)
    for copies in (1, 3):
        core = RecurrentCore(8, "gru", copies=copies, layer_norm=True)
        x = torch.randn(6, 5, 3, 8)
        h0 = torch.randn(5, 3, 8)
        starts = torch.rand(6, 5) < 0.3
        out, h = core(x, h0, starts)
        ref_out, ref_h = _gru_reference(core, x, h0, starts)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)


def test_lstm_state_resets_where_episodes_start() -> None:
    torch.manual_seed(0)
    core = RecurrentCore(4, "lstm", copies=1, layer_norm=False)
    x = torch.randn(3, 2, 1, 4)
    starts = torch.tensor([[True, True], [False, True], [False, False]])
    out_a, _ = core(x, torch.randn(2, 1, 8), starts)
    out_b, _ = core(x, torch.randn(2, 1, 8), starts)
    # Both envs start an episode at t = 0, so the initial state never matters.
    torch.testing.assert_close(out_a, out_b)
    # Env 1 restarts at t = 1: its outputs from t = 1 equal a fresh run on x[1:].
    fresh, _ = core(x[1:, 1:], torch.zeros(1, 1, 8), torch.tensor([[True], [False]]))
    torch.testing.assert_close(out_a[1:, 1:], fresh)


def _spec(n: int = 3) -> EnvSpec:
    group = GroupSpec(tuple(f"a{i}" for i in range(n)), (6,), ActionSpec((5,)), True)
    return EnvSpec({"agents": group}, (6 * n,), 10)


def test_chunked_forward_equals_step_by_step() -> None:
    """Training on a chunk from a stored state reproduces the rollout's step-by-step outputs."""
    torch.manual_seed(0)
    policy = ActorCritic(_spec(), ModelConfig(recurrent="gru"), AlgoConfig())
    actor = policy.actors["agents"]
    T, E = 10, 4
    obs = torch.randn(T, E, 3, 6)
    starts = torch.zeros(T, E, dtype=torch.bool)
    starts[0] = True
    starts[4, 1] = True
    state = torch.zeros(E, 3, actor.state_size)
    step_logits, stored = [], []
    for t in range(T):
        stored.append(state)
        dist, state = actor(obs[t : t + 1], state, starts[t : t + 1], None)
        step_logits.append(dist.log_prob(torch.zeros(1, E, 3, 1, dtype=torch.long)))
    # A chunk of 5 steps starting at t = 5 from the stored state.
    dist, _ = actor(obs[5:], stored[5], starts[5:], None)
    chunk = dist.log_prob(torch.zeros(5, E, 3, 1, dtype=torch.long))
    torch.testing.assert_close(chunk, torch.cat(step_logits[5:]), atol=1e-6, rtol=1e-5)


def test_masked_actor_gives_zero_probability_and_no_gradient() -> None:
    torch.manual_seed(0)
    policy = ActorCritic(_spec(), ModelConfig(recurrent="none"), AlgoConfig())
    actor = policy.actors["agents"]
    obs = torch.randn(1, 8, 3, 6)
    mask = torch.ones(1, 8, 3, 5, dtype=torch.bool)
    mask[..., 2] = False
    dist, _ = actor(obs, torch.zeros(8, 3, 0), torch.zeros(1, 8, dtype=torch.bool), mask)
    assert torch.all(dist.probs[..., 2] == 0)
    samples = dist.sample(torch.Generator().manual_seed(0))
    assert not torch.any(samples == 2)


def test_shared_critic_on_global_state_runs_once_per_env() -> None:
    spec = _spec()
    shared = ActorCritic(spec, ModelConfig(), AlgoConfig(critic_input="state"))
    assert shared.critic_inputs["agents"].copies == 1
    per_agent = ActorCritic(spec, ModelConfig(agent_id=True), AlgoConfig(critic_input="state"))
    assert per_agent.critic_inputs["agents"].copies == 3
    local = ActorCritic(spec, ModelConfig(), AlgoConfig(critic_input="local"))
    assert local.critic_inputs["agents"].copies == 3
    separate = ActorCritic(spec, ModelConfig(share_params=False), AlgoConfig())
    assert separate.critics["agents"].head.weight.shape[0] == 3


def test_concatenated_observations_critic_reads_the_groups_observations_side_by_side() -> None:
    spec = _spec()
    obs = torch.randn(4, 3, 6)
    alive = torch.tensor([[True, False, True]] * 4)
    step = EnvStep(
        obs={"agents": obs},
        state=torch.zeros(4, 18),
        reward={"agents": torch.zeros(4, 3)},
        terminated=torch.zeros(4, dtype=torch.bool),
        truncated=torch.zeros(4, dtype=torch.bool),
        alive={"agents": alive},
        final_obs={"agents": obs + 1.0},
    )
    shared = ActorCritic(spec, ModelConfig(), AlgoConfig(critic_input="concat_obs"))
    assert shared.critic_inputs["agents"].copies == 1  # one value per env
    assert shared.critics["agents"].in_features == 18
    x = shared.critic_input("agents", step)
    assert x.shape == (4, 1, 18)
    torch.testing.assert_close(x[:, 0], obs.reshape(4, 18))
    torch.testing.assert_close(shared.critic_input("agents", step, final=True)[:, 0], x[:, 0] + 1)
    # death masking: a dead agent's copy is zeros and its id; the living see everyone
    masked = ActorCritic(
        spec, ModelConfig(), AlgoConfig(critic_input="concat_obs", death_masked_critic=True)
    )
    x = masked.critic_input("agents", step)
    assert x.shape == (4, 3, 18 + 3)
    torch.testing.assert_close(x[:, 0, :18], obs.reshape(4, 18))
    assert torch.all(x[:, 1, :18] == 0) and torch.equal(x[0, :, 18:], torch.eye(3))
    images = GroupSpec(("a0", "a1"), (3, 8, 8), ActionSpec((5,)))
    with pytest.raises(ValueError, match="concat_obs.*model.encoder=cnn"):
        ActorCritic(
            EnvSpec({"agents": images}, (6, 8, 8), 10),
            ModelConfig(encoder="cnn"),
            AlgoConfig(critic_input="concat_obs"),
        )


@pytest.mark.parametrize("kind", ["gru", "lstm"])
@pytest.mark.parametrize("layer_norm", [False, True])
def test_fused_whole_episode_unroll_equals_the_stepwise_one(kind, layer_norm):
    torch.manual_seed(0)
    core = RecurrentCore(16, kind, 1, layer_norm)
    x = torch.randn(7, 5, 3, 16, requires_grad=True)
    state = torch.randn(5, 3, core.state_size)
    starts = torch.zeros(7, 5, dtype=torch.bool)
    starts[0, :2] = True  # the first step may start episodes (the state is zeroed there)
    loop, loop_state = core(x, state, starts)
    fused, fused_state = core(x, state, starts, whole_episodes=True)
    torch.testing.assert_close(fused, loop, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_state, loop_state, rtol=1e-5, atol=1e-6)
    (g_loop,) = torch.autograd.grad(loop.square().sum(), x)
    (g_fused,) = torch.autograd.grad(fused.square().sum(), x)
    torch.testing.assert_close(g_fused, g_loop, rtol=1e-4, atol=1e-5)


def _gru_sequence_case(dtype: torch.dtype):
    """A GRU core, inputs with two batch axes and agents, resets at scattered steps (some rows
    only, and all rows at once), a state injected where an episode starts and one injected at
    a step where none does, in ``dtype``."""
    torch.manual_seed(1)
    core = RecurrentCore(8, "gru", 1, layer_norm=True).to(dtype)
    L, B, C = 9, (2, 3), 2
    x = torch.randn(L, *B, C, 8, dtype=dtype, requires_grad=True)
    state = torch.randn(*B, C, 8, dtype=dtype, requires_grad=True)
    starts = torch.zeros(L, *B, dtype=torch.bool)
    starts[3, 0, 1] = True
    starts[6] = True
    starts[0, 1, 2] = True  # some rows start at the first step
    inject = torch.zeros(L, *B, C, 8, dtype=dtype)
    inject[3, 0, 1] = torch.randn(C, 8, dtype=dtype)
    inject[1, 1, 0] = torch.randn(C, 8, dtype=dtype)  # added to a state that carries on
    return core, x, state, starts, inject


@pytest.mark.parametrize("native", [True, False], ids=["loops in C", "loops in torch"])
def test_the_written_out_gru_backward_equals_autograd(native, monkeypatch) -> None:
    """:class:`SequenceGRU` (the GRU's backward through time written out, used for training on
    small steps) gives the step loop's outputs, final state and gradients for the inputs, the
    initial state and every parameter, in double precision to rounding, with its loops in C
    and in torch."""
    from mappo.nn import gru_sequence

    monkeypatch.setattr(gru_sequence, "NATIVE", native)
    assert (gru_sequence.native_library(torch.float64) is not None) == native
    core, x, state, starts, inject = _gru_sequence_case(torch.float64)
    used = []
    written_out = RecurrentCore._sequence
    monkeypatch.setattr(RecurrentCore, "_sequence", lambda *a: used.append(1) or written_out(*a))
    w = torch.randn(x.shape, dtype=x.dtype)

    def run():
        out, final = core(x, state, starts, inject)
        loss = (out * w).sum() + final.square().sum()
        return out, final, torch.autograd.grad(loss, [x, state, *core.parameters()])

    def final_only():
        out, final = core(x, state, starts, inject)
        wrt = [x, state, *core.parameters()]  # the LayerNorm after the outputs is unused
        return out, final, torch.autograd.grad(final.sum(), wrt, allow_unused=True)

    got, got_final = run(), final_only()
    assert used == [1, 1]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the step loop
    want, want_final = run(), final_only()
    assert used == [1, 1]
    for a, b in zip(got_final[2], want_final[2], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-12)
    for a, b in zip(got[2], want[2], strict=True):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("native", [True, False], ids=["loops in C", "loops in torch"])
def test_the_written_out_gru_passes_gradcheck(native, monkeypatch) -> None:
    """Finite differences agree with :class:`SequenceGRU`'s backward (double precision) for the
    step inputs, the initial state, the weight and the bias, across a reset and an injection."""
    from mappo.nn import gru_sequence
    from mappo.nn.gru_sequence import SequenceGRU

    monkeypatch.setattr(gru_sequence, "NATIVE", native)

    torch.manual_seed(2)
    L, M, H = 5, 3, 4
    gx = torch.randn(L, M, 3 * H, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(M, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(H, 3 * H, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3 * H, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(L, M, 1, dtype=torch.float64)
    keep[2, 1] = 0.0
    inject = torch.zeros(L, M, H, dtype=torch.float64)
    inject[2, 1] = torch.randn(H, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda *a: SequenceGRU.apply(*a, keep, inject, [2]), (gx, h0, weight, bias)
    )


def _sequence_grads(gx, h0, weight, bias, keep, inject, cuts, dout):
    """SequenceGRU's output and the gradients of (gx, h0, weight, bias) for ``dout``."""
    from mappo.nn.gru_sequence import SequenceGRU

    leaves = [t.detach().requires_grad_() for t in (gx, h0, weight, bias)]
    out = SequenceGRU.apply(*leaves, keep, inject, cuts)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "L, M, H, threads",
    # 13 rows: three tiles of four and one row left over, split between two threads; 40 units:
    # register tiles of 32 floats or 16 doubles and the rest; 4 rows of 128: JaxMARL's critic,
    # one tile; 6 rows of 3 units: a tile and a half, no whole register tile
    [(30, 13, 40, 2), (30, 13, 40, 1), (128, 4, 128, 2), (7, 6, 3, 2)],
)
def test_the_gru_loops_in_c_equal_the_torch_loops(L, M, H, threads, dtype, monkeypatch):
    """The C loops (their own exp in float32, register tiles of rows and columns, rows split
    between threads) give the torch loops' outputs and gradients to rounding, across resets of
    some rows, injected states, tile edges and an input that is not contiguous."""
    from mappo.nn import gru_sequence

    if gru_sequence.native_library(dtype) is None:
        pytest.fail(f"the GRU's C loops did not build: {gru_sequence.unavailable_reason()}")
    torch.manual_seed(3)
    gx = (torch.randn(M, L, 3 * H, dtype=dtype) * 2).transpose(0, 1)  # [L, M, 3H], strided
    h0, weight = torch.randn(M, H, dtype=dtype), torch.randn(H, 3 * H, dtype=dtype) / H**0.5
    bias, dout = torch.randn(3 * H, dtype=dtype), torch.randn(L, M, H, dtype=dtype)
    keep = torch.ones(L, M, 1, dtype=dtype)
    keep[L // 2, ::2] = 0.0
    inject = torch.zeros(L, M, H, dtype=dtype)
    inject[L // 2, ::3] = torch.randn(H, dtype=dtype)
    cuts = [0, L // 2]
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    c_loops = _sequence_grads(gx, h0, weight, bias, keep, inject, cuts, dout)
    monkeypatch.setattr(gru_sequence, "NATIVE", False)
    torch_loops = _sequence_grads(gx, h0, weight, bias, keep, inject, cuts, dout)
    rtol, atol = (1e-4, 2e-5) if dtype == torch.float32 else (1e-11, 1e-12)
    for got, want in zip(c_loops, torch_loops, strict=True):
        assert want.abs().max() > 0
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol * scale)


def test_the_gru_loops_fall_back_to_torch_without_a_compiler(monkeypatch, tmp_path):
    """Where the C file does not build (here: no such compiler), SequenceGRU runs its torch
    loops and says why the C loops are missing."""
    from mappo.nn import gru_sequence

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MAPPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gru_sequence, "_libraries", {})
    monkeypatch.setattr(gru_sequence, "_reason", None)
    monkeypatch.setattr(gru_sequence.native_build, "_noted", set())
    # (said once: without a compiler, as on Windows, the slower loops were a silent choice)
    with pytest.warns(RuntimeWarning, match="the GRU's C loops could not be built .* half as"):
        assert gru_sequence.native_library(torch.float32) is None
    assert "no C compiler found" in gru_sequence.unavailable_reason()
    torch.manual_seed(4)
    args = torch.randn(5, 3, 12), torch.randn(3, 4), torch.randn(4, 12), torch.randn(12)
    got = _sequence_grads(*args, torch.ones(5, 3, 1), None, [0], torch.randn(5, 3, 4))
    assert all(torch.isfinite(g).all() for g in got)


def _forward_in_c(args, keep):
    """SequenceGRU's output (its forward loop in C, as an array: a tensor would go back to a
    parent through torch's shared-memory handover) and the threads it would use for 16 rows."""
    from mappo.nn import gru_sequence
    from mappo.nn.gru_sequence import SequenceGRU

    leaves = [t.detach().requires_grad_() for t in args]
    out = SequenceGRU.apply(*leaves, keep, None, [0])
    return out.detach().numpy(), gru_sequence._threads(16)


def test_the_gru_loops_in_c_run_in_a_forked_child() -> None:
    """A forked child (an environment worker) runs the C loops on one thread rather than
    waiting on its parent's OpenMP team, and gets the parent's results. (Its forward only:
    torch's own matrix products can wait forever in such a child once the parent has used
    OpenMP, whichever loops ran.)"""
    import multiprocessing

    from mappo.nn import gru_sequence

    if gru_sequence.native_library(torch.float32) is None:
        pytest.fail(f"the GRU's C loops did not build: {gru_sequence.unavailable_reason()}")
    torch.manual_seed(5)
    args = torch.randn(20, 16, 96), torch.randn(16, 32), torch.randn(32, 96) / 6, torch.randn(96)
    keep = torch.ones(20, 16, 1)
    want, threads = _forward_in_c(args, keep)  # on two threads here: OpenMP's team made
    assert threads == min(torch.get_num_threads(), 4)
    with multiprocessing.get_context("fork").Pool(1) as pool:
        got, threads = pool.apply_async(_forward_in_c, (args, keep)).get(timeout=60)
    assert threads == 1
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=0, atol=1e-6)


def test_gru_inference_and_large_steps_keep_autograd_s_path(monkeypatch) -> None:
    """Without gradients, inside ``torch.func.grad``, with steps above ``SEQUENCE_MAX_STEP``
    rows x units (``SEQUENCE_NATIVE_MAX_STEP`` where its loops run in C), or for an LSTM, the
    sequence does not go through :class:`SequenceGRU`."""
    import mappo.nn.layers
    from mappo.nn import gru_sequence

    core, x, state, starts, inject = _gru_sequence_case(torch.float32)
    used = []
    written_out = RecurrentCore._sequence
    monkeypatch.setattr(RecurrentCore, "_sequence", lambda *a: used.append(1) or written_out(*a))
    with torch.no_grad():
        core(x, state, starts, inject)
    lstm = RecurrentCore(8, "lstm", 1, layer_norm=False)
    lstm(x.detach(), torch.zeros(*state.shape[:-1], 16), starts)
    params = dict(core.named_parameters())

    def loss(p):
        out, _ = torch.func.functional_call(core, p, (x.detach(), state.detach(), starts, inject))
        return out.square().sum()

    grads = torch.func.grad(loss)(params)  # inside torch.func: autograd's path
    want = torch.autograd.grad(loss(params), list(params.values()))
    for g, w in zip(grads.values(), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert used == [1]  # only the plain autograd call above
    # the bound for the torch loops, and where they run in C, the C loops' bound
    for native, bound in ((False, "SEQUENCE_MAX_STEP"), (True, "SEQUENCE_NATIVE_MAX_STEP")):
        monkeypatch.setattr(gru_sequence, "NATIVE", native)
        if native and gru_sequence.native_library(x.dtype) is None:
            pytest.fail(f"the GRU's C loops did not build: {gru_sequence.unavailable_reason()}")
        used.clear()
        monkeypatch.setattr(mappo.nn.layers, bound, x[0].numel() - 1)
        core(x, state, starts, inject)
        assert used == []
        monkeypatch.setattr(mappo.nn.layers, bound, x[0].numel())
        core(x, state, starts, inject)
        assert used == [1]
