"""The accumulate ops' registration and argument checking: opcheck on every registered op,
the errors a user gets for bad input (from ``gradaccel.ops`` and from the raw ops), and the
Triton kernels compiled for a GPU on a machine without one. Numerics: tests/ops/test_accumulate.py.
"""

import os
import subprocess
import sys

import pytest
import torch

from gradaccel.ops import accumulate as ops  # the registered ops and their dispatch, private parts included
from gradaccel.ops import extension as _ext
from gradaccel.ops.triton import accumulate as kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rand(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


# --- registration -----------------------------------------------------------------------------

def _op(name):
    ops.scale_accumulate_(torch.zeros(1), torch.zeros(1), 1.0)  # loads the extension
    return getattr(torch.ops.gradaccel, name).default


def test_cpu_runs_the_cpp_kernel():
    for name in ("scale_accumulate_", "fold_", "finalize_", "_fold_plan"):
        _op(name)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gradaccel::{name}", "CPU") or \
            name == "_fold_plan"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gradaccel::{name}", "Meta")


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype):
    g = rand((33, 5), dtype, device, 90)
    torch.library.opcheck(_op("scale_accumulate_"), (rand((33, 5), torch.float32, device, 91), g, 0.5))
    torch.library.opcheck(_op("scale_accumulate_"), (rand((5, 33), torch.float32, device, 92), g.t(), 2.0))
    grads = [rand(17, dtype, device, 96), rand(4099, dtype, device, 97), rand((4, 3), dtype, device, 98).t()]
    offsets, total = [4, 24, 4124], 4140
    torch.library.opcheck(_op("fold_"), (rand(total, torch.float32, device, 93), grads, offsets, 0.5))
    torch.library.opcheck(_op("finalize_"), (rand(4099, torch.float32, device, 94),
                                             torch.tensor(0.5, device=device)))
    slots = _ext.load().fold_plan_capacity(total, len(grads), kernels.FOLD_BLOCK)
    plan = torch.zeros(slots, dtype=torch.int64)
    torch.library.opcheck(_op("_fold_plan"), (rand(total, torch.float32, device, 95), grads, offsets,
                                              kernels.FOLD_BLOCK, plan))


# --- validation -------------------------------------------------------------------------------

def test_scale_accumulate_rejects_bad_input(device):
    acc, grad = torch.zeros(4, device=device), torch.zeros(4, device=device)
    with pytest.raises(ValueError, match="acc must be float32"):
        ops.scale_accumulate_(acc.double(), grad, 1.0)
    with pytest.raises(ValueError, match="acc must be float32"):
        ops.scale_accumulate_(acc.half(), grad, 1.0)
    with pytest.raises(ValueError, match="shape"):
        ops.scale_accumulate_(acc, torch.zeros(5, device=device), 1.0)
    with pytest.raises(ValueError, match="int64"):
        ops.scale_accumulate_(acc, grad.long(), 1.0)
    with pytest.raises(ValueError, match="float64"):
        ops.scale_accumulate_(acc, grad.double(), 1.0)
    with pytest.raises(ValueError, match="meta"):
        ops.scale_accumulate_(acc, torch.zeros(4, device="meta"), 1.0)
    with pytest.raises(TypeError, match="grad"):
        ops.scale_accumulate_(acc, [0.0] * 4, 1.0)
    # The registered op raises the same errors: the checks are its own (C++), not gradaccel.ops'.
    if device == "cpu":
        with pytest.raises(ValueError, match="acc must be float32"):
            _op("scale_accumulate_")(acc.double(), grad, 1.0)
        with pytest.raises(ValueError, match="shape"):
            _op("scale_accumulate_")(acc, torch.zeros(5), 1.0)
        with pytest.raises(RuntimeError, match="overlapping|internal overlap|single memory location"):
            _op("scale_accumulate_")(torch.zeros(1).expand(4), grad, 1.0)
    with pytest.raises(ValueError, match="dense"):
        ops.scale_accumulate_(acc, grad.to_sparse(), 1.0)
    with pytest.raises(ValueError, match=r"grads\[1\] must be a dense"):
        ops.fold_(torch.zeros(8, device=device), [grad, grad.to_sparse()], [0, 4], 1.0)
    with pytest.raises(TypeError, match=r"grads\[0\]"):
        ops.fold_(torch.zeros(8, device=device), [[0.0] * 4], [0], 1.0)
    # A grad interleaved with acc, sharing no element: refused on both paths alike (conservative).
    inter = torch.zeros(8, device=device)
    for fn in (ops.scale_accumulate_, ops._scale_accumulate_triton):
        with pytest.raises(RuntimeError, match="partially overlaps"):
            fn(inter[0::2], inter[1::2], 1.0)
    # ... and so does the function registered as the CUDA kernel (run here on CPU tensors).
    with pytest.raises(RuntimeError, match="overlapping"):
        ops._scale_accumulate_triton(torch.zeros(1, device=device).expand(4), grad, 1.0)
    # grad a shifted view of acc's memory: both paths refuse; acc itself as grad is well defined.
    base = torch.arange(6.0, device=device)
    for fn in (ops.scale_accumulate_, ops._scale_accumulate_triton):
        with pytest.raises(RuntimeError, match="single memory location|partially overlaps"):
            fn(base[0:4], base[1:5], 1.0)
        assert torch.equal(base, torch.arange(6.0, device=device))
        if fn is ops.scale_accumulate_ or device != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
            same = torch.arange(4.0, device=device)  # launches the kernel (conftest: Triton on CPU)
            fn(same, same, 0.5)
            assert torch.equal(same, torch.arange(4.0, device=device) * 1.5)


