"""What a trace depends on besides shapes: the arguments' layout and aliasing, the state of the
modules it runs, and the tensors replay reads in backward. Each case against no checkpointing
(bit-exact, on calls that trace and on calls that reuse the plan), or a clear error."""

import gc
import sys
import types
import warnings

import pytest
import torch
import torch.nn as nn

import gradaccel
from gradaccel.recompute.state import STATE
from gradaccel.recompute.checkpoint import plan_rows, reset_plans
from gradaccel.memory.counter import StorageLog

BUDGETS = [0.25, 0.5, 300]


@pytest.fixture(autouse=True)
def _fresh_plans():
    reset_plans()
    yield
    reset_plans()


def grads(fn, *inputs, params=()):
    """fn's output and the gradients of ``inputs`` and ``params``."""
    for t in (*inputs, *params):
        t.grad = None
    out = fn(*inputs)
    out.square().sum().backward()
    return [out.detach()] + [t.grad.clone() for t in (*inputs, *params)]


def assert_equal(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


@pytest.mark.parametrize("budget", BUDGETS)
def test_same_shape_other_offset_layout_or_aliasing_is_another_plan(budget):
    net = _mlp()
    x = torch.randn(8, 8)
    for mb in list(x.chunk(2)) * 2:  # micro-batches: one shape, two storage offsets
        mb = mb.requires_grad_() if mb.is_leaf else mb.detach().requires_grad_()
        assert_equal(grads(lambda t: gradaccel.checkpoint(net, t, budget=budget), mb, params=net.parameters()),
                     grads(net, mb, params=net.parameters()))
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GELU(), nn.Conv2d(4, 2, 3))
    for fmt in (torch.contiguous_format, torch.channels_last, torch.channels_last):
        img = torch.randn(2, 3, 8, 8).to(memory_format=fmt).requires_grad_()
        assert_equal(grads(lambda t: gradaccel.checkpoint(conv, t, budget=budget), img),
                     grads(conv, img))

    def attend(q, k):
        return torch.softmax(q @ k.t(), -1) @ k

    t = torch.randn(6, 8, requires_grad=True)
    u = torch.randn(6, 8, requires_grad=True)
    for a, b in ((t, t), (t, u), (t, u)):
        assert_equal(grads(lambda p, q: gradaccel.checkpoint(attend, p, q, budget=budget), a, b),
                     grads(attend, a, b))


@pytest.mark.parametrize("budget", BUDGETS)
def test_submodule_mode_attributes_frozen_or_replaced_parameters_trace_again(budget):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    for change in (None, lambda: setattr(net[2], "p", 0.5), lambda: net[2].eval(),
                   lambda: net[3].weight.requires_grad_(False),
                   lambda: setattr(net[0], "weight", nn.Parameter(torch.randn(16, 8)))):
        if change is not None:
            change()
        for _ in range(2):
            torch.manual_seed(1)
            ours = grads(lambda t: gradaccel.checkpoint(net, t, budget=budget), x)
            torch.manual_seed(1)
            assert_equal(ours, grads(net, x))
    assert len(plan_rows()) == 5  # one plan per state, each used twice


@pytest.mark.parametrize("budget", BUDGETS)
def test_which_tensors_hold_the_arguments_is_not_part_of_the_plan(budget):
    # Traced on a leaf copy of the input, planned on the input itself: a non-leaf (as a layer's
    # input is), which the region saves (Linear saves its input) with another autograd node.
    mlp = _mlp()
    x = torch.randn(4, 8, requires_grad=True)
    copy = (x * 2).detach().requires_grad_()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="gradaccel")
        assert_equal(grads(lambda t: gradaccel.checkpoint(mlp, t, budget=budget), copy), grads(mlp, copy))
        assert_equal(grads(lambda t: gradaccel.checkpoint(mlp, t * 2, budget=budget), x), grads(lambda t: mlp(t * 2), x))
    (row,) = plan_rows()
    assert row["mode"] == "selective" and row["calls"] == 2


