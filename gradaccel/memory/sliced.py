"""A decoder block a slice of the sequence at a time, keys and values whole: the ``"sliced:n"`` plan.

A decoder block is token-wise but for attention, and attention mixes tokens only through its
keys and values (K/V). So the block runs as: K/V of the whole sequence (the input norm, the
``k_proj``/``v_proj`` projections with their adapters, rotary), made a slice of tokens at a
time; then, for each slice of ``ceil(T / n)`` queries, the whole block on those rows (norm, the
``q_proj`` projection, attention over the keys up to the slice's last row, ``o_proj``, residual,
norm, MLP, residual), each slice's output written into the block's output.

Backward (:class:`_SlicedBlock`, one autograd node per block) rebuilds K/V without grad, then
runs each slice's rows again with grad, last slice first, and takes their gradients
(``torch.autograd.grad``) with respect to the slice's input rows, K/V up to its last row (summed
in fp32 over the slices) and the block's trainable parameters (summed in fp32); last, K/V's
gradient goes back through their projections, a slice at a time. So a block's backward holds a
slice of every tokens x hidden tensor except its input, its output's gradient, its input's
gradient and K/V with their gradients; and between forward and backward it holds its input alone
(which ``inputs_on_host`` parks on the host). It recomputes what a keep-nothing checkpoint
recomputes (every op of the block once), plus the K/V projections once more; the parameters'
gradients come out of the node as any op's do (hooks, ``FusedAccumOptimizer``'s fold), once per
backward.

Attention over the keys ``0 .. s + L - 1`` for queries ``s .. s + L - 1`` is causal aligned to
the lower right (:func:`attend`): on CUDA, torch's ``causal_lower_right`` bias (flash attention
takes it as it is); on CPU, the keys before the slice without a mask and the slice's own keys
causally, the two merged by their log-sum-exp, with the backward of each part taken at the
merged output (the ring-attention identity), so no mask of queries x keys is ever made. A model's
own mask (padding, packed sequences) is sliced to the slice's rows and passed as it is.

Which blocks: the decoder layers and attention modules listed in :data:`ATTENTION` (Llama,
Mistral, Qwen2, Qwen3: the forwards this module reproduces, q/k norms included), without a sliding
window, logit soft-capping or attention dropout; :func:`why_not` says why another is not.
Their attention then runs as written here, whatever ``attn_implementation`` the model was given.
"""

import contextlib
import functools
import sys

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils._pytree import tree_flatten

from gradaccel.recompute.block_plan import BlockPlan, Mode, plan_of, set_plan
from gradaccel.recompute.blocks import model_class
from gradaccel.recompute.host_inputs import run_parked
from gradaccel.recompute.own_forward import own_forward
from gradaccel.recompute.context import capture_rng, rng_restored

__all__ = ["ATTENTION", "why_not", "run_sliced", "install_sliced", "set_sliced", "attend", "kv_flops"]

# Decoder layer -> its attention class, whose forwards run_sliced reproduces (transformers 5.x).
ATTENTION = {"LlamaDecoderLayer": "LlamaAttention", "MistralDecoderLayer": "MistralAttention",
             "Qwen2DecoderLayer": "Qwen2Attention", "Qwen3DecoderLayer": "Qwen3Attention"}


def why_not(block) -> str | None:
    """Why ``block`` cannot run sliced (a line for the fit's table), or None where it can."""
    name = model_class(block).__name__
    attn = getattr(block, "self_attn", None)
    if ATTENTION.get(name) is None or type(attn).__name__ != ATTENTION[name]:
        return f"{name} is not a decoder layer whose attention runs sliced ({', '.join(ATTENTION)})"
    config = getattr(attn, "config", None)
    window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
    if window is not None:
        return f"{name} attends over a sliding window of {window} tokens"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return f"{name} soft-caps its attention logits"
    if getattr(attn, "attention_dropout", 0.0):
        return f"{name} has attention dropout"
    return None


