"""The update's own memory: extra bytes allocated during the ``step()`` that ends a window.

Not a suite (``python -m bench`` does not run it): a side-by-side measurement of one fact, run as

    python -m bench.update_memory [--layers 12] [--embd 768] [--vocab 50257] [--device cpu|cuda]

bf16 parameters of a GPT-2 layout (``bench.accumulate.gpt2_layout``), no fp32 masters, plain
SGD (it allocates nothing itself), one window of two micro-batches whose gradients are set by
hand. Stock PyTorch's ``opt.step()`` on bf16 ``.grad`` is the baseline. On CPU the peak is of
the storages created during the step and still alive (``gradaccel.measure.StorageLog``, checked
after every op); on CUDA it is ``torch.cuda.max_memory_allocated`` above the memory before the
step. The time is the median of the update step alone, without the log.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.accumulate import gpt2_layout
from gradaccel.measure import StorageLog
from gradaccel.optimizer import FusedAccumOptimizer


class _PeakLog(StorageLog):
    """Peak bytes of the storages created while active and still alive, after each op."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.peak = max(self.peak, sum(st.nbytes() for _, st, _ in self.created.live()))
        return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _update(params, opt, fused: bool, grads) -> None:
    """One window: two micro-batches of gradients (set by hand), then the update."""
    for k, gs in enumerate(grads):
        for p, g in zip(params, gs):
            if fused or k == 0:  # the wrapper folds each micro-batch's .grad at its step()
                p.grad = g.clone()
            else:
                p.grad += g
        if fused and k < len(grads) - 1:
            opt.step()


def measure(shapes: list[tuple], device: str, fused: bool, reps: int = 5) -> tuple[int, float]:
    """Returns (peak extra bytes during the update, median seconds of the update)."""
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
                log = _PeakLog()
                with log:
                    opt.step()
                peak = log.peak
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
        print(f"{name:10s} peak extra during the update {peak / 2**20:8.2f} MiB  "
              f"update {sec * 1e3:8.1f} ms  ({sec / base:.2f}x torch)")


if __name__ == "__main__":
    main()
