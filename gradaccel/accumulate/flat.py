"""The flat fp32 window buffer's layout: one slice per parameter, laid out like the parameter.

Optimizers, fused ones most of all, pair ``.grad`` with its parameter element by element in
memory, so each slice takes its parameter's strides when the parameter is dense (channels_last,
transposed), as autograd lays out a gradient. A state dict holds every slice row-major instead,
so that it loads into a model of another memory layout.

At the update a bf16/fp16 parameter without an fp32 master needs its gradient in its own dtype.
:func:`narrow_in_place` rounds the slice into the first half of its own memory, so that no
gradient-sized copy is made (at 8B parameters a bf16 copy of every gradient is 15 GiB).
"""

from __future__ import annotations

import torch

# Elements of a slice rounded through a temporary before the rest is rounded in place: the
# temporary is at most this many 2-byte elements (2 MiB), and a slice of n elements takes about
# 2 + log2(n / NARROW_HEAD) copies.
NARROW_HEAD = 1 << 20


def slice_like(flat: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
    """``p``'s slice of ``flat`` from ``offset``, shaped like ``p`` and, as autograd lays out a
    gradient, with ``p``'s strides when ``p`` is dense, else row-major."""
    n = p.numel()
    if n == 0 or p.is_contiguous() or not dense(p):
        return flat[offset: offset + n].view(p.shape)
    return flat.as_strided(p.shape, p.stride(), offset)


def dense(t: torch.Tensor) -> bool:
    """Its elements fill ``numel`` consecutive slots, each once (a permutation of row-major)."""
    expected = 1
    for d in reversed(memory_order(t)):
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def memory_order(view: torch.Tensor) -> list[int]:
    """Dimensions from the largest stride to the smallest: ``view.permute(order)`` is row-major."""
    return sorted(range(view.dim()), key=lambda d: (-view.stride(d), -view.size(d)))


def to_rowmajor(flat: torch.Tensor, offsets: list[int], views: list[torch.Tensor]) -> torch.Tensor:
    """A copy of ``flat`` with every slice (``views``, from ``offsets``) in row-major order."""
    out = torch.empty_like(flat)
    for o, v in zip(offsets, views):
        out[o: o + v.numel()].view(v.shape).copy_(v)
    return out


def from_rowmajor(views: list[torch.Tensor], offsets: list[int], rowmajor: torch.Tensor) -> None:
    """Fills every slice (``views``) from :func:`to_rowmajor`'s layout."""
    for o, v in zip(offsets, views):
        v.copy_(rowmajor[o: o + v.numel()].view(v.shape))


def narrow_in_place(flat: torch.Tensor, offset: int, view: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rounds a slice of the fp32 buffer to a 2-byte ``dtype`` in the first half of its own memory.

    Rounds as ``view.to(dtype)`` does, element by element in memory order, so the result has
    ``view``'s shape and strides. Its fp32 values are lost: call it on a window that is over.

    Args:
        flat: the 1-D contiguous fp32 buffer.
        offset: where the slice starts in ``flat``; the slice is dense from there.
        view: the slice, shaped like its parameter (:func:`slice_like`).
        dtype: ``torch.bfloat16`` or ``torch.float16``.

    Returns:
        A ``dtype`` tensor shaped and strided like ``view``, sharing ``flat``'s memory.
    """
    n = view.numel()
    half = flat.view(dtype)  # two 2-byte elements per fp32 element
    src, dst = flat[offset: offset + n], half[2 * offset: 2 * offset + n]
    head = min(n, NARROW_HEAD)
    if head:
        # The head's target overlaps its own source: round it through a small temporary.
        dst[:head].copy_(src[:head].to(dtype))
    a = head
    while a < n:
        # Elements [a, 2a) land on bytes below their source, disjoint from it, over fp32 values
        # that earlier copies have already read: one copy each, safe on any device.
        b = min(2 * a, n)
        dst[a:b].copy_(src[a:b])
        a = b
    return half.as_strided(view.shape, view.stride(), 2 * offset)
