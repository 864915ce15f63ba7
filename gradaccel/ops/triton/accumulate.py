"""Triton kernels for gradient accumulation into fp32 buffers, and their thin launchers.

Three ops, all in fp32 arithmetic with int64 element offsets and every load masked:

- ``scale_accumulate(acc, grad, scale)``: ``acc += grad * scale`` for one tensor of any strides.
- ``fold(flat, grads, offsets, scale)``: one launch folds a list of grads into their slices of a
  flat fp32 buffer, whatever their dtypes. A plan, built by the C++ extension in the layout it
  defines (gradaccel/ops/csrc/fold_plan.h, read here through the extension's ``fold_plan_layout()``),
  holds a row per grad (raw data address, numel, offset, first block, dtype code) and a block -> row map.
  Raw addresses work on CUDA and in the interpreter (``TRITON_INTERPRET=1`` on CPU tensors)
  alike: the interpreter dereferences host addresses.
- ``finalize(flat, scale)``: ``flat *= scale`` (``scale`` a 0-d tensor, read on the device),
  with a non-finite flag and the sum of squares of the result: per-block fp64 partials, then one
  small single-program reduction, so the result does not depend on scheduling.

Launchers take tensors that the caller (``gradaccel.ops``) has already validated; ``fold``'s plan
builder checks its arguments itself. Full blocks load under a mask that is all-true at compile
time, so their loads vectorise whatever numel is.
"""

import torch
import triton
import triton.language as tl

from gradaccel.ops import extension as _ext

# Rank the strided kernel indexes directly; the launcher collapses contiguous runs of dims first.
_MAX_DIMS = 4
# Elements per fold program: fixed, because the plan (built before launch) maps blocks to grads.
FOLD_BLOCK, FOLD_WARPS = 4096, 8

# The fold plan's layout, defined once in C++ (gradaccel/ops/csrc/fold_plan.h). The kernel sees the row
# columns and dtype codes as compile-time constants.
_C = _ext.load()
_LAYOUT = _C.fold_plan_layout()
_HEAD = _LAYOUT["header"]
_ROW = tl.constexpr(_LAYOUT["row"]["width"])
_ADDRESS = tl.constexpr(_LAYOUT["row"]["address"])
_NUMEL = tl.constexpr(_LAYOUT["row"]["numel"])
_OFFSET = tl.constexpr(_LAYOUT["row"]["offset"])
_FIRST_BLOCK = tl.constexpr(_LAYOUT["row"]["first_block"])
_DTYPE = tl.constexpr(_LAYOUT["row"]["dtype"])
_BF16 = tl.constexpr(_LAYOUT["dtype"]["bfloat16"])
_FP16 = tl.constexpr(_LAYOUT["dtype"]["float16"])
_build_plan = torch.ops.gradaccel._fold_plan.default


