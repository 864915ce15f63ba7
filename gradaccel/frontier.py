"""``checkpoint_blocks(model, memory=...)``: one memory target for a training step, reached
below what per-block plans can reach.

``memory`` is the most bytes one training step (forward and backward) may add above what
exists before it: the activations held for backward, backward's working set, and the
parameters' gradients, as :class:`gradaccel.memory.LiveBytes` counts them. At the first
training call for an input shape the model is profiled on fake tensors (gradaccel/_profile.py:
nothing allocated) and the plan with the least recompute whose peak fits is chosen, from a
ladder ordered by recompute:

1. **Per-block plans.** Each block's plan is chosen so that total recompute is least and the
   predicted peak (``Profile.predict``) fits, on the peak's own terms (gradaccel/_knapsack.py:
   what a block keeps is paid at every later phase, so the last block keeps more, and blocks
   rebuilt with a larger working set make the blocks before them keep less). A block whose
   plan recomputes nothing runs uncheckpointed (the same memory, without the checkpoint's
   own cost).
2. Below the keep-least per-block plans, a per-block checkpoint's floor is not its block's
   input (that is one hidden state per block) but backward's working set: a block recomputes
   all its activations at once before its backward runs, while every gradient made so far is
   alive; and the loss over a large vocabulary makes and holds logits-sized tensors.
   Two mechanisms lower it, tried in this order (fewest recompute FLOPs first), each measured
   on fake tensors by a whole fake step under ``LiveBytes``:

   - **parts**: each block runs uncheckpointed and each of its direct children (attention,
     MLP, norms) runs as its own keep-nothing checkpoint, so backward rebuilds one part at a
     time. The same FLOPs are recomputed; the block holds its parts' inputs instead of one.
   - **head**: for a Hugging Face causal LM whose loss is the stock ``ForCausalLMLoss``, the
     loss is computed by :class:`ChunkedLinearCrossEntropy` from the final hidden states and
     the LM head's weight, rows at a time: it holds no logits-sized tensor for backward and
     rebuilds logits a chunk at a time in backward (one more LM-head matmul). The model's
     ``logits`` output is still made by ``lm_head`` as before (and still differentiable),
     then freed when the caller drops it.
   - **tiles**: with parts, each token-wise part (an MLP of linear layers) runs a quarter of
     the tokens at a time, each its own checkpoint: backward rebuilds a quarter of its
     intermediates at once.
   - combinations of these, in the order of ``LOW_MEMORY_MODES``.

The choice is made once per input shape; outputs and gradients are those without
checkpointing (up to the order of floating-point sums).
"""

import functools
import threading
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as _tc
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryTarget", "ChunkedLinearCrossEntropy", "LOW_MEMORY_MODES", "install_head", "set_head"]

# Below the per-block floor, in order of recompute (then of regions run).
LOW_MEMORY_MODES = (("parts",), ("head",), ("parts", "head"), ("parts", "tiles"), ("parts", "tiles", "head"))
TILES = 4  # token chunks of a token-wise part in "tiles" mode
_busy = threading.local()


