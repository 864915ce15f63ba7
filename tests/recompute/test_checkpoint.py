"""gradaccel.checkpoint against stock PyTorch: same outputs and gradients at every budget, the
budget honoured in measured bytes, and recompute that only shrinks as the budget grows."""

import gc
import math
import sys
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc
from torch.utils.flop_counter import FlopCounterMode

import gradaccel
from _models import Block, GPTConfig
from gradaccel.recompute.state import STATE
from gradaccel.recompute.checkpoint import plan_report, plan_rows, reset_plans
from gradaccel.memory.counter import held_activation_bytes

BUDGETS = [None, 0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.fixture(autouse=True)
def _fresh_plans():
    reset_plans()
    yield
    reset_plans()


def make_block(dropout=0.1, seq_len=32, n_embd=64, n_head=4, seed=0):
    torch.manual_seed(seed)
    return Block(GPTConfig(seq_len=seq_len, n_embd=n_embd, n_head=n_head, dropout=dropout))


def run(fn, module, *inputs, seed=1):
    """Output and gradients (parameters, then inputs that require grad) of one step."""
    torch.manual_seed(seed)
    out = fn(*inputs)
    wrt = [p for p in module.parameters() if p.requires_grad] + [x for x in inputs if x.requires_grad]
    return out, torch.autograd.grad(out.float().square().sum(), wrt)


def assert_same(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert torch.equal(ga, gb)


@pytest.mark.parametrize("budget", BUDGETS + [4096])
def test_block_with_dropout_matches_no_checkpoint_bit_exact(budget):
    block = make_block(dropout=0.1)
    x = torch.randn(2, 32, 64, requires_grad=True)
    expected = run(block, block, x)
    for _ in range(3):  # the traced call, then calls that run the cached plan
        assert_same(run(lambda t: gradaccel.checkpoint(block, t, budget=budget), block, x), expected)


def test_kwargs_non_tensor_inputs_and_outputs_pass_through():
    lin = nn.Linear(8, 8)

    def fn(x, scale, *, tag, extra=None, shift):
        assert tag == "hello" and extra is None
        return {"y": lin(x) * scale + shift, "tag": tag, "none": None}

    x, shift = torch.randn(3, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    for budget in (0.0, 0.5, 1.0):
        for _ in range(2):
            out = gradaccel.checkpoint(fn, x, 2.0, tag="hello", shift=shift, budget=budget)
            assert out["tag"] == "hello" and out["none"] is None
            got = torch.autograd.grad(out["y"].square().sum(), [x, shift, lin.weight])
            ref = fn(x, 2.0, tag="hello", shift=shift)
            want = torch.autograd.grad(ref["y"].square().sum(), [x, shift, lin.weight])
            for g, w in zip(got, want):
                assert torch.equal(g, w)


@pytest.mark.parametrize("budget", [0.25, 0.5, 1.0])
def test_inputs_without_grad_and_frozen_parameters(budget):
    block = make_block(dropout=0.0)
    for p in block.attn.parameters():
        p.requires_grad_(False)
    x = torch.randn(2, 32, 64)  # no grad
    expected = run(block, block, x)
    for _ in range(2):
        assert_same(run(lambda t: gradaccel.checkpoint(block, t, budget=budget), block, x), expected)


@pytest.mark.parametrize("budget", [0.25, 0.5, 1.0])
def test_double_backward_with_create_graph(budget):
    block = make_block(dropout=0.0)
    x = torch.randn(2, 32, 64, requires_grad=True)

    def second_order(fn):
        y = fn(x)
        (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        return torch.autograd.grad(g.square().sum(), [x] + list(block.parameters()))

    want = second_order(block)
    for _ in range(2):
        got = second_order(lambda t: gradaccel.checkpoint(block, t, budget=budget))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_nested_checkpoints_with_different_budgets():
    inner, outer_block = make_block(dropout=0.1, seed=1), make_block(dropout=0.1, seed=2)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.block = inner, outer_block

        def forward(self, x):
            return self.block(gradaccel.checkpoint(self.inner, x.sin(), budget=0.25)).cos()

    model = Outer()

    def plain(x):
        return outer_block(inner(x.sin())).cos()

    x = torch.randn(2, 32, 64, requires_grad=True)
    expected = run(plain, model, x)
    for budget in (0.0, 0.5, 1.0):
        for _ in range(2):
            assert_same(run(lambda t: gradaccel.checkpoint(model, t, budget=budget), model, x), expected)


@pytest.mark.parametrize("budget", [0.0, 0.3, 0.6, 1.0])
def test_bf16_autocast_on_cpu(budget):
    block = make_block(dropout=0.1)
    x = torch.randn(2, 32, 64, requires_grad=True)

    def under_autocast(fn):
        def step(t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(t)
        return step

    expected = run(under_autocast(block), block, x)
    for _ in range(3):
        got = run(under_autocast(lambda t: gradaccel.checkpoint(block, t, budget=budget)), block, x)
        assert_same(got, expected)


def test_autocast_state_is_part_of_the_signature():
    block = make_block(dropout=0.0)
    x = torch.randn(2, 32, 64, requires_grad=True)
    gradaccel.checkpoint(block, x, budget=0.5).sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gradaccel.checkpoint(block, x, budget=0.5).float().sum().backward()
    assert len(plan_rows()) == 2


@pytest.mark.parametrize("budget", [None, 0.5, 1.0])
def test_checkpoint_sequential_matches_torch(budget):
    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2)) for _ in range(6)])
    x = torch.randn(4, 16, requires_grad=True)
    expected = run(lambda t: tc.checkpoint_sequential(seq, 3, t, use_reentrant=False), seq, x)
    for _ in range(3):
        assert_same(run(lambda t: gradaccel.checkpoint_sequential(seq, 3, t, budget=budget), seq, x), expected)
    if budget:  # two checkpointed segments, each traced once and then run from its plan
        assert sorted(r["calls"] for r in plan_rows()) == [3, 3]
    seq.eval()  # dropout off: a new signature, planned anew
    assert_same(run(lambda t: gradaccel.checkpoint_sequential(seq, 3, t, budget=budget), seq, x),
                run(lambda t: tc.checkpoint_sequential(seq, 3, t, use_reentrant=False), seq, x))


def test_budget_zero_holds_no_more_than_torch_checkpoint():
    block = make_block(dropout=0.1)
    x = torch.randn(2, 32, 64, requires_grad=True)
    _, torch_bytes = held_activation_bytes(lambda t: tc.checkpoint(block, t, use_reentrant=False), x)
    for budget in (None, 0.0, 0):
        _, ours = held_activation_bytes(lambda t: gradaccel.checkpoint(block, t, budget=budget), x)
        assert ours <= torch_bytes


@pytest.mark.parametrize("budget", [0.1, 0.25, 0.5, 0.75, 1.0])
def test_float_budget_bounds_measured_bytes_from_the_first_call(budget):
    block = make_block(dropout=0.1)
    x = torch.randn(2, 32, 64, requires_grad=True)
    _, full = held_activation_bytes(block, x)
    for _ in range(3):  # first (traced) call included
        out, held = held_activation_bytes(lambda t: gradaccel.checkpoint(block, t, budget=budget), x)
        assert held <= budget * full
        out.sum().backward()
    (row,) = plan_rows()
    assert row["total_bytes"] == full  # the planner's "no checkpoint" bytes are the real ones
    if budget == 1.0:
        assert held == full


def test_int_budget_is_a_limit_in_bytes():
    block = make_block(dropout=0.1)
    x = torch.randn(2, 32, 64, requires_grad=True)
    for limit in (50_000, 150_000):
        reset_plans()
        for _ in range(2):
            _, held = held_activation_bytes(lambda t: gradaccel.checkpoint(block, t, budget=limit), x)
            assert held <= limit
        assert plan_rows()[0]["kept_bytes"] <= limit


def backward_flops(block, x, budget) -> int:
    gradaccel.checkpoint(block, x, budget=budget).sum().backward()  # trace + plan
    out = gradaccel.checkpoint(block, x, budget=budget)
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    return counter.get_total_flops()


def test_more_budget_never_costs_more_recompute():
    block = make_block(dropout=0.1)
    x = torch.randn(2, 32, 64, requires_grad=True)
    flops = [backward_flops(block, x, b) for b in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert flops == sorted(flops, reverse=True)
    assert flops[0] > flops[-1]  # full recompute really recomputes
    costs = [r["recompute_flops"] for r in plan_rows()]
    assert costs == sorted(costs, reverse=True)


def test_planner_finds_megatron_selective_policy():
    # Long sequence, as in Megatron-LM's analysis: the (B, H, T, T) attention matrix outweighs
    # all the block's (B, T, C) activations together, so at budget 0.5 it cannot be kept.
    block = make_block(dropout=0.0, seq_len=512, n_embd=128, n_head=8)
    x = torch.randn(1, 512, 128, requires_grad=True)
    gradaccel.checkpoint(block, x, budget=0.5).sum().backward()
    (row,) = plan_rows()
    kept, replayed = set(row["kept_ops"]), set(row["replayed_ops"])
    # Linear-layer outputs and attention @ V (the contiguous (B,T,C) copy fed to the output
    # projection) are kept ...
    assert {"aten.addmm.default", "aten.clone.default", "aten.gelu.default"} <= kept
    # ... and the s^2 tensors are not: Q K^T and the softmax are recomputed, no linear layer is.
    assert "aten._softmax.default" not in kept
    assert {"aten.bmm.default", "aten._softmax.default"} <= replayed
    assert "aten.addmm.default" not in replayed
    ours = backward_flops(block, x, 0.5)
    none = backward_flops(block, x, 1.0)
    full = backward_flops(block, x, 0.0)
    assert ours - none <= 0.30 * (full - none)


def test_one_byte_and_everything_are_different_budgets():
    block = make_block(dropout=0.0)
    x = torch.randn(2, 32, 64, requires_grad=True)
    _, full = held_activation_bytes(block, x)
    for budget, expected in ((1, 0), (1.0, full)):
        for _ in range(2):
            out, held = held_activation_bytes(lambda t: gradaccel.checkpoint(block, t, budget=budget), x)
            out.sum().backward()
        assert held == expected


def test_plan_cache_keeps_no_argument_alive():
    def fn(module, x):
        return module(x).relu()

    m = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    gradaccel.checkpoint(fn, m, x, budget=0.5).sum().backward()
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


def test_new_shape_plans_again_and_plans_are_reused():
    block = make_block(dropout=0.0, seq_len=64)
    for T in (16, 16, 32, 16, 32):
        gradaccel.checkpoint(block, torch.randn(2, T, 64, requires_grad=True), budget=0.5).sum().backward()
    rows = plan_rows()
    assert len(rows) == 2 and sorted(r["calls"] for r in rows) == [2, 3]


def test_mutated_outputs_views_and_random_ops():
    lin1, lin2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def fn(x):
        h = lin1(x)
        a, b = h.split(16, dim=-1)          # views of one storage
        a = a * 2.0
        a.add_(1.0)                          # in-place on an intermediate
        m = torch.rand_like(a) > 0.5         # random op
        a = a.masked_fill(m, 0.0)
        a.mul_(b.sigmoid())                  # in-place after the values were used
        t = a.t().contiguous().t()           # views around a copy
        return lin2(torch.cat([t, b.tanh()], -1).exp().log1p()[..., :32])

    x = torch.randn(8, 16, requires_grad=True)
    module = nn.ModuleList([lin1, lin2])
    expected = run(fn, module, x)
    for budget in (0.0, 0.2, 0.5, 0.8, 1.0):
        for _ in range(2):
            assert_same(run(lambda t: gradaccel.checkpoint(fn, t, budget=budget), module, x), expected)


def test_batch_norm_running_stats_updated_once():
    torch.manual_seed(0)
    ref_net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
    net.load_state_dict(ref_net.state_dict())
    for step in range(3):
        x = torch.randn(16, 8, requires_grad=True)
        expected = run(ref_net, ref_net, x)
        # Batch norm's output cannot be recomputed, and at 0.3 it does not fit: warned once, at the plan.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert_same(run(lambda t: gradaccel.checkpoint(net, t, budget=0.3), net, x), expected)
        assert ["over its budget" in str(w.message) for w in caught] == ([True] if step == 0 else [])
    assert torch.equal(net[1].running_mean, ref_net[1].running_mean)
    assert torch.equal(net[1].running_var, ref_net[1].running_var)


def test_budget_too_small_for_what_cannot_be_recomputed_is_warned_about():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(16, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="over its budget"):
        gradaccel.checkpoint(net, x, budget=1).sum().backward()
    (row,) = plan_rows()
    assert not row["fits"] and row["kept_bytes"] > row["budget_bytes"]


def test_data_dependent_region_falls_back_and_stays_correct():
    lin = nn.Linear(8, 8)

    def fn(x):
        h = lin(x)
        scale = h.abs().max().item()  # a value read from data
        return (h / scale).tanh() * h

    for _ in range(3):
        x = torch.randn(4, 8, requires_grad=True)
        expected = run(fn, lin, x)
        assert_same(run(lambda t: gradaccel.checkpoint(fn, t, budget=0.5), lin, x), expected)
    assert plan_rows()[0]["mode"].startswith("torch.utils.checkpoint")


def test_region_that_changes_behaviour_is_traced_again():
    class Flip(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.use_gelu = nn.Linear(8, 8), False

        def forward(self, x):
            h = self.lin(x)
            return F.gelu(h) * h if self.use_gelu else h.sigmoid() * h.exp()

    m = Flip()
    x = torch.randn(4, 8, requires_grad=True)
    for use_gelu in (False, False, True, True):
        m.use_gelu = use_gelu
        expected = run(m, m, x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert_same(run(lambda t: gradaccel.checkpoint(m, t, budget=0.3), m, x), expected)


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, True, "half", -3, [0.5]])
def test_bad_budget_raises_value_error_naming_budget(bad):
    with pytest.raises(ValueError, match="budget"):
        gradaccel.checkpoint(nn.Linear(2, 2), torch.randn(1, 2), budget=bad)


def test_use_reentrant_true_is_warned_about_and_works():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.warns(UserWarning, match="use_reentrant"):
        gradaccel.checkpoint(lin, x, use_reentrant=True, budget=0.5).sum().backward()


def test_plan_report_is_a_readable_table():
    block = make_block(dropout=0.1)
    gradaccel.checkpoint(block, torch.randn(2, 32, 64, requires_grad=True), budget=0.5).sum().backward()
    report = plan_report()
    assert "Block" in report and "kept" in report and "replayed" in report and "recompute GFLOP" in report
    (row,) = plan_rows()
    assert row["kept_bytes"] <= row["budget_bytes"] and row["exact"] and row["fits"]


# -- offload: keep, offload or recompute under one budget --------------------------------------
def _store():
    return STATE.stores


@pytest.fixture
def copy_at_memory_speed(monkeypatch):
    """Prices copies as if they ran at memory speed, the ideal on CPU (4 bytes moved per byte
    offloaded, at 8 FLOPs a byte), rather than as measured now on a shared, noisy machine."""
    monkeypatch.setattr(sys.modules["gradaccel.recompute.region"], "offload_cost_per_byte", lambda device, cost: 32.0)


@pytest.mark.parametrize("budget", [0.0, 0.25, 0.5])
def test_offload_gradients_equal_and_device_budget_holds(budget, copy_at_memory_speed):
    block = make_block(dropout=0.1)
    x = torch.randn(2, 32, 64, requires_grad=True)
    expected = run(block, block, x)
    _, full = held_activation_bytes(block, x)
    for _ in range(3):
        assert_same(run(lambda t: gradaccel.checkpoint(block, t, budget=budget, offload=True), block, x), expected)
    out, held = held_activation_bytes(lambda t: gradaccel.checkpoint(block, t, budget=budget, offload=True), x)
    (row,) = plan_rows()
    assert held <= budget * full
    assert row["offloaded_bytes"] > 0 and row["offloaded_ops"]
    # What sits in host memory is what the plan sent there: device and host bytes add up.
    assert _store()[None].bytes_in_use == row["offloaded_bytes"]
    assert held + row["offloaded_bytes"] <= full
    out.sum().backward()


def test_offload_pool_is_reused_and_host_memory_stays_flat(copy_at_memory_speed):
    block = make_block(dropout=0.0, seq_len=16)
    x = torch.randn(1, 16, 64, requires_grad=True)
    sizes = []
    for _ in range(100):
        gradaccel.checkpoint(block, x, budget=0.0, offload=True).sum().backward()
        sizes.append((_store()[None].bytes_reserved, _store()[None].buffer_count))
    assert len(set(sizes[2:])) == 1
    assert _store()[None].bytes_in_use == 0  # every handle released once its graph is gone
    assert _store()[None].hits >= 90


def test_offload_host_budget_exhausted_falls_back_to_recompute_with_one_warning(copy_at_memory_speed):
    block = make_block(dropout=0.1)
    x = torch.randn(2, 32, 64, requires_grad=True)
    expected = run(block, block, x)
    _, full = held_activation_bytes(block, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            got = run(lambda t: gradaccel.checkpoint(block, t, budget=0.25, offload=True, host_budget=4096), block, x)
            assert_same(got, expected)
            _, held = held_activation_bytes(
                lambda t: gradaccel.checkpoint(block, t, budget=0.25, offload=True, host_budget=4096), x)
            assert held <= 0.25 * full
    assert sum("host_budget" in str(w.message) for w in caught) == 1


def test_offload_only_where_the_copy_is_cheaper(monkeypatch):
    block = make_block(dropout=0.1)
    x = torch.randn(2, 32, 64, requires_grad=True)
    plan_module = sys.modules["gradaccel.recompute.plan"]
    monkeypatch.setattr(sys.modules["gradaccel.recompute.region"], "offload_cost_per_byte", lambda device, cost: 1e12)
    gradaccel.checkpoint(block, x, budget=0.25, offload=True).sum().backward()
    assert plan_rows()[0]["offloaded_bytes"] == 0  # copies priced out: recompute, as without offload
    reset_plans()
    monkeypatch.setattr(sys.modules["gradaccel.recompute.region"], "offload_cost_per_byte", lambda device, cost: 1e-9)
    gradaccel.checkpoint(block, x, budget=0.25, offload=True).sum().backward()
    row = plan_rows()[0]
    assert row["replayed_ops"] == [] and row["offloaded_bytes"] > 0  # free copies: nothing recomputed
    assert plan_module.offload_cost_per_byte(torch.device("cpu")) > 0


@pytest.mark.parametrize("bad", [{"offload": 1}, {"offload": True, "host_budget": -1}, {"offload": True, "host_budget": 1.5}])
def test_bad_offload_arguments(bad):
    with pytest.raises(ValueError, match="offload|host_budget"):
        gradaccel.checkpoint(nn.Linear(2, 2), torch.randn(1, 2), budget=0.5, **bad)


def test_saved_tensor_hooks_are_not_traced_by_dynamo():
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    compiled = torch.compile(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)), backend="aot_eager")
    for _ in range(3):
        x = torch.randn(4, 16, requires_grad=True)
        gradaccel.checkpoint(compiled, x, budget=0.5).sum().backward()
    frames = set(counters["resumes"]) | set(counters["graph_break"])
    assert not any("pack" in f or "same_meta" in f or "_is_view" in f for f in frames)


def test_data_dependent_branch_falls_back_and_stays_correct():
    lin = nn.Linear(8, 8)

    def fn(x):
        h = lin(x)
        return h.exp() if h.sum() > 0 else h.sigmoid()  # `if tensor:` reads data into Python

    for _ in range(4):
        x = torch.randn(4, 8, requires_grad=True)
        assert_same(run(lambda t: gradaccel.checkpoint(fn, t, budget=0.5), lin, x), run(fn, lin, x))
    assert plan_rows()[0]["mode"].startswith("torch.utils.checkpoint")


def test_fused_attention_is_planned_not_treated_as_data_dependent():
    qkv = nn.Linear(32, 96)

    def attention(x):
        q, k, v = qkv(x).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 16, 32)

    x = torch.randn(2, 16, 32, requires_grad=True)
    for budget in (0.3, 1.0):
        for _ in range(2):
            assert_same(run(lambda t: gradaccel.checkpoint(attention, t, budget=budget), qkv, x), run(attention, qkv, x))
    assert all(r["mode"] == "selective" for r in plan_rows())


def test_region_that_saves_nothing_fits_any_budget():
    x = torch.randn(4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            gradaccel.checkpoint(torch.neg, x, budget=0.5).sum().backward()
    (row,) = plan_rows()
    assert row["fits"] and row["exact"] and row["kept_bytes"] == 0 == row["total_bytes"]


def test_two_methods_of_one_object_get_their_own_plans():
    t = torch.randn(8, requires_grad=True)
    y = torch.randn(8, requires_grad=True)
    for _ in range(2):
        for method, want in (("mul", t * y), ("add", t + y), ("mul", t * y)):
            got = gradaccel.checkpoint(getattr(t, method), y, budget=0.5)  # one object, same signature
            assert torch.equal(got, want)
            assert torch.equal(torch.autograd.grad(got.sum(), y)[0], torch.autograd.grad(want.sum(), y)[0])
