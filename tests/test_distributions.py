"""Masked multi-head categorical distribution: exact probabilities, gradients and sampling."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical

from mappo.nn import MultiCategorical

NVECS = [(5,), (4, 4, 4), (5, 10), (3, 1, 6)]


def _heads(x: torch.Tensor, nvec: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    return torch.split(x, list(nvec), dim=-1)


def _random_mask(shape: tuple[int, ...], nvec: tuple[int, ...], seed: int) -> torch.Tensor:
    """A random mask with at least one allowed action per head."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand((*shape, sum(nvec)), generator=g) < 0.5
    heads = []
    for m in _heads(mask, nvec):
        keep = torch.randint(m.shape[-1], (*shape, 1), generator=g)
        heads.append(m.scatter(-1, keep, True))
    return torch.cat(heads, -1)


@pytest.mark.parametrize("nvec", NVECS)
@pytest.mark.parametrize("masked", [False, True])
def test_matches_per_head_categorical(nvec: tuple[int, ...], masked: bool) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 3, sum(nvec), generator=g, requires_grad=True)
    mask = _random_mask((7, 3), nvec, seed=1) if masked else None
    dist = MultiCategorical(logits, nvec, mask)
    actions = dist.sample(torch.Generator().manual_seed(2))
    assert actions.shape == (7, 3, len(nvec)) and actions.dtype == torch.int64

    ref_logp = torch.zeros(7, 3)
    ref_ent = torch.zeros(7, 3)
    ref_probs = []
    mask_heads = _heads(mask, nvec) if masked else [None] * len(nvec)
    for h, (lg, m) in enumerate(zip(_heads(logits, nvec), mask_heads, strict=True)):
        if m is not None:
            lg = lg.masked_fill(~m, -1e9)  # -inf would give torch.distributions nan gradients
        cat = Categorical(logits=lg)
        ref_logp += cat.log_prob(actions[..., h])
        ref_ent += cat.entropy()
        ref_probs.append(cat.probs)
    torch.testing.assert_close(dist.log_prob(actions), ref_logp)
    torch.testing.assert_close(dist.entropy(), ref_ent)
    torch.testing.assert_close(dist.probs, torch.cat(ref_probs, -1))
    assert dist.log_prob(actions).shape == dist.entropy().shape == (7, 3)
    # Gradients of a PPO-style objective agree with the reference too.
    weights = torch.randn(2, 7, 3, generator=g)
    for ours, ref, w in (
        (dist.log_prob(actions), ref_logp, weights[0]),
        (dist.entropy(), ref_ent, weights[1]),
    ):
        (grad,) = torch.autograd.grad((w * ours).sum(), logits, retain_graph=True)
        (ref_grad,) = torch.autograd.grad((w * ref).sum(), logits, retain_graph=True)
        torch.testing.assert_close(grad, ref_grad)


def test_single_head_log_prob_accepts_actions_without_head_axis() -> None:
    logits = torch.randn(4, 6)
    dist = MultiCategorical(logits, (6,))
    actions = torch.tensor([0, 5, 2, 3])
    torch.testing.assert_close(dist.log_prob(actions), dist.log_prob(actions[:, None]))
    torch.testing.assert_close(dist.log_prob(actions), Categorical(logits=logits).log_prob(actions))


@pytest.mark.parametrize("nvec", NVECS)
def test_masked_probs_exactly_zero_and_no_gradient(nvec: tuple[int, ...]) -> None:
    logits = torch.randn(64, sum(nvec), generator=torch.Generator().manual_seed(3))
    logits.requires_grad_(True)
    mask = _random_mask((64,), nvec, seed=4)
    dist = MultiCategorical(logits, nvec, mask)
    assert torch.all(dist.probs[~mask] == 0.0)
    assert torch.all(dist.probs[mask] > 0.0)
    actions = dist.sample(torch.Generator().manual_seed(5))
    entropy = dist.entropy()
    assert torch.isfinite(entropy).all() and (entropy >= 0).all()
    # A large upstream scale (as a loss scaler would apply) must not overflow into inf/nan.
    loss = 1e6 * (dist.log_prob(actions).sum() + entropy.sum())
    loss.backward()
    grad = logits.grad
    assert grad is not None and torch.isfinite(grad).all()
    assert torch.all(grad[~mask] == 0.0)
    assert grad[mask].abs().sum() > 0


def test_entropy_of_mask_equals_entropy_of_allowed_support() -> None:
    logits = torch.tensor([[0.3, -1.2, 2.0, 0.7, 0.0]])
    mask = torch.tensor([[True, False, True, False, True]])
    dist = MultiCategorical(logits, (5,), mask)
    ref = Categorical(logits=logits[:, [0, 2, 4]])
    torch.testing.assert_close(dist.entropy(), ref.entropy())
    one_allowed = MultiCategorical(logits, (5,), torch.tensor([[False, False, True, False, False]]))
    assert one_allowed.entropy().item() == 0.0
    assert one_allowed.log_prob(torch.tensor([[2]])).item() == 0.0