def _bounds(tokens: int, n: int) -> list:
    size = -(-tokens // n)
    return [(s, min(s + size, tokens)) for s in range(0, tokens, size)]


def _rope(attn):
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb


def _project(attn, proj, h, norm=None):
    """``proj(h)`` as ``(batch, heads, tokens, head_dim)``, through the head-dim ``norm`` where the
    attention has one (Qwen3's ``q_norm``, ``k_norm``)."""
    y = getattr(attn, proj)(h).view(*h.shape[:-1], -1, attn.head_dim)
    if norm is not None and getattr(attn, norm, None) is not None:
        y = getattr(attn, norm)(y)
    return y.transpose(1, 2)


def _kv(block, x, cos, sin):
    """The keys (rotated) and values of rows ``x`` of the block's input."""
    attn = block.self_attn
    h = block.input_layernorm(x)
    k = _project(attn, "k_proj", h, "k_norm")
    v = _project(attn, "v_proj", h)
    return _rope(attn)(k, k, cos, sin)[1], v


def kv_flops(block, x, cos, sin) -> int:
    """FLOPs of making K/V for rows ``x`` (what the plan recomputes beyond keep-nothing), counted
    by torch's ``FlopCounterMode`` (fake tensors count as real ones)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        _kv(block, x, cos, sin)
    return counter.get_total_flops()


class _CpuLowerRight(torch.autograd.Function):
    """Causal attention aligned to the lower right on CPU, without a mask (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, start, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, l1 = flash(q, k[:, :, :start], v[:, :, :start], 0.0, False, scale=scale)
        o2, l2 = flash(q, k[:, :, start:], v[:, :, start:], 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)
        out = (o1.float() * (l1 - lse).exp().unsqueeze(-1) + o2.float() * (l2 - lse).exp().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.start, ctx.scale = start, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        s, back = ctx.start, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        # Each part's backward at the merged output and log-sum-exp is its share of the whole's.
        dq1, dk1, dv1 = back(dout, q, k[:, :, :s], v[:, :, :s], out, lse, 0.0, False, scale=ctx.scale)
        dq2, dk2, dv2 = back(dout, q, k[:, :, s:], v[:, :, s:], out, lse, 0.0, True, scale=ctx.scale)
        return dq1 + dq2, torch.cat([dk1, dk2], 2), torch.cat([dv1, dv2], 2), None, None


def attend(q, k, v, start: int, scale: float, mask=None):
    """Attention of queries ``q`` (batch, heads, L, d) at positions ``start .. start + L - 1`` over
    keys and values ``k``, ``v`` (batch, kv heads, start + L, d), each query seeing the keys up to
    its own position; ``mask``: the model's own (rows of the slice, columns up to its end) instead."""
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    if q.device.type == "cpu":
        return _CpuLowerRight.apply(q, k, v, start, scale)
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]),
                                          scale=scale, enable_gqa=True)


