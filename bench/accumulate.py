"""Accumulate suite: folding a model's bf16 gradients into one flat fp32 buffer, and finalizing it.

Case ``fold …``: every parameter-shaped bf16 gradient of a GPT-2-small layout (124M parameters;
quick mode on CPU: 2 layers and an 8K vocabulary) is added, times a scale, into its slice of a
flat fp32 buffer, by:

- ``torch-naive``: ``t = g.float(); t.mul_(s); view.add_(t)`` per tensor (26 B per parameter);
- ``torch-add-loop``: ``view.add_(g, alpha=s)`` per tensor (10 B: one fused kernel each);
- ``torch-foreach``: ``torch._foreach_add_(views, grads, alpha=s)``;
- ``gradaccel-loop``: ``gradaccel.ops.scale_accumulate_`` per tensor (what the optimizer's
  per-parameter hook does);
- ``gradaccel-fold``: ``gradaccel.ops.fold_``, all tensors in one op (one Triton launch on CUDA).

Case ``finalize …``: the end-of-window pass over the flat buffer: ``torch-finalize`` is
``flat.mul_(s)``, ``torch.linalg.vector_norm(flat)``, ``torch.isfinite(flat).all()`` (18 B per
element); ``gradaccel-finalize`` is ``gradaccel.ops.finalize_`` (8 B: one read, one write).

Cases ``window …``: a model's weight gradients over a window, stock vs fold vs
``fuse_wgrad`` (bench/wgrad.py: window time, peak bytes, gradient error against fp64).

Metrics: ``time`` (s, median, interleaved), ``time_vs_naive`` (x), ``bytes_per_param`` (B, the
minimum traffic of the variant's kernels, counted from the dtypes, not measured), and on CUDA
``bandwidth`` (GB/s = bytes_per_param x params / time) and ``bandwidth_vs_copy`` (x), against a
device-to-device ``copy_`` of an fp32 buffer of the same size measured in the same run
(``torch-copy``, 8 B per element).
"""


import torch

from bench import wgrad
from bench.common import progress, pyplot, row, save_figure, time_interleaved, tiny
from gradaccel import ops

SUITE = "accumulate"
BASELINE = ["torch-naive", "torch-finalize", "torch-copy", "torch-stock"]
TABLE_METRICS = ["time", "bytes_per_param", "bandwidth", "bandwidth_vs_copy", "window_time",
                 "layer_overhead", "peak_bytes", "largest_in_backward", "largest_weight_grad", "peak_below_fold",
                 "grad_error"]
FP32 = 4


def gpt2_layout(n_layer: int = 12, n_embd: int = 768, vocab: int = 50257, n_ctx: int = 1024) -> list[tuple]:
    """Parameter shapes of GPT-2 small (the defaults: 124,439,808 parameters), tied head."""
    shapes = [(vocab, n_embd), (n_ctx, n_embd)]
    for _ in range(n_layer):
        shapes += [(n_embd,), (n_embd,),                       # ln_1
                   (n_embd, 3 * n_embd), (3 * n_embd,),       # attention qkv
                   (n_embd, n_embd), (n_embd,),               # attention out
                   (n_embd,), (n_embd,),                      # ln_2
                   (n_embd, 4 * n_embd), (4 * n_embd,),       # mlp up
                   (4 * n_embd, n_embd), (n_embd,)]           # mlp down
    return shapes + [(n_embd,), (n_embd,)]                    # ln_f


def _layout(device: str, quick: bool) -> tuple[str, list[tuple]]:
    if tiny():
        return "gpt2 1L d64 v512", gpt2_layout(1, 64, 512, 64)
    if quick and not device.startswith("cuda"):
        return "gpt2 2L v8k", gpt2_layout(2, 768, 8192, 1024)
    return "gpt2 124M", gpt2_layout()


def naive_bytes(grad_dtype: torch.dtype) -> int:
    """g.float() (read g, write t), t.mul_(s) (read, write t), acc.add_(t) (read t, acc; write acc)."""
    g = torch.empty((), dtype=grad_dtype).element_size()
    return (g + FP32) + 2 * FP32 + 3 * FP32


def fused_bytes(grad_dtype: torch.dtype) -> int:
    """Read g, read and write acc: the floor for any fold."""
    return torch.empty((), dtype=grad_dtype).element_size() + 2 * FP32


FINALIZE_TORCH_BYTES = 2 * FP32 + FP32 + (FP32 + 1) + 1  # mul_, norm, isfinite (bool out), all
FINALIZE_FUSED_BYTES = 2 * FP32


