"""Triton kernels for gradient accumulation into fp32 buffers, and their thin launchers.

Three ops, all in fp32 arithmetic with int64 element offsets and every load masked:

- ``scale_accumulate(acc, grad, scale)``: ``acc += grad * scale`` for one tensor of any strides.
- ``fold(flat, grads, offsets, scale)``: one launch folds a list of grads into their slices of a
  flat fp32 buffer. The grads are reached through a table of raw data pointers (one int64 per
  grad), with a per-tensor (numel, offset, first block) table and a block -> tensor map. Raw
  addresses work on CUDA and in the interpreter (``TRITON_INTERPRET=1`` on CPU tensors) alike,
  since the interpreter dereferences host addresses directly.
- ``finalize(flat, scale)``: ``flat *= scale`` (``scale`` a 0-d tensor, read on the device),
  with a non-finite flag and the sum of squares of the result: per-block fp64 partials, then one
  small single-program reduction, so the result does not depend on scheduling.

Launchers take tensors that the caller (``gradaccel.ops``) has already validated.
"""

import functools

import torch
import triton
import triton.language as tl

# Rank the strided kernel indexes directly; the launcher collapses contiguous runs of dims first.
_MAX_DIMS = 4
# Grads of one dtype share one fold launch; the kernel reads them through typed pointers.
_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def block_config(numel: int) -> tuple[int, int]:
    """Elements per program and warps for an elementwise pass over ``numel`` elements.

    4096 elements on 8 warps is 16 per thread: four 16-byte fp32 vectors, enough bytes in flight
    to saturate HBM. Small inputs get one small block instead of a mostly-masked large one.
    """
    block = min(4096, max(128, triton.next_power_of_2(max(numel, 1))))
    return block, max(1, min(8, block // 512))


@triton.jit
def _scale_accumulate_kernel(acc_ptr, grad_ptr, numel, scale,
                             size1, size2, size3,
                             acc_s0, acc_s1, acc_s2, acc_s3,
                             grad_s0, grad_s1, grad_s2, grad_s3,
                             CONTIGUOUS: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    if CONTIGUOUS:
        acc_off = idx
        grad_off = idx
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
    g = tl.load(grad_ptr + grad_off, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(acc_ptr + acc_off, mask=mask, other=0.0)
    tl.store(acc_ptr + acc_off, a + g * scale, mask=mask)


@triton.jit
def _fold_kernel(flat_ptr, grad_addr_ptr, meta_ptr, block_map_ptr, scale,
                 GRAD_DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(block_map_ptr + pid).to(tl.int64)
    numel = tl.load(meta_ptr + 3 * t)
    offset = tl.load(meta_ptr + 3 * t + 1)
    first_block = tl.load(meta_ptr + 3 * t + 2)
    grad_ptr = tl.load(grad_addr_ptr + t).to(tl.pointer_type(GRAD_DTYPE))
    if ALIGNED:
        # The launcher checked: every grad address is 16-byte aligned, every offset a multiple
        # of 4 fp32. Values read from memory carry no alignment facts, and without these hints
        # the loads stay scalar.
        grad_ptr = tl.multiple_of(grad_ptr, 16)
        offset = tl.multiple_of(offset, 4)
    start = (pid - first_block).to(tl.int64) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    acc_ptrs = flat_ptr + offset + idx
    grad_ptrs = grad_ptr + idx
    if start + BLOCK <= numel:
        # A full block: a mask derived from a loaded numel would also block vectorisation.
        g = tl.load(grad_ptrs).to(tl.float32)
        tl.store(acc_ptrs, tl.load(acc_ptrs) + g * scale)
    else:
        mask = idx < numel
        g = tl.load(grad_ptrs, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(acc_ptrs, mask=mask, other=0.0)
        tl.store(acc_ptrs, a + g * scale, mask=mask)


@triton.jit
def _finalize_kernel(flat_ptr, scale_ptr, sq_partial_ptr, bad_partial_ptr, numel,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    x = tl.load(flat_ptr + idx, mask=mask, other=0.0) * tl.load(scale_ptr)
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
    tl.store(sumsq_ptr, tl.sum(sq, axis=0).to(tl.float32))
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


@functools.lru_cache(maxsize=64)
def _fold_layout(numels: tuple, offsets: tuple, block: int, device: torch.device):
    """Per-tensor (numel, offset, first block) table and block -> tensor map for one layout.

    The optimizer folds the same parameter layout every micro-batch, so this is built (and sent
    to the device) once; per call only the grad addresses change.
    """
    meta, block_map = [], []
    for t, (n, off) in enumerate(zip(numels, offsets)):
        meta += [n, off, len(block_map)]
        block_map += [t] * triton.cdiv(n, block)
    return (torch.tensor(meta, dtype=torch.int64).to(device),
            torch.tensor(block_map, dtype=torch.int32).to(device))


def fold(flat: torch.Tensor, grads: list, offsets: list, scale: float) -> None:
    """For each i: ``flat[offsets[i]:offsets[i] + grads[i].numel()] += grads[i].float() * scale``.

    One kernel launch per grad dtype present for the contiguous grads; a non-contiguous grad
    goes through the strided single-tensor kernel onto a view of its slice.

    Args:
        flat: 1-D contiguous fp32 buffer.
        grads: fp32/bf16/fp16 tensors on ``flat``'s device.
        offsets: element offset of each grad's slice in ``flat``; slices in bounds, disjoint.
        scale: multiplier, applied in fp32.
    """
    groups: dict = {}
    for g, off in zip(grads, offsets):
        n = g.numel()
        if n == 0:
            continue
        if not g.is_contiguous():
            scale_accumulate(flat[off:off + n].view(g.shape), g, scale)
            continue
        groups.setdefault(g.dtype, []).append((g, n, off))
    for dtype, items in groups.items():
        if len(items) == 1:
            g, n, off = items[0]
            scale_accumulate(flat[off:off + n], g.view(-1), scale)
            continue
        block, warps = block_config(max(n for _, n, _ in items))
        meta, block_map = _fold_layout(tuple(n for _, n, _ in items), tuple(o for _, _, o in items),
                                       block, flat.device)
        addrs = torch.tensor([g.data_ptr() for g, _, _ in items], dtype=torch.int64)
        if flat.device.type != "cpu":
            addrs = addrs.to(flat.device, non_blocking=True)
        aligned = (flat.data_ptr() % 16 == 0 and all(g.data_ptr() % 16 == 0 and off % 4 == 0
                                                     for g, _, off in items))
        _fold_kernel[(block_map.numel(),)](flat, addrs, meta, block_map, scale,
                                           GRAD_DTYPE=_TL_DTYPE[dtype], ALIGNED=aligned,
                                           BLOCK=block, num_warps=warps)


def finalize(flat: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat *= scale`` in one read and write, with the sum of squares and a non-finite flag.

    Args:
        flat: contiguous fp32 tensor (any shape).
        scale: fp32 0-d (or 1-element) tensor on ``flat``'s device, read by the kernel, so a
            value computed on the device needs no host sync.

    Returns:
        ``(sumsq, nonfinite)``: 0-d fp32 sum of squares of the scaled values (accumulated in
        fp64), and 0-d bool, True if any scaled value is inf or NaN.
    """
    numel = flat.numel()
    block, warps = block_config(numel)
    nblocks = triton.cdiv(numel, block)
    sq_partial = torch.empty(nblocks, dtype=torch.float64, device=flat.device)
    bad_partial = torch.empty(nblocks, dtype=torch.int32, device=flat.device)
    sumsq = torch.empty((), dtype=torch.float32, device=flat.device)
    nonfinite = torch.empty((), dtype=torch.bool, device=flat.device)
    if nblocks:
        _finalize_kernel[(nblocks,)](flat, scale, sq_partial, bad_partial, numel,
                                     BLOCK=block, num_warps=warps)
    _finalize_reduce_kernel[(1,)](sq_partial, bad_partial, nblocks, sumsq, nonfinite,
                                  BLOCK=1024, num_warps=4)
    return sumsq, nonfinite
