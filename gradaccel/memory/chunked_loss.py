"""The causal-LM loss in chunks, and head mode: the loss without the whole logits.

:class:`ChunkedLinearCrossEntropy` computes ``cross_entropy(linear(hidden, weight, bias))`` from
the final hidden states and the LM head's weight a chunk of rows at a time: forward makes each
chunk's logits, keeps its log-sum-exp and drops them; backward makes them again (one more
LM-head matmul) to form each chunk's gradients. No logits-sized tensor exists in either pass.
The head weight's gradient is summed over the chunks in fp32 (``gradaccel.ops.wgrad_accumulate_``):
into a buffer of its own, or, where ``FusedAccumOptimizer(fuse_wgrad=True)`` routes the head
(gradaccel/accumulate/wgrad.py), straight into the weight's slice of the fp32 window, so that no
weight-sized gradient is made either.

**Head mode** (:func:`install_head`, switched by :func:`set_head`; the ``memory=`` target and
the fit turn it on where the loss would set the step's peak) runs a Hugging Face causal LM's
stock ``ForCausalLMLoss`` through it. In a training forward with grad and ``labels``, the
``lm_head`` module does not make its output: it returns a :class:`HeadLogits` stand-in (no
memory; it carries the head's input to the loss), and the loss computes the chunks from that
input. ``outputs.logits`` is then that stand-in: its shape and dtype are the logits', and
anything that reads its values raises :class:`HeadLogitsError`, naming head mode and how to turn
it off (no silently wrong numbers). Calls in eval, under ``no_grad`` or without ``labels`` (a
loss computed outside the model) return real logits.

Head mode takes only models whose ``forward`` hands the head's output straight to the loss
(``logits = self.lm_head(...)`` then ``self.loss_function(logits=logits, ...)``, read from the
forward's source): a model that rescales or soft-caps its logits in between (Gemma 2, Cohere,
Granite) has no head mode, as one whose loss is not the stock ``ForCausalLMLoss``.
"""

import ast
import inspect
import math
import textwrap
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccel import ops
from gradaccel.accumulate import wgrad as _wgrad

__all__ = ["ChunkedLinearCrossEntropy", "HeadLogits", "HeadLogitsError", "chunk_rows", "head_flops", "install_head",
           "logsumexp_rows", "set_head", "stock_head"]


# -- the loss from hidden states, a chunk of rows at a time --------------------------------------
def _autocast_dtype(t: torch.Tensor):
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) and t.is_floating_point() else None


_WGRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what ops.wgrad_accumulate_ takes


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(linear(hidden, weight, bias).float(), labels, reduction="sum") / denom``
    without a logits-sized tensor: forward makes each chunk's logits (or reads ``logits``, if
    given) and keeps the per-row log-sum-exp; backward makes each chunk's logits again.

    Args (of ``apply``):
        hidden: ``(N, C)``; weight: ``(V, C)``; bias: ``(V,)`` or None.
        logits: ``(N, V)`` logits already made from the same hidden and weight (no grad), or None.
        labels: ``(N,)`` int64, ``ignore_index`` for rows that do not count.
        denom: what the sum is divided by (a number or a 0-d tensor).
        ignore_index: int; chunk: rows per chunk.
        sink: None, or the head weight's window sink (``gradaccel.accumulate.wgrad.sink_of``):
            ``sink(add)`` hands ``add`` the weight's fp32 window slice. Backward then adds each
            chunk's ``dyᵀ·h`` there and returns no gradient for ``weight``.

    Returns:
        A 0-d float32 tensor.

    Under autocast the matmuls run in autocast's dtype, in backward too (as stock ``F.linear``
    under autocast would), so that backward's logits are forward's. The gradient of the logits
    is made in fp32 and rounded to the logits' dtype for the hidden states' gradient, as stock
    autograd rounds it. Over several chunks the weight's gradient is summed in fp32: on CPU from
    the fp32 gradient of the logits (the CPU op would widen a rounded copy to fp32 anyway), on
    CUDA from the rounded one (the Triton GEMM sums its products in fp32). In one chunk, without
    ``sink``, it is one GEMM in the logits' dtype, as stock.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, logits, labels, denom, ignore_index, chunk, sink=None):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for a in range(0, hidden.shape[0], chunk):
            b = min(a + chunk, hidden.shape[0])
            # Under autocast F.linear casts (the weight through autocast's cache, once).
            z = logits[a:b] if logits is not None else F.linear(hidden[a:b], weight, bias)
            own = logits is None or z.dtype != torch.float32  # z is this chunk's own tensor, not the caller's
            z = z.float()
            y = labels[a:b]
            valid = y != ignore_index
            picked = z.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
            logsumexp_rows(z, lse[a:b], in_place=own)
            total = total + torch.where(valid, lse[a:b] - picked, 0.0).sum()
            del z
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.denom, ctx.ignore_index, ctx.chunk, ctx.sink = denom, ignore_index, chunk, sink
        ctx.cast = _autocast_dtype(hidden)
        return total / denom

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        scale = grad / ctx.denom
        cast = ctx.cast  # backward runs without autocast: cast as forward's F.linear did
        w = weight if cast is None else weight.to(cast)
        bb = bias if cast is None or bias is None else bias.to(cast)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        sink = ctx.sink if need_w else None
        gh = torch.empty_like(hidden) if need_h else None
        # The head weight's gradient over several chunks: fp32 sums (fp64 for an fp64 weight). In
        # one chunk, one GEMM in the logits' dtype, as stock autograd makes it: an fp32 buffer
        # would cost more than the logits it replaces.
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        one = hidden.shape[0] <= ctx.chunk
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) \
            if need_w and sink is None and not one else None
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if bias is not None and need_b else None
        for a in range(0, hidden.shape[0], ctx.chunk):
            b = min(a + ctx.chunk, hidden.shape[0])
            h, y = hidden[a:b], labels[a:b]
            if cast is not None:
                h = h.to(cast)
            # In place: one chunk's fp32 logits become d loss / d logits (softmax - one-hot, scaled).
            p = F.linear(h, w, bb).float()
            p.sub_(lse[a:b].unsqueeze(1)).exp_()  # softmax
            valid = (y != ctx.ignore_index).unsqueeze(1)
            p.scatter_add_(1, y.clamp(min=0).unsqueeze(1), -valid.float())
            p.mul_(valid * scale)
            if gb is not None:
                gb += p.sum(0)
            if (sink is not None or gw is not None) and p.device.type == "cpu":
                # On CPU wgrad_accumulate_ widens bf16/fp16 to fp32 blocks itself: hand it the
                # fp32 d-logits there are (unrounded; no widened copy of them is made).
                _add_wgrad(sink, gw, h.to(p.dtype), p)
                added = True
            else:
                added = False
            p = p.to(h.dtype)  # in the logits' dtype, as stock autograd makes it
            if gh is not None:
                if gh.dtype == p.dtype and gh.is_contiguous():
                    torch.mm(p, w, out=gh[a:b])  # no chunk-sized temporary
                else:
                    gh[a:b] = p @ w
            if need_w and one and sink is None:
                gw = p.t() @ h
            elif not added and (sink is not None or gw is not None):
                _add_wgrad(sink, gw, h, p)  # on CUDA, the Triton GEMM sums bf16 products in fp32
            del p
        return (gh, gw.to(weight.dtype) if gw is not None else None, gb.to(bias.dtype) if gb is not None else None,
                None, None, None, None, None, None)


