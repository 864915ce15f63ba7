"""``checkpoint_blocks(model, memory=...)``: one memory target for a training step, reached
below what per-block checkpoints can reach.

``memory`` is the most bytes one training step (forward and backward) may add above what
exists before it: the activations held for backward, backward's working set, and the
parameters' gradients, as :class:`gradaccel.memory.LiveBytes` counts them. At the first
training call for an input shape the model is profiled on fake tensors (gradaccel/_profile.py:
nothing allocated), and each block's plan is chosen so that the step's predicted peak
(``Profile.predict``) fits with the least recompute, on the peak's own terms
(gradaccel/_knapsack.py: what a block keeps is paid at every later phase, so the last blocks
keep more, and a block rebuilt with a larger working set makes the blocks before it keep less).
A block may run:

- a checkpoint plan at some budget (``gradaccel.checkpoint``'s planner), or no checkpoint where
  its plan would recompute nothing (the same memory, without the checkpoint's own cost);
- **parts**: uncheckpointed, each of its direct children (attention, MLP, norms) a keep-nothing
  checkpoint of its own. It recomputes what keep-least does and holds its parts' inputs instead
  of one, but backward rebuilds one part at a time, not the whole block at once while every
  gradient made so far is alive: below keep-least's floor, that working set is what counts;
- **tiles**: parts, with each token-wise part (an MLP of linear layers) a quarter of the tokens
  at a time, each its own checkpoint: backward rebuilds a quarter of its intermediates at once.

And where the model's loss does not fit or the peak is at the loss, **head**: for a Hugging
Face causal LM whose loss is the stock ``ForCausalLMLoss``, the loss is computed by
:class:`ChunkedLinearCrossEntropy` from the final hidden states and the LM head's weight, rows
at a time: it holds no logits-sized tensor for backward and rebuilds logits a chunk at a time
in backward (one more LM-head matmul, priced as such). The model's ``logits`` output is still
made by ``lm_head`` as before (and still differentiable), then freed when the caller drops it.

The choice is made once per input shape; outputs and gradients are those without
checkpointing (up to the order of floating-point sums). ``gradaccel.fit`` plans with the same
choices.
"""

import functools
import threading
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as _tc
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryTarget", "ChunkedLinearCrossEntropy", "install_head", "set_head", "set_plans"]

TILES = 4  # token chunks of a token-wise part in "tiles" mode
SEEN = 1024  # input shapes whose plan memory= keeps; past it, the oldest goes
PREDICT_LENGTHS = True  # False: profile each new input shape on fake tensors (before 2026-12; for bench/)
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


def has_parts(block: nn.Module) -> bool:
    """Whether ``block`` can run as its parts (two children or more with parameters); if so,
    readies them (:func:`install_parts`)."""
    if len(_parts_of(block)) < 2:
        return False
    install_parts(block)
    return True