@pytest.mark.parametrize("nvec", NVECS)
def test_samples_never_masked(nvec: tuple[int, ...]) -> None:
    batch = 4096
    logits = 3.0 * torch.randn(batch, sum(nvec), generator=torch.Generator().manual_seed(6))
    mask = _random_mask((batch,), nvec, seed=7)
    # Make the masked actions the most attractive ones: masking must still win.
    logits = torch.where(mask, logits, logits + 50.0)
    dist = MultiCategorical(logits, nvec, mask)
    gen = torch.Generator().manual_seed(8)
    offsets = torch.tensor([sum(nvec[:h]) for h in range(len(nvec))])
    for _ in range(5):
        actions = dist.sample(gen)
        assert (actions >= 0).all() and (actions < torch.tensor(nvec)).all()
        assert mask.gather(-1, actions + offsets).all()


def test_sampling_never_picks_masked_action_when_uniform_draw_is_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch.rand can return exactly 0; -log(-log 0) = -inf must not hand the win to a masked slot.
    logits = torch.zeros(2, 5)
    mask = torch.tensor([[False, False, True, False, False], [True, True, True, True, True]])
    dist = MultiCategorical(logits, (5,), mask)
    zeros = torch.zeros
    monkeypatch.setattr(torch, "rand", lambda shape, generator, **kw: zeros(shape, **kw))
    actions = dist.sample(torch.Generator())
    assert actions[0, 0].item() == 2


@pytest.mark.parametrize("nvec", [(5,), (5, 10)])
def test_sample_frequencies_match_probs(nvec: tuple[int, ...]) -> None:
    logits = torch.randn(sum(nvec), generator=torch.Generator().manual_seed(9))
    mask = _random_mask((), nvec, seed=10)
    n = 200_000
    dist = MultiCategorical(logits.expand(n, -1), nvec, mask.expand(n, -1))
    actions = dist.sample(torch.Generator().manual_seed(11))
    offsets = torch.tensor([sum(nvec[:h]) for h in range(len(nvec))])
    counts = torch.bincount((actions + offsets).flatten(), minlength=sum(nvec)).double()
    freq = counts / n
    probs = dist.probs[0].double()
    # Binomial standard error at n = 2e5 is <= 0.0012; 5 sigma.
    torch.testing.assert_close(freq, probs, atol=6e-3, rtol=0.0)


def test_sampling_reproducible_and_leaves_global_rng_alone() -> None:
    logits = torch.randn(32, 15)
    dist = MultiCategorical(logits, (5, 10))
    state = torch.get_rng_state()
    a = dist.sample(torch.Generator().manual_seed(123))
    b = dist.sample(torch.Generator().manual_seed(123))
    c = dist.sample(torch.Generator().manual_seed(124))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("nvec", NVECS)
def test_mode_is_masked_argmax(nvec: tuple[int, ...]) -> None:
    logits = torch.randn(50, sum(nvec), generator=torch.Generator().manual_seed(12))
    mask = _random_mask((50,), nvec, seed=13)
    dist = MultiCategorical(logits, nvec, mask)
    heads = zip(_heads(logits, nvec), _heads(mask, nvec), strict=True)
    expected = torch.stack([lg.masked_fill(~m, -1e30).argmax(-1) for lg, m in heads], -1)
    assert torch.equal(dist.mode(), expected)


def test_fully_masked_head_is_finite_and_caught_by_validate() -> None:
    logits = torch.randn(3, 15, requires_grad=True)
    mask = torch.ones(3, 15, dtype=torch.bool)
    mask[1, 5:] = False  # every action of head 1 (size 10) in batch row 1
    dist = MultiCategorical(logits, (5, 10), mask)
    assert torch.isfinite(dist.entropy()).all()
    assert torch.isfinite(dist.log_prob(dist.mode())).all()
    with pytest.raises(ValueError, match="head 1 .*batch index \\(1,\\)"):
        dist.validate()
    MultiCategorical(logits, (5, 10), torch.ones(3, 15, dtype=torch.bool)).validate()


def test_bad_shapes_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="expected \\[..., 15\\]"):
        MultiCategorical(torch.zeros(2, 14), (5, 10))
    with pytest.raises(ValueError, match="mask has shape"):
        MultiCategorical(torch.zeros(2, 15), (5, 10), torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="positive head sizes"):
        MultiCategorical(torch.zeros(2, 5), (5, 0))
    with pytest.raises(ValueError, match="actions have shape"):
        MultiCategorical(torch.zeros(2, 15), (5, 10)).log_prob(torch.zeros(2, dtype=torch.long))
