"""A tiny pre-norm transformer block for the tests, so that they import nothing from bench/.

Attention is materialised (``q @ k^T``, causal mask, softmax, dropout, ``@ v``): the ops a real
block saves for backward, dropout's random draws among them, which the planner must handle.
"""

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class GPTConfig:
    seq_len: int = 32
    n_embd: int = 64
    n_head: int = 4
    dropout: float = 0.0


class Attention(nn.Module):
    """Multi-head causal self-attention with an explicit (B, H, T, T) attention matrix."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        c, self.n_head = cfg.n_embd, cfg.n_head
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.attn_drop, self.resid_drop = nn.Dropout(cfg.dropout), nn.Dropout(cfg.dropout)
        self.register_buffer("mask", torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.n_head))
        att = self.attn_drop(F.softmax(att.masked_fill(~self.mask[:T, :T], float("-inf")), dim=-1))
        return self.resid_drop(self.proj((att @ v).transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc, self.proj = nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``; (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.n_embd), Attention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def assert_grads_match(ref, model):
    """Checkpointing does not change the maths: only ulp-level differences from a recompute that
    orders reductions differently are allowed, relative to each tensor's scale."""
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert q.grad is not None, name
        scale = p.grad.abs().max().item() or 1.0
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6 * scale, msg=lambda m, name=name: f"{name}: {m}")


class PlainBlock(nn.Module):
    """A pre-norm block of plain modules, no config: attention by SDPA (``materialised=False``)
    or as ``q @ k^T`` scores held for backward (``True``: quadratic in the length)."""

    def __init__(self, width: int, heads: int, materialised: bool = False):
        super().__init__()
        self.heads, self.materialised = heads, materialised
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.materialised:
            att = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
            a = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1) @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def hf_llama(hidden: int, inter: int, layers: int, vocab: int, seq: int):
    """A Hugging Face Llama causal LM (4 heads, 2 of keys and values, sdpa, fp32), the same
    weights at every call, in training mode."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=seq, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).train()


def token_batch(vocab: int, seq: int) -> dict:
    """One sequence of ``seq`` token ids (the same at every call), its own labels."""
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}