def logsumexp_rows(z: torch.Tensor, out: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``torch.logsumexp(z, dim=-1)`` into ``out``, computed as aten's kernel computes it (the
    same ops: bit for bit), without the ``z``-sized temporary that kernel makes and frees inside
    itself, which no dispatch-level count sees (the fake-tensor profile would miss a chunk's
    logits' worth of memory at the loss). ``in_place``: ``z`` may be overwritten (with
    ``exp(z - max)``); otherwise that temporary is made here, where the count sees it."""
    m = z.amax(dim=-1)
    m.masked_fill_(m.abs() == math.inf, 0)
    shifted = z.sub_(m.unsqueeze(-1)) if in_place else z - m.unsqueeze(-1)
    torch.sum(shifted.exp_(), dim=-1, out=out)
    return out.log_().add_(m)


def _add_wgrad(sink, gw, h, dy) -> None:
    """Adds ``dyᵀ·h`` to the head weight's gradient: through ``sink`` into the window, or into
    ``gw`` (fp32; fp64 for fp64 inputs), products summed in fp32, no weight-sized temporary."""
    if sink is not None:  # straight into the window: nothing weight-sized is made
        sink(lambda window: ops.wgrad_accumulate_(window, h, dy, 1.0))
    elif h.dtype in _WGRAD_DTYPES and gw.dtype == torch.float32:
        ops.wgrad_accumulate_(gw, h, dy, 1.0)
    else:
        gw.addmm_(dy.t().to(gw.dtype), h.to(gw.dtype))


def chunk_rows(rows: int, vocab: int) -> int:
    """Rows per chunk of :class:`ChunkedLinearCrossEntropy` for ``rows`` rows of ``vocab`` logits:
    ~16 MiB of fp32 logits a chunk, and at most 64 chunks (each chunk is a few kernels, and the
    loop's Python is the fake-tensor profile's cost too)."""
    return max(1, (1 << 22) // max(1, vocab), -(-rows // 64))


# -- the stand-in for logits that head mode does not make -----------------------------------------
class HeadLogitsError(RuntimeError):
    """Something read the values of a :class:`HeadLogits` stand-in."""


_MESSAGE = ("these logits were not made: gradaccel's head mode computed the loss a chunk of rows at a time from "
            "the hidden states (checkpoint_blocks(memory=...) or a gradaccel.fit plan with chunked_loss), so "
            "outputs.logits is a stand-in of shape {shape} that holds no values. To read logits in a training "
            "step, turn head mode off (gradaccel.memory.chunked_loss.set_head(model, False), or "
            "checkpoint_blocks(..., memory=None)), or call the model without labels (real logits) and "
            "compute the loss yourself; eval and no_grad calls return real logits.")

# Ops that read no values: a stand-in in, a stand-in out (accelerate's fp32 conversion of a
# model's outputs, DDP's clone of them, detach). Anything else raises.
_KEEPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.clone.default,
          torch.ops.aten._to_copy.default, torch.ops.aten.lift_fresh.default}


class HeadLogits(torch.Tensor):
    """What ``lm_head`` returns in head mode: a tensor with the logits' shape, dtype and device
    and no storage (0 bytes). The loss takes the head's input from it; reading its values (any
    op but ``detach``/``clone``/``.to(dtype)``, which give another stand-in) raises
    :class:`HeadLogitsError`."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape, dtype, device, source=None):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, storage_size=0,
                                                requires_grad=False)
        t._source = source
        return t

    def __init__(self, shape, dtype, device, source=None):
        super().__init__()

    def take_source(self):
        """The head's input, once (the loss takes it; the stand-in then holds nothing)."""
        source, self._source = self._source, None
        return source

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _KEEPS and isinstance(args[0], HeadLogits):
            t = args[0]
            return HeadLogits(t.shape, kwargs.get("dtype") or t.dtype, kwargs.get("device") or t.device)
        shape = next((tuple(a.shape) for a in args if isinstance(a, HeadLogits)), "?")
        raise HeadLogitsError(f"{func}: " + _MESSAGE.format(shape=shape))

    def __repr__(self, *, tensor_contents=None):
        return (f"HeadLogits(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}: not made, "
                "gradaccel head mode)")

    def _unreadable(self, *args, **kwargs):
        """Reads the values outside dispatch (to a list, to numpy, pickling): refused alike."""
        raise HeadLogitsError(_MESSAGE.format(shape=tuple(self.shape)))

    tolist = numpy = __array__ = __reduce_ex__ = _unreadable


class _HeadForward:
    """The LM head's ``forward`` once head mode is installed (an instance attribute shadowing
    the class's): in head mode, for a training call with grad and labels, the stand-in; else the
    head's own forward (``inner``: fuse_wgrad's routed forward, or None for the class's)."""

    wraps_forward = True  # gradaccel/accumulate/wgrad.py routes ``inner``, not this

    def __init__(self, module: nn.Linear, inner=None) -> None:
        self.module, self.inner = module, inner

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        state = m.__dict__
        if state.get("_gradaccel_head") and state.get("_gradaccel_labels") and m.training \
                and torch.is_grad_enabled() and isinstance(x, torch.Tensor):
            w = m.weight
            dtype = _autocast_dtype(x) or x.dtype
            if x.device == w.device and (x.dtype == w.dtype or _autocast_dtype(x) is not None):
                out = HeadLogits(tuple(x.shape[:-1]) + (w.shape[0],), dtype, x.device, source=x)
                state["_gradaccel_made"] = weakref.ref(out)
                return out
        return self.inner(x) if self.inner is not None else type(m).forward(m, x)


