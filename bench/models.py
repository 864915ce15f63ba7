"""A compact causal GPT for the benchmarks (training and checkpointing suites).

Attention is materialised on purpose (``q @ k^T``, softmax, dropout, ``@ v``), not
``scaled_dot_product_attention``: the benchmarks measure what a memory-bound training step
really holds and recomputes, and the fused kernel would hide the ``T x T`` attention matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "CausalSelfAttention", "MLP", "Block", "GPT", "synthetic_tokens"]


@dataclass
class GPTConfig:
    """Shape of a GPT.

    Args:
        vocab_size: tokens in the vocabulary.
        seq_len: the longest sequence (positions learned up to it).
        n_layer: number of transformer blocks.
        n_embd: hidden size; must be divisible by ``n_head``.
        n_head: attention heads.
        dropout: dropout probability on attention weights and residual branches.
        bias: biases in the linear layers and layer norms.
        tie_weights: share the token embedding with the output head (its gradient then has two
            sources, which gradient accumulation must sum).
    """

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with an explicit ``(B, H, T, T)`` attention matrix."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).tril()
        # Not persistent: it is derived from the config, so state dicts stay parameters-only.
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(C, 4C), GELU, Linear(4C, C), dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``. (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final norm, linear head.

    ``forward(idx)`` returns logits (B, T, vocab); ``forward(idx, targets, reduction=...)``
    returns ``(logits, loss)`` with the cross-entropy over all tokens (``"mean"`` or ``"sum"``;
    targets equal to -100 are ignored).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init)
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance flat.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"):
        """idx: (B, T) int64 with T <= seq_len. Returns logits, or (logits, loss) given targets."""
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-100, reduction=reduction)
        return logits, loss


def synthetic_tokens(cfg: GPTConfig, n_seq: int, seed: int = 0, noise: float = 0.1) -> torch.Tensor:
    """(n_seq, seq_len + 1) int64 token sequences with learnable structure.

    Each next token is a fixed random permutation of the current one, except with probability
    ``noise`` a uniform random token, so a model's loss falls well below ``log(vocab)`` in a few
    hundred steps. Slice ``[:, :-1]`` as inputs and ``[:, 1:]`` as targets.
    """
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(cfg.vocab_size, generator=g)
    out = torch.empty(n_seq, cfg.seq_len + 1, dtype=torch.long)
    out[:, 0] = torch.randint(cfg.vocab_size, (n_seq,), generator=g)
    for t in range(cfg.seq_len):
        nxt = perm[out[:, t]]
        rand = torch.randint(cfg.vocab_size, (n_seq,), generator=g)
        out[:, t + 1] = torch.where(torch.rand(n_seq, generator=g) < noise, rand, nxt)
    return out
