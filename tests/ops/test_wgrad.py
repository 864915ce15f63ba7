"""The weight-gradient ops against a float64 PyTorch reference, on every path.

``wgrad_accumulate_(acc, x, dy, s)`` is ``acc + s * dyᵀ @ x``; ``embedding_accumulate_(acc, ids,
dy, s)`` is ``acc.index_add_(0, ids, s * dy)``. ``path="ops"`` is the public function (C++ on CPU),
``"triton"`` the Triton launcher (on CPU through the interpreter), ``"kernel"`` the function
registered as the CUDA kernel (its C++ checks, then the launch). Bit-exact only where the same
kernel runs: the CPU fp32 op is ``acc.addmm_`` itself. And ``fused_linear`` (the C++ autograd
function that fuse_wgrad routes ``nn.Linear`` through) against stock ``F.linear``.
"""

import os
import subprocess
import sys

import pytest
import torch

from gradaccel.ops import wgrad as ops
from gradaccel.ops.triton import wgrad as kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PATHS = ["ops", "triton", "kernel"]
EPS32 = 2.0**-24


def rand(shape, dtype, device, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def wgrad(path, acc, x, dy, scale):
    if path == "triton":
        kernels.wgrad_accumulate(acc, x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]), scale)
    elif path == "kernel":
        ops._wgrad_accumulate_triton(acc, x, dy, scale)
    else:
        assert ops.wgrad_accumulate_(acc, x, dy, scale) is acc


def embedding(path, acc, ids, dy, scale, padding_idx=None):
    pad = -1 if padding_idx is None else padding_idx
    if path == "triton":
        kernels.embedding_accumulate(acc, ids.reshape(-1).long(), dy.reshape(-1, dy.shape[-1]), scale, pad)
    elif path == "kernel":
        ops._embedding_accumulate_triton(acc, ids, dy, scale, pad)
    else:
        assert ops.embedding_accumulate_(acc, ids, dy, scale, padding_idx) is acc


def assert_wgrad(out, acc0, x, dy, scale):
    """Within fp32 GEMM accuracy of the fp64 result: K roundings of the product's magnitude."""
    x2, dy2 = x.double().reshape(-1, x.shape[-1]), dy.double().reshape(-1, dy.shape[-1])
    ref = acc0.double() + scale * (dy2.t() @ x2)
    k = x2.shape[0]
    bound = EPS32 * ((k + 4) * abs(scale) * (dy2.abs().t() @ x2.abs()) + 2 * acc0.double().abs() + ref.abs())
    err = (out.double() - ref).abs()
    assert out.dtype == torch.float32 and out.shape == acc0.shape
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


