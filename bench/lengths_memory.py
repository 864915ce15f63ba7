"""memory= over steps of new sequence lengths: per-length fake-tensor profiles (before) against
the length profile (gradaccel/memory/lengths.py), side by side with HF checkpointing and no
checkpointing, in one run. Reports total time relative to HF checkpointing, fake-tensor
profiles made, and each step's peak of live bytes against the target.

    PYTHONPATH=. python bench/lengths_memory.py --steps 40
"""

import argparse
import random
import time

import torch

import gradaccel
import gradaccel.memory.target as frontier
from gradaccel.memory.profile import profile_runs
from gradaccel.memory.counter import LiveBytes


def llama(layers, hidden, vocab):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=int(2.75 * hidden), num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=vocab,
                                   max_position_embeddings=2048, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).train()


def step(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def peak(model, ids):
    """The step's peak of live bytes, on a step of its own after the timed one (which planned:
    LiveBytes leaves planning's fake tensors out, but its dispatch mode would slow the timing)."""
    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return live.peak


class _Timed:
    """Wraps memory='s forward pre-hook to time the planning it does."""

    def __init__(self, hook):
        self.hook, self.seconds = hook, 0.0

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.hook(*args)
        finally:
            self.seconds += time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--fraction", type=float, default=0.6, help="target: this fraction of no checkpointing's peak")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(0)
    warm = [a.max_len, a.max_len // 2, a.max_len // 4, 3 * a.max_len // 4]
    # Skewed like instruction data: many short texts, a few long ones; none seen in warm-up.
    lengths = []
    while len(lengths) < a.steps:
        t = min(a.max_len, max(8, int(rng.lognormvariate(4.8, 0.6))))
        if t not in warm and t not in lengths:
            lengths.append(t)
    ids = {t: torch.randint(0, a.vocab, (1, t), generator=torch.Generator().manual_seed(t)) for t in warm + lengths}
    memory = int(a.fraction * peak(llama(a.layers, a.hidden, a.vocab), ids[a.max_len]))
    variants = {"no checkpointing": lambda m: m, "HF checkpointing": lambda m: (m.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False}), m)[1],
        "memory= (profile per length: before)": lambda m: gradaccel.checkpoint_blocks(m, memory=memory),
        "memory= (length profile)": lambda m: gradaccel.checkpoint_blocks(m, memory=memory)}
    rows = {}
    for name, make in variants.items():
        gradaccel.reset_plans()
        frontier.PREDICT_LENGTHS = "before" not in name
        model = make(llama(a.layers, a.hidden, a.vocab))
        timed = None
        for k, hook in list(model._forward_pre_hooks.items()):
            if isinstance(hook, frontier.MemoryTarget):
                timed = model._forward_pre_hooks[k] = _Timed(hook)
        start = time.perf_counter()
        for t in warm:
            step(model, ids[t])
        warmup = time.perf_counter() - start
        runs = profile_runs()
        blocks = sum(lp.block_runs for lp in getattr(getattr(timed, "hook", None), "lengths", {}).values()
                     if hasattr(lp, "block_runs"))
        total, planning, peaks = 0.0, 0.0, []
        for t in lengths:
            before = timed.seconds if timed else 0.0
            start = time.perf_counter()
            step(model, ids[t])  # the first step at this length: planning included
            total += time.perf_counter() - start
            planning += (timed.seconds - before) if timed else 0.0
            peaks.append(peak(model, ids[t]))
        blocks = sum(lp.block_runs for lp in getattr(getattr(timed, "hook", None), "lengths", {}).values()
                     if hasattr(lp, "block_runs")) - blocks
        rows[name] = (warmup, total, planning, profile_runs() - runs, blocks, peaks)
    frontier.PREDICT_LENGTHS = True
    hf = rows["HF checkpointing"][1]
    print(f"{a.steps} new lengths {min(lengths)}..{max(lengths)} (warm-up {warm}), Llama {a.layers}x{a.hidden}, "
          f"vocab {a.vocab}, 1 thread; target {memory} bytes")
    print(f"{'variant':<40} {'warm-up s':>9} {'time s':>7} {'vs HF':>6} {'planning s':>10} {'profiles':>8} "
          f"{'block runs':>10} {'max peak/target':>15} {'steps over':>10}")
    for name, (warmup, secs, planning, runs, blocks, peaks) in rows.items():
        over = sum(p > memory for p in peaks)
        print(f"{name:<40} {warmup:9.2f} {secs:7.2f} {secs / hf:6.2f} {planning:10.2f} {runs:8d} {blocks:10d} "
              f"{max(peaks) / memory:15.3f} {over:10d}")


if __name__ == "__main__":
    main()
