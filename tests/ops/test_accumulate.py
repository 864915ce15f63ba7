"""The accumulate ops against a float64 PyTorch reference, on both paths.

``path="ops"`` is the public ``gradaccel.ops`` function: the C++ kernel on CPU, Triton on CUDA.
``path="triton"`` calls the Triton launchers directly: on CPU through ``TRITON_INTERPRET=1``
(set by conftest), on CUDA compiled (the fold's launcher gets its plan from the C++ extension).
``path="kernel"`` calls the functions that gradaccel registers as the ops' CUDA kernels (their C++
checks + Triton launch), on whatever device. So every device runs both the Triton and the
native path.

Bit-exactness: on CPU both paths compute ``acc + float(g) * s`` with two fp32 roundings, as
PyTorch does, so they must match PyTorch's fp32 result bit for bit. On CUDA, Triton may contract
the two into one FMA (one rounding), so there the check is the fp64 bound below, which is at
most one fp32 ulp of the operands' magnitude.
"""

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradaccel.ops import accumulate as ops  # the registered ops and their dispatch, private parts included
from gradaccel.ops import extension as _ext
from gradaccel.ops.triton import accumulate as kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 2 * 4096 - 1: the last block of the largest kernel block is one element short.
SIZES = [0, 1, 17, 4099, 2 * 4096 - 1, 2**16 + 3]
SCALES = [0.0, 1.0, 1e-8, 1e8]
PATHS = ["ops", "triton", "kernel"]
ULP = 2.0**-23


def paths_on(device):
    """The paths that can run on ``device`` here (conftest: Triton on CPU needs its interpreter)."""
    return PATHS if device != "cpu" or os.environ.get("TRITON_INTERPRET") == "1" else ["ops"]


def f32(x: float) -> float:
    """The scale as the kernels apply it."""
    return torch.tensor(x, dtype=torch.float32).item()


def rand(shape, dtype, device, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def rand_guarded(n, dtype, device, seed, scale=1.0):
    """A contiguous 1-D tensor of ``n`` elements followed in memory by 16 non-zero ones: a kernel
    that reads past the end picks up a value, and one that writes past it changes the guard."""
    base = rand(n + 16, dtype, device, seed, scale)
    base[n:] = 3.0
    return base[:n], base[n:]


def scale_accumulate(path, acc, grad, scale):
    if path == "kernel":
        ops._scale_accumulate_triton(acc, grad, scale)
        return acc
    if path == "triton":
        kernels.scale_accumulate(acc, grad, scale)
        return acc
    return ops.scale_accumulate_(acc, grad, scale)


def fold(path, flat, grads, offsets, scale):
    if path == "kernel":
        ops._fold_triton(flat, grads, offsets, scale)
        return flat
    if path == "triton":
        kernels.fold(flat, grads, offsets, scale)
        return flat
    return ops.fold_(flat, grads, offsets, scale)


def finalize(path, flat, scale):
    if path == "kernel":
        return ops._finalize_triton(flat, scale)
    if path == "triton":
        return kernels.finalize(flat, scale)
    return ops.finalize_(flat, scale)


def assert_accumulated(out, acc0, grad, scale):
    """``out`` is ``acc0 + grad * scale``: exact on CPU, within 1 ulp of the magnitudes anywhere."""
    s = f32(scale)
    prod = grad.double() * s
    ref = acc0.double() + prod
    err = (out.double() - ref).abs()
    bound = ULP * (acc0.double().abs() + prod.abs())
    assert out.dtype == torch.float32 and out.shape == acc0.shape
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    if out.device.type == "cpu" or scale in (0.0, 1.0):
        assert torch.equal(out, acc0 + grad.float() * s)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_scale_accumulate_sizes(device, path, dtype, n):
    acc, guard = rand_guarded(n, torch.float32, device, 1)
    grad, _ = rand_guarded(n, dtype, device, 2)
    acc0 = acc.clone()
    assert scale_accumulate(path, acc, grad, 0.75) is acc
    assert_accumulated(acc, acc0, grad, 0.75)
    assert bool((guard == 3.0).all())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES)