def block_config(numel: int) -> tuple[int, int]:
    """Elements per program and warps for an elementwise pass over ``numel`` elements.

    4096 elements on 8 warps is 16 per thread: four 16-byte fp32 vectors, enough bytes in flight
    to saturate HBM. Small inputs get one small block instead of a mostly-masked large one.
    """
    block = min(4096, max(128, triton.next_power_of_2(max(numel, 1))))
    return block, max(1, min(8, block // 512))


@triton.jit
def _axpy_block(acc_ptrs, grad_ptrs, scale, mask):
    g = tl.load(grad_ptrs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(acc_ptrs, mask=mask, other=0.0)
    tl.store(acc_ptrs, a + g * scale, mask=mask)


@triton.jit
def _scale_accumulate_kernel(acc_ptr, grad_ptr, numel, scale,
                             size1, size2, size3,
                             acc_s0, acc_s1, acc_s2, acc_s3,
                             grad_s0, grad_s1, grad_s2, grad_s3,
                             CONTIGUOUS: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    mask = idx < numel
    if CONTIGUOUS:
        if start + BLOCK <= numel:
            # A full block: its mask is all-true at compile time, so the loads vectorise
            # whatever numel is (a mask from numel would split them into scalar loads).
            _axpy_block(acc_ptr + idx, grad_ptr + idx, scale, tl.arange(0, BLOCK) < BLOCK)
        else:
            _axpy_block(acc_ptr + idx, grad_ptr + idx, scale, mask)
    else:
        # Row-major multi-index of up to 4 (collapsed) dims; dim 0's size is implied by numel.
        i3 = idx % size3
        rest = idx // size3
        i2 = rest % size2
        rest = rest // size2
        i1 = rest % size1
        i0 = rest // size1
        acc_off = i0 * acc_s0 + i1 * acc_s1 + i2 * acc_s2 + i3 * acc_s3
        grad_off = i0 * grad_s0 + i1 * grad_s1 + i2 * grad_s2 + i3 * grad_s3
        _axpy_block(acc_ptr + acc_off, grad_ptr + grad_off, scale, mask)


@triton.jit
def _fold_block(flat_ptr, addr, offset, idx, numel, scale, DTYPE: tl.constexpr,
                ALIGNED: tl.constexpr, FULL: tl.constexpr, BLOCK: tl.constexpr):
    if FULL:
        # All-true at compile time, so the loads vectorise (a mask from numel splits them).
        # Built here, not passed in: a mask from outside the dtype branch loses that fact.
        mask = tl.arange(0, BLOCK) < BLOCK
    else:
        mask = idx < numel
    ptr = addr.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        # Values read from memory carry no alignment facts; without this the loads stay scalar.
        ptr = tl.multiple_of(ptr, 16)
    g = tl.load(ptr + idx, mask=mask, other=0.0).to(tl.float32)
    acc_ptrs = flat_ptr + offset + idx
    a = tl.load(acc_ptrs, mask=mask, other=0.0)
    tl.store(acc_ptrs, a + g * scale, mask=mask)


@triton.jit
def _fold_kernel(flat_ptr, table_ptr, block_map_ptr, scale,
                 ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = table_ptr + tl.load(block_map_ptr + pid).to(tl.int64) * _ROW
    addr = tl.load(row + _ADDRESS)
    numel = tl.load(row + _NUMEL)
    offset = tl.load(row + _OFFSET)
    first_block = tl.load(row + _FIRST_BLOCK)
    code = tl.load(row + _DTYPE)
    if ALIGNED:
        offset = tl.multiple_of(offset, 4)  # 16 bytes of fp32
    start = (pid - first_block).to(tl.int64) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    full = start + BLOCK <= numel
    # Branch on dtype and fullness here, outermost: loads nested in a branch lose the facts
    # about a mask or pointer made outside it, and stay scalar (seen in the sm_90 PTX).
    if code == _BF16:
        if full:
            _fold_block(flat_ptr, addr, offset, idx, numel, scale, tl.bfloat16, ALIGNED, True, BLOCK)
        else:
            _fold_block(flat_ptr, addr, offset, idx, numel, scale, tl.bfloat16, ALIGNED, False, BLOCK)
    elif code == _FP16:
        if full:
            _fold_block(flat_ptr, addr, offset, idx, numel, scale, tl.float16, ALIGNED, True, BLOCK)
        else:
            _fold_block(flat_ptr, addr, offset, idx, numel, scale, tl.float16, ALIGNED, False, BLOCK)
    else:  # float32: the C++ plan builder refuses any other dtype
        if full:
            _fold_block(flat_ptr, addr, offset, idx, numel, scale, tl.float32, ALIGNED, True, BLOCK)
        else:
            _fold_block(flat_ptr, addr, offset, idx, numel, scale, tl.float32, ALIGNED, False, BLOCK)


@triton.jit
def _finalize_kernel(flat_ptr, scale_ptr, sq_partial_ptr, bad_partial_ptr, numel,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    scale = tl.load(scale_ptr)
    if (pid + 1) * BLOCK <= numel:
        full = tl.arange(0, BLOCK) < BLOCK  # all-true at compile time: the loads vectorise
        x = tl.load(flat_ptr + idx, mask=full, other=0.0) * scale
        tl.store(flat_ptr + idx, x, mask=full)
    else:
        x = tl.load(flat_ptr + idx, mask=mask, other=0.0) * scale
        tl.store(flat_ptr + idx, x, mask=mask)
        # Masked lanes are 0 * scale, which is NaN for an infinite scale: keep them out.
        x = tl.where(mask, x, 0.0)
    x64 = x.to(tl.float64)
    # fp64 squares: an fp32 square overflows from |x| ~ 1.8e19, long before the values are inf.
    tl.store(sq_partial_ptr + pid, tl.sum(x64 * x64, axis=0))
    bad = (x != x) | (tl.abs(x) > 3.4028234663852886e38)
    tl.store(bad_partial_ptr + pid, tl.max(bad.to(tl.int32), axis=0))


@triton.jit
def _finalize_reduce_kernel(sq_partial_ptr, bad_partial_ptr, n, sumsq_ptr, bad_ptr,
                            BLOCK: tl.constexpr):
    sq = tl.zeros([BLOCK], dtype=tl.float64)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < n
        sq += tl.load(sq_partial_ptr + idx, mask=mask, other=0.0)
        bad = tl.maximum(bad, tl.load(bad_partial_ptr + idx, mask=mask, other=0))
    tl.store(sumsq_ptr, tl.sum(sq, axis=0))
    tl.store(bad_ptr, tl.max(bad, axis=0) > 0)


def _collapse(shape, *strides_list):
    """Drops size-1 dims and merges dims that are contiguous in every stride list at once."""
    dims = [(size, [s[d] for s in strides_list]) for d, size in enumerate(shape) if size != 1]
    out = []
    for size, strides in dims:
        if out and all(prev == cur * size for prev, cur in zip(out[-1][1], strides)):
            out[-1] = (out[-1][0] * size, strides)
        else:
            out.append((size, strides))
    return out


def _launch_strided(acc: torch.Tensor, grad: torch.Tensor, scale: float) -> bool:
    """Launches the strided kernel if the pair collapses to at most 4 dims; else returns False."""
    dims = _collapse(acc.shape, acc.stride(), grad.stride())
    if len(dims) > _MAX_DIMS:
        return False
    dims = [(1, [0, 0])] * (_MAX_DIMS - len(dims)) + dims
    sizes = [d[0] for d in dims]
    acc_s = [d[1][0] for d in dims]
    grad_s = [d[1][1] for d in dims]
    numel = acc.numel()
    block, warps = block_config(numel)
    _scale_accumulate_kernel[(triton.cdiv(numel, block),)](
        acc, grad, numel, scale, sizes[1], sizes[2], sizes[3], *acc_s, *grad_s,
        CONTIGUOUS=False, BLOCK=block, num_warps=warps)
    return True


def scale_accumulate(acc: torch.Tensor, grad: torch.Tensor, scale: float) -> None:
    """``acc += grad.float() * scale`` in place.

    Args:
        acc: fp32, any shape and strides (no internal overlap).
        grad: fp32/bf16/fp16 with ``acc``'s shape, any strides, on ``acc``'s device.
        scale: multiplier, applied in fp32.
    """
    numel = acc.numel()
    if numel == 0:
        return
    if acc.is_contiguous() and grad.is_contiguous():
        block, warps = block_config(numel)
        _scale_accumulate_kernel[(triton.cdiv(numel, block),)](
            acc, grad, numel, scale, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0,
            CONTIGUOUS=True, BLOCK=block, num_warps=warps)
        return
    if _launch_strided(acc, grad, scale):
        return
    # More than 4 dims that no stride pattern merges: rare enough that a copy is the fix.
    grad = grad.contiguous()
    if _launch_strided(acc, grad, scale):
        return
    tmp = acc.contiguous()
    scale_accumulate(tmp, grad, scale)
    acc.copy_(tmp)


def fold_planned(flat: torch.Tensor, grads: list, offsets: list, plan: torch.Tensor, scale: float) -> None:
    """Launches the fold described by ``plan`` (written by the extension's ``_fold_plan`` op): one
    launch for every contiguous grad, whatever their dtypes; each non-contiguous grad goes through
    the strided single-tensor kernel onto a view of its slice."""
    head = plan[:_HEAD["length"]].tolist()
    table, block_map, blocks = head[_HEAD["table_start"]], head[_HEAD["map_start"]], head[_HEAD["blocks"]]
    for i in plan[_HEAD["length"]:table].tolist():
        g = grads[i]
        scale_accumulate(flat[offsets[i]:offsets[i] + g.numel()].view(g.shape), g, scale)
    if blocks == 0:
        return
    plan = plan[:head[_HEAD["end"]]]
    if flat.device.type != "cpu":
        # Pageable memory: the copy is staged before this returns, so the plan may be freed.
        plan = plan.to(flat.device, non_blocking=True)
    _fold_kernel[(blocks,)](flat, plan[table:block_map], plan[block_map:].view(torch.int32), scale,
                            ALIGNED=bool(head[_HEAD["aligned"]]), BLOCK=FOLD_BLOCK, num_warps=FOLD_WARPS)


def fold(flat: torch.Tensor, grads: list, offsets: list, scale: float) -> None:
    """For each i: ``flat[offsets[i]:offsets[i] + grads[i].numel()] += grads[i].float() * scale``.

    Args:
        flat: 1-D contiguous fp32 buffer.
        grads: fp32/bf16/fp16 tensors on ``flat``'s device, any shapes and strides.
        offsets: element offset of each grad's slice in ``flat``; slices in bounds, disjoint.
        scale: multiplier, applied in fp32.

    Raises:
        ValueError, RuntimeError: from the plan builder, which checks the arguments before any
            launch (see ``gradaccel.ops.fold_``).
    """
    plan = torch.empty(_C.fold_plan_capacity(flat.numel(), len(grads), FOLD_BLOCK), dtype=torch.int64)
    _build_plan(flat, grads, offsets, FOLD_BLOCK, plan)
    fold_planned(flat, grads, offsets, plan, scale)


def finalize(flat: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat *= scale`` in one read and write, with the sum of squares and a non-finite flag.

    Args:
        flat: contiguous fp32 tensor (any shape).
        scale: fp32 0-d (or 1-element) tensor on ``flat``'s device, read by the kernel, so a
            value computed on the device needs no host sync.

    Returns:
        ``(sumsq, nonfinite)``: 0-d fp64 sum of squares of the scaled values (fp32 would
        overflow for finite values past a norm of 1.8e19), and 0-d bool, True if any scaled
        value is inf or NaN.
    """
    numel = flat.numel()
    block, warps = block_config(numel)
    nblocks = triton.cdiv(numel, block)
    sq_partial = torch.empty(nblocks, dtype=torch.float64, device=flat.device)
    bad_partial = torch.empty(nblocks, dtype=torch.int32, device=flat.device)
    sumsq = torch.empty((), dtype=torch.float64, device=flat.device)
    nonfinite = torch.empty((), dtype=torch.bool, device=flat.device)
    if nblocks:
        _finalize_kernel[(nblocks,)](flat, scale, sq_partial, bad_partial, numel,
                                     BLOCK=block, num_warps=warps)
    _finalize_reduce_kernel[(1,)](sq_partial, bad_partial, nblocks, sumsq, nonfinite,
                                  BLOCK=1024, num_warps=4)
    return sumsq, nonfinite
