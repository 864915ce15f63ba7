"""The peak of one block's step under gradaccel's replay against ``torch.utils.checkpoint``.

    PYTHONPATH=. python -m bench.replay_peak [--tokens 1024 2048] [--lora 8]

One Hugging Face Llama decoder layer (hidden 256, MLP 1024, 4 heads, sdpa, fp32, batch 1) runs
forward and backward under three checkpoints: ``torch.utils.checkpoint``, ``gradaccel.checkpoint``
at ``budget=1`` byte (the keep-least plan: its replay rebuilds everything autograd saved; at
``budget=0`` gradaccel hands the region to torch's checkpoint itself) and at ``budget=0.5``; and
without checkpointing. Each is measured on a planned call (the third), in exact bytes: the most
bytes of storages alive at once that the step created (gradaccel.memory.LiveBytes), during the
forward and during the backward. ``--lora r`` adds a LoRA-like adapter (``x @ A @ B * s``, frozen
base weight) beside each of the block's linear layers.
"""

import argparse
import warnings

import torch
import torch.utils.checkpoint as tc
from torch import nn

import gradaccel
from gradaccel.memory import LiveBytes

VARIANTS = ("torch-nockpt", "torch-ckpt", "gradaccel-budget1B", "gradaccel-budget0.5")


class LoRALinear(nn.Module):
    """``base(x) + (x @ A) @ B * scale`` with the base frozen: the shape of a peft adapter."""

    def __init__(self, base: nn.Linear, r: int):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(base.in_features, r) / r)
        self.B = nn.Parameter(torch.randn(r, base.out_features) / base.out_features)
        self.scale = 2.0

    def forward(self, x):
        return self.base(x) + (x @ self.A) @ self.B * self.scale


def llama_block(hidden=256, inter=1024, heads=4, lora=0):
    """(decoder layer, rotary embedding) of a small HF Llama, fp32, sdpa, training mode; ``lora``:
    the adapters' rank on every linear layer (0: none)."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                                   num_key_value_heads=heads, vocab_size=128, max_position_embeddings=1 << 16)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    block = LlamaDecoderLayer(cfg, layer_idx=0).train()
    if lora:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, LoRALinear(child, lora))
    return block, LlamaRotaryEmbedding(cfg)


def step_peaks(block, rope, tokens: int, variant: str, calls: int = 3):
    """(forward peak, backward peak, input gradient, parameter gradients) of the last of ``calls``
    steps of ``block`` under ``variant`` (one of VARIANTS), in bytes the step created."""
    torch.manual_seed(1)
    x0 = torch.randn(1, tokens, block.hidden_size)
    pos = torch.arange(tokens)[None]
    with torch.no_grad():
        cos_sin = rope(x0, pos)
    forward = lambda x: block(x, position_embeddings=cos_sin)  # noqa: E731

    def run(x):
        if variant == "torch-nockpt":
            return forward(x)
        if variant == "torch-ckpt":
            return tc.checkpoint(block, x, position_embeddings=cos_sin, use_reentrant=False)
        budget = 1 if variant == "gradaccel-budget1B" else 0.5
        return gradaccel.checkpoint(block, x, position_embeddings=cos_sin, budget=budget)

    for _ in range(calls):
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        live = LiveBytes()
        with live:
            live.set_phase("fwd")
            loss = run(x).square().sum()
            live.set_phase("bwd")
            loss.backward()
            del loss
    grads = [p.grad.clone() for p in block.parameters() if p.grad is not None]
    return live.phases["fwd"][1], live.phases["bwd"][1], x.grad.clone(), grads


def measure(tokens_list=(1024, 2048), lora_ranks=(0, 8), hidden=256, inter=1024):
    """Rows (tokens, lora, variant, forward peak, backward peak), all in one run."""
    rows = []
    for lora in lora_ranks:
        block, rope = llama_block(hidden, inter, lora=lora)
        for t in tokens_list:
            for v in VARIANTS:
                f, b, _, _ = step_peaks(block, rope, t, v)
                rows.append((t, lora, v, f, b))
            gradaccel.reset_plans()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--lora", type=int, nargs="+", default=[0, 8])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=1024)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="budget=1 is an int")
    rows = measure(a.tokens, a.lora, a.hidden, a.inter)
    print(f"{'tokens':>6} {'lora':>4} {'variant':<20} {'fwd peak B':>12} {'bwd peak B':>12} {'bwd vs torch-ckpt':>17}")
    ref = {(t, r): b for t, r, v, f, b in rows if v == "torch-ckpt"}
    for t, r, v, f, b in rows:
        print(f"{t:>6} {r:>4} {v:<20} {f:>12} {b:>12} {b / ref[(t, r)]:>16.3f}x")


if __name__ == "__main__":
    main()
