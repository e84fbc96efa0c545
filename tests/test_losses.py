"""Closed-form checks of the PPO loss terms."""

from __future__ import annotations

import torch

from mappo.algos.mappo import masked_mean, normalized_advantages, policy_loss, value_loss
from mappo.config import AlgoConfig


def test_huber_value_loss_closed_form() -> None:
    cfg = AlgoConfig(value_loss="huber", huber_delta=1.0, clip_value_loss=False)
    v = torch.tensor([0.0, 0.0, 0.0])
    targets = torch.tensor([0.5, 2.0, -3.0])
    loss = value_loss(v, v, targets, cfg)
    # 0.5 e^2 inside delta; delta * (|e| - delta / 2) outside.
    torch.testing.assert_close(loss, torch.tensor([0.125, 1.5, 2.5]))


def test_mse_value_loss_is_half_squared_error() -> None:
    cfg = AlgoConfig(value_loss="mse", clip_value_loss=False)
    loss = value_loss(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([4.0]), cfg)
    torch.testing.assert_close(loss, torch.tensor([4.5]))


def test_clipped_value_loss_takes_the_larger_loss() -> None:
    cfg = AlgoConfig(value_loss="mse", clip_value_loss=True, clip=0.2)
    old = torch.tensor([0.0, 0.0])
    new = torch.tensor([1.0, 1.0])
    targets = torch.tensor([1.0, -1.0])
    loss = value_loss(new, old, targets, cfg)
    # Clipped prediction is 0.2. Target 1: raw 0, clipped 0.5*0.8^2 = 0.32 -> 0.32.
    # Target -1: raw 0.5*2^2 = 2, clipped 0.5*1.2^2 = 0.72 -> 2.
    torch.testing.assert_close(loss, torch.tensor([0.32, 2.0]))
    cfg_vc = AlgoConfig(value_loss="mse", clip_value_loss=True, clip=0.2, value_clip=0.5)
    loss = value_loss(new, old, targets, cfg_vc)
    torch.testing.assert_close(loss, torch.tensor([0.125, 2.0]))


def test_policy_loss_clips_the_ratio() -> None:
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, ratio = policy_loss(logp, old, adv, clip=0.2)
    torch.testing.assert_close(ratio, torch.tensor([1.5, 1.5, 0.5, 0.5]))
    # min(r A, clip(r) A): A>0 & r>1+eps -> 1.2; A<0 & r>1 -> 1.5 * -1; A>0 & r<1-eps -> 0.5;
    # A<0 & r<1-eps -> clip 0.8 * -1.
    torch.testing.assert_close(loss, -torch.tensor([1.2, -1.5, 0.5, -0.8]))


def test_masked_mean_ignores_masked_entries() -> None:
    x = torch.tensor([[1.0, 100.0], [3.0, 100.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert masked_mean(x, mask).item() == 2.0
    assert masked_mean(x, None).item() == x.mean().item()


def test_advantages_are_normalised_per_group_or_per_agent_over_alive_steps() -> None:
    """Statistics over alive steps; one set per call (a group's), or one per agent where the
    agents have networks of their own: an agent whose advantages are 1000x another's leaves the
    other's normalised advantages as they were (pooled, they shrank to almost nothing)."""
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(5, 4, 2, generator=g)
    alive = torch.ones(5, 4, 2, dtype=torch.bool)
    alive[3:, :, 1] = False
    out = normalized_advantages(adv, alive, per_agent=False)
    kept = out[alive]
    torch.testing.assert_close(kept.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(kept.std(unbiased=False), torch.tensor(1.0), atol=1e-4, rtol=0)
    scaled = adv.clone()
    scaled[..., 1] *= 1000.0
    per_agent = normalized_advantages(scaled, alive, per_agent=True)
    alone = normalized_advantages(adv[..., :1], alive[..., :1], per_agent=False)
    torch.testing.assert_close(per_agent[..., :1], alone)
    for k in range(2):
        col = per_agent[..., k][alive[..., k]]
        torch.testing.assert_close(col.std(unbiased=False), torch.tensor(1.0), atol=1e-4, rtol=0)
    # an agent never alive in the rollout has no statistics: 0, not its advantages / 1e-5
    alive[..., 1] = False
    out = normalized_advantages(adv, alive, per_agent=True)
    assert torch.equal(out[..., 1], torch.zeros(5, 4))
    assert bool(out[..., 0].abs().max() < 10)