def test_scale_accumulate_scales(device, path, dtype, scale):
    acc = rand(4099, torch.float32, device, 3, scale=1e3)
    grad = rand(4099, dtype, device, 4)
    acc0 = acc.clone()
    scale_accumulate(path, acc, grad, scale)
    assert_accumulated(acc, acc0, grad, scale)


def _non_contiguous(device, dtype):
    """(acc, grad) pairs where one or both are not contiguous, incl. > 4 dims and stride 0."""
    base = rand((6, 5, 4), dtype, device, 5)
    yield rand((4, 5, 6), torch.float32, device, 6), base.permute(2, 1, 0)
    yield rand((6, 5, 2), torch.float32, device, 7), base[:, :, ::2]
    yield rand((6, 5, 4), torch.float32, device, 8).transpose(0, 2).contiguous().transpose(0, 2), base
    yield rand((3, 7), torch.float32, device, 9), rand((1, 7), dtype, device, 10).expand(3, 7)
    # Six dims whose strides cannot be collapsed to four: the launcher's fallback.
    g6 = rand((2, 3, 2, 3, 2, 3), dtype, device, 11).permute(5, 3, 1, 4, 2, 0)
    yield rand((3, 3, 3, 2, 2, 2), torch.float32, device, 12), g6
    a6 = rand((2, 3, 2, 3, 2, 3), torch.float32, device, 13).permute(5, 3, 1, 4, 2, 0)
    yield a6, rand((3, 3, 3, 2, 2, 2), dtype, device, 14)
    yield rand((9, 4), torch.float32, device, 15)[::3], rand((3, 8), dtype, device, 16)[:, 1::2]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_accumulate_non_contiguous(device, path, dtype):
    for acc, grad in _non_contiguous(device, dtype):
        acc0 = acc.clone()
        strides = acc.stride()
        scale_accumulate(path, acc, grad, 1.5)
        assert acc.stride() == strides
        assert_accumulated(acc, acc0, grad, 1.5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
       data=st.data(), dtype=st.sampled_from(DTYPES))
def test_scale_accumulate_random_strides(device, shape, data, dtype):
    path = data.draw(st.sampled_from(paths_on(device)))
    perm = data.draw(st.permutations(range(len(shape))))
    steps = data.draw(st.lists(st.integers(1, 3), min_size=len(shape), max_size=len(shape)))
    big = [s * k for s, k in zip(shape, steps)]
    grad = rand(big, dtype, device, 17)[tuple(slice(None, None, k) for k in steps)]
    grad = grad.permute(perm)
    acc = rand(grad.shape, torch.float32, device, 18)
    if acc.dim() >= 2 and data.draw(st.booleans()):
        # acc non-contiguous too: same shape, its first and last dims swapped in memory.
        acc = acc.transpose(0, -1).contiguous().transpose(0, -1)
    acc0 = acc.clone()
    scale_accumulate(path, acc, grad, -0.3)
    assert_accumulated(acc, acc0, grad, -0.3)


