"""A planned call that strays from its trace (the region saves another tensor than the trace did
at some point, or more or fewer): it is recomputed whole in backward, with the gradients of no
checkpointing, warns once naming the region and the first difference, and the region is traced
again on its next call. Each case against the same region without checkpointing, bit for bit."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradaccel
from gradaccel.recompute.checkpoint import plan_rows, reset_plans
from gradaccel.recompute.state import STATE


@pytest.fixture(autouse=True)
def _fresh_plans():
    reset_plans()
    yield
    reset_plans()


class Switch(nn.Module):
    """Its path hangs on a dict entry, which is not part of the plan's signature (a module's
    plain attributes are; a dict of them is not): changing it changes what the region saves."""

    def __init__(self, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.dropout = dropout
        self.path = {"mode": "cos"}

    def forward(self, x):
        a = F.dropout(self.lin(x), self.dropout)
        b = a.exp()  # exp saves b: dropped by the plan, replayed from a
        mode = self.path["mode"]
        if mode == "fewer":
            return a + b  # saves nothing: a is never saved
        c = b.sin() if mode == "sin" else b.cos() if mode == "cos" else b.cos().cos()
        return a * c  # mul saves c, then a: the first save of a, which the plan keeps and b's replay reads


def grads(fn, x, module):
    x.grad = None
    module.zero_grad()
    out = fn(x)
    out.square().sum().backward()
    return [out.detach(), x.grad.clone(), *(p.grad.clone() for p in module.parameters())]


def assert_equal(a, b):
    assert len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))


def _region():
    """The one live region's (plan, calls)."""
    (row,) = plan_rows()
    return row


def cheap_copies(op):
    """A cost model under which sending to host memory is free: offload takes what the budget leaves."""
    return 0.0 if op.name == "gradaccel.offload" else float(op.flops + op.bytes)


@pytest.mark.parametrize("mode", ["sin", "fewer", "more"])
@pytest.mark.parametrize("offload", [None, "host", "refused"])
def test_a_call_that_strays_after_a_dropped_tensor_is_recomputed_whole(mode, offload):
    m = Switch()
    x = torch.randn(4, 8, requires_grad=True)
    kwargs = {} if offload is None else dict(offload=True, cost=cheap_copies, host_budget=None if offload == "host" else 0)
    ours = lambda t: gradaccel.checkpoint(m, t, budget=0.34, **kwargs)  # noqa: E731
    assert_equal(grads(ours, x, m), grads(m, x, m))  # traced
    row = _region()
    assert row["kept_ops"] == ["aten.addmm.default"]
    if offload is None:  # the case: b's replay reads a, kept but first saved after b
        assert "aten.exp.default" in row["replayed_ops"]
    else:  # b and c go to host memory (or, refused, are replayed as above)
        assert row["offloaded_ops"] == ["aten.cos.default", "aten.exp.default"]
    m.path["mode"] = mode
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_equal(grads(ours, x, m), grads(m, x, m))  # strays: recomputed whole (it used to raise)
        assert_equal(grads(ours, x, m), grads(m, x, m))  # traced again
        assert_equal(grads(ours, x, m), grads(m, x, m))  # planned
    said = [str(w.message) for w in caught if "gradaccel.checkpoint" in str(w.message)]
    assert len(said) == 1 and "Switch saved different tensors" in said[0], said
    first = {"sin": "saved tensor 4 is (4, 8) float32 from SinBackward0, where the trace saved (4, 8) float32 "
                    "from aten.cos.default",
             "fewer": "it saved 3 tensors, where the trace saved 6 (the next: (4, 8) float32 from aten.exp.default)",
             "more": "saved tensor 5 is (4, 8) float32 from CosBackward0, where the trace saved (4, 8) float32 "
                     "from aten.addmm.default (lin)"}[mode]
    assert first in said[0]
    row = _region()
    assert row["mode"] == "selective" and row["calls"] == 2  # planned again on its new trace


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_the_recompute_draws_the_random_numbers_of_the_forward(device):
    # Dropout's output is kept (the replay draws nothing, so the plan alone would not save the
    # generator state); the recompute of the call that strays must draw the same mask again.
    m = Switch(dropout=0.5).to(device)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    ours = lambda t: gradaccel.checkpoint(m, t, budget=0.5)  # noqa: E731
    for step, mode in enumerate(["cos", "sin"]):
        m.path["mode"] = mode
        torch.manual_seed(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = grads(ours, x, m)
        torch.manual_seed(step)
        assert_equal(got, grads(m, x, m))
        if step == 0:
            plan = next(r() for r in STATE.in_order).plan
            assert plan.draws and (device == "cuda" or not plan.needs_rng)  # on CPU only the recompute needs it


def test_an_argument_modified_after_a_call_that_strays_is_refused():
    m = Switch()
    x = torch.randn(4, 8)
    ours = lambda t: gradaccel.checkpoint(m, t, budget=0.34)  # noqa: E731
    ours(x.requires_grad_()).sum().backward()
    m.path["mode"] = "sin"
    y = x.detach().clone().requires_grad_()
    z = y * 1  # a non-leaf argument, so that it can be modified in place
    with pytest.warns(UserWarning, match="saved different tensors"):
        out = ours(z)
    z.detach().add_(1)
    with pytest.raises(RuntimeError, match="modified in place after its forward"):
        out.sum().backward()


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_a_call_saves_the_generator_state_only_where_the_region_draws(p):
    # Attention without dropout is tagged random but draws nothing: no state to save per call.
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    attention = lambda t: F.scaled_dot_product_attention(t, t, t, dropout_p=p).exp()  # noqa: E731
    gradaccel.checkpoint(attention, q, budget=1.0).sum().backward()
    plan = next(r() for r in STATE.in_order).plan
    assert any(op.random for op in plan.graph.ops) and not plan.needs_rng
    assert plan.draws == (p > 0)
