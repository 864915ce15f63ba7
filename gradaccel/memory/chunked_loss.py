"""The causal-LM loss in chunks: :class:`ChunkedLinearCrossEntropy` computes the loss from the
final hidden states and the LM head's weight, rows at a time, so no logits-sized tensor is held
for backward; backward rebuilds the logits a chunk at a time (one more LM-head matmul).

:func:`install_head` routes a Hugging Face causal LM's stock ``ForCausalLMLoss`` through it
(switched by :func:`set_head`); the ``memory=`` target and the fit choose it where the loss would
set the step's peak.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ChunkedLinearCrossEntropy", "chunk_rows", "head_flops", "install_head", "set_head", "stock_head"]


# -- head: the loss from hidden states, a chunk of rows at a time --------------------------------
class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(linear(hidden, weight, bias).float(), labels, reduction="sum") / denom``
    without holding logits for backward: forward reads the logits the model made already (or
    makes them a chunk at a time), saves the per-row log-sum-exp, and backward rebuilds each
    chunk's logits from ``hidden`` to form its gradient.

    Args (of ``apply``):
        hidden: ``(N, C)``; weight: ``(V, C)``; bias: ``(V,)`` or None.
        logits: ``(N, V)`` logits already made from the same hidden and weight (no grad), or None.
        labels: ``(N,)`` int64, ``ignore_index`` for rows that do not count.
        denom: what the sum is divided by (a number or a 0-d tensor).
        ignore_index: int; chunk: rows per chunk.

    Returns:
        A 0-d float32 tensor.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, logits, labels, denom, ignore_index, chunk):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for a in range(0, hidden.shape[0], chunk):
            b = min(a + chunk, hidden.shape[0])
            z = logits[a:b] if logits is not None else F.linear(hidden[a:b], weight, bias)
            z = z.float()
            y = labels[a:b]
            valid = y != ignore_index
            lse[a:b] = torch.logsumexp(z, dim=-1)
            picked = z.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
            total = total + torch.where(valid, lse[a:b] - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.denom, ctx.ignore_index, ctx.chunk = denom, ignore_index, chunk
        return total / denom

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        scale = grad / ctx.denom
        gh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if bias is not None and ctx.needs_input_grad[2] else None
        for a in range(0, hidden.shape[0], ctx.chunk):
            b = min(a + ctx.chunk, hidden.shape[0])
            h, y = hidden[a:b], labels[a:b]
            p = torch.exp(F.linear(h, weight, bias).float() - lse[a:b].unsqueeze(1))  # softmax
            valid = (y != ctx.ignore_index).unsqueeze(1)
            p.scatter_add_(1, y.clamp(min=0).unsqueeze(1), -valid.float())  # softmax - one-hot
            p = (p * (valid * scale)).to(hidden.dtype)  # d loss / d logits
            if gh is not None:
                gh[a:b] = p @ weight
            if gw is not None:
                gw += p.t().float() @ h.float()
            if gb is not None:
                gb += p.float().sum(0)
        return (gh, gw.to(weight.dtype) if gw is not None else None, gb.to(bias.dtype) if gb is not None else None,
                None, None, None, None, None)


def chunk_rows(rows: int, vocab: int) -> int:
    """Rows per chunk of :class:`ChunkedLinearCrossEntropy` for ``rows`` rows of ``vocab`` logits:
    ~16 MiB of fp32 logits a chunk, and at most 64 chunks (each chunk is a few kernels, and the
    loop's Python is the fake-tensor profile's cost too)."""
    return max(1, (1 << 22) // max(1, vocab), -(-rows // 64))


def _record_head(module, args, out):
    if module.__dict__.get("_gradaccel_head") and module.training and torch.is_grad_enabled():
        module._gradaccel_seen = (args[0], out)
    return None


class _HeadLoss:
    """A causal LM's ``loss_function`` in head mode: the stock ``ForCausalLMLoss`` maths through
    :class:`ChunkedLinearCrossEntropy` when its logits are the LM head's own, else the original."""

    def __init__(self, head: nn.Linear, original):
        self.head, self.original = head, original

    def __call__(self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                 shift_labels=None, **kwargs):
        seen = self.head.__dict__.pop("_gradaccel_seen", None)
        if seen is None or seen[1] is not logits or not self.head.__dict__.get("_gradaccel_head"):
            return self.original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        hidden = seen[0]
        if shift_labels is None:  # as ForCausalLMLoss: tokens < n predict n
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        labels = shift_labels.reshape(-1).to(logits.device)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if num_items_in_batch is None:
            denom = (labels != ignore_index).sum()
        else:
            denom = num_items_in_batch.to(logits.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        return ChunkedLinearCrossEntropy.apply(hidden, self.head.weight, self.head.bias,
                                               logits.detach().reshape(-1, vocab_size), labels, denom,
                                               ignore_index, chunk_rows(labels.numel(), vocab_size))


def _clear_head(model, args, out):
    # Whatever the loss did not take (no labels given) must not outlive the forward.
    loss = model.__dict__.get("_loss_function")
    if isinstance(loss, _HeadLoss):
        loss.head.__dict__.pop("_gradaccel_seen", None)
    return None


def stock_head(model: nn.Module):
    """The LM head of a Hugging Face causal LM whose loss is the stock ``ForCausalLMLoss`` (or is
    head mode's already), else None: what head mode needs."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or not hasattr(type(model), "loss_function"):
        return None
    return head if isinstance(model.loss_function, _HeadLoss) or model.loss_function is ForCausalLMLoss else None


def head_flops(model: nn.Module) -> int:
    """What the loss in chunks costs beyond the model's own loss, per token: the LM head's matmul
    once more in backward (2 FLOPs a weight). 0 where the model has no stock head."""
    head = stock_head(model)
    return 0 if head is None else 2 * head.weight.numel()


def install_head(model: nn.Module) -> bool:
    """Prepares head mode on a Hugging Face causal LM whose loss is the stock ``ForCausalLMLoss``
    (off until :func:`set_head`). Returns whether the model has such a head."""
    head = stock_head(model)
    if head is None:
        return False
    current = model.loss_function
    if isinstance(current, _HeadLoss):
        return True
    head._gradaccel_head = False
    head.register_forward_hook(_record_head)
    model.register_forward_hook(_clear_head)
    model.loss_function = _HeadLoss(head, current)
    return True


def set_head(model: nn.Module, on: bool) -> None:
    loss = getattr(model, "loss_function", None)
    if isinstance(loss, _HeadLoss):
        loss.head._gradaccel_head = on