def _layout(device, sizes_dtypes, gap, seed=20, align=1):
    """Random grads (each followed in memory by a guard, see rand_guarded) and their offsets:
    ``gap`` elements apart, each rounded up to ``align``."""
    grads, offsets, off = [], [], gap
    for i, (shape, dtype) in enumerate(sizes_dtypes):
        shape = (shape,) if isinstance(shape, int) else shape
        g = rand_guarded(math.prod(shape), dtype, device, seed + i)[0].view(shape)
        off = -(-off // align) * align
        grads.append(g)
        offsets.append(off)
        off += g.numel() + gap
    return grads, offsets, off


MIXED = [(17, torch.bfloat16), (1, torch.bfloat16), (0, torch.bfloat16), (4099, torch.bfloat16),
         (2**16 + 3, torch.bfloat16), ((33, 7), torch.bfloat16), (4099, torch.float16),
         (5, torch.float32), (300, torch.float32),
         # One short of two full blocks: the last block is partial by one element.
         (2 * 4096 - 1, torch.bfloat16)]


@pytest.mark.parametrize("path", PATHS)
# (gap, align): packed; with gaps (misaligned slices); every slice 16-byte aligned (the
# kernel's vectorised path on CUDA).
@pytest.mark.parametrize("gap,align", [(0, 1), (3, 1), (3, 4)])
@pytest.mark.parametrize("scale", SCALES)
def test_fold_mixed_list(device, path, gap, align, scale):
    grads, offsets, total = _layout(device, MIXED, gap, align=align)
    grads[5] = grads[5].t()  # a non-contiguous member
    flat, guard = rand_guarded(total, torch.float32, device, 30, scale=10.0)
    flat0 = flat.clone()
    assert fold(path, flat, grads, offsets, scale) is flat
    touched = torch.zeros(total, dtype=torch.bool, device=device)
    for g, off in zip(grads, offsets):
        sl = slice(off, off + g.numel())
        assert_accumulated(flat[sl], flat0[sl], g.reshape(-1), scale)
        touched[sl] = True
    assert torch.equal(flat[~touched], flat0[~touched])  # gaps untouched
    assert bool((guard == 3.0).all())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fold_same_layout_new_grads(device, path, dtype):
    """The layout is cached; the grads' addresses are not and must be read afresh each call."""
    sizes = [(4099, dtype), (17, dtype), (1, dtype), (5000, dtype)]
    flat = torch.zeros(_layout(device, sizes, 4)[2], device=device)
    ref = flat.double()
    for seed in (40, 50, 60):
        grads, offsets, _ = _layout(device, sizes, 4, seed=seed)
        fold(path, flat, grads, offsets, 0.5)
        for g, off in zip(grads, offsets):
            ref[off:off + g.numel()] += g.double() * 0.5
    assert (flat.double() - ref).abs().max().item() <= 3 * ULP * ref.abs().max().item()


@pytest.mark.parametrize("path", PATHS)
def test_fold_empty_and_single(device, path):
    flat = rand(100, torch.float32, device, 70)
    flat0 = flat.clone()
    fold(path, flat, [], [], 2.0)
    assert torch.equal(flat, flat0)
    g = rand((10, 3), torch.bfloat16, device, 71)
    fold(path, flat, [g], [50], 2.0)
    assert_accumulated(flat[50:80], flat0[50:80], g.reshape(-1), 2.0)
    assert torch.equal(flat[:50], flat0[:50]) and torch.equal(flat[80:], flat0[80:])


def test_fold_plan_reads_back_through_the_layout(device):
    """A plan written by the C++ builder, read through the layout the extension exposes (the one
    the Triton launcher and kernel use), describes each grad: every header slot, row column and
    dtype code lands where the layout says."""
    grads, offsets, total = _layout(device, MIXED, 4, align=4)
    grads[5] = grads[5].t()
    flat = torch.zeros(total, device=device)
    layout = _ext.load().fold_plan_layout()
    head, col, codes = layout["header"], layout["row"], layout["dtype"]
    slots = _ext.load().fold_plan_capacity(total, len(grads), kernels.FOLD_BLOCK)
    plan_op = torch.ops.gradaccel._fold_plan.default

    def plan_of(offs):
        plan = torch.full((slots,), -1, dtype=torch.int64)
        plan_op(flat, grads, offs, kernels.FOLD_BLOCK, plan)
        return plan, {name: plan[slot].item() for name, slot in head.items() if name != "length"}

    plan, h = plan_of(offsets)
    rows = [i for i, g in enumerate(grads) if g.numel() and g.is_contiguous()]
    assert h["rows"] == len(rows) and h["strided"] == 1 and h["aligned"] == 1
    assert plan[head["length"]:h["table_start"]].tolist() == [5]  # the strided grad's index
    assert h["end"] <= slots
    table = plan[h["table_start"]:h["map_start"]].view(-1, col["width"])
    block_map = plan[h["map_start"]:h["end"]].view(torch.int32)[:h["blocks"]].tolist()
    dtypes = {code: getattr(torch, name) for name, code in codes.items()}
    first = 0
    for r, i in enumerate(rows):
        g, row = grads[i], table[r].tolist()
        assert row[col["address"]] == g.data_ptr() and row[col["numel"]] == g.numel()
        assert row[col["offset"]] == offsets[i] and row[col["first_block"]] == first
        assert dtypes[row[col["dtype"]]] == g.dtype
        n_blocks = -(-g.numel() // kernels.FOLD_BLOCK)
        assert block_map[first:first + n_blocks] == [r] * n_blocks
        first += n_blocks
    assert h["blocks"] == first == len(block_map)
    assert plan_of([o + 1 for o in offsets])[1]["aligned"] == 0
    with pytest.raises(RuntimeError, match="slots"):
        plan_op(flat, grads, offsets, kernels.FOLD_BLOCK, torch.empty(10, dtype=torch.int64))


# A grad: (numel, dtype, contiguous?). Sizes around the fold's block of 4096 elements.
_GRAD = st.tuples(st.sampled_from([0, 1, 5, 4095, 4096, 4097, 9000]), st.sampled_from(DTYPES), st.booleans())


@pytest.mark.triton
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.lists(_GRAD, min_size=1, max_size=6), gap=st.sampled_from([0, 1, 4]), data=st.data())
def test_fold_triton_matches_cpp(device, spec, gap, data):
    """The Triton fold (C++ plan, Python launcher, kernel reading each row through the layout)
    gives the C++ fold's result on lists of mixed dtypes, sizes and strides."""
    grads, offsets, off = [], [], gap
    for i, (n, dtype, contiguous) in enumerate(spec):
        g = rand((n, 2) if contiguous else (2, n), dtype, device, 100 + i)
        grads.append(g if contiguous else g.t())
        offsets.append(off)
        off += 2 * n + gap
    order = data.draw(st.permutations(range(len(grads))))  # slices need not follow list order
    grads, offsets = [grads[i] for i in order], [offsets[i] for i in order]
    flat0 = rand(off, torch.float32, device, 99, scale=10.0)
    out = flat0.clone()
    kernels.fold(out, grads, offsets, 0.3)
    ref = flat0.cpu()
    ops.fold_(ref, [g.cpu() for g in grads], offsets, 0.3)
    if device == "cpu":
        # Both compute fl(fl(acc) + fl(float(g) * s)) with two IEEE fp32 roundings and no FMA
        # (the interpreter in numpy, the C++ without contraction): equal bit for bit.
        assert torch.equal(out, ref)
    else:
        # Compiled Triton may contract into one FMA (one rounding): within an ulp of the operands.
        prod = torch.zeros(off, dtype=torch.float64)
        for g, o in zip(grads, offsets):
            prod[o:o + g.numel()] = g.reshape(-1).cpu().double() * f32(0.3)
        bound = 2 * ULP * (flat0.cpu().double().abs() + prod.abs())
        assert bool(((out.cpu().double() - ref.double()).abs() <= bound).all())


def _finalize_reference(flat0, scale):
    out = flat0 * f32(scale)
    return out, out.double().square().sum()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", SCALES)
def test_finalize(device, path, n, scale):
    flat, guard = rand_guarded(n, torch.float32, device, 80, scale=1e3)
    flat0 = flat.clone()
    sumsq, nonfinite = finalize(path, flat, torch.tensor(scale, device=device))
    out, ref = _finalize_reference(flat0, scale)
    assert torch.equal(flat, out)  # one fp32 multiply: exact on every device
    assert sumsq.shape == () and sumsq.dtype == torch.float64 and sumsq.device == flat.device
    assert nonfinite.shape == () and nonfinite.dtype == torch.bool and not nonfinite.item()
    assert sumsq.item() == pytest.approx(ref.item(), rel=2 * ULP, abs=1e-38)
    assert bool((guard == 3.0).all())


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # numpy, in the interpreter
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [0, 4098, 2**16 + 2])
def test_finalize_flags_non_finite(device, path, bad, where):
    flat = rand(2**16 + 3, torch.float32, device, 81)
    flat[where] = bad
    flat0 = flat.clone()
    sumsq, nonfinite = finalize(path, flat, torch.tensor(0.5, device=device))
    assert nonfinite.item()
    assert not torch.isfinite(sumsq).item()
    assert torch.equal(flat.isnan(), flat0.isnan())


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # numpy, in the interpreter
@pytest.mark.parametrize("path", PATHS)
def test_finalize_flags_overflow_from_scale(device, path):
    """Finite inputs whose scaled value overflows fp32 are non-finite results."""
    flat = torch.ones(4099, device=device)
    flat[17] = 1e30
    _, nonfinite = finalize(path, flat, torch.tensor(1e10, device=device))
    assert nonfinite.item()
    # An infinite scale makes every value inf: the sum of squares is inf, not NaN.
    sumsq, nonfinite = finalize(path, torch.ones(17, device=device), torch.tensor(float("inf"), device=device))
    assert nonfinite.item() and sumsq.item() == float("inf")
    # ... and an infinite scale on an all-zero buffer gives 0 * inf = NaN.
    _, nonfinite = finalize(path, torch.zeros(100, device=device), torch.tensor(float("inf"), device=device))
    assert nonfinite.item()


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # numpy, in the interpreter
@pytest.mark.parametrize("path", PATHS)
def test_finalize_large_finite_is_not_flagged(device, path):
    """|x| = 1e20 squares past fp32's range; the fp64 sum of squares must not raise the flag."""
    flat = torch.full((17,), 1e20, device=device)
    sumsq, nonfinite = finalize(path, flat, torch.tensor(1.0, device=device))
    assert not nonfinite.item()
    flat = torch.full((17,), 1e15, device=device)
    sumsq, nonfinite = finalize(path, flat, torch.tensor(1.0, device=device))
    assert sumsq.item() == pytest.approx(17 * 1e30, rel=2 * ULP) and not nonfinite.item()


