"""The README's headline table: a few rows of a bench run, each gradaccel beside PyTorch.

Copied from a run's ``results.json``, never typed, by ``make results``::

    python -m bench.headline bench/results/latest --readme README.md

Each line names a suite, a metric, the PyTorch baseline the suite compares against, PyTorch's
nearest alternative, and the gradaccel variant. Cells are ``value / baseline`` of the same run
and case (the first case that has all three); a line whose variants the run lacks is left out.
"""

import argparse
import json
import re
import sys
from pathlib import Path

from bench.report import fmt, fmt_ratio, partial_run

# (what it shows, suite, metric, PyTorch baseline, PyTorch's alternative or None, gradaccel)
HEADLINE = [
    ("fold bf16 grads into fp32: time", "accumulate", "time", "torch-naive", "torch-foreach", "gradaccel-fold"),
    ("bf16 weight gradients over 16 micro-batches: error vs fp64", "accumulate", "grad_error", "torch-stock",
     "gradaccel-fold", "gradaccel-fused"),
    ("window finalize (scale, norm, non-finite): time", "accumulate", "time", "torch-finalize", None,
     "gradaccel-finalize"),
    ("checkpoint a GPT stack: activations held", "checkpoint", "held_bytes", "torch-none", "torch-full",
     "gradaccel-b0.5"),
    ("checkpoint a GPT stack: step time", "checkpoint", "time", "torch-none", "torch-full", "gradaccel-b0.5"),
    ("train, 4 micro-batches a window: window time", "train", "window_time", "torch", None, "gradaccel"),
    ("HF Llama step peak, memory target vs torch.compile", "frontier", "peak_bytes", "torch-nockpt",
     "torch-compile-amb0.1", "gradaccel-memory0.55"),
    ("HF Llama step time, memory target vs torch.compile", "frontier", "time", "torch-nockpt",
     "torch-compile-amb0.1", "gradaccel-memory0.55"),
    ("40 never-seen lengths, budget=0.5: total time", "lengths", "time", "torch-hf-ckpt", "torch-nockpt",
     "gradaccel-budget0.5"),
    ("40 never-seen lengths, memory=: total time", "lengths", "time", "torch-hf-ckpt", None, "gradaccel-memory"),
    ("40 never-seen lengths, memory=: step peak", "lengths", "peak_bytes", "torch-hf-ckpt", "torch-nockpt",
     "gradaccel-memory"),
    ("FSDP2, 2 ranks: gradient bytes sent per window", "distributed", "grad_sent_bytes", "torch-fsdp2",
     "torch-fsdp2-nosync", "gradaccel-window"),
    ("HF Trainer, 2 DDP ranks: gradient bytes held between micro-batches", "distributed", "grad_bytes",
     "torch-ddp-trainer", None, "gradaccel-trainer"),
    ("fit: predicted step peak / measured", "fit", "peak_bytes", "gradaccel-measured", None,
     "gradaccel-predicted"),
]
START, END = "<!-- bench:headline:start -->", "<!-- bench:headline:end -->"


def _line(rows: list[dict], what: str, suite: str, metric: str, base: str, alt: str | None, ours: str) -> str | None:
    cases: dict[str, dict[str, float]] = {}
    units: dict[str, str] = {}
    for r in rows:
        if r["suite"] == suite and r["metric"] == metric:
            cases.setdefault(r["case"], {})[r["variant"]] = r["value"]
            units[r["case"]] = r["unit"]
    wanted = [v for v in (base, alt, ours) if v]
    for case, values in cases.items():
        if all(v in values for v in wanted) and values[base]:
            alt_cell = f"{alt}: {fmt_ratio(values[alt] / values[base])}" if alt else ""
            return (f"| {what} | {case} | {base}: {fmt(values[base])} {units[case]} | {alt_cell} | "
                    f"{ours}: {fmt_ratio(values[ours] / values[base])} |")
    return None


def headline(rows: list[dict]) -> str:
    """The markdown table for ``rows`` (a run's results.json)."""
    lines = ["| | case | PyTorch baseline | PyTorch alternative (/ baseline) | gradaccel (/ baseline) |",
             "|---|---|---:|---:|---:|"]
    lines += [x for spec in HEADLINE if (x := _line(rows, *spec)) is not None]
    return "\n".join(lines) + "\n"


def update(results_dir: Path, target: Path) -> None:
    """Replace the headline section of ``target`` with the table of ``results_dir``'s run."""
    rows = json.loads((results_dir / "results.json").read_text())
    report = results_dir / "report.md"
    date = re.search(r"^\| date \| (\S+)", report.read_text(), re.M) if report.exists() else None
    note = f"From `make bench-all` on {date.group(1)[:10]}; " if date else "From `make bench-all`; "
    section = (f"{START}\n{headline(rows)}\n{note}every table of that run: [bench/RESULTS.md](bench/RESULTS.md).\n"
               f"{END}")
    text = target.read_text()
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{target} has no {START} ... {END} section")
    target.write_text(pattern.sub(lambda _: section, text, count=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.headline", description=__doc__.split("\n")[0])
    p.add_argument("dir", type=Path, help="a `python -m bench --out` directory")
    p.add_argument("--readme", type=Path, default=Path(__file__).resolve().parents[1] / "README.md")
    a = p.parse_args(argv)
    if partial_run(a.dir, "python -m bench.headline"):
        return 2
    update(a.dir, a.readme)
    print(f"{a.readme}: headline updated from {a.dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