# (leading dims, in, out): a single token, odd sizes, 3-D activations, more tokens than a block
SHAPES = [((1,), 1, 1), ((17,), 5, 33), ((2, 3), 19, 7), ((3, 37), 16, 16), ((129,), 33, 17)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,n_in,n_out", SHAPES)
def test_wgrad_matches_fp64(device, path, dtype, lead, n_in, n_out):
    x = rand((*lead, n_in), dtype, device, 1)
    dy = rand((*lead, n_out), dtype, device, 2)
    acc = rand((n_out, n_in), torch.float32, device, 3)
    acc0 = acc.clone()
    wgrad(path, acc, x, dy, 0.75)
    assert_wgrad(acc, acc0, x, dy, 0.75)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_wgrad_non_contiguous(device, path, dtype):
    # x a transposed view, dy a strided slice, acc a transposed slice of a bigger buffer
    x = rand((2, 21, 30), dtype, device, 4).transpose(1, 2)     # (2, 30, 21): 60 tokens of 21
    dy = rand((2, 30, 26), dtype, device, 5)[..., ::2]          # (2, 30, 13)
    big = rand((21, 40), torch.float32, device, 6)
    acc = big[:, 3:16].t()                                      # (13, 21), column-major
    acc0, big0 = acc.clone(), big.clone()
    wgrad(path, acc, x, dy, -2.0)
    assert_wgrad(acc, acc0, x, dy, -2.0)
    untouched = torch.ones_like(big, dtype=torch.bool)
    untouched[:, 3:16] = False
    assert torch.equal(big[untouched], big0[untouched])


@pytest.mark.parametrize("scale", [0.0, 1.0, 1e-8, 1e8])
def test_wgrad_scales(device, scale):
    x, dy = rand((9, 23), torch.bfloat16, device, 7), rand((9, 18), torch.bfloat16, device, 8)
    acc = rand((18, 23), torch.float32, device, 9)
    acc0 = acc.clone()
    ops.wgrad_accumulate_(acc, x, dy, scale)
    assert_wgrad(acc, acc0, x, dy, scale)


def test_wgrad_fp32_is_addmm_bit_for_bit():
    """On CPU the fp32 op is ``acc.addmm_(dyᵀ, x)``: the same kernel, so the same bits."""
    x, dy = rand((4, 33, 65), torch.float32, "cpu", 10), rand((4, 33, 31), torch.float32, "cpu", 11)
    acc = rand((31, 65), torch.float32, "cpu", 12)
    ref = acc.clone().addmm_(dy.reshape(-1, 31).t(), x.reshape(-1, 65))
    ops.wgrad_accumulate_(acc, x, dy)
    assert torch.equal(acc, ref)


def test_wgrad_low_precision_blocks_make_no_weight_sized_temporary():
    """The bf16 CPU path widens token blocks, each far smaller than the weight's gradient."""
    from gradaccel.memory import LiveBytes
    n_in, n_out, tokens = 512, 384, 4096
    x, dy = rand((tokens, n_in), torch.bfloat16, "cpu", 13), rand((tokens, n_out), torch.bfloat16, "cpu", 14)
    acc = torch.zeros(n_out, n_in)
    with LiveBytes() as live:
        ops.wgrad_accumulate_(acc, x, dy)
    assert live.peak <= n_in * n_out * 2 // 2, live.peak  # under half of one bf16 gradient
    assert_wgrad(acc, torch.zeros_like(acc), x, dy, 1.0)


# --- embedding ----------------------------------------------------------------------------------

def embedding_ref(acc0, ids, dy, scale, padding_idx=None):
    d = dy.double().reshape(-1, dy.shape[-1]) * scale
    flat = ids.reshape(-1).long()
    if padding_idx is not None:
        d[flat == padding_idx] = 0
    return acc0.double().index_add_(0, flat, d)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,dim,lead", [(1, 1, (1,)), (7, 33, (3, 5)), (50, 130, (64,)), (3, 17, (40,))])
def test_embedding_matches_fp64(device, path, dtype, vocab, dim, lead):
    gen = torch.Generator().manual_seed(20)
    ids = torch.randint(0, vocab, lead, generator=gen).to(device)  # many repeats when lead > vocab
    dy = rand((*lead, dim), dtype, device, 21)
    acc = rand((vocab, dim), torch.float32, device, 22)
    acc0 = acc.clone()
    embedding(path, acc, ids, dy, 0.5)
    ref = embedding_ref(acc0, ids, dy, 0.5)
    count = torch.bincount(ids.reshape(-1).cpu(), minlength=vocab).double().to(device).unsqueeze(1)
    bound = EPS32 * (count + 2) * (ref.abs() + acc0.double().abs() + 0.5 * 4)  # |dy| < ~4.5 sigma
    assert bool(((acc.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("path", PATHS)
def test_embedding_padding_idx_int32_and_strided_dy(device, path):
    ids = torch.tensor([[2, 0, 2], [1, 2, 0]], dtype=torch.int32, device=device)
    dy = rand((2, 3, 10), torch.bfloat16, device, 23)[..., ::2]
    acc = rand((4, 5), torch.float32, device, 24)
    acc0 = acc.clone()
    embedding(path, acc, ids, dy, 1.0, padding_idx=0)
    ref = embedding_ref(acc0, ids, dy, 1.0, padding_idx=0)
    assert torch.equal(acc[0], acc0[0]) and torch.equal(acc[3], acc0[3])
    torch.testing.assert_close(acc.double(), ref, rtol=1e-6, atol=1e-6)


def test_embedding_same_order_as_serial_adds():
    """Repeats are added one token at a time in token order: bit-equal to that loop in fp32."""
    ids = torch.tensor([3, 1, 3, 3, 0, 1])
    dy = rand((6, 70), torch.float32, "cpu", 25)
    acc = rand((5, 70), torch.float32, "cpu", 26)
    ref = acc.clone()
    for t in range(6):
        ref[ids[t]] += dy[t] * 0.25
    ops.embedding_accumulate_(acc, ids, dy, 0.25)
    assert torch.equal(acc, ref)


def test_embedding_out_of_range_ids_raise():
    with pytest.raises(IndexError, match="out of range"):
        ops.embedding_accumulate_(torch.zeros(3, 2), torch.tensor([0, 3]), torch.zeros(2, 2))


# --- registration and refusals ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype):
    ops.wgrad_accumulate_(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1))  # loads the ops
    lib = torch.ops.gradaccel
    torch.library.opcheck(lib.wgrad_accumulate_.default,
                          (rand((7, 5), torch.float32, device, 30), rand((2, 3, 5), dtype, device, 31),
                           rand((2, 3, 7), dtype, device, 32), 0.5))
    torch.library.opcheck(lib.wgrad_accumulate_.default,
                          (rand((5, 7), torch.float32, device, 33).t(), rand((5, 11), dtype, device, 34).t(),
                           rand((7, 11), dtype, device, 35).t(), 2.0))
    torch.library.opcheck(lib.embedding_accumulate_.default,
                          (rand((6, 4), torch.float32, device, 36), torch.tensor([[1, 5, 1]], device=device),
                           rand((1, 3, 4), dtype, device, 37), 0.5, 5))


def test_wgrad_refusals_name_the_argument(device):
    acc, x, dy = torch.zeros(3, 4, device=device), torch.zeros(5, 4, device=device), torch.zeros(5, 3, device=device)
    with pytest.raises(ValueError, match="acc must be float32"):
        ops.wgrad_accumulate_(acc.double(), x, dy)
    with pytest.raises(ValueError, match="x is torch.bfloat16 but dy is torch.float32"):
        ops.wgrad_accumulate_(acc, x.bfloat16(), dy)
    with pytest.raises(ValueError, match="x must be float32"):
        ops.wgrad_accumulate_(acc, x.long(), dy.long())
    with pytest.raises(ValueError, match="leading dims"):
        ops.wgrad_accumulate_(acc, x, torch.zeros(6, 3, device=device))
    with pytest.raises(ValueError, match="acc has shape"):
        ops.wgrad_accumulate_(acc.t().contiguous(), x, dy)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        ops.wgrad_accumulate_(acc, 1.0, dy)
    buf = torch.zeros(5, 4, device=device)
    with pytest.raises(RuntimeError, match="overlap"):
        ops.wgrad_accumulate_(buf[:4, :4].t()[:3], buf, torch.zeros(5, 3, device=device))


def test_embedding_refusals_name_the_argument(device):
    acc = torch.zeros(4, 3, device=device)
    ids = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match="ids must be int64 or int32"):
        ops.embedding_accumulate_(acc, ids.float(), torch.zeros(2, 3, device=device))
    with pytest.raises(ValueError, match="dy must have shape"):
        ops.embedding_accumulate_(acc, ids, torch.zeros(2, 4, device=device))
    with pytest.raises(ValueError, match="acc must be float32"):
        ops.embedding_accumulate_(acc.half(), ids, torch.zeros(2, 3, device=device))


# --- fused_linear: F.linear whose weight gradient goes onto a buffer -----------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(7,), (2, 5)])
def test_fused_linear_is_f_linear_and_adds_the_weight_gradient(device, dtype, bias, lead):
    """Output, input and bias gradients as stock F.linear's (bit-equal on CPU, where the same
    kernels run); the weight gets none, and dyᵀ·x is added onto acc_of() at fp32 GEMM accuracy."""
    x = rand(lead + (6,), dtype, device, 40).requires_grad_()
    w = rand((4, 6), dtype, device, 41).requires_grad_()
    b = rand((4,), dtype, device, 42).requires_grad_() if bias else None
    g = rand(lead + (4,), dtype, device, 43)
    acc0 = rand((4, 6), torch.float32, device, 44)
    acc, calls = acc0.clone(), []
    y = ops.fused_linear(x, w, b, lambda: calls.append(1) or acc)
    y.backward(g)
    ref_x, ref_b = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_() if bias else None
    ref = torch.nn.functional.linear(ref_x, w.detach(), ref_b)
    ref.backward(g)
    same = torch.equal if device == "cpu" else (lambda a, b: torch.allclose(a, b, rtol=1e-2, atol=1e-5))
    assert same(y, ref) and same(x.grad, ref_x.grad)
    assert w.grad is None and (not bias or same(b.grad, ref_b.grad))
    assert calls == [1]
    assert_wgrad(acc, acc0, x.detach(), g, 1.0)


def test_fused_linear_only_what_is_needed():
    """No input gradient for an input without one; no buffer asked for a frozen weight."""
    x, w = torch.randn(3, 5), torch.randn(2, 5, requires_grad=True)
    acc, calls = torch.zeros(2, 5), []
    ops.fused_linear(x, w, None, lambda: calls.append(1) or acc).sum().backward()
    assert calls == [1] and acc.abs().sum() > 0
    x.requires_grad_()
    ops.fused_linear(x, w.detach(), None, lambda: calls.append(1) or acc).sum().backward()
    assert calls == [1] and x.grad is not None


def test_fused_linear_autocast_multiplies_the_cast_input():
    """Under autocast the input is saved as autocast casts it (bf16), as stock linear saves it:
    the added gradient is dyᵀ·x of the bf16 values."""
    x, w = torch.randn(3, 5, requires_grad=True), torch.randn(2, 5, requires_grad=True)
    acc = torch.zeros(2, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ops.fused_linear(x, w, None, lambda: acc)
    assert y.dtype == torch.bfloat16
    g = torch.randn(3, 2).bfloat16()
    y.backward(g)
    assert x.grad.dtype == torch.float32
    assert_wgrad(acc, torch.zeros(2, 5), x.detach().bfloat16(), g, 1.0)


def test_fused_linear_callable_errors_and_lifetime():
    """An error in the callable reaches backward's caller as itself, and so does a result that is
    not a tensor; the callable lives as long as the graph does."""
    import gc
    import weakref

    x, w = torch.randn(3, 5), torch.randn(2, 5, requires_grad=True)

    def boom():
        raise KeyError("from the sink")
    with pytest.raises(KeyError, match="from the sink"):
        ops.fused_linear(x, w, None, boom).sum().backward()
    with pytest.raises(Exception, match="(?i)cast"):
        ops.fused_linear(x, w, None, lambda: None).sum().backward()

    class AccOf:
        def __call__(self):
            return torch.zeros(2, 5)
    acc_of = AccOf()
    ref = weakref.ref(acc_of)
    y = ops.fused_linear(x, w, None, acc_of)
    del acc_of
    gc.collect()
    assert ref() is not None
    del y
    gc.collect()
    assert ref() is None
    with pytest.raises(TypeError, match="acc_of must be callable"):
        ops.fused_linear(x, w, None, 3)


# --- compiled for a GPU, without one ------------------------------------------------------------

_COMPILE_SCRIPT = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gradaccel.ops.triton import wgrad as k

arch = int(sys.argv[1])
ALIGNED16 = [["tt.divisibility", 16]]
def compile_ptx(fn, sig, consts, aligned_args, warps, stages):
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs={(i,): ALIGNED16 for i in aligned_args})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages}).asm["ptx"]

