"""trainer.losses against hand-computed values on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from miles_env.trainer.losses import (
    aggregate,
    group_advantages,
    kl_k3,
    policy_loss,
    tis_weights,
    token_logprobs,
)
from miles_env.trainer.torch_backend import pack_microbatches


def close(a: torch.Tensor, b: list[float] | float, tol: float = 1e-5) -> bool:
    return torch.allclose(a.double(), torch.as_tensor(b, dtype=torch.float64), atol=tol)


def test_group_advantages_grpo_and_dr_grpo() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    assert close(group_advantages(r, "grpo"), [0.866025, -0.866025, -0.866025, 0.866025])
    assert close(group_advantages(r, "dr_grpo"), [0.5, -0.5, -0.5, 0.5])
    assert close(group_advantages(torch.tensor([3.0]), "grpo"), [0.0])
    assert close(group_advantages(torch.tensor([2.0, 2.0]), "grpo"), [0.0, 0.0])


def test_token_logprobs_follow_engine_convention() -> None:
    logits = torch.tensor([[[0.0, math.log(3)], [math.log(2), 0.0], [5.0, 5.0]]])
    ids = torch.tensor([[0, 1, 0]])  # id at position 0 has no prediction
    out = token_logprobs(logits, ids)
    assert close(out, [[0.0, math.log(3 / 4), math.log(2 / 3)]])
    s3 = math.sqrt(3)  # T = 2: logits [0, ln 3] / 2 -> softmax [1, sqrt 3] / (1 + sqrt 3)
    assert close(token_logprobs(logits, ids, temperature=2.0)[0, 1], math.log(s3 / (1 + s3)))


def test_policy_loss_clipping() -> None:
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 1.0]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]])
    loss, clipped = policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.2)
    # r=1.5,A=1 -> -min(1.5, 1.2); r=1.5,A=-1 -> -min(-1.5,-1.2); r=0.5,A=-1 -> -min(-0.5,-0.8); r=1,A=2
    assert close(loss, [[-1.2, 1.5, 0.8, -2.0]])
    assert close(clipped, [[1.0, 0.0, 1.0, 0.0]])
    loss_hi, _ = policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.6)  # clip-higher keeps 1.5
    assert close(loss_hi[0, 0], -1.5)
    w = torch.tensor([[2.0, 1.0, 0.5, 1.0]])
    wl, _ = policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.2, weights=w)
    assert close(wl, [[-2.4, 1.5, 0.4, -2.0]])
    per_sample, _ = policy_loss(logp, old, torch.tensor([1.0]), clip_low=0.2, clip_high=0.2)
    assert close(per_sample, [[-1.2, -1.2, -0.5, -1.0]])


def test_policy_loss_gradient_flows_through_logp() -> None:
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([3.0]), clip_low=0.2, clip_high=0.2)
    loss.sum().backward()
    assert close(logp.grad, [[-3.0, -3.0]])  # d/dlogp of -ratio*A at ratio 1


def test_tis_weights_truncate() -> None:
    old = torch.zeros(3)
    rollout = torch.log(torch.tensor([0.25, 2.0, 1.0]))
    assert close(tis_weights(old, rollout, 2.0), [2.0, 0.5, 1.0])
    assert close(tis_weights(old, rollout, None), [4.0, 0.5, 1.0])


def test_kl_k3() -> None:
    logp = torch.zeros(2)
    ref = torch.log(torch.tensor([2.0, 1.0]))
    assert close(kl_k3(logp, ref), [2 - math.log(2) - 1, 0.0])


@pytest.mark.parametrize(
    ("kind", "expected"), [("token-mean", 3.0), ("seq-mean-token-mean", 3.75), ("dr_grpo", 0.45)]
)
def test_aggregate(kind: str, expected: float) -> None:
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    out = aggregate(v, m, kind, total_tokens=3, total_seqs=2, norm_tokens=10)  # type: ignore[arg-type]
    assert close(out, expected)
    # microbatches with global denominators sum to the whole-batch value
    parts = sum(
        aggregate(v[i : i + 1], m[i : i + 1], kind, total_tokens=3, total_seqs=2, norm_tokens=10)  # type: ignore[arg-type]
        for i in range(2)
    )
    assert close(parts, expected)


def test_pack_microbatches_respects_budget() -> None:
    assert pack_microbatches([5, 3, 8, 2], 10) == [[2], [0, 1], [3]]
    assert pack_microbatches([20], 10) == [[0]]  # too long: alone