def test_output_modified_after_the_forward_is_fine_and_a_modified_argument_is_refused():
    lin = nn.Linear(8, 8)

    def region(x):
        h = lin(x)
        return h, h.tanh() * 2  # nothing saves h: the caller may change it in place

    def run(fn, x):
        h, y = fn(x)
        h.add_(1)
        (y.sum() + h.square().sum()).backward()
        return [t.grad.clone() for t in (x, *lin.parameters())]

    for _ in range(2):  # the traced call and a planned one
        for t in (x := torch.randn(4, 8, requires_grad=True), *lin.parameters()):
            t.grad = None
        ours = run(lambda t: gradaccel.checkpoint(region, t, budget=0.25), x)
        for t in (x, *lin.parameters()):
            t.grad = None
        assert_equal(ours, run(region, x))

    # An argument backward recomputes from: refused, as torch.utils.checkpoint refuses it.
    b = nn.Parameter(torch.randn(8))

    def shift(t):
        return (t + b).tanh() * 2

    for _ in range(2):
        x = torch.randn(4, 8)
        y = gradaccel.checkpoint(shift, x, budget=0.25)
        x.add_(1)
        with pytest.raises(RuntimeError, match="modified in place after its forward"):
            y.sum().backward()


def test_an_output_the_caller_drops_is_not_held():
    # y = x + f(x): f's output is freed after the add in plain autograd; replay must not hold it.
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 16), nn.GELU(), nn.Linear(16, 64))  # its output outweighs the rest
    x = torch.randn(32, 64, requires_grad=True)
    for budget in (0.25, 1024):
        reset_plans()
        for _ in range(3):
            log = StorageLog()
            with log:
                y = x + gradaccel.checkpoint(mlp, x, budget=budget)
            gc.collect()
            alive = sum(nbytes for _, nbytes in log.created.items())  # storages still alive
            assert alive - y.untyped_storage().nbytes() <= plan_rows()[0]["budget_bytes"]
            y.sum().backward()


def test_conjugate_views_are_kept_not_rebuilt():
    lin = nn.Linear(8, 16)

    def region(x):
        z = torch.view_as_complex(lin(x).view(4, 8, 2))
        return torch.view_as_real(z.conj().exp() * z) * 3.0

    x = torch.randn(4, 8, requires_grad=True)
    for budget in (0.25, 1.0):
        for _ in range(2):
            assert_equal(grads(lambda t: gradaccel.checkpoint(region, t, budget=budget), x), grads(region, x))


def test_lstm_kernel_outputs_are_kept():
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8, batch_first=True)
    x = torch.randn(2, 4, 8, requires_grad=True)

    def region(t):
        return lstm(t)[0]

    with pytest.warns(UserWarning, match="over its budget"):
        ours = grads(lambda t: gradaccel.checkpoint(region, t, budget=0.5), x)
    assert_equal(ours, grads(region, x))
    assert_equal(grads(lambda t: gradaccel.checkpoint(region, t, budget=0.5), x), grads(region, x))


def test_closure_state_is_part_of_the_signature_and_hidden_state_is_recomputed_whole():
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def region(x):  # a closure over modules: their state is part of the signature
        h = lin1(x)
        return h * lin2(h.exp())

    x = torch.randn(4, 8, requires_grad=True)
    for freeze in (False, True, True):
        lin2.weight.requires_grad_(not freeze)  # frozen, lin2 no longer saves h.exp()
        assert_equal(grads(lambda t: gradaccel.checkpoint(region, t, budget=0.75), x), grads(region, x))
    assert sorted(r["calls"] for r in plan_rows()) == [1, 2]

    holder = types.SimpleNamespace(lin=lin2)  # reached through a plain object: not seen

    def hidden(x):
        h = lin1(x)
        return h * holder.lin(h.exp())

    gradaccel.checkpoint(hidden, x, budget=0.75).sum().backward()
    holder.lin.weight.requires_grad_(True)
    with pytest.warns(UserWarning, match="saved different tensors"):  # the call that strays: recomputed whole
        assert_equal(grads(lambda t: gradaccel.checkpoint(hidden, t, budget=0.75), x), grads(hidden, x))
    assert_equal(grads(lambda t: gradaccel.checkpoint(hidden, t, budget=0.75), x), grads(hidden, x))  # traced again


SCALE = 1.0  # a global the region below reads: part of its signature


def _scaled(t):
    return (_LIN(t) * SCALE).sin()