def _attention(attn, k, v, start, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """The attention module's forward for one slice of rows, over the whole K/V up to its end."""
    q = _project(attn, "q_proj", hidden_states, "q_norm")
    cos, sin = position_embeddings
    q = _rope(attn)(q, q, cos, sin)[0]
    out = attend(q, k, v, start, attn.scaling, attention_mask)
    return attn.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


@contextlib.contextmanager
def _attention_over(attn, k, v, start):
    """``attn``'s forward, for a while, the slice's over the given K/V."""
    was = attn.__dict__.get("forward")
    attn.forward = functools.partial(_attention, attn, k, v, start)
    try:
        yield
    finally:
        if was is None:
            del attn.forward
        else:
            attn.forward = was


class _Slices:
    """One call of a sliced block: its forward, its arguments cut to a slice, and the generator
    and autocast states each slice ran with (a rebuild runs as the forward did)."""

    def __init__(self, block, forward, n, x, kwargs):
        self.block, self.forward, self.kwargs = block, forward, kwargs
        self.bounds = _bounds(x.shape[1], n)
        self.rng = {}
        self.devices = {x.device} | {t.device for t in tree_flatten(kwargs)[0] if isinstance(t, torch.Tensor)}
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]
        self.cache = torch.is_autocast_cache_enabled()

    def _cut(self, s, e):
        """The block's keyword arguments for rows ``s:e``."""
        kw = dict(self.kwargs)
        cos, sin = kw["position_embeddings"]
        kw["position_embeddings"] = (cos[:, s:e], sin[:, s:e])
        if torch.is_tensor(kw.get("position_ids")):
            kw["position_ids"] = kw["position_ids"][..., s:e]
        if torch.is_tensor(kw.get("cache_position")):
            kw["cache_position"] = kw["cache_position"][s:e]
        mask = kw.get("attention_mask")
        if torch.is_tensor(mask):
            kw["attention_mask"] = mask[..., s:e, :e]
        return kw

    @contextlib.contextmanager
    def replay(self, key):
        """Runs as the forward's ``key`` did: its generator states (stashed at the forward's
        first run, restored at every later one) and the forward's autocast."""
        with contextlib.ExitStack() as stack:
            if key in self.rng:
                stack.enter_context(rng_restored(self.rng[key]))
            else:
                self.rng[key] = capture_rng(self.devices)
            for device, on, dtype in self.autocast:
                if on:
                    stack.enter_context(torch.autocast(device, dtype, cache_enabled=self.cache))
            yield

    def kv(self, x, j):
        s, e = self.bounds[j]
        cos, sin = self._cut(s, e)["position_embeddings"]
        with self.replay(("kv", j)):
            return _kv(self.block, x, cos, sin)

    def whole_kv(self, x):
        """K and V of all rows ``x``, made a slice at a time (called without grad)."""
        k = v = None
        for j, (s, e) in enumerate(self.bounds):
            kj, vj = self.kv(x[:, s:e], j)
            if k is None:
                k = kj.new_empty((*kj.shape[:2], x.shape[1], kj.shape[-1]))
                v = vj.new_empty((*vj.shape[:2], x.shape[1], vj.shape[-1]))
            k[:, :, s:e], v[:, :, s:e] = kj, vj
        return k, v

    def rows(self, x, k, v, i):
        s, e = self.bounds[i]
        kw = self._cut(s, e)
        with self.replay(("rows", i)), _attention_over(self.block.self_attn, k, v, s):
            return self.forward(x, **kw)


class _SlicedBlock(torch.autograd.Function):
    """The block's node: ``forward`` runs it without grad, slice by slice; ``backward`` rebuilds
    each slice and takes its gradients (see the module docstring)."""

    @staticmethod
    def forward(ctx, run: _Slices, x, *params):
        k, v = run.whole_kv(x)
        out = None
        for i, (s, e) in enumerate(run.bounds):
            y = run.rows(x[:, s:e], k[:, :, :e], v[:, :, :e], i)
            if out is None:
                out = y.new_empty((*x.shape[:2], *y.shape[2:]))
            out[:, s:e] = y
            del y
        ctx.run = run
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, dout):
        (x,), run = ctx.saved_tensors, ctx.run
        params = [p for p in run.block.parameters() if p.requires_grad]
        with torch.no_grad():
            k, v = run.whole_kv(x)
        wants_x = ctx.needs_input_grad[1]
        dx = torch.zeros_like(x) if wants_x else None
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        grads = [None] * len(params)

        def add(found):
            for i, g in enumerate(found):
                if g is not None:
                    grads[i] = g.float() if grads[i] is None else grads[i].add_(g)

        for i in reversed(range(len(run.bounds))):
            s, e = run.bounds[i]
            with torch.enable_grad():
                xi = x[:, s:e].detach().requires_grad_(wants_x)
                ki, vi = k[:, :, :e].detach().requires_grad_(), v[:, :, :e].detach().requires_grad_()
                y = run.rows(xi, ki, vi, i)
                leaves = ([xi] if wants_x else []) + [ki, vi] + params
                found = torch.autograd.grad(y, leaves, dout[:, s:e], allow_unused=True)
            del y
            if wants_x:
                dx[:, s:e] += found[0]
                found = found[1:]
            dk[:, :, :e] += found[0]
            dv[:, :, :e] += found[1]
            add(found[2:])
            del found, xi, ki, vi
        del k, v
        for j, (s, e) in enumerate(run.bounds):
            with torch.enable_grad():
                xj = x[:, s:e].detach().requires_grad_(wants_x)
                kj, vj = run.kv(xj, j)
                leaves = ([xj] if wants_x else []) + params
                found = torch.autograd.grad((kj, vj), leaves, (dk[:, :, s:e].to(kj.dtype), dv[:, :, s:e].to(vj.dtype)),
                                            allow_unused=True)
            if wants_x:
                dx[:, s:e] += found[0]
                found = found[1:]
            add(found)
            del found, kj, vj, xj
        grads = [g if g is None else g.to(p.dtype) for g, p in zip(grads, params)]
        return (None, dx, *grads)


