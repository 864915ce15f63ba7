"""What the first step at a new length costs, split into forward and backward.

The `lengths` suite's model and lengths at batch 1 (bench/lengths.py), 60 never-seen lengths,
the variants interleaved as the suite runs them: each length is run by every variant in turn,
first call then a second (planned) call. Prints, per variant, the forward's and the backward's
milliseconds per length on the first call and on the second::

    PYTHONPATH=. python bench/lengths_split.py                 # in a fresh process
    PYTHONPATH=. python bench/lengths_split.py --after-suites  # after the 8 other suites, as make bench runs it

``--after-suites`` first runs every other suite of ``python -m bench`` in this process (into a
temporary directory), so that the split is measured in the process state `make bench`'s last
suite sees.
"""

import argparse
import gc
import sys
import tempfile
import time

import numpy as np
import torch

VARIANTS = ("torch-nockpt", "torch-hf-ckpt", "gradaccel-budget0.5")


def _step(variant, inputs) -> tuple:
    t0 = time.perf_counter()
    loss = variant.model(**inputs).loss
    t1 = time.perf_counter()
    loss.backward()
    variant.opt.step()
    variant.opt.zero_grad(set_to_none=True)
    return t1 - t0, time.perf_counter() - t1


def split(steps: int = 60) -> dict:
    """{variant: (forward first, backward first, forward again, backward again)} in ms per length."""
    import gradaccel
    from bench import lengths as L

    torch.set_num_threads(1)
    torch.manual_seed(0)
    c, batch = L._config(False), 1
    rng = np.random.default_rng(batch)
    base, seen = L._model(c, "cpu"), set()
    gradaccel.reset_plans()
    variants = {n: L._Variant(n, base, c, "cpu", None, batch) for n in VARIANTS}
    warm, new = L._lengths(c, c["warmup"], seen, rng), L._lengths(c, steps, seen, rng)
    total = {n: np.zeros(4) for n in variants}
    for i, t in enumerate(warm + new, 1):
        if i == len(warm) + 1:  # as the suite does: what exists by now is not scanned by each collection
            gc.collect()
            gc.freeze()
        inputs = L._batch(c, t, batch, rng, "cpu")
        for n, v in variants.items():
            first, again = _step(v, inputs), _step(v, inputs)
            if i > len(warm):
                total[n] += first + again
    gc.unfreeze()
    return {n: tuple(a * 1000 / len(new)) for n, a in total.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--after-suites", action="store_true", help="run the other suites first, in this process")
    p.add_argument("--steps", type=int, default=60, help="new lengths (default 60)")
    a = p.parse_args(argv)
    if a.after_suites:
        from bench.__main__ import SUITES, main as bench_main

        with tempfile.TemporaryDirectory() as out:
            bench_main(["--suite", ",".join(s for s in SUITES if s != "lengths"), "--out", out])
    print(f"{'variant':22s} {'forward first':>14s} {'again':>7s} {'extra':>6s}  {'backward first':>15s} "
          f"{'again':>7s} {'extra':>6s}  (ms per length)")
    for n, (f1, b1, f2, b2) in split(a.steps).items():
        print(f"{n:22s} {f1:14.2f} {f2:7.2f} {f1 - f2:+6.2f}  {b1:15.2f} {b2:7.2f} {b1 - b2:+6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
