"""Regions with ops from outside aten (a library's kernel, as bitsandbytes' gemm_4bit or
flash-attn's, or the user's ``torch.library`` op): sized across lengths like any other region,
where the op has a fake kernel; traced per length, and said so, where it has none; and computed
in the dtype autocast gives their own aten ops, as without gradaccel. Each against no
checkpointing at every length."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradaccel
from gradaccel.recompute.checkpoint import plan_rows, reset_plans
from gradaccel.recompute.flops import FORMULAS
from gradaccel.recompute.state import STATE
from test_lengths import LENGTHS, check_length, traces


@torch.library.custom_op("gradaccel_test::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention as one op, standing in for flash-attn's kernel."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def _attention_backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        return torch.autograd.grad(out, leaves, grad)


attention.register_autograd(_attention_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


@torch.library.custom_op("gradaccel_test::unfaked", mutates_args=())
def unfaked(x: torch.Tensor) -> torch.Tensor:
    """An op with no fake kernel: its region cannot be run on symbolic sizes."""
    return torch.tanh(x)


unfaked.register_autograd(lambda ctx, g: g * (1 - ctx.saved_tensors[0] ** 2),
                          setup_context=lambda ctx, inputs, output: ctx.save_for_backward(output))


@torch.library.custom_op("gradaccel_test::linear", mutates_args=())
def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear`` inside an op, as bitsandbytes' CPU gemm_4bit computes: under autocast, its
    output is in autocast's dtype, which its fake kernel (like bitsandbytes') does not say."""
    return F.linear(x, w)


@linear.register_fake
def _(x, w):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def _linear_backward(ctx, grad):
    x, w = ctx.saved_tensors
    g = grad.float()
    return (g @ w.float()).to(x.dtype), (g.flatten(0, -2).T @ x.float().flatten(0, -2)).to(w.dtype)


linear.register_autograd(_linear_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class Block(nn.Module):
    """A pre-norm block whose attention is one foreign op (or ``inner``'s op on its output)."""

    def __init__(self, c=32, heads=4, inner=None, proj=None):
        super().__init__()
        self.heads, self.inner, self.proj_op = heads, inner, proj
        self.norm1, self.norm2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.out = nn.Linear(c, 3 * c), nn.Linear(c, c, bias=False)
        self.fc1, self.fc2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(C, dim=2))
        a = attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        a = self.proj_op(a, self.out.weight) if self.proj_op is not None else self.out(a)
        h = x + a
        m = self.fc1(self.norm2(h))
        return h + self.fc2(self.inner(m) if self.inner is not None else F.gelu(m))


@pytest.fixture(autouse=True)
def _fresh_plans():
    reset_plans()
    yield
    reset_plans()


@pytest.mark.parametrize("budget", [0.3, 0.6])
def test_a_region_with_a_foreign_op_is_sized_at_every_length(budget):
    torch.manual_seed(0)
    block = Block()
    fn = lambda t: gradaccel.checkpoint(block, t, budget=budget)  # noqa: E731
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="gradaccel")  # nothing traced per length, nothing strays
        for seed, T in enumerate(LENGTHS):
            check_length(fn, block, [torch.randn(2, T, 32, requires_grad=True)], budget, seed, block, exact=False)
    # Every other length planned from formulas, on each torch: the region holds a Linear without
    # bias on 3-d input, which torch 2.11's own matmul cannot run on symbolic sizes (backports.py).
    assert traces(block) == [1], (torch.__version__, plan_rows()[0]["lengths"])
    assert sum(s.sized for s in STATE.shapes[block].values()) == len(set(LENGTHS)) - 1
    # The op has no FLOP formula: priced by its time in the traced call, scaled at other sizes.
    priced = {r["made"]: r["priced_ops"] for r in plan_rows()}
    assert priced["traced"] == {"gradaccel_test.attention.default": "measured"}
    assert priced["sized"] == {"gradaccel_test.attention.default": "measured, scaled"}
    assert all(r["lengths"]["traced"] == 1 and r["lengths"]["not_sized"] == "" for r in plan_rows())


class Packed(nn.Parameter):
    """A Parameter subclass that adds only Python, as bitsandbytes' ``Params4bit`` (the frozen
    4-bit weight of a QLoRA layer, which its ``gemm_4bit`` reads)."""


def test_a_foreign_op_on_a_parameter_subclass_is_sized_at_every_length():
    """torch 2.11's fake tensors refuse such a weight: sized there through backports.py."""
    torch.manual_seed(0)
    block = Block(proj=linear)
    block.out.weight = Packed(block.out.weight.detach(), requires_grad=False)
    fn = lambda t: gradaccel.checkpoint(block, t, budget=0.5)  # noqa: E731
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="gradaccel")
        for seed, T in enumerate(LENGTHS):
            check_length(fn, block, [torch.randn(2, T, 32, requires_grad=True)], 0.5, seed, block, exact=False)
    assert traces(block) == [1], (torch.__version__, plan_rows()[0]["lengths"])


def test_an_op_without_a_fake_kernel_is_traced_per_length_and_named():
    torch.manual_seed(0)
    block = Block(inner=unfaked)
    fn = lambda t: gradaccel.checkpoint(block, t, budget=0.5)  # noqa: E731
    with pytest.warns(UserWarning, match="gradaccel_test::unfaked.*fake"):
        for seed, T in enumerate([24, 9, 40, 64, 3, 57]):
            check_length(fn, block, [torch.randn(2, T, 32, requires_grad=True)], 0.5, seed, block, exact=False)
    assert traces(block) == [6]  # correct, and not sized: each length traced
    assert "gradaccel_test::unfaked" in plan_rows()[0]["lengths"]["not_sized"]


def test_a_foreign_ops_own_aten_ops_are_autocast_as_without_gradaccel():
    """Under autocast, the op's F.linear computes in bf16 in a plain forward. Traced, planned
    and sized calls (and their replays) must do the same, bit for bit: the same kernels run."""
    torch.manual_seed(0)
    block = Block(proj=linear)
    fn = lambda t: gradaccel.checkpoint(block, t, budget=0.3)  # noqa: E731
    for seed, T in enumerate([24, 24, 9, 40, 9]):
        x = torch.randn(2, T, 32, requires_grad=True)
        results = []
        for f in (block, fn):
            torch.manual_seed(seed)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = f(x)
            grads = torch.autograd.grad(out.float().square().sum(), [x, *block.parameters()])
            results.append((out, *grads))
        for a, b in zip(*results, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert traces(block) == [1]


def test_the_flop_table_counts_a_4bit_gemm_and_flash_attention():
    A, q, k = torch.empty(2, 7, 64), torch.empty(2, 9, 8, 16), torch.empty(2, 11, 4, 16)
    assert FORMULAS["bitsandbytes.gemm_4bit"](A, None, [96, 64]) == 2 * 2 * 7 * 64 * 96
    assert FORMULAS["flash_attn._flash_attn_forward"](q, k, k) == 4 * 2 * 8 * 9 * 11 * 16
    torch.testing.assert_close(FORMULAS["flash_attn._flash_attn_backward"](q, q, k) / 2.5,
                               float(FORMULAS["flash_attn._flash_attn_forward"](q, k, k)))
