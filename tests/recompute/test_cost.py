"""The recompute cost model of gradaccel.checkpoint (gradaccel/recompute/cost.py): ``cost="flops"``,
``"measured"`` or a callable, each giving the stock gradients, priced once per trace, part of
the plan's key, passed through checkpoint_sequential and checkpoint_blocks, and checked."""

import math
import sys
import time

import pytest
import torch
import torch.nn as nn

import gradaccel
from _models import Block, GPTConfig
from gradaccel.recompute import offload
from gradaccel.recompute.cost import OpCost, price
from gradaccel.recompute.state import STATE
from gradaccel.recompute.checkpoint import plan_rows, reset_plans

ckpt = sys.modules["gradaccel.recompute.checkpoint"]


@pytest.fixture(autouse=True)
def _fresh_plans():
    reset_plans()
    yield
    reset_plans()


def _block(dropout=0.1):
    torch.manual_seed(0)
    return Block(GPTConfig(seq_len=16, n_embd=32, n_head=2, dropout=dropout))


def _step(fn, block, x):
    torch.manual_seed(1)
    out = fn(x)
    return out, torch.autograd.grad(out.square().sum(), list(block.parameters()) + [x])


def _regions(owner) -> list:
    return list(STATE.regions[owner].values())


def _one_per_op(op: OpCost) -> float:
    return 1.0


@pytest.mark.parametrize("cost", ["flops", "measured", _one_per_op])
def test_every_cost_model_gives_stock_gradients_and_keeps_its_plan(cost):
    block, x = _block(), torch.randn(2, 16, 32, requires_grad=True)
    want = _step(block, block, x)
    plans = set()
    for _ in range(3):  # the traced call, then the cached plan
        got = _step(lambda t: gradaccel.checkpoint(block, t, budget=0.5, cost=cost), block, x)
        for a, b in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
            assert torch.equal(a, b)  # same kernels in the same order: bit for bit
        (region,) = _regions(block)
        plans.add(id(region.plan))
    assert len(plans) == 1 and region.graph.cost == cost
    plan = region.plan
    assert plan.fits and plan.kept_bytes <= plan.budget_bytes and plan.steps
    assert plan.cost == pytest.approx(sum(region.graph.ops[i].cost for i in plan.steps))


def test_flops_is_the_default_roofline():
    block, x = _block(), torch.randn(2, 16, 32, requires_grad=True)
    gradaccel.checkpoint(block, x, budget=0.5).sum().backward()
    (region,) = _regions(block)
    mm = next(op for op in region.graph.ops if str(op.func) == "aten.addmm.default")
    inp, w = mm.leaves[1], mm.leaves[2]  # addmm(bias, input, weight.T): 2 * M * K * N FLOPs
    assert mm.flops == 2 * inp.size[0] * inp.size[1] * w.size[1]
    assert mm.cost > mm.flops  # plus the bytes it moves, at 8 FLOPs a byte on CPU
    assert region.graph.cost == "flops"


def test_measured_costs_are_seconds_of_the_traced_call():
    block, x = _block(), torch.randn(2, 16, 32, requires_grad=True)
    t0 = time.perf_counter()
    out = gradaccel.checkpoint(block, x, budget=0.5, cost="measured")
    wall = time.perf_counter() - t0
    out.sum().backward()
    (region,) = _regions(block)
    costs = [op.cost for op in region.graph.ops]
    assert all(c >= 0 and math.isfinite(c) for c in costs)
    # Each op's own time, within the call that traced it (which also ran the tracer's hooks).
    assert 0 < sum(costs) < wall


def test_a_callable_sees_each_op_and_prices_the_plan():
    seen = []

    def cost(op):
        seen.append(op)
        return 2.5 if op.name.startswith("aten.addmm") else 1.0

    block, x = _block(), torch.randn(2, 16, 32, requires_grad=True)
    gradaccel.checkpoint(block, x, budget=0.25, cost=cost).sum().backward()
    (region,) = _regions(block)
    assert len(seen) == len(region.graph.ops) and all(isinstance(op, OpCost) for op in seen)
    mm = next(op for op in seen if op.name == "aten.addmm.default")
    assert mm.flops > 0 and mm.bytes > 0 and mm.device == torch.device("cpu")
    plan = region.plan
    want = sum(2.5 if str(region.graph.ops[i].func).startswith("aten.addmm") else 1.0 for i in plan.steps)
    assert plan.cost == want


