"""Block inputs parked in host memory between a block's forward and its backward.

A checkpointed block holds one tensor for its whole life between forward and backward: its
input hidden state, which the replay starts from (8 KiB a token per layer for Llama-3-8B in
bf16: 16 GiB over 32 layers at 65K tokens). :func:`run_parked` moves it to host memory:

- forward: the block runs on a private copy of its input (``clone``: nothing else holds it), and
  once the block has run, that copy goes to a host buffer of the shared
  :class:`~gradaccel.recompute.offload.ActivationStore` (pinned, side stream on CUDA; the store
  records the copy on its stream, so the device memory given back at once is not reused before
  the copy has read it) and its device storage is resized to 0 bytes;
- backward: when the block's backward starts (a pre-hook on its outputs' autograd nodes, which
  run before any node inside the block), the input comes back into the same storage, and the
  previous block's input (the next backward needs) starts coming back: one block ahead, so at
  most two block inputs are on the device in backward.

The checkpoint around the block (``torch.utils.checkpoint``, or ``gradaccel.checkpoint``'s own
plans) is unchanged: it holds the private copy as its input and finds it restored when it
replays. Gradients are those of the input kept on the device: the values are copied bit for bit.
Only the first positional argument is parked (a decoder layer's hidden state; its rotary tables
and mask are shared by every layer and stay). :mod:`gradaccel.memory.counter` is told of each
resize, so :class:`~gradaccel.memory.LiveBytes` counts the parked input as gone from the device.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["run_parked", "parked_bytes", "MIN_BYTES"]

MIN_BYTES = 1 << 16  # a smaller input is not worth a copy
_LAST = [None]  # weakref to the most recently parked input: the previous block of the next one
_RESIZE_LISTENERS: list = []  # callables (storage, delta bytes): see add_resize_listener


class _Parked:
    """One parked input: its host handle, the device tensor whose storage it refills, and the
    input parked before it (whose copy back this one's backward starts)."""

    __slots__ = ("store", "handle", "tensor", "prev", "staged", "nbytes", "order", "__weakref__")

    def __init__(self, store, handle: int, tensor: torch.Tensor, prev):
        self.store, self.handle, self.prev, self.staged = store, handle, prev, False
        # Held here until it is back: gradaccel.checkpoint's plans hold detached views of it, not the
        # object; after that only the checkpoint holds it (backward's nodes outlive their use).
        self.tensor = tensor
        self.nbytes = tensor.untyped_storage().nbytes()
        self.order = None  # test hook: a list each restore and prefetch is appended to

    def restore(self, *_):
        t = self.tensor
        if self.handle is None or t is None:  # already back (a backward with retain_graph ran)
            return
        self.tensor = None
        back = self.store.fetch(self.handle)  # the current stream waits for the copy; the host does not
        storage = t.untyped_storage()
        storage.resize_(self.nbytes)
        storage.copy_(back.untyped_storage())  # storage-level: the tensor's version does not move
        _resized(storage, self.nbytes)
        del back
        self._release()
        if self.order is not None:
            self.order.append(("restore", id(self)))
        prev = self.prev() if self.prev is not None else None
        if prev is not None and prev.handle is not None and not prev.staged:
            prev.staged = True
            prev.store.prefetch(prev.handle)
            if self.order is not None:
                self.order.append(("prefetch", id(prev)))

    def _release(self):
        if self.handle is not None:
            self.store.release(self.handle)
            self.handle = None

    def __del__(self):
        try:
            self._release()
        except Exception:  # interpreter shutdown: the store may be gone already
            pass


def add_resize_listener(listener) -> None:
    """Calls ``listener(storage, delta)`` whenever a parked input's device storage is resized
    (emptied when parked, refilled when back): a byte counter (gradaccel/memory/counter.py)
    follows the device memory that way.

    Args:
        listener: a callable ``(storage, delta bytes) -> None``.
    """
    _RESIZE_LISTENERS.append(listener)


def _resized(storage, delta: int) -> None:
    for listener in _RESIZE_LISTENERS:
        listener(storage, delta)


def _worth_parking(x) -> bool:
    # A leaf that requires grad (the embeddings' output under enable_input_require_grads) is held
    # by its gradient accumulator in the graph anyway: parking a copy would free nothing.
    return (type(x) in (torch.Tensor, torch.nn.Parameter) and x.layout == torch.strided
            and not (x.is_leaf and x.requires_grad)
            and x.device.type in ("cpu", "cuda") and x.is_floating_point()
            and x.numel() * x.element_size() >= MIN_BYTES)


def run_parked(call, args: tuple, store=None, order: list | None = None):
    """``call(*args)`` with ``args[0]`` parked in host memory from the end of this forward until
    this call's backward starts (see the module's docstring).

    Args:
        call: the checkpointed block, called as ``call(*args)`` (grad enabled, training).
        args: its positional arguments; the first is the one parked.
        store: the :class:`~gradaccel.recompute.offload.ActivationStore` (``None``: the one of
            ``gradaccel.checkpoint``'s offload without a host budget).
        order: test hook: restores and prefetches are appended to it, in the order they happen.

    Returns:
        What ``call`` returns. The input stays on the device (nothing parked) where it is not a
        floating strided CPU/CUDA tensor of at least :data:`MIN_BYTES`, where it is a leaf that
        requires grad (autograd holds it anyway), where an output shares
        its storage, or where the store refuses it (host budget, host memory refused).
    """
    if not args or not _worth_parking(args[0]) or not torch.is_grad_enabled():
        return call(*args)
    own = args[0].clone()  # autograd's clone saves nothing; this copy is the checkpoint's alone
    out = call(own, *args[1:])
    storage = own.untyped_storage()
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if any(t.untyped_storage()._cdata == storage._cdata for t in outs):
        return out  # the block hands its input (or a view of it) back: it must stay
    nodes = {id(t.grad_fn): t.grad_fn for t in outs if t.grad_fn is not None}
    if not nodes:
        return out  # no backward will run through it
    if store is None:
        from gradaccel.recompute.offload_frame import store_for

        store = store_for(None)
    handle = store.offload(own)
    if handle is None:
        return out
    last = _LAST[0]() if _LAST[0] is not None else None
    parked = _Parked(store, handle, own, weakref.ref(last) if last is not None and last.handle is not None else None)
    parked.order = order
    storage.resize_(0)  # on CUDA the store recorded its copy's stream: the memory waits for it
    _resized(storage, -parked.nbytes)
    for node in nodes.values():
        node.register_prehook(lambda grads, p=parked: p.restore())
    _LAST[0] = weakref.ref(parked)
    return out


def parked_bytes(x: torch.Tensor) -> int:
    """Bytes :func:`run_parked` would send to host memory for a block whose first argument is
    like ``x`` (0 where it would keep it), for the planner; fake tensors count as real ones.
    Whether ``x`` is a leaf that requires grad is the caller's to check (a block kind's traced
    input stands for all its blocks')."""
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided or not x.is_floating_point():
        return 0
    n = x.numel() * x.element_size()
    return n if n >= MIN_BYTES else 0
