"""Triton kernels for gradient accumulation into fp32 buffers, and their thin launchers.

Three ops, all in fp32 arithmetic with int64 element offsets and every load masked:

- ``scale_accumulate(acc, grad, scale)``: ``acc += grad * scale`` for one tensor of any strides.
- ``fold(flat, grads, offsets, scale)``: one launch folds a list of grads into their slices of a
  flat fp32 buffer, whatever their dtypes. A plan (built by ``make_fold_plan`` here, or in C++
  by ``gradaccel.ops``) holds a row per grad (raw data address, numel, offset, first block,
  dtype code) and a block -> row map. Raw addresses work on CUDA and in the interpreter
  (``TRITON_INTERPRET=1`` on CPU tensors) alike: the interpreter dereferences host addresses.
- ``finalize(flat, scale)``: ``flat *= scale`` (``scale`` a 0-d tensor, read on the device),
  with a non-finite flag and the sum of squares of the result: per-block fp64 partials, then one
  small single-program reduction, so the result does not depend on scheduling.

Launchers take tensors that the caller (``gradaccel.ops``) has already validated. Full blocks
load under a mask that is all-true at compile time, so their loads vectorise whatever numel is.
"""

import torch
import triton
import triton.language as tl

# Rank the strided kernel indexes directly; the launcher collapses contiguous runs of dims first.
_MAX_DIMS = 4
# The fold reads each grad through a pointer typed by this code (csrc/accumulate.cpp agrees).
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Fold plan: int64 columns per grad (address, numel, offset, first block, dtype code).
ROW = 5
# Elements per fold program: fixed, because the plan (built before launch) maps blocks to grads.
FOLD_BLOCK, FOLD_WARPS = 4096, 8


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
                 ROW: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = table_ptr + tl.load(block_map_ptr + pid).to(tl.int64) * ROW
    addr = tl.load(row + 0)
    numel = tl.load(row + 1)
    offset = tl.load(row + 2)
    first_block = tl.load(row + 3)
    code = tl.load(row + 4)
    if ALIGNED:
        offset = tl.multiple_of(offset, 4)  # 16 bytes of fp32
    start = (pid - first_block).to(tl.int64) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    full = start + BLOCK <= numel
    # Branch on dtype and fullness here, outermost: loads nested in a branch lose the facts
    # about a mask or pointer made outside it, and stay scalar (seen in the sm_90 PTX).
    if code == 1:
        if full:
            _fold_block(flat_ptr, addr, offset, idx, numel, scale, tl.bfloat16, ALIGNED, True, BLOCK)
        else:
            _fold_block(flat_ptr, addr, offset, idx, numel, scale, tl.bfloat16, ALIGNED, False, BLOCK)
    elif code == 2:
        if full:
            _fold_block(flat_ptr, addr, offset, idx, numel, scale, tl.float16, ALIGNED, True, BLOCK)
        else:
            _fold_block(flat_ptr, addr, offset, idx, numel, scale, tl.float16, ALIGNED, False, BLOCK)
    else:
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


def fold_plan_capacity(flat_numel: int, n_grads: int) -> int:
    """int64 slots that a fold plan of ``n_grads`` grads into ``flat_numel`` elements may need.

    Disjoint slices hold at most ``flat_numel`` elements, so they span at most
    ``flat_numel // FOLD_BLOCK + n_grads`` blocks.
    """
    return 4 + n_grads + ROW * n_grads + (flat_numel // FOLD_BLOCK + n_grads + 1) // 2 + 1


def make_fold_plan(flat: torch.Tensor, grads: list, offsets: list) -> torch.Tensor:
    """The fold plan built in Python (``gradaccel.ops`` builds the same one in C++, faster).

    Layout (int64, CPU): a header ``[rows, blocks, aligned, k]``; the indices of the ``k``
    non-contiguous grads (folded separately); ``rows`` table rows ``[address, numel, offset,
    first block, dtype code]``, one per non-empty contiguous grad; then the block -> row map as
    ``blocks`` int32 values packed two per slot.
    """
    strided = [i for i, g in enumerate(grads) if g.numel() and not g.is_contiguous()]
    table, block_map = [], []
    aligned = flat.data_ptr() % 16 == 0
    for g, off in zip(grads, offsets):
        n = g.numel()
        if n == 0 or not g.is_contiguous():
            continue
        aligned = aligned and g.data_ptr() % 16 == 0 and off % 4 == 0
        table += [g.data_ptr(), n, off, len(block_map), DTYPE_CODE[g.dtype]]
        block_map += [len(table) // ROW - 1] * triton.cdiv(n, FOLD_BLOCK)
    header = [len(table) // ROW, len(block_map), int(aligned), len(strided)]
    if len(block_map) % 2:
        block_map.append(0)
    packed = torch.tensor(block_map, dtype=torch.int32).view(torch.int64)
    return torch.cat([torch.tensor(header + strided + table, dtype=torch.int64), packed])


def fold_planned(flat: torch.Tensor, grads: list, offsets: list, plan: torch.Tensor, scale: float) -> None:
    """Launches the fold described by ``plan`` (see :func:`make_fold_plan`): one launch for every
    contiguous grad, whatever their dtypes; each non-contiguous grad goes through the strided
    single-tensor kernel onto a view of its slice."""
    rows, blocks, aligned, k = plan[:4].tolist()
    for i in plan[4:4 + k].tolist():
        g = grads[i]
        scale_accumulate(flat[offsets[i]:offsets[i] + g.numel()].view(g.shape), g, scale)
    if blocks == 0:
        return
    t0 = 4 + k
    m0 = t0 + ROW * rows
    plan = plan[:m0 + (blocks + 1) // 2]
    if flat.device.type != "cpu":
        # Pageable memory: the copy is staged before this returns, so the plan may be freed.
        plan = plan.to(flat.device, non_blocking=True)
    _fold_kernel[(blocks,)](flat, plan[t0:m0], plan[m0:].view(torch.int32), scale,
                            ROW=ROW, ALIGNED=bool(aligned), BLOCK=FOLD_BLOCK, num_warps=FOLD_WARPS)


def fold(flat: torch.Tensor, grads: list, offsets: list, scale: float) -> None:
    """For each i: ``flat[offsets[i]:offsets[i] + grads[i].numel()] += grads[i].float() * scale``.

    Args:
        flat: 1-D contiguous fp32 buffer.
        grads: fp32/bf16/fp16 tensors on ``flat``'s device, any shapes and strides.
        offsets: element offset of each grad's slice in ``flat``; slices in bounds, disjoint.
        scale: multiplier, applied in fp32.
    """
    fold_planned(flat, grads, offsets, make_fold_plan(flat, grads, offsets), scale)


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