def run_sliced(block, n: int, forward, args: tuple, kwargs: dict):
    """``forward(*args, **kwargs)`` of ``block`` (its plain forward: no checkpoint around it) as
    ``n`` slices of the sequence, K/V whole (see the module docstring). Outside training (no
    grad) the block runs as it is."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    kwargs = dict(kwargs)
    x, args = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
    if args:
        raise ValueError(f"sliced plan: {type(block).__name__} called with more than its hidden states positionally")
    for name in ("cache", "past_key_values", "use_cache"):  # as HF's checkpointing: no cache in training
        if name in kwargs:
            kwargs[name] = False if name == "use_cache" else None
    for name, t in kwargs.items():
        if torch.is_tensor(t) and t.requires_grad:
            raise ValueError(f"sliced plan: {type(block).__name__}'s argument {name} requires grad: it cannot be sliced")
    if kwargs.get("position_embeddings") is None:
        raise ValueError(f"sliced plan: {type(block).__name__} was not given position_embeddings")
    run = _Slices(block, forward, max(1, int(n)), x, kwargs)
    params = [p for p in block.parameters() if p.requires_grad]
    return _SlicedBlock.apply(run, x, *params)


def _sliced_forward(block, *args, **kwargs):
    """The forward :func:`install_sliced` gives a block: sliced in training where its plan is
    SLICED, its input parked on the host where the plan's parking says so, and run with the next
    block under one checkpoint where it is a pair's first (gradaccel/memory/parking.py); as the
    model's own otherwise."""
    forward = own_forward(block, model_class(block))
    plan = plan_of(block)
    if not (plan is not None and plan.mode is Mode.SLICED and block.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    n = plan.slices
    pending = block.__dict__.pop("_gradaccel_pending", None)
    if pending is not None and args and args[0] is pending:
        return pending  # the pair's first block ran this one inside its checkpoint
    tail = plan.pair
    tail_plan = plan_of(tail)
    if tail_plan is not None and tail_plan.mode is Mode.SLICED:
        tail_forward = own_forward(tail, model_class(tail))

        def both(x):
            y = run_sliced(block, n, forward, (x,), kwargs)
            return run_sliced(tail, tail_plan.slices, tail_forward, (y,), kwargs)

        def run(*a):
            return torch.utils.checkpoint.checkpoint(both, *a, use_reentrant=False)
    else:
        tail = None

        def run(*a):
            return run_sliced(block, n, forward, a, kwargs)

    out = run_parked(run, args) if plan.parked else run(*args)
    if tail is not None:
        tail.__dict__["_gradaccel_pending"] = out
    return out


def install_sliced(block) -> None:
    """Gives ``block`` the forward that runs it sliced whenever its plan is SLICED (once)."""
    installed = block.__dict__.get("forward")
    if getattr(installed, "func", None) is not _sliced_forward:
        block.forward = functools.partial(_sliced_forward, block)


def set_sliced(block, n: int) -> None:
    """``block`` runs as ``n`` slices in training (``n`` >= 1; its checkpoint off: the plan is its
    own), its plan's parking kept."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    install_sliced(block)
    set_plan(block, (plan_of(block) or BlockPlan()).run_as(BlockPlan(Mode.SLICED, slices=n)))