_LIN = nn.Linear(8, 8)


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("mask", torch.ones(8))
        self.shape = (8,)

    def forward(self, t):
        return (self.lin(t) * self.mask).sin().reshape(-1, *self.shape)


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_globals_buffers_tuples_and_tolist_branches_are_seen(budget):
    global SCALE
    x = torch.randn(4, 8, requires_grad=True)
    for SCALE in (1.0, 1.0, 2.0):  # a changed global constant: traced again
        assert_equal(grads(lambda t: gradaccel.checkpoint(_scaled, t, budget=budget), x), grads(_scaled, x))
    m = _Masked()
    masks = [torch.ones(8), torch.full((8,), 2.0)]  # the old buffer stays alive
    for mask, shape in ((masks[0], (8,)), (masks[1], (8,)), (masks[1], (2, 4))):
        m.mask, m.shape = mask, shape
        assert_equal(grads(lambda t: gradaccel.checkpoint(m, t, budget=budget), x), grads(m, x))

    def branch(t):  # reads data into Python without an aten op: the region is data dependent
        return (_LIN(t) * (3.0 if t[0, 0].tolist() > 0 else 2.0)).sin()

    for sign in (1, -1, 1):
        y = (sign * x.detach().abs()).requires_grad_()
        assert_equal(grads(lambda t: gradaccel.checkpoint(branch, t, budget=budget), y), grads(branch, y))


def test_a_kept_tensor_modified_after_the_forward_raises_as_in_autograd():
    lin = nn.Linear(8, 8)

    def region(x, y):
        return (lin(x) * y).sin()  # mul saves y, an argument: kept

    def ends_in_sigmoid(x):
        return lin(x).sin().sigmoid()  # sigmoid saves its output, the region's output

    for _ in range(2):  # the traced call and a planned one
        x, y = torch.ones(4, 8, requires_grad=True), torch.ones(4, 8)
        out = gradaccel.checkpoint(region, x, y, budget=1.0)
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation|modified in place"):
            out.sum().backward()
        out = gradaccel.checkpoint(ends_in_sigmoid, x, budget=0.25)
        out.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_module_with_a_cycle_and_state_that_changes_every_call(monkeypatch):
    class Child(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x)

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = Child()
            self.child.parent = self  # a registered back-reference: a cycle among submodules

        def forward(self, x):
            return torch.tanh(self.child(x)).exp()

    p = Parent()
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(2):
        assert_equal(grads(lambda t: gradaccel.checkpoint(p, t, budget=0.5), x), grads(p, x))

    # A new global tensor every call (kept alive elsewhere): traced again each time, and the
    # cache stays bounded.
    global _MASK
    monkeypatch.setattr(sys.modules["gradaccel.recompute.region"], "MAX_PLANS", 3)
    alive = []
    with pytest.warns(UserWarning, match="traced for more than 3 signatures"):
        for step in range(6):
            _MASK = torch.full((4, 8), float(step))
            alive.append(_MASK)
            assert_equal(grads(lambda t: gradaccel.checkpoint(_masked, t, budget=0.5), x), grads(_masked, x))
    assert len(STATE.regions[_masked]) == 3


_MASK = None


def _masked(t):
    return torch.tanh(_LIN(t) * _MASK).exp()


def test_reset_plans_clears_every_piece_of_state_and_gives_host_buffers_back(monkeypatch):
    # Copies priced as free: the planned call offloads what it drops, so the store holds buffers.
    monkeypatch.setattr(sys.modules["gradaccel.recompute.region"], "offload_cost_per_byte", lambda device, cost: 1e-9)
    net, x = _mlp(), torch.randn(32, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="use_reentrant=True"):
        for _ in range(2):  # the traced call, then one that offloads
            gradaccel.checkpoint(net, x, budget=0.0, offload=True, use_reentrant=True).sum().backward()
    (store,) = STATE.stores.values()
    assert store.bytes_reserved > 0 and plan_rows()[0]["offloaded_bytes"] > 0
    assert STATE.regions and STATE.shapes and STATE.in_order and STATE.warned and STATE.previous_offload is not None
    reset_plans()
    assert store.bytes_reserved == 0  # the pool's idle buffers went back to the system
    assert not (STATE.regions or STATE.shapes or STATE.kinds or STATE.in_order or STATE.warned or STATE.stores)
    assert STATE.previous_offload is None
    assert plan_rows() == []
    # Every field is checked above: a new piece of state must be added to this test.
    assert set(vars(STATE)) == {"regions", "shapes", "kinds", "in_order", "warned", "stores", "previous_offload"}
    with pytest.warns(UserWarning, match="use_reentrant=True"):  # warned again, traced again
        gradaccel.checkpoint(net, x, budget=0.0, offload=True, use_reentrant=True).sum().backward()
    assert plan_rows()[0]["calls"] == 1