def test_cost_is_part_of_the_plan_key():
    block, x = _block(), torch.randn(2, 16, 32, requires_grad=True)
    for cost in ("flops", _one_per_op, "flops", _one_per_op):
        gradaccel.checkpoint(block, x, budget=0.5, cost=cost).sum().backward()
    regions = _regions(block)
    assert len(regions) == 2 and {r.graph.cost for r in regions} == {"flops", _one_per_op}
    assert sorted(r.calls for r in regions) == [2, 2]


def test_offload_copies_are_priced_in_the_cost_models_units():
    def cost(op):
        return 3.0 * op.bytes if op.name == "gradaccel.offload" else 1.0

    plan_module = sys.modules["gradaccel.recompute.plan"]
    cpu = torch.device("cpu")
    assert plan_module.offload_cost_per_byte(cpu, cost) == 3.0
    d2h, h2d = offload.copy_bandwidth(cpu)
    assert plan_module.offload_cost_per_byte(cpu, "measured") == pytest.approx(1 / d2h + 1 / h2d)
    # Ops at one unit each, copies at 3 a byte: nothing is worth sending to host.
    block, x = _block(), torch.randn(2, 16, 32, requires_grad=True)
    want = _step(block, block, x)
    for c, sends in ((cost, False), (lambda op: 1e-12 if op.name == "gradaccel.offload" else 1.0, True)):
        reset_plans()
        for _ in range(2):
            got = _step(lambda t: gradaccel.checkpoint(block, t, budget=0.0, offload=True, cost=c), block, x)
            for a, b in zip(got[1], want[1], strict=True):
                assert torch.equal(a, b)
        assert (plan_rows()[0]["offloaded_bytes"] > 0) == sends


def test_sequential_and_blocks_pass_cost_through():
    calls = []

    def cost(op):
        calls.append(op.name)
        return 1.0

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 8, requires_grad=True)
    gradaccel.checkpoint_sequential(seq, 2, x, budget=0.5, cost=cost).sum().backward()
    assert calls and all(r.graph.cost is cost for rs in STATE.regions.values() for r in rs.values())

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(_block(dropout=0.0) for _ in range(2))

        def forward(self, h):
            for b in self.blocks:
                h = b(h)
            return h

    calls.clear()
    net = gradaccel.checkpoint_blocks(Net(), budget=0.5, cost=cost)
    net(torch.randn(1, 16, 32, requires_grad=True)).sum().backward()
    assert calls and all(_regions(b)[0].graph.cost is cost for b in net.blocks)


def test_the_hugging_face_route_keeps_cost_through_set_budget():
    """checkpoint_blocks hands HF models a checkpoint function (blocks._HFCheckpoint); a later
    set_budget must keep its cost model. Without transformers: the hand-over itself."""
    from gradaccel.recompute import blocks

    calls = []

    def cost(op):
        calls.append(op.name)
        return 1.0

    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    layer.gradient_checkpointing = True  # what blocks._take_over looks for on HF layers
    blocks._take_over(layer, 0.5, cost)
    assert blocks.set_budget(layer, 0.25) == 1
    func = layer._gradient_checkpointing_func
    assert func.budget == 0.25 and func.cost is cost
    func(layer, torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert calls and _regions(layer)[0].graph.cost is cost


class _Unhashable:
    __hash__ = None

    def __call__(self, op):
        return 1.0


@pytest.mark.parametrize("bad, error", [("bogus", ValueError), ("FLOPS", ValueError), (3, TypeError),
                                        (None, TypeError), (_Unhashable(), TypeError)])
def test_bad_cost_arguments_are_refused(bad, error):
    with pytest.raises(error, match="cost"):
        gradaccel.checkpoint(nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True), budget=0.5, cost=bad)
    with pytest.raises(error, match="cost"):
        gradaccel.checkpoint_blocks(nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])), cost=bad)


@pytest.mark.parametrize("returned", [-1.0, float("nan"), float("inf"), "1.0", True, None, torch.tensor(1.0)])
def test_a_callable_returning_a_bad_cost_raises(returned):
    with pytest.raises(ValueError, match="cost"):
        gradaccel.checkpoint(nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True), budget=0.5,
                             cost=lambda op: returned)
    with pytest.raises(ValueError, match="cost"):
        price(lambda op: returned, OpCost("aten.mm.default", 8, 16, torch.device("cpu")), None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA timing needs a GPU")
def test_measured_on_cuda_gives_stock_gradients():
    block, x = _block().cuda(), torch.randn(2, 16, 32, device="cuda", requires_grad=True)
    want = _step(block, block, x)
    for _ in range(2):
        got = _step(lambda t: gradaccel.checkpoint(block, t, budget=0.5, cost="measured"), block, x)
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b)
    assert all(op.cost >= 0 for op in _regions(block)[0].graph.ops)
