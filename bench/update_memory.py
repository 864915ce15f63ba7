"""The update's own memory: what the ``step()`` that ends a window allocates and holds.

Not a suite (``python -m bench`` does not run it): a side-by-side measurement of one fact, run as

    python -m bench.update_memory [--layers 12] [--embd 768] [--vocab 50257] [--device cpu|cuda]

bf16 parameters of a GPT-2 layout (``bench.accumulate.gpt2_layout``), no fp32 masters, plain
SGD (it allocates nothing itself), one window of two micro-batches whose gradients are set by
hand. Stock PyTorch's ``opt.step()`` on bf16 ``.grad`` is the baseline. On CUDA the figure is
``torch.cuda.max_memory_allocated`` above the memory before the step; on CPU, the bytes of the
storages created by the step and alive when the inner optimizer begins
(``gradaccel.memory.counter.StorageLog``). The time is the median of the update step alone, unlogged.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.accumulate import gpt2_layout
from gradaccel.memory.counter import StorageLog
from gradaccel import FusedAccumOptimizer


def _held_at_inner_step(opt, inner) -> int:
    """Runs ``opt.step()`` and returns the bytes of the storages created in it that are alive when
    the inner optimizer's step begins: what the update holds besides the model and its state
    while the optimizer runs (the old bf16 gradient copies were all alive then)."""
    log, held = StorageLog(), []
    hook = inner.register_step_pre_hook(
        lambda *_: held.append(sum(st.nbytes() for _, st, _ in log.created.live())))
    try:
        with log:
            opt.step()
    finally:
        hook.remove()
    return held[0]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _update(params, opt, fused: bool, grads) -> None:
    """One window: two micro-batches of gradients (set by hand), then the update."""
    for k, gs in enumerate(grads):
        for p, g in zip(params, gs):
            if fused:  # folded at the wrapper's step(), which drops it: nothing to clone
                p.grad = g
            elif k == 0:
                p.grad = g.clone()
            else:
                p.grad += g
        if fused and k < len(grads) - 1:
            opt.step()


def measure(shapes: list[tuple], device: str, fused: bool, reps: int = 5) -> tuple[int, float]:
    """Returns (extra bytes of the update, as the module docstring says; median seconds of it)."""
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g, device=device).to(torch.bfloat16)) for s in shapes]
    grads = [[torch.randn(s, generator=g, device=device).to(torch.bfloat16) for s in shapes] for _ in range(2)]
    inner = torch.optim.SGD(params, lr=1e-3)
    opt = FusedAccumOptimizer(inner, 2) if fused else inner
    peak, times = 0, []
    for rep in range(reps + 1):
        _update(params, opt, fused, grads)
        _sync(device)
        if rep == 0:  # the measured update, under the log on CPU
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                opt.step()
                _sync(device)
                peak = torch.cuda.max_memory_allocated() - before
            else:
                peak = _held_at_inner_step(opt, inner)
        else:
            t = time.perf_counter()
            opt.step()
            _sync(device)
            times.append(time.perf_counter() - t)
        opt.zero_grad()
    return peak, sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = gpt2_layout(args.layers, args.embd, args.vocab)
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"{n:,} bf16 parameters (gradients {2 * n / 2**20:.1f} MiB), no masters, SGD, {args.device}")
    base = None
    for name, fused in (("torch", False), ("gradaccel", True)):
        peak, sec = measure(shapes, args.device, fused)
        base = base or sec
        print(f"{name:10s} extra held by the update {peak / 2**20:8.2f} MiB  "
              f"update {sec * 1e3:8.1f} ms  ({sec / base:.2f}x torch)")


if __name__ == "__main__":
    main()
