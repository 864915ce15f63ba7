"""What every suite shares: the row format and an interleaved, warmed-up median timer."""

import statistics
import time
from typing import Callable

import torch


def row(suite: str, case: str, variant: str, metric: str, value: float, unit: str, device: str) -> dict:
    """One result. Variants are named ``torch…`` (the baseline) or ``gradaccel…``."""
    return {"suite": suite, "case": case, "variant": variant, "metric": metric,
            "value": float(value), "unit": unit, "device": device}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_interleaved(fns: dict[str, Callable[[], object]], device: str, warmup: int = 2,
                     reps: int = 5) -> dict[str, float]:
    """Median seconds per call of each function, measured round-robin in one run.

    Interleaving (A B C A B C …) makes a drift in machine speed hit every variant alike, so
    their ratios stay meaningful on a noisy machine. CUDA time comes from events.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    _sync(device)
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if device.startswith("cuda"):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}
