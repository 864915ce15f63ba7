"""The Triton wgrad GEMM against cuBLAS, on a GPU (run by bench/gpu.sh): ``python -m bench.wgrad_gpu``.

For weight shapes of a 7-8B model and 8K tokens, bf16, times (``triton.testing.do_bench``,
median, inputs of 64+ MiB, never zeros):

- ``cublas``: ``dyᵀ @ x`` into a fresh bf16 tensor: the stock weight-gradient GEMM alone;
- ``cublas+fold``: the same, then ``acc.add_(g)``: what the fold path does per micro-batch;
- ``gradaccel``: ``gradaccel.ops.wgrad_accumulate_(acc, x, dy)``: one Triton GEMM whose epilogue
  adds onto the fp32 ``acc``.

Prints TFLOP/s and the ratios that issue 29 asks for (gradaccel >= 0.9x cuBLAS throughput, and
faster than cuBLAS plus the fold), one line per shape, and checks the result against an fp32
reference. Exits 0 whatever the ratios (the lines say PASS or FAIL); 1 if a result is wrong.

Then whole layers, forward and backward of one micro-batch (:func:`layer_times`): a LoRA
adapter's pair (r 16) and a full projection, bf16, 8K tokens: stock ``.grad`` accumulation, the
fold and ``fuse_wgrad``, each under its own optimizer, interleaved. Whether ``fuse_wgrad`` pays
on a GPU, launches and Python included, is what decides turning it on by default.
"""

import sys

import torch

SHAPES = [  # (out, in, tokens)
    (4096, 4096, 8192),    # attention projection, hidden 4096
    (14336, 4096, 8192),   # MLP up/gate
    (4096, 14336, 8192),   # MLP down
]


LAYERS = {  # name: (in, out) of each nn.Linear in a chain, bias-free
    "lora r16 pair 4096": ((4096, 16), (16, 4096)),
    "projection 4096": ((4096, 4096),),
}


def layer_times(device: str, dtype: torch.dtype, tokens: int, layers: dict = LAYERS, reps: int = 20) -> dict:
    """Seconds per micro-batch (forward and backward) of each chain in ``layers``, per variant:
    ``{name: {"stock": s, "fold": s, "fused": s}}``, interleaved (bench.common.time_interleaved)."""
    import copy

    import torch.nn as nn

    from bench.common import time_interleaved
    from gradaccel import FusedAccumOptimizer

    out = {}
    for name, dims in layers.items():
        torch.manual_seed(0)
        base = nn.Sequential(*[nn.Linear(i, o, bias=False) for i, o in dims]).to(device, dtype)
        x = torch.randn(tokens, dims[0][0], device=device, dtype=dtype)
        models, opts = {}, {}
        for v in ("stock", "fold", "fused"):
            models[v] = m = copy.deepcopy(base)
            if v != "stock":  # a window longer than the timing: no step, only the per-micro-batch work
                opts[v] = FusedAccumOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), 1 << 30,
                                              fuse_wgrad=v == "fused", module=m if v == "fused" else None)
        assert len(opts["fused"].fused_layers) == len(dims), opts["fused"].fused_layers  # all routed
        out[name] = time_interleaved({v: (lambda m=m: m(x).float().square().mean().backward())
                                      for v, m in models.items()}, device, warmup=3, reps=reps)
        del opts
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU: nothing to measure")
        return 0
    import triton.testing

    from gradaccel import ops

    bad = False
    print(f"{'out x in x tokens':>22} {'cublas':>8} {'+fold':>8} {'gradaccel':>10}  TFLOP/s   vs cublas  vs cublas+fold")
    for m, n, k in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(k, n, generator=gen, device="cuda").to(torch.bfloat16)
        dy = torch.randn(k, m, generator=gen, device="cuda").to(torch.bfloat16)
        acc = torch.randn(m, n, generator=gen, device="cuda")

        # Correctness on this very shape: against fp32 products of the same bf16 inputs.
        ref = acc + dy.float().t() @ x.float()
        out = ops.wgrad_accumulate_(acc.clone(), x, dy)
        err = ((out - ref).norm() / ref.norm()).item()
        if not err < 1e-5:
            print(f"WRONG: relative error {err:.2e} at {m}x{n}x{k}")
            bad = True

        t_cublas = triton.testing.do_bench(lambda: dy.t() @ x, return_mode="median")
        t_fold = triton.testing.do_bench(lambda: acc.add_(dy.t() @ x), return_mode="median")
        t_ours = triton.testing.do_bench(lambda: ops.wgrad_accumulate_(acc, x, dy), return_mode="median")
        flops = 2.0 * m * n * k
        ratio, vs_fold = t_cublas / t_ours, t_fold / t_ours
        verdict = "PASS" if ratio >= 0.9 and vs_fold > 1.0 else "FAIL"
        print(f"{m:>6}x{n:>6}x{k:>6} {t_cublas:8.3f} {t_fold:8.3f} {t_ours:10.3f}  "
              f"{flops / t_ours / 1e9:7.1f}   {ratio:8.3f}x  {vs_fold:8.3f}x  {verdict}  (ms; err {err:.1e})")
    print("\nwhole layers, bf16, 8192 tokens, one micro-batch forward and backward (ms):")
    print(f"{'layers':>22} {'stock':>8} {'fold':>8} {'fused':>8}  fused vs fold")
    for name, t in layer_times("cuda", torch.bfloat16, 8192).items():
        print(f"{name:>22} {t['stock'] * 1e3:8.3f} {t['fold'] * 1e3:8.3f} {t['fused'] * 1e3:8.3f}  "
              f"{t['fused'] / t['fold']:8.3f}x")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