def test_fold_rejects_bad_input(device):
    flat = torch.zeros(10, device=device)
    g = torch.ones(4, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="flat must be float32"):
        ops.fold_(flat.bfloat16(), [g], [0], 1.0)
    with pytest.raises(ValueError, match="1-D"):
        ops.fold_(flat.view(2, 5), [g], [0], 1.0)
    with pytest.raises(ValueError, match="2 offsets"):
        ops.fold_(flat, [g], [0, 4], 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        ops.fold_(flat, [g], [7], 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        ops.fold_(flat, [g], [-1], 1.0)
    with pytest.raises(ValueError, match="overlaps"):
        ops.fold_(flat, [g, g], [0, 3], 1.0)
    with pytest.raises(ValueError, match=r"grads\[1\].*int32"):
        ops.fold_(flat, [g, g.int()], [0, 4], 1.0)
    with pytest.raises(ValueError, match=r"grads\[0\] is on meta"):
        ops.fold_(flat, [g.to("meta")], [0], 1.0)
    assert torch.equal(flat, torch.zeros(10, device=device))
    # A grad living in flat: read while the fold writes (its own slice or another's).
    flat[:] = torch.arange(10.0)
    for grad_view, off in ((flat[0:4], 0), (flat[0:4], 2), (flat[3:9:2], 0)):
        with pytest.raises(RuntimeError, match="shares memory with flat"):
            ops.fold_(flat, [g, grad_view], [6, off], 1.0)
    assert torch.equal(flat, torch.arange(10.0, device=device))
    flat.zero_()
    if device == "cpu":
        with pytest.raises(ValueError, match="overlaps"):
            _op("fold_")(flat, [g, g], [0, 3], 1.0)
        with pytest.raises(ValueError, match="does not fit"):
            _op("fold_")(flat, [g], [8], 1.0)


def test_finalize_rejects_bad_input(device):
    flat = torch.zeros(10, device=device)
    with pytest.raises(ValueError, match="flat must be float32"):
        ops.finalize_(flat.double(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="contiguous"):
        ops.finalize_(flat.view(2, 5).t(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="0-d"):
        ops.finalize_(flat, torch.ones(1, device=device))
    with pytest.raises(ValueError, match="floating"):
        ops.finalize_(flat, torch.tensor(2, device=device))
    with pytest.raises(TypeError, match="scale"):
        ops.finalize_(flat, "2")
    if device == "cpu":
        with pytest.raises(ValueError, match="0-d"):
            _op("finalize_")(flat, torch.ones(2))


def test_missing_triton_says_how_to_fix():
    stand_in = ops._MissingTriton(ImportError("No module named 'triton'"))
    with pytest.raises(RuntimeError, match="pip install triton"):
        stand_in.fold


# --- compiled for a GPU, without one -----------------------------------------------------------

_COMPILE_SCRIPT = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gradaccel.ops.triton import accumulate as k

ALIGNED16 = [["tt.divisibility", 16]]
def compile_ptx(fn, sig, consts, aligned_args, arch):
    src = ASTSource(fn=fn, signature=sig, constexprs=consts,
                    attrs={(i,): ALIGNED16 for i in aligned_args})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 8}).asm["ptx"]

sa = {n: "i64" for n in k._scale_accumulate_kernel.arg_names}
sa.update(acc_ptr="*fp32", grad_ptr="*bf16", scale="fp32", CONTIGUOUS="constexpr", BLOCK="constexpr")
fold = dict(flat_ptr="*fp32", table_ptr="*i64", block_map_ptr="*i32", scale="fp32",
            ALIGNED="constexpr", BLOCK="constexpr")
fin = dict(flat_ptr="*fp32", scale_ptr="*fp32", sq_partial_ptr="*fp64", bad_partial_ptr="*i32",
           numel="i64", BLOCK="constexpr")
red = dict(sq_partial_ptr="*fp64", bad_partial_ptr="*i32", n="i64", sumsq_ptr="*fp32",
           bad_ptr="*i1", BLOCK="constexpr")
arch = int(sys.argv[1])
cases = {
    "scale_accumulate": (k._scale_accumulate_kernel, sa, {"CONTIGUOUS": True, "BLOCK": 4096}, (0, 1), True),
    "scale_accumulate_strided": (k._scale_accumulate_kernel, sa, {"CONTIGUOUS": False, "BLOCK": 4096}, (0, 1), False),
    "fold": (k._fold_kernel, fold, {"ALIGNED": True, "BLOCK": k.FOLD_BLOCK}, (0,), True),
    "fold_unaligned": (k._fold_kernel, fold, {"ALIGNED": False, "BLOCK": k.FOLD_BLOCK}, (0,), False),
    "finalize": (k._finalize_kernel, fin, {"BLOCK": 4096}, (0,), True),
    "finalize_reduce": (k._finalize_reduce_kernel, red, {"BLOCK": 1024}, (), False),
}
for name, (fn, sig, consts, aligned, want_vectors) in cases.items():
    ptx = compile_ptx(fn, sig, consts, aligned, arch)
    vectors = len(re.findall(r"ld\.global\.v4", ptx))
    assert not want_vectors or vectors > 0, f"{name}: no 16-byte vector loads for sm_{arch}"
    print(name, vectors)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests above run the compiled kernels")
@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_gpu(arch):
    """Compiles every kernel to PTX for sm_80/sm_90 with Triton's own ptxas (no GPU needed), and
    checks that full blocks use 16-byte vector loads: a kernel that only runs interpreted here
    could otherwise fail to compile, or lose its bandwidth, unnoticed."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(arch)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_cuda_kernels_check_their_arguments(device):
    """The functions registered as the ops' CUDA kernels (reachable through torch.ops without
    gradaccel.ops' own checks) refuse bad input too; run here on the test's device."""
    acc = torch.zeros(4, device=device)
    with pytest.raises(ValueError, match="shape"):
        ops._scale_accumulate_triton(acc, torch.zeros(5, device=device), 1.0)
    with pytest.raises(ValueError, match="int64"):
        ops._scale_accumulate_triton(acc, torch.zeros(4, dtype=torch.int64, device=device), 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        ops._finalize_triton(torch.zeros(4, 4, device=device).t(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="0-d"):
        ops._finalize_triton(acc, torch.ones(2, device=device))
    with pytest.raises(ValueError, match="overlaps"):
        ops._fold_triton(torch.zeros(8, device=device), [acc, acc], [0, 2], 1.0)
    assert torch.equal(acc, torch.zeros(4, device=device))


# --- packaging --------------------------------------------------------------------------------

def test_triton_kernels_install_under_gradaccel_not_top_level(tmp_path):
    # Triton ships a distribution named `triton_kernels`: ours installs as gradaccel.ops.triton,
    # so neither shadows the other. Run outside the repository, where its folder is not on the path.
    code = ("import importlib.util, gradaccel.ops.triton.accumulate as k\n"
            "spec = importlib.util.find_spec('triton_kernels')\n"
            "print(k.__name__); print(spec.origin if spec else None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    name, origin = out.stdout.split()
    assert name == "gradaccel.ops.triton.accumulate"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert origin == "None" or not origin.startswith(repo), origin