# -- head mode on a Hugging Face causal LM --------------------------------------------------------
class _HeadLoss:
    """A causal LM's ``loss_function`` in head mode: the stock ``ForCausalLMLoss`` maths through
    :class:`ChunkedLinearCrossEntropy` when its logits are the LM head's stand-in, else the original."""

    def __init__(self, head: nn.Linear, original):
        self.head, self.original = head, original

    def __call__(self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                 shift_labels=None, **kwargs):
        hidden = logits.take_source() if isinstance(logits, HeadLogits) else None
        if hidden is None:  # real logits (head mode off), or a stand-in something else made
            return self.original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if shift_labels is None:  # as ForCausalLMLoss: tokens < n predict n
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        labels = shift_labels.reshape(-1).to(hidden.device)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if num_items_in_batch is None:
            denom = (labels != ignore_index).sum()
        else:
            denom = num_items_in_batch.to(hidden.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        head = self.head
        return ChunkedLinearCrossEntropy.apply(hidden, head.weight, head.bias, None, labels, denom, ignore_index,
                                               chunk_rows(labels.numel(), vocab_size), _wgrad.sink_of(head))


def _labels_index(model) -> int | None:
    params = list(inspect.signature(type(model).forward).parameters)
    return params.index("labels") - 1 if "labels" in params else None  # - self


def _note_labels(model, args, kwargs):
    # The head does not see the labels: whether this call computes the loss is noted here.
    loss = model.__dict__.get("_loss_function")
    if isinstance(loss, _HeadLoss):
        i = model.__dict__.get("_gradaccel_labels_at")
        labels = kwargs.get("labels", args[i] if i is not None and i < len(args) else None)
        loss.head._gradaccel_labels = labels is not None and model.training and torch.is_grad_enabled()
    return None


def _clear_head(model, args, out):
    # Nothing of the head outlives the forward: a stand-in the loss did not take (the forward
    # failed) lets go of the hidden states.
    loss = model.__dict__.get("_loss_function")
    if isinstance(loss, _HeadLoss):
        state = loss.head.__dict__
        state["_gradaccel_labels"] = False
        ref = state.get("_gradaccel_made")
        if ref is not None:
            delattr(loss.head, "_gradaccel_made")  # (torch 2.11's dynamo traces no __dict__.pop or del)
            made = ref()
            if made is not None:
                made.take_source()
    return None


def _feeds_loss_straight(cls) -> bool:
    """Whether ``cls.forward`` assigns ``logits`` once, from ``self.lm_head(...)``, and hands it
    as it is to ``self.loss_function``: then the head's stand-in reaches the loss untouched."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return False

    def names(node):
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    writes = [n for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr))
              and "logits" in names(_targets(n))]
    if len(writes) != 1 or not isinstance(writes[0], ast.Assign):
        return False
    v = writes[0].value
    if not (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "lm_head"
            and isinstance(v.func.value, ast.Name) and v.func.value.id == "self"):
        return False
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "loss_function"]

    def passes_logits(call):
        given = [k.value for k in call.keywords if k.arg == "logits"] + call.args[:1]
        return len(given) == 1 and isinstance(given[0], ast.Name) and given[0].id == "logits"

    return bool(calls) and all(passes_logits(c) for c in calls)


def _targets(node) -> ast.AST:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return ast.Tuple(elts=list(targets), ctx=ast.Store())


def stock_head(model: nn.Module):
    """The LM head of a Hugging Face causal LM that head mode can run, else None: the loss is the
    stock ``ForCausalLMLoss`` (or head mode's already), the head a plain ``nn.Linear`` at
    ``model.lm_head`` whose forward is not the user's own, and ``forward`` hands the head's
    output straight to the loss (see the module doc)."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or getattr(model, "lm_head", None) is not head \
            or not hasattr(type(model), "loss_function"):
        return None
    own = vars(head).get("forward")
    if own is not None and not isinstance(own, _HeadForward) and not _wgrad.is_routed_forward(own):
        return None  # a forward the user set on the instance: head mode would bypass it
    if isinstance(model.loss_function, _HeadLoss):
        return head
    if model.loss_function is not ForCausalLMLoss or not _feeds_loss_straight(type(model)):
        return None
    return head


def head_flops(model: nn.Module) -> int:
    """What the loss in chunks costs beyond the model's own loss, per token: the LM head's matmul
    once more in backward (2 FLOPs a weight). 0 where the model has no stock head."""
    head = stock_head(model)
    return 0 if head is None else 2 * head.weight.numel()


def install_head(model: nn.Module) -> bool:
    """Prepares head mode on a Hugging Face causal LM (see :func:`stock_head`; off until
    :func:`set_head`). Returns whether the model has such a head."""
    head = stock_head(model)
    if head is None:
        return False
    current = model.loss_function
    if isinstance(current, _HeadLoss):
        return True
    head._gradaccel_head = False
    own = vars(head).get("forward")
    head.forward = _HeadForward(head, own)  # fuse_wgrad's routed forward, if any, runs inside it
    model._gradaccel_labels_at = _labels_index(model)
    model.register_forward_pre_hook(_note_labels, with_kwargs=True)
    model.register_forward_hook(_clear_head, always_call=True)
    model.loss_function = _HeadLoss(head, current)
    return True


def set_head(model: nn.Module, on: bool) -> None:
    """Turns head mode (installed by :func:`install_head`) on or off."""
    loss = getattr(model, "loss_function", None)
    if isinstance(loss, _HeadLoss):
        loss.head._gradaccel_head = on
