"""What every suite shares: the row format and an interleaved, warmed-up median timer."""

import contextlib
import os
import re
import statistics
import sys
import tempfile
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


# --- Hooks between the suites and the `python -m bench` front end -----------------------------
# Suites call these; the CLI wires them. Run outside the CLI (a notebook, pytest), they are inert.

TINY_ENV = "GRADACCEL_BENCH_TINY"

_progress_hook: Callable[[str, int | None, int | None], None] | None = None


def progress(case: str, i: int | None = None, n: int | None = None) -> None:
    """Tell the front end which case a suite starts now.

    Args:
        case: the case name, as it will appear in the rows' ``case`` field.
        i, n: optional position, 1-based, and total number of cases, for a ``(i/n)`` counter;
            without them the front end counts calls itself.

    A no-op unless ``python -m bench`` is running the suite.
    """
    if _progress_hook is not None:
        _progress_hook(case, i, n)


def set_progress_hook(hook: Callable[[str, int | None, int | None], None] | None) -> None:
    """Install (or, with ``None``, remove) the display that :func:`progress` feeds. CLI only."""
    global _progress_hook
    _progress_hook = hook


def tiny() -> bool:
    """True when the suite must run its smallest configuration (seconds, not minutes).

    ``python -m bench --tiny`` sets it, and so do the tests of the front end: sizes may then be
    too small to mean anything; only the code paths, the rows and the plots are checked.
    """
    return os.environ.get(TINY_ENV, "") not in ("", "0")


@contextlib.contextmanager
def stderr_without(pattern: str):
    """Hides lines matching ``pattern`` that C++ code writes to file descriptor 2 (the kineto
    profiler's ``USDT ... profiler_start`` lines) and passes every other line through."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not re.search(pattern, ln)]
            sys.stderr.write("".join(kept))


def pad_collate(items: list[dict]) -> dict:
    """Examples of token ids (1-d ``input_ids``, optional ``labels``) as one batch padded at the
    end to the longest: ``input_ids`` padded with 0, ``attention_mask``, and ``labels`` (an
    example's own, else its ids) with -100 on the padding, as a padding collator gives them."""
    n = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros((len(items), n), dtype=torch.long)
    labels = torch.full((len(items), n), -100)
    mask = torch.zeros((len(items), n), dtype=torch.long)
    for i, x in enumerate(items):
        k = len(x["input_ids"])
        ids[i, :k], labels[i, :k], mask[i, :k] = x["input_ids"], x.get("labels", x["input_ids"]), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def backward_flops(loss_fn: Callable[[], torch.Tensor]) -> int:
    """FLOPs of the backward of ``loss_fn()`` (a checkpoint's recompute included), by torch's
    FlopCounterMode; the forward runs outside it. Take a step's peak memory on another step:
    under the counter a recomputing step's peak is higher (HF checkpointing's about 2x)."""
    from torch.utils.flop_counter import FlopCounterMode

    loss = loss_fn()
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def hf_checkpointing(model) -> None:
    """Hugging Face gradient checkpointing on ``model``, non-reentrant, under the name the
    installed transformers has (5.x renamed ``gradient_checkpointing_enable``, which warns)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def pyplot():
    """matplotlib's pyplot on the Agg backend: figures go to files, no display is needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, out_dir: str, name: str, dpi: int = 120) -> str:
    """Writes ``fig`` to ``out_dir/name``, closes it, and returns the path."""
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
