"""pytest-benchmark form of the accumulate suite: ``pytest bench --benchmark-only``.

Each case is one benchmark group, so the torch and gradaccel variants of it sit side by side in
pytest-benchmark's table. The layout is the suite's quick one on CPU (2 GPT-2 layers) and the
full 124M one on CUDA; ``GRADACCEL_BENCH_TINY=1`` shrinks it to seconds. These files live under
bench/, so ``pytest tests`` (``make test``) never collects them.
"""

import pytest
import torch

from bench import accumulate as suite

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAME, SHAPES = suite._layout(DEVICE, quick=True)
FOLD = ["torch-naive", "torch-add-loop", "torch-foreach", "gradaccel-loop", "gradaccel-fold"]
FINALIZE = ["torch-finalize", "gradaccel-finalize"]


def _synced(fn):
    if DEVICE == "cpu":
        return fn

    def call():
        fn()
        torch.cuda.synchronize()
    return call


@pytest.fixture(scope="module")
def fold_inputs():
    return suite.make_fold_inputs(SHAPES, DEVICE)


@pytest.mark.benchmark(group=f"fold {NAME} bf16")
@pytest.mark.parametrize("variant", FOLD)
def test_fold(benchmark, fold_inputs, variant):
    benchmark(_synced(suite.fold_variants(*fold_inputs, 0.125)[variant]))


@pytest.mark.benchmark(group=f"finalize {NAME}")
@pytest.mark.parametrize("variant", FINALIZE)
def test_finalize(benchmark, fold_inputs, variant):
    flat = fold_inputs[0]
    benchmark(_synced(suite.finalize_variants(flat, torch.tensor(1.0, device=DEVICE))[variant]))


def test_variants_agree():
    """Every fold variant computes the same thing (within one fp32 ulp: add_ may use an FMA)."""
    shapes = suite.gpt2_layout(1, 64, 512, 64)
    flat0, grads, offsets, _ = suite.make_fold_inputs(shapes, DEVICE, seed=1)
    ref = flat0.double() + torch.cat([g.reshape(-1).double() for g in grads]) * 0.125
    bound = 2.0**-23 * (flat0.double().abs() + (ref - flat0.double()).abs())
    for variant in FOLD:
        flat = flat0.clone()
        views = [flat[o:o + g.numel()].view(g.shape) for g, o in zip(grads, offsets)]
        suite.fold_variants(flat, grads, offsets, views, 0.125)[variant]()
        assert bool(((flat.double() - ref).abs() <= bound).all()), variant
    scale = torch.tensor(0.5, device=DEVICE)
    norm, finite_all = suite.finalize_variants(flat0.clone(), scale)["torch-finalize"]()
    sumsq, nonfinite = suite.finalize_variants(flat0.clone(), scale)["gradaccel-finalize"]()
    assert sumsq.item() == pytest.approx(norm.item() ** 2, rel=1e-5)
    assert nonfinite.item() == (not finite_all.item())