def make_fold_inputs(shapes: list[tuple], device: str, dtype=torch.bfloat16, seed: int = 0):
    """(flat, grads, offsets, views): random grads and a random flat buffer (never zeros)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    grads = [torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype) for s in shapes]
    offsets, total = [], 0
    for g in grads:
        offsets.append(total)
        total += g.numel()
    flat = torch.randn(total, generator=gen, device=device)
    views = [flat[o:o + g.numel()].view(g.shape) for g, o in zip(grads, offsets)]
    return flat, grads, offsets, views


def fold_variants(flat, grads, offsets, views, scale: float) -> dict:
    """The fold variants, each a no-argument callable doing one fold of every grad."""
    def naive():
        for v, g in zip(views, grads):
            t = g.float()
            t.mul_(scale)
            v.add_(t)

    def add_loop():
        for v, g in zip(views, grads):
            v.add_(g, alpha=scale)

    def foreach():
        torch._foreach_add_(views, grads, alpha=scale)

    def ga_loop():
        for v, g in zip(views, grads):
            ops.scale_accumulate_(v, g, scale)

    def ga_fold():
        ops.fold_(flat, grads, offsets, scale)

    return {"torch-naive": naive, "torch-add-loop": add_loop, "torch-foreach": foreach,
            "gradaccel-loop": ga_loop, "gradaccel-fold": ga_fold}


def finalize_variants(flat, scale: torch.Tensor) -> dict:
    def torch_finalize():
        flat.mul_(scale)
        return torch.linalg.vector_norm(flat), torch.isfinite(flat).all()

    def ga_finalize():
        return ops.finalize_(flat, scale)

    return {"torch-finalize": torch_finalize, "gradaccel-finalize": ga_finalize}


def run(device: str, quick: bool) -> list[dict]:
    """Times every variant on ``device``; returns ``bench.common.row`` dicts."""
    name, shapes = _layout(device, quick)
    warmup, reps = (1, 3) if quick or tiny() else (3, 10)
    rows = []

    def add(case, variant, metric, value, unit):
        rows.append(row(SUITE, case, variant, metric, value, unit, device))

    case = f"fold {name} bf16"
    progress(case, 1, 2)
    flat, grads, offsets, views = make_fold_inputs(shapes, device)
    params = flat.numel()
    fns = fold_variants(flat, grads, offsets, views, 0.125)
    bytes_pp = {v: (naive_bytes(torch.bfloat16) if v == "torch-naive" else fused_bytes(torch.bfloat16))
                for v in fns}
    copy_gbs = None
    if device.startswith("cuda"):
        src, dst = torch.randn_like(flat), torch.empty_like(flat)
        fns["torch-copy"] = lambda: dst.copy_(src)
        bytes_pp["torch-copy"] = 2 * FP32
    times = time_interleaved(fns, device, warmup=warmup, reps=reps)
    if "torch-copy" in times:
        copy_gbs = bytes_pp["torch-copy"] * params / times["torch-copy"] / 1e9
    for v, t in times.items():
        add(case, v, "time", t, "s")
        add(case, v, "bytes_per_param", bytes_pp[v], "B")
        if v != "torch-copy":
            add(case, v, "time_vs_naive", t / times["torch-naive"], "x")
        if copy_gbs is not None:
            gbs = bytes_pp[v] * params / t / 1e9
            add(case, v, "bandwidth", gbs, "GB/s")
            add(case, v, "bandwidth_vs_copy", gbs / copy_gbs, "x")
    del fns, grads, views

    case = f"finalize {name}"
    progress(case, 2, 2)
    # A scale of 1 keeps the buffer's values steady across repetitions; the work is the same.
    scale = torch.tensor(1.0, device=device)
    fns = finalize_variants(flat, scale)
    times = time_interleaved(fns, device, warmup=warmup, reps=reps)
    for v, t in times.items():
        b = FINALIZE_TORCH_BYTES if v == "torch-finalize" else FINALIZE_FUSED_BYTES
        add(case, v, "time", t, "s")
        add(case, v, "bytes_per_param", b, "B")
        if copy_gbs is not None:
            gbs = b * params / t / 1e9
            add(case, v, "bandwidth", gbs, "GB/s")
            add(case, v, "bandwidth_vs_copy", gbs / copy_gbs, "x")
    wgrad.run_rows(device, quick, add)
    return rows


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """Bars of bytes moved per parameter and of time relative to the baseline per case; on CUDA,
    GB/s per variant against the copy bandwidth. Returns the PNG paths."""
    plt = pyplot()

    rows = [r for r in rows if r["suite"] == SUITE]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    paths = []

    def bars(metric, ylabel, title, fname, ref_line=None):
        sel = {c: [r for r in rows if r["case"] == c and r["metric"] == metric] for c in cases}
        sel = {c: rs for c, rs in sel.items() if rs}
        if not sel:
            return
        fig, axes = plt.subplots(1, len(sel), figsize=(5.5 * len(sel), 4), squeeze=False)
        for ax, (c, rs) in zip(axes[0], sel.items()):
            names = [r["variant"] for r in rs]
            colors = ["tab:orange" if n.startswith("gradaccel") else "tab:gray" for n in names]
            ax.bar(range(len(rs)), [r["value"] for r in rs], color=colors)
            ax.set_xticks(range(len(rs)), names, rotation=30, ha="right")
            ax.set_ylabel(ylabel)
            ax.set_title(c, fontsize=10)
            line = ref_line(c) if ref_line else None
            if line is not None:
                ax.axhline(line, color="tab:blue", linestyle="--", label="device-to-device copy")
                ax.legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        path = save_figure(fig, out_dir, fname, dpi=100)
        paths.append(path)

    bars("bytes_per_param", "bytes moved per parameter (B)", "Memory traffic per parameter",
         "accumulate_bytes.png")
    bars("time", "time per call (s)", "Time per call (median)", "accumulate_time.png")

    def copy_line(case):
        for r in rows:
            if r["case"] == case and r["variant"] == "torch-copy" and r["metric"] == "bandwidth":
                return r["value"]
        fold = [r for r in rows if r["variant"] == "torch-copy" and r["metric"] == "bandwidth"]
        return fold[0]["value"] if fold else None

    bars("bandwidth", "achieved bandwidth (GB/s)", "Bandwidth vs device-to-device copy",
         "accumulate_bandwidth.png", ref_line=copy_line)
    return paths
