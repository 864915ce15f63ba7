"""Breadth: gradaccel.checkpoint plans, and replays exactly, the blocks of many model families.

A toy MoE block first (routing by integer indices that change on every call), then tiny random
Hugging Face models (no downloads) of decoders, encoders, encoder-decoders, vision, audio, MoE
and state-space families, each against the same model without checkpointing.
"""

import copy
import warnings

import pytest
import torch

import gradaccel
from gradaccel.checkpoint import plan_rows, reset_plans


class ToyMoE(torch.nn.Module):
    """Top-k routing to experts gathered by integer index: ``w1[idx]`` is ``aten.index.Tensor``."""

    def __init__(self, d=16, experts=4, k=2):
        super().__init__()
        self.router = torch.nn.Linear(d, experts)
        self.w1 = torch.nn.Parameter(torch.randn(experts, d, 2 * d) * 0.2)
        self.w2 = torch.nn.Parameter(torch.randn(experts, 2 * d, d) * 0.2)
        self.k = k

    def forward(self, x):
        weights, idx = self.router(x).softmax(-1).topk(self.k, dim=-1)
        h = torch.einsum("nd,nkdf->nkf", x, self.w1[idx]).relu()
        y = torch.einsum("nkf,nkfd->nkd", h, self.w2[idx])
        picked = x.gather(0, idx[:, :1].expand(-1, x.shape[1]))  # gather by routing index too
        return (y * weights.unsqueeze(-1)).sum(1) + picked.index_select(0, idx[:, 0])


@pytest.mark.parametrize("budget", [0.25, 0.5, 1.0])
def test_moe_routing_replays_the_current_call(budget):
    # A new input every step moves the routing away from the traced call's: replay must gather
    # with this call's indices (a frozen trace constant would give wrong gradients).
    reset_plans()
    torch.manual_seed(0)
    moe = ToyMoE()
    routes = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the region is selective
        for step in range(4):
            x = torch.randn(12, 16, requires_grad=True)
            params = [x, *moe.parameters()]
            expected = torch.autograd.grad(moe(x).square().sum(), params)
            got = torch.autograd.grad(gradaccel.checkpoint(moe, x, budget=budget).square().sum(), params)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, rtol=0, atol=0)  # the same kernels run in the same order
            routes.add(tuple(moe.router(x).topk(2, dim=-1).indices.flatten().tolist()))
    assert len(routes) == 4  # the routing did change between calls
    (row,) = plan_rows()
    assert row["mode"] == "selective" and row["calls"] == 4
    if budget < 1.0:
        assert "aten.index.Tensor" in row["replayed_ops"]  # the gather is rebuilt, not kept
