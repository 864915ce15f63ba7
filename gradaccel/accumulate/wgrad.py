"""``fuse_wgrad``: the weight gradients of ``nn.Linear`` and ``nn.Embedding`` layers added by
their own GEMM (or row gather) straight into the fp32 window, never made as a tensor.

Stock autograd makes each weight's gradient as a tensor of the weight's dtype; the fold hook
(gradaccel/accumulate/slots.py) then adds it into the weight's fp32 slice and frees it. For a
bf16 model that rounds every micro-batch's gradient to bf16 before the exact fp32 sum, and for
every weight a weight-sized tensor is made, read back and freed. Here each routed layer's
``forward`` becomes an autograd function (as Megatron's gradient-accumulation fusion does): its
backward computes the input's and the bias's gradients as stock does, and hands the weight's to
``gradaccel.ops.wgrad_accumulate_`` (``slice += dyᵀ @ x``, products summed in fp32) or
``embedding_accumulate_`` (``slice[ids] += dy``), then returns no gradient for the weight. For
``nn.Linear`` that function is C++ (``gradaccel.ops.wgrad.fused_linear``): it runs for every
layer in every micro-batch, and a Python one cost more than the fold it replaces on small
layers (bench/wgrad.py, ``layer_overhead``); the embedding's, once per model, is Python.
So nothing weight-sized exists in backward, and the weight's ``.grad`` stays None (autograd
still calls its post-accumulate-grad hooks, which then see None).

Routed: a module whose class keeps ``nn.Linear.forward`` / ``nn.Embedding.forward`` (subclasses
with their own forward, such as quantized layers, are left alone), whose weight is a plain
(not sharded) trainable parameter with a slice, and, for an embedding, without ``max_norm``,
``scale_grad_by_freq`` or ``sparse``. Everything else keeps the fold. A weight shared by two
routed layers (tied embedding and LM head) gets both contributions summed in its slice; a use of
the same weight elsewhere (``F.linear(h, emb.weight)``) arrives through the fold hook and is
summed too, whichever comes first. Code that computes a routed layer's weight gradient itself
takes the layer's sink from :func:`sink_of`: the chunked loss (gradaccel/memory/chunked_loss.py)
adds each chunk's share of the LM head's gradient there.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccel import ops
from gradaccel.ops.wgrad import fused_linear

__all__ = ["route", "routable", "sink_of", "is_routed_forward"]


class _FusedEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose weight gradient goes to ``sink``."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, sink):
        ctx.save_for_backward(ids)
        ctx.sink, ctx.padding_idx = sink, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        ctx.sink(lambda acc: ops.embedding_accumulate_(acc, ids, dy, 1.0, ctx.padding_idx))
        return None, None, None, None


def _linear_forward(module: nn.Linear, weight: torch.Tensor, sink: Callable, x: torch.Tensor) -> torch.Tensor:
    w = module.weight
    if w is not weight or not (torch.is_grad_enabled() and w.requires_grad):
        return F.linear(x, w, module.bias)  # replaced, frozen since, or no grad: stock
    return fused_linear(x, w, module.bias, sink.open)


def _embedding_forward(module: nn.Embedding, weight: torch.Tensor, sink: Callable, ids: torch.Tensor) -> torch.Tensor:
    w = module.weight
    if w is not weight or not (torch.is_grad_enabled() and w.requires_grad) or not routable(module):
        return nn.Embedding.forward(module, ids)
    return _FusedEmbedding.apply(ids, w, module.padding_idx, sink)


class _Routed:
    """A routed layer's ``forward`` (an instance attribute shadowing its class's). A copy of the
    model (``copy.deepcopy``, pickling) gets the class's forward back: the copy's weights own no
    slice of this optimizer's window."""

    def __init__(self, forward: Callable, module: nn.Module, weight: torch.Tensor, sink: Callable) -> None:
        self.forward, self.module, self.weight, self.sink = forward, module, weight, sink

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(self.module, self.weight, self.sink, x)

    def __deepcopy__(self, memo):
        import copy
        return _Stock(copy.deepcopy(self.module, memo))

    def __reduce__(self):
        return _Stock, (self.module,)


class _Stock:
    """The class's own forward, for a copy of a routed layer."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)


def routable(module: nn.Module) -> bool:
    """Whether ``module``'s weight gradient can go through the fused ops (see the module doc);
    its weight must also own a slice of the window for :func:`route` to take it."""
    if type(module).forward is nn.Linear.forward:
        return True
    if type(module).forward is nn.Embedding.forward:
        return module.max_norm is None and not module.scale_grad_by_freq and not module.sparse
    return False


def route(root: nn.Module, sink_for: Callable[[torch.Tensor], Callable | None]) -> list[tuple[nn.Module, str]]:
    """Routes every routable layer under ``root`` whose weight ``sink_for`` gives a sink.

    Args:
        root: the model.
        sink_for: ``weight -> sink`` or None; ``sink(add)`` calls ``add(slice)`` on the weight's
            fp32 slice, first zeroing it if it is the weight's first gradient of the window.

    Returns:
        ``(module, qualified name)`` of each routed layer; :func:`unroute` undoes.
    """
    routed = []
    for name, m in root.named_modules():
        own = vars(m).get("forward")
        # A forward that wraps the layer's own (head mode's, gradaccel/memory/chunked_loss.py)
        # keeps its place and runs the routed forward inside it (``inner``).
        wrapper = own if getattr(own, "wraps_forward", False) else None
        if wrapper is not None:
            own = wrapper.inner
        if not routable(m) or (own is not None and not is_routed_forward(own)):
            continue  # a forward the user set on the instance: theirs
        w = m.weight
        if not isinstance(w, torch.Tensor) or type(w) not in (torch.Tensor, nn.Parameter) or not w.requires_grad:
            continue
        sink = sink_for(w)
        if sink is None:
            continue
        fwd = _linear_forward if isinstance(m, nn.Linear) else _embedding_forward
        # An instance attribute shadows the class's forward; nn.Module.__call__ (and its hooks)
        # run as before.
        if wrapper is not None:
            wrapper.inner = _Routed(fwd, m, w, sink)
        else:
            m.forward = _Routed(fwd, m, w, sink)
        routed.append((m, name))
    return routed


def is_routed_forward(forward) -> bool:
    """Whether an instance's ``forward`` is this module's (routed, or a copy's stock one)."""
    return isinstance(forward, (_Routed, _Stock))


def sink_of(module: nn.Module) -> Callable | None:
    """The window sink of a routed layer's weight (see :func:`route`), for code that computes
    that layer's weight gradient itself (the chunked loss computes the LM head's); None where
    the layer is not routed, its weight was replaced since, or no gradient is being recorded."""
    own = vars(module).get("forward")
    if getattr(own, "wraps_forward", False):
        own = own.inner
    if not isinstance(own, _Routed) or own.weight is not module.weight:
        return None
    if not (torch.is_grad_enabled() and own.weight.requires_grad):
        return None
    return own.sink


def unroute(routed: list[tuple[nn.Module, str]]) -> None:
    """Gives the layers that :func:`route` routed their class's forward back."""
    for m, _ in routed:
        own = vars(m).get("forward")
        if getattr(own, "wraps_forward", False) and isinstance(own.inner, _Routed):
            own.inner = None
        elif isinstance(own, _Routed):
            del m.forward
    routed.clear()
