"""The linear cross-entropy in chunks: gradaccel's ``ChunkedLinearCrossEntropy`` beside torch's
own ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())`` (torch 2.13+; torch
2.11 has no such function), against the unchunked ``cross_entropy(linear(h, W))``.

Variants, each the summed loss over ``N`` rows divided by ``N``, forward and backward:

- ``torch-unchunked``: ``F.cross_entropy(F.linear(h, W).float(), y)``, the baseline;
- ``torch-chunked``: torch's ``F.linear_cross_entropy`` with its chunking options (``"auto"``);
- ``gradaccel-chunked``: ``ChunkedLinearCrossEntropy`` from the hidden states (no logits given:
  as the fit prices it when nothing else made them), in the chunks the ``memory=`` target uses
  (``chunk_rows``: ~16 MiB of fp32 logits each, at most 64).

Metrics: ``time`` (s, median of interleaved runs), ``peak_bytes`` (the most bytes alive above
the inputs during forward and backward, by ``gradaccel.memory.LiveBytes``: exact), and
``grad_rel_err`` (the hidden states' gradient against the fp64 reference, max abs / max abs).
"""

import torch
import torch.nn.functional as F

from bench import common
from gradaccel.memory import LiveBytes
from gradaccel.memory.chunked_loss import ChunkedLinearCrossEntropy, chunk_rows

SUITE = "chunked_loss"
BASELINE = "torch-unchunked"
TABLE_METRICS = ["time", "peak_bytes", "grad_rel_err"]


def _cases(quick: bool):
    if common.tiny():
        return [(64, 32, 512, torch.float32)]
    if quick:
        return [(1024, 128, 16000, torch.float32), (1024, 128, 16000, torch.bfloat16),
                (256, 256, 32000, torch.float32)]
    return [(2048, 256, 32000, torch.float32), (2048, 256, 32000, torch.bfloat16),
            (4096, 512, 32000, torch.bfloat16), (512, 256, 128256, torch.bfloat16)]


def _variants():
    out = {"torch-unchunked": lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y)}
    if hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        opts = torch.nn.LinearCrossEntropyOptions()
        out["torch-chunked"] = lambda h, w, y: F.linear_cross_entropy(h, w, y, options=opts)
    out["gradaccel-chunked"] = lambda h, w, y: ChunkedLinearCrossEntropy.apply(
        h, w, None, None, y, y.numel(), -100, chunk_rows(y.numel(), w.shape[0]))
    return out


def _step(fn, h, w, y):
    h.grad = w.grad = None
    fn(h, w, y).backward()
    return h.grad


def run(device: str, quick: bool) -> list[dict]:
    """Every case on ``device``: rows of time, peak_bytes and grad_rel_err per variant."""
    rows = []
    cases = _cases(quick)
    for i, (n, c, v, dtype) in enumerate(cases, 1):
        case = f"N{n} C{c} V{v} {str(dtype).removeprefix('torch.')}"
        common.progress(case, i, len(cases))
        gen = torch.Generator().manual_seed(0)
        h = (torch.randn(n, c, generator=gen) / c ** 0.5).to(device, dtype).requires_grad_()
        w = torch.randn(v, c, generator=gen).to(device, dtype).requires_grad_()
        y = torch.randint(0, v, (n,), generator=gen).to(device)
        h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        F.cross_entropy(F.linear(h64, w64), y).backward()
        ref = h64.grad
        variants = _variants()
        for name, fn in variants.items():
            g = _step(fn, h, w, y)
            err = (g.double() - ref).abs().max() / ref.abs().max()
            rows.append(common.row(SUITE, case, name, "grad_rel_err", err.item(), "", device))
            with LiveBytes() as live:
                _step(fn, h, w, y)
            rows.append(common.row(SUITE, case, name, "peak_bytes", live.peak, "B", device))
        times = common.time_interleaved({k: (lambda f=f: _step(f, h, w, y)) for k, f in variants.items()},
                                        device, warmup=1, reps=3 if quick else 5)
        rows += [common.row(SUITE, case, k, "time", t, "s", device) for k, t in times.items()]
    return rows


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """Peak bytes against time, one point per case and variant."""
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    by = {}
    for r in rows:
        by.setdefault((r["case"], r["variant"]), {})[r["metric"]] = r["value"]
    for variant in dict.fromkeys(k[1] for k in by):
        pts = [(m["peak_bytes"] / 2**20, m["time"]) for (c, v), m in by.items() if v == variant
               and "time" in m and "peak_bytes" in m]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=variant)
    ax.set_xlabel("peak MiB above inputs")
    ax.set_ylabel("forward + backward, s")
    ax.set_xscale("log")
    ax.set_title("linear cross-entropy: unchunked, torch chunked, gradaccel chunked")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return [common.save_figure(fig, out_dir, "chunked_loss.png")]