def has_tiles(block: nn.Module) -> bool:
    """Whether ``block`` has parts and a token-wise one among them (tiles mode changes it)."""
    return has_parts(block) and any(_token_wise(c) for c in _parts_of(block))


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
        # ~16 MiB of fp32 logits a chunk, and at most 64 chunks: each chunk is a few kernels,
        # and the loop's Python is the fake-tensor profile's cost too.
        rows = max(1, (1 << 22) // max(1, vocab_size), -(-labels.numel() // 64))
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


def set_plans(model: nn.Module, blocks: list, chunked_loss: bool, settings: list) -> None:
    """Sets what each of ``model``'s checkpointed ``blocks`` runs: ``settings[i]`` is block
    ``i``'s int budget, None (uncheckpointed), or PARTS / TILES (gradaccel/_profile.py); and the
    loss in chunks on or off (the head must be installed to turn it on)."""
    from gradaccel._profile import PARTS, TILES

    for block, s in zip(blocks, settings):
        if s in (PARTS, TILES):
            install_parts(block)
        set_parts(block, s in (PARTS, TILES), s == TILES)
        if s is None:  # a plan that recomputes nothing: no checkpoint, and none of its cost
            block._gradaccel_fine = True
        elif s not in (PARTS, TILES):
            block._gradaccel_budget = s
    set_head(model, chunked_loss)


class MemoryTarget:
    """``checkpoint_blocks(memory=...)``'s forward pre-hook: picks, per input shape, the plan
    with the least recompute whose step peak fits ``memory`` (see the module docstring).

    Attributes:
        memory: the target in bytes.
        chosen: input signature -> ``(mode, predicted peak, floor)``; mode is ``"blocks"`` when
            every block runs a checkpoint plan (or none) and the loss is the model's, else a
            tuple of what the plan also uses: ``"parts"`` (blocks run as their parts),
            ``"tiles"`` (MLPs a chunk of tokens at a time), ``"head"`` (the loss in chunks);
            ``floor`` is the predicted peak with every block at its keep-least plan and the
            model's loss, the least per-block checkpoints reach.
    """

    def __init__(self, memory: int, blocks: list, model: nn.Module):
        self.memory = memory
        self.seen = {}
        self.chosen = {}
        self.lengths = {}  # structure key -> LengthProfile (gradaccel/_lengthprofile.py)
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
            self._set(module, blocks, False, [0] * len(blocks))
            _busy.on = True
            try:
                self.seen[key], self.chosen[key] = self._choose(module, args, kwargs)
            finally:
                _busy.on = False
                torch.clear_autocast_cache()
            for cache in (self.seen, self.chosen):  # one entry per length seen: the oldest go first
                while len(cache) > SEEN:
                    cache.pop(next(iter(cache)))
        head, settings = self.seen[key]
        # The loss computed outside the model (no labels): logits as they are.
        self._set(module, blocks, head and kwargs.get("labels") is not None, settings)
        return None

    def _profile(self, module, args, kwargs, head, predict=True):
        """The step's profile at this call's length: predicted from the structure's profiles
        at other lengths (gradaccel/_lengthprofile.py) where it can be, else a fake-tensor run."""
        from gradaccel._lengthprofile import LengthProfile, at_length, length_of, profile_lengths
        from gradaccel._profile import Profile

        def run(a, kw):
            return Profile(module, _step, (a, kw), grad_hooks=False, prepare=lambda m: set_head(m, head),
                           trajectories=True)

        length, structure = length_of(tree_flatten((args, kwargs))[0])
        if length is None or not PREDICT_LENGTHS or not predict:
            return run(args, kwargs)
        # The loss in chunks is its own structure; where its number of chunks follows the length
        # (a large vocabulary), the fit fails and each length is profiled.
        structure = (structure, head)
        lp = self.lengths.get(structure)
        if lp is None:
            lengths = profile_lengths(length)
            if lengths is None:
                return run(args, kwargs)
            try:
                lp = LengthProfile(lambda t: run(*at_length((args, kwargs), length, t)), lengths)
            except Exception as e:  # the model does not run at other lengths: per length, as before
                lp = _Unprofiled(repr(e))
            self.lengths[structure] = lp
            if lp.failed is not None:
                warnings.warn(f"gradaccel.checkpoint_blocks(memory=...): the step's profile is not predicted across "
                              f"lengths ({lp.failed}); each new length is profiled on fake tensors.", UserWarning,
                              stacklevel=5)
        try:
            if lp.failed is None and not lp.covers(length):
                lp.extend(length)  # one fake-tensor run, checked against the fit: covered from now on
            if lp.covers(length):
                return lp.at(length)
        except Exception as e:  # noqa: BLE001 (a length the fit cannot predict: profiled itself)
            lp.failed = repr(e)
        return run(args, kwargs)

    @staticmethod
    def _set(model, blocks, head, settings):
        set_plans(model, blocks, head, settings)

    def _choose(self, module, args, kwargs, predict=True):
        from gradaccel._knapsack import least_peak, least_recompute
        from gradaccel._profile import PARTS, TILES

        def plan(head):
            prof = self._profile(module, args, kwargs, head, predict)
            opts = [prof.options(prof.kind_of[i]) for i in range(len(prof.blocks))]
            return prof, opts, least_recompute(prof, opts, self.memory)

        tried = {False: plan(False)}
        plain, opts, points = tried[False]
        floor = plain.predict([o[0] for o in opts])["peak"]
        labels = kwargs.get("labels")
        if self.has_head and torch.is_tensor(labels) and (points is None or plain.predict(points)["phase"] == "head"):
            tried[True] = plan(True)
        head_cost = labels.numel() * head_flops(module) if True in tried else 0
        fitting = [(sum(p.cost for p in pts) + head_cost * h, h) for h, (_, _, pts) in tried.items() if pts is not None]
        if fitting:
            head = min(fitting)[1]
            prof, _, points = tried[head]
        else:
            least = {h: least_peak(prof, opts) for h, (prof, opts, _) in tried.items()}
            head = min(least, key=lambda h: tried[h][0].predict(least[h])["peak"])
            prof, points = tried[head][0], least[head]
        peak = prof.predict(points)["peak"]
        # The split works on estimated block peaks; the least-peak plan's exact peak may fit where
        # its estimate did not: it is then the plan, without a warning.
        if not fitting and peak > self.memory and any(hasattr(t[0], "_source") for t in tried.values()):
            # A predicted profile offers fewer plans than a profile of this length (the candidates
            # fitted across lengths): before going over the target, profile this length itself.
            return self._choose(module, args, kwargs, predict=False)
        if not fitting and peak > self.memory:
            warnings.warn(f"gradaccel.checkpoint_blocks: memory={self.memory} bytes is below the least this step can "
                          f"take with gradaccel's plans ({peak} bytes, predicted on fake tensors); using that plan. "
                          "Lower the micro-batch or sequence length to fit.", UserWarning, stacklevel=4)
        settings = [_setting(p, prof.kind_of[i], PARTS, TILES) for i, p in enumerate(points)]
        used = {s for s in settings if s in (PARTS, TILES)}
        mode = tuple(m for m, on in (("parts", bool(used)), ("tiles", TILES in used), ("head", head)) if on)
        return (head, settings), (mode or "blocks", peak, floor)


class _Unprofiled:
    """A structure whose profile at other lengths could not be made: every length is its own."""

    def __init__(self, reason):
        self.failed = reason


def _setting(point, kind, *parts_plans):
    """What :meth:`MemoryTarget._set` sets a block to for ``point``."""
    if point.plan in parts_plans:
        return point.plan
    if point.cost == 0 and point is kind.frontier[-1]:
        return None  # recomputes nothing: no checkpoint, and none of its cost
    return point.budget