for dt, tdt in (("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32")):
    import torch
    torch_dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
    cfg = k.wgrad_config(4096, 4096, torch_dt, interpret=False)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    sig = {n: "i32" for n in k._wgrad_accumulate_kernel.arg_names}
    sig.update(acc_ptr="*fp32", x_ptr=f"*{tdt}", dy_ptr=f"*{tdt}", scale="fp32")
    consts = dict(cfg, EVEN_K=True, IEEE=dt == "fp32", WIDEN=False)
    for c in consts: sig[c] = "constexpr"
    ptx = compile_ptx(k._wgrad_accumulate_kernel, sig, consts, (0, 1, 2), warps, stages)
    mma = len(re.findall(r"wgmma|mma\.sync", ptx))
    assert dt == "fp32" or mma > 0, f"wgrad {dt}: no tensor-core instructions for sm_{arch}"
    print("wgrad", dt, mma)
sig = {n: "i64" for n in k._embedding_accumulate_kernel.arg_names}
sig.update(acc_ptr="*fp32", dy_ptr="*bf16", sorted_ptr="*i64", order_ptr="*i64", end_ptr="*i64", scale="fp32", BLOCK_D="constexpr")
compile_ptx(k._embedding_accumulate_kernel, sig, {"BLOCK_D": 1024}, (0, 1), 4, 3)
print("embedding ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests above run the compiled kernels")
@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_gpu(arch):
    """Compiles the wgrad GEMM (bf16, fp16, fp32) at the tile sizes a GPU gets, and the embedding
    kernel, to PTX for sm_80/sm_90 (no GPU needed), and checks that bf16/fp16 use tensor cores
    (mma.sync / wgmma): kernels that only run interpreted here could otherwise break unnoticed."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(arch)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
