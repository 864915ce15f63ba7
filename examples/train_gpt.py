"""Train a small byte-level GPT on the source of Python's own standard library (no download).

    python examples/train_gpt.py --accum-steps 8 --budget 0.5 --dtype bfloat16

Each optimizer step is one window of --accum-steps micro-batches: the loop is the stock one
(backward, step, zero_grad every micro-batch) and FusedAccumOptimizer decides when to update.
--budget checkpoints every block (a fraction of its activations kept, or bytes; "off" for none).
"""

import argparse
import math
import os
import resource
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccel import FusedAccumOptimizer, checkpoint_blocks


def stdlib_corpus(max_bytes):
    """Bytes of the standard library's .py files, in a fixed order."""
    root, chunks, total = os.path.dirname(os.__file__), [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and total < max_bytes:
            with open(os.path.join(root, name), "rb") as f:
                chunks.append(f.read())
            total += len(chunks[-1])
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers, d, heads, seq, vocab=256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def parse_budget(text):
    if text == "off":
        return "off"
    return float(text) if any(c in text for c in ".en") else int(text)  # "0.5", "1e-1", "nan"; "65536" bytes


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accum-steps", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--budget", type=parse_budget, default="0.5", help='fraction, bytes, or "off"')
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps (windows)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    data = stdlib_corpus(args.corpus_bytes)
    print(f"corpus: {len(data):,} bytes of stdlib source, device {device}, dtype {args.dtype}")

    model = GPT(args.layers, args.d_model, args.heads, args.seq).to(device=device, dtype=dtype)
    if args.budget != "off":
        checkpoint_blocks(model, budget=args.budget)
    # Low-precision parameters get fp32 master copies; gradients accumulate in fp32 either way.
    opt = FusedAccumOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1),
                              args.accum_steps, max_grad_norm=1.0, master_weights=dtype != torch.float32)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {args.layers} blocks, "
          f"window = {args.accum_steps} x {args.micro_batch} x {args.seq} tokens, budget {args.budget}")

    gen = torch.Generator().manual_seed(args.seed)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    window, tokens, start = 0, 0, time.perf_counter()
    while window < args.steps:
        starts = torch.randint(0, len(data) - args.seq - 1, (args.micro_batch,), generator=gen)
        chunk = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()]).to(device)
        loss = model(chunk[:, :-1], chunk[:, 1:])
        loss.backward()
        tokens += chunk[:, 1:].numel()
        if opt.step(loss=loss):  # True at the end of a window: the update happened
            window += 1
            mean = opt.window_loss  # the window's loss, weighted as its gradient: the big batch's
            print(f"step {window:4d}  loss {mean:.4f}  ppl {math.exp(min(mean, 50)):.1f}  "
                  f"grad-norm {opt.last_grad_norm:.3f}", flush=True)
        opt.zero_grad()
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if device == "cuda":
        peak = f"{torch.cuda.max_memory_allocated() / 2**20:.1f} MiB allocated on the GPU"
    else:
        peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.1f} MiB resident (process)"
    print(f"tokens/s: {tokens / elapsed:,.0f}")
    print(f"peak memory: {peak}")


if __name__ == "__main__":
    main()