# -- parts: a block's children as their own checkpoints -----------------------------------------
def _part_forward(module, *args, **kwargs):
    forward = type(module).forward.__get__(module)
    if not (module.__dict__.get("_gradaccel_part") and module.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    tiles = module.__dict__.get("_gradaccel_tiles", 1)
    if tiles > 1 and len(args) == 1 and not kwargs and torch.is_tensor(args[0]) and args[0].dim() >= 2:
        # A token-wise part (an MLP): each chunk of tokens is its own checkpoint, so backward
        # rebuilds a chunk's intermediates at a time. Outputs are the same rows, concatenated.
        return torch.cat([_tc.checkpoint(forward, x, use_reentrant=False)
                          for x in args[0].chunk(tiles, dim=-2)], dim=-2)
    return _tc.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _token_wise(module: nn.Module) -> bool:
    """An MLP made of linear layers and parameterless activations: each token's output depends
    on that token alone, so it can run a chunk of tokens at a time."""
    return type(module).__name__.endswith("MLP") and all(
        isinstance(m, nn.Linear) or not any(True for _ in m.parameters(recurse=False))
        for m in module.modules())


def _parts_of(block: nn.Module) -> list:
    return [c for c in block.children() if any(True for _ in c.parameters())]


def install_parts(block: nn.Module) -> None:
    """Lets ``block``'s children run as their own checkpoints (off until :func:`set_parts`)."""
    for child in _parts_of(block):
        if "_gradaccel_part" not in child.__dict__:
            child._gradaccel_part = False
            child.forward = functools.partial(_part_forward, child)


def set_parts(block: nn.Module, on: bool, tiles: bool = False) -> None:
    """``on``: ``block`` runs uncheckpointed and its children as keep-nothing checkpoints;
    ``tiles``: its token-wise children (MLPs) a chunk of tokens at a time."""
    block._gradaccel_fine = on
    for child in _parts_of(block):
        if "_gradaccel_part" in child.__dict__:
            child._gradaccel_part = on
            child._gradaccel_tiles = TILES if on and tiles and _token_wise(child) else 1


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
        rows = max(1, (1 << 22) // max(1, vocab_size))  # ~16 MiB of fp32 logits a chunk
        return ChunkedLinearCrossEntropy.apply(hidden, self.head.weight, self.head.bias,
                                               logits.detach().reshape(-1, vocab_size), labels, denom,
                                               ignore_index, rows)


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


# -- the target ---------------------------------------------------------------------------------
def _loss_of(out):
    """The scalar a fake step backpropagates: the model's ``loss``, else its output summed (a
    stand-in for a loss computed outside the model)."""
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(loss, dict) or not torch.is_tensor(loss):
            loss = tree_flatten(out)[0][0]
    return loss if loss.dim() == 0 else loss.float().sum()


def _step(model, batch):
    args, kwargs = batch
    return _loss_of(model(*args, **kwargs))


class MemoryTarget:
    """``checkpoint_blocks(memory=...)``'s forward pre-hook: picks, per input shape, the plan
    with the least recompute whose step peak fits ``memory`` (see the module docstring).

    Attributes:
        memory: the target in bytes.
        chosen: input signature -> ``(mode, predicted peak, floor)``; mode is ``"blocks"`` or a
            tuple of :data:`LOW_MEMORY_MODES`; ``floor`` is the predicted peak with every block at
            its keep-least plan, the least per-block plans reach.
    """

    def __init__(self, memory: int, blocks: list, model: nn.Module):
        self.memory = memory
        self.seen = {}
        self.chosen = {}
        for b in blocks:
            install_parts(b)
        self.has_head = install_head(model)

    def __call__(self, module, args, kwargs):
        if getattr(_busy, "on", False) or not (module.training and torch.is_grad_enabled()):
            return None
        from gradaccel._profile import find_blocks

        flat = tree_flatten((args, kwargs))[0]
        key = tuple((tuple(t.shape), t.dtype) for t in flat if isinstance(t, torch.Tensor))
        blocks = find_blocks(module)
        if key not in self.seen:
            self._set(module, blocks, (), [0] * len(blocks))
            _busy.on = True
            try:
                self.seen[key], self.chosen[key] = self._choose(module, args, kwargs)
            finally:
                _busy.on = False
                torch.clear_autocast_cache()
        mode, budgets = self.seen[key]
        if kwargs.get("labels") is None:  # the loss is computed outside the model: logits as they are
            mode = tuple(m for m in mode if m != "head") if mode != "blocks" else mode
        self._set(module, blocks, mode, budgets)
        return None

    def _set(self, model, blocks, mode, budgets):
        for block, budget in zip(blocks, budgets):
            block._gradaccel_budget = budget or 0
            set_parts(block, "parts" in mode, "tiles" in mode)
            if budget is None:  # a plan that recomputes nothing: no checkpoint, and none of its cost
                block._gradaccel_fine = True
        set_head(model, "head" in mode)

    def _choose(self, module, args, kwargs):
        from gradaccel._knapsack import least_recompute
        from gradaccel._profile import Profile

        prof = Profile(module, _step, (args, kwargs), grad_hooks=False, skeleton=True)
        fronts = [prof.kind_of[i].frontier for i in range(len(prof.blocks))]
        least = [f[0] for f in fronts]
        floor = prof.predict(least)["peak"]
        points = least_recompute(prof, fronts, self.memory) if floor <= self.memory else None
        if points is not None:
            budgets = [None if p.cost == 0 and p is f[-1] else p.budget for p, f in zip(points, fronts)]
            return ("blocks", budgets), ("blocks", prof.predict(points)["peak"], floor)
        tried = []
        for mode in LOW_MEMORY_MODES:
            if "head" in mode and not self.has_head:
                continue
            peak = _fake_peak(prof, mode, least)
            tried.append((peak, mode))
            if peak <= self.memory:
                return (mode, [p.budget for p in least]), (mode, peak, floor)
        peak, mode = min(tried + [(floor, ())], key=lambda t: t[0])
        warnings.warn(f"gradaccel.checkpoint_blocks: memory={self.memory} bytes is below the least this step can "
                      f"take with gradaccel's plans ({peak} bytes, predicted on fake tensors); using that plan. "
                      "Lower the micro-batch or sequence length to fit.", UserWarning, stacklevel=4)
        return (mode, [p.budget for p in least]), (mode, peak, floor)


def _fake_peak(prof, mode, least) -> int:
    """Peak live bytes of a whole fake step with ``mode`` on (blocks not in parts mode run their
    keep-least plan, as checkpoint_blocks would)."""
    from gradaccel._profile import _run_plan
    from gradaccel.memory import LiveBytes

    model = prof.model
    for b in prof.blocks:
        install_parts(b)
        set_parts(b, "parts" in mode, "tiles" in mode)
    if "head" in mode:
        install_head(model)
    set_head(model, "head" in mode)

    def runner(i, forward, *args, **kwargs):
        if "parts" in mode:
            return forward(*args, **kwargs)
        return _run_plan(forward, least[i].plan, args, kwargs)

    for p in model.parameters():
        p.grad = None
    originals = prof._install(runner)
    live = LiveBytes()
    try:
        with prof.mode, torch.enable_grad(), live:
            loss = prof.step(model, prof.batch)
            loss.backward()
            del loss
    finally:
        prof._uninstall(originals)
        for b in prof.blocks:
            set_parts(b, False)
        set_head(model, False)
        for p in model.parameters():
            p.grad = None
    return live.peak
