"""FLOP formulas for ops outside torch's flop registry that fine-tuning meets in checkpointed blocks.

torch's ``FlopCounterMode`` registry covers aten. A QLoRA model's projections run
bitsandbytes' ``gemm_4bit``, and a model loaded with ``attn_implementation="flash_attention_2"``
runs flash-attn's kernels; neither has an entry there. Without a formula such an op is priced by
its measured time (gradaccel/recompute/trace.py ``_flops``), which holds at the traced size only.
With one, its cost at every other size is a formula of the sizes like any aten op's.

The table is gradaccel's own, keyed by op name, so that importing gradaccel changes nothing in
torch's registry (a user's ``FlopCounterMode`` counts as it did) and needs none of those
libraries installed. Each formula takes the op's arguments as the op does and returns an int
(a ``torch.SymInt`` on symbolic sizes). Ops not here that have no torch formula are priced by
time and scaled with the size of their largest input (gradaccel/recompute/symbolic.py).

Liger-Kernel's fused ops launch Triton kernels inside ``autograd.Function`` s rather than
dispatcher ops, so they are not ops a trace records at all.
"""

import math


def _numel(shape) -> int:
    return math.prod(shape)


def gemm_4bit(A, B, shapeB, *args, **kwargs) -> int:
    """bitsandbytes' 4-bit GEMM ``A @ dequantize(B).T``: ``shapeB`` is the dequantised weight's
    (out_features, in_features), ``A`` (..., in_features)."""
    return 2 * A.numel() * shapeB[0]


def flash_forward(q, k, *args, **kwargs) -> int:
    """flash-attn's forward on ``q`` (batch, Tq, heads, d), ``k`` (batch, Tk, kv heads, d):
    two GEMMs per head, Q·Kᵀ and P·V, as torch counts SDPA (a causal mask is not discounted)."""
    b, tq, h, d = q.shape
    return 4 * b * h * tq * k.shape[1] * d


def flash_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args, **kwargs) -> int:
    """flash-attn's variable-length forward on ``q`` (total tokens, heads, d): each token
    attends to at most ``max_seqlen_k`` keys (the sequence lengths themselves are data)."""
    total, h, d = q.shape
    return 4 * total * h * d * max_seqlen_k


def flash_backward(dout, q, k, *args, **kwargs) -> int:
    """flash-attn's backward: Q·Kᵀ again, then dV, dP, dQ and dK: 2.5 forwards."""
    b, tq, h, d = q.shape
    return 10 * b * h * tq * k.shape[1] * d


def flash_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, *args, **kwargs) -> int:
    """flash-attn's variable-length backward: 2.5 of its forward's bound."""
    total, h, d = q.shape
    return 10 * total * h * d * max_seqlen_k


FORMULAS = {
    "bitsandbytes.gemm_4bit": gemm_4bit,
    "flash_attn._flash_attn_forward": flash_forward,
    "flash_attn._flash_attn_backward": flash_backward,
    "flash_attn._flash_attn_varlen_forward": flash_varlen_forward,
    "flash_attn._flash_attn_varlen_backward": flash_varlen_backward,
}


def formula(func, args, kwargs):
    """FLOPs of ``func`` on these arguments by the table, or None where it has no entry."""
    f = FORMULAS.get(str(func.overloadpacket))
    return None if f is None else f(*args, **kwargs)