@pytest.mark.parametrize("path", PATHS)
def test_finalize_tiny_values_square_in_fp64(device, path):
    """Squares of |x| ~ 1e-20 are fp32 denormals (or zero with flush-to-zero); in fp64 they are
    exact, and their sum is a normal fp32 number."""
    flat = torch.full((4099,), 1.2345678e-20, device=device)
    ref = flat.double().square().sum().item()
    sumsq, _ = finalize(path, flat, torch.tensor(1.0, device=device))
    assert sumsq.item() == pytest.approx(ref, rel=2 * ULP, abs=0)


@pytest.mark.triton
def test_finalize_reduce_kernel_many_partials(device):
    """More partials than the reduction's block: it must loop and sum all of them."""
    n = 3000
    sq = rand(n, torch.float64, device, 84).abs()
    bad = torch.zeros(n, dtype=torch.int32, device=device)
    sumsq = torch.empty((), device=device)
    flag = torch.empty((), dtype=torch.bool, device=device)
    kernels._finalize_reduce_kernel[(1,)](sq, bad, n, sumsq, flag, BLOCK=1024)
    assert sumsq.item() == pytest.approx(sq.sum().item(), rel=2 * ULP) and not flag.item()
    bad[n - 1] = 1
    kernels._finalize_reduce_kernel[(1,)](sq, bad, n, sumsq, flag, BLOCK=1024)
    assert flag.item()


@pytest.mark.parametrize("path", PATHS)
def test_finalize_deterministic(device, path):
    flat = rand(3 * 2**16 + 5, torch.float32, device, 82)
    results = []
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            results.append(finalize(path, flat.clone(), torch.tensor(0.25, device=device))[0].item())
        finally:
            torch.set_num_threads(previous)
    assert results[0] == results[1]


def test_finalize_scale_forms(device):
    """A float64 scale, a CPU scale for a device buffer, and a Python number all work."""
    flat = rand(100, torch.float32, device, 83)
    flat0 = flat.clone()
    ops.finalize_(flat, torch.tensor(0.1, dtype=torch.float64))
    assert torch.equal(flat, flat0 * f32(0.1))
    ops.finalize_(flat, 4)
    assert torch.equal(flat, flat0 * f32(0.1) * 4)
    # A float64 scale past float32's range is inf as float32, as the Triton kernel applies it.
    sumsq, nonfinite = ops.finalize_(flat, torch.tensor(1e300, dtype=torch.float64))
    assert nonfinite.item() and torch.isinf(flat).all()
