"""The `checkpoint` suite: activation memory against recompute, gradaccel.checkpoint at several
budgets beside no checkpointing, torch.utils.checkpoint and torch's selective checkpointing.

One case: a stack of GPT blocks (bench/models.py, materialised attention), each block a region.
Per variant, side by side in one run:

- ``time``: median step (forward + backward), interleaved with every other variant;
- ``held_bytes``: activation bytes the forward leaves alive for backward, measured by storage
  (gradaccel.memory.counter), exact;
- ``recompute_flops``: FLOPs of the backward minus those of the no-checkpoint backward
  (``torch.utils.flop_counter``), exact;
- on CUDA, ``peak_bytes``: ``torch.cuda.max_memory_allocated`` over the step.

``gradaccel-keepnothing`` (a budget of one byte) and ``gradaccel-b1.0`` (keep everything) time
the keep/recompute mechanism on its own, against ``torch-full`` and ``torch-none``.
``gradaccel-offload-b…`` may also send activations to host memory; ``torch-save_on_cpu`` (what
Hugging Face's ``offload=True`` does) copies every one, synchronously. On CPU, "host" is the
same memory: there the offload points show the mechanism's cost, not a memory saving.
"""


import torch
import torch.utils.checkpoint as tc
from torch.utils.flop_counter import FlopCounterMode

import gradaccel
from bench.common import progress, pyplot, row, save_figure, time_interleaved, tiny
from bench.models import Block, GPTConfig
from gradaccel.memory.counter import StorageLog, held_activation_bytes

SUITE = "checkpoint"
BASELINE = "torch-none"
TABLE_METRICS = ["time", "held_bytes", "recompute_flops", "peak_bytes"]
BUDGETS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _config(device: str, quick: bool):
    """(GPTConfig, batch, layers) sized to the device and mode."""
    if tiny():
        return GPTConfig(seq_len=32, n_embd=32, n_head=2, dropout=0.1), 2, 2
    if device == "cuda":
        return GPTConfig(seq_len=2048 if quick else 4096, n_embd=1024, n_head=16, dropout=0.1), 4, 4
    if quick:
        return GPTConfig(seq_len=256, n_embd=128, n_head=4, dropout=0.1), 2, 4
    return GPTConfig(seq_len=512, n_embd=256, n_head=8, dropout=0.1), 2, 4


def _matmuls_policy():
    ops = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def policy(ctx, op, *args, **kwargs):
        return tc.CheckpointPolicy.MUST_SAVE if op in ops else tc.CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: tc.create_selective_checkpoint_contexts(policy)


def variants() -> dict:
    """variant name -> how one block is run."""
    sac = _matmuls_policy()
    out = {
        "torch-none": lambda b, h: b(h),
        "torch-full": lambda b, h: tc.checkpoint(b, h, use_reentrant=False),
        "torch-sac-matmuls": lambda b, h: tc.checkpoint(b, h, use_reentrant=False, context_fn=sac),
        "gradaccel-keepnothing": lambda b, h: gradaccel.checkpoint(b, h, budget=1),
    }
    for budget in BUDGETS:
        out[f"gradaccel-b{budget}"] = lambda b, h, budget=budget: gradaccel.checkpoint(b, h, budget=budget)
    # Offload: HF-style synchronous copies of every saved tensor, against the planner's choice
    # per tensor of keep / offload (side stream) / recompute under the same device budget.
    out["torch-save_on_cpu"] = _save_on_cpu
    for budget in (0.0, 0.25):
        out[f"gradaccel-offload-b{budget}"] = (
            lambda b, h, budget=budget: gradaccel.checkpoint(b, h, budget=budget, offload=True))
    return out


def _save_on_cpu(block, h):
    with torch.autograd.graph.save_on_cpu(pin_memory=h.is_cuda):
        return block(h)


def run(device: str, quick: bool) -> list[dict]:
    cfg, batch, layers = _config(device, quick)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(cfg) for _ in range(layers)).to(device)
    x = torch.randn(batch, cfg.seq_len, cfg.n_embd, device=device, requires_grad=True)
    case = f"gpt{layers}x(T{cfg.seq_len},C{cfg.n_embd},H{cfg.n_head})"
    per_block = variants()

    def forward(wrap):
        h = x
        for b in blocks:
            h = wrap(b, h)
        return h

    def step(wrap):
        forward(wrap).float().square().mean().backward()

    rows, flops = [], {}
    n = len(per_block)
    for i, (name, wrap) in enumerate(per_block.items(), 1):
        progress(f"{case} {name}: bytes and FLOPs", i, n)
        step(wrap)  # traces and plans gradaccel's regions; later calls use the plan
        out, held = held_activation_bytes(forward, wrap)
        with StorageLog():  # a dispatch mode in backward too: torch's SAC needs both passes alike
            out.float().square().mean().backward()
        with FlopCounterMode(display=False) as counter:
            loss = forward(wrap).float().square().mean()
            forward_flops = counter.get_total_flops()
            loss.backward()
        flops[name] = counter.get_total_flops() - forward_flops
        rows.append(row(SUITE, case, name, "held_bytes", held, "B", device))
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(wrap)
            torch.cuda.synchronize()
            rows.append(row(SUITE, case, name, "peak_bytes", torch.cuda.max_memory_allocated() - base, "B", device))
    for name in per_block:
        rows.append(row(SUITE, case, name, "recompute_flops", flops[name] - flops["torch-none"], "FLOP", device))
    progress(f"{case}: timing {n} variants, interleaved", n, n)
    reps = 3 if tiny() else 9 if quick else 15
    times = time_interleaved({name: (lambda w=wrap: step(w)) for name, wrap in per_block.items()},
                             device, warmup=1 if tiny() else 2, reps=reps)
    rows += [row(SUITE, case, name, "time", t, "s", device) for name, t in times.items()]
    blocks.zero_grad(set_to_none=True)
    return rows


def plot(rows: list[dict], out_dir: str) -> list[str]:
    plt = pyplot()

    paths = []
    by = {}
    for r in rows:
        by.setdefault(r["variant"], {})[r["metric"]] = r["value"]
    device = rows[0]["device"] if rows else "cpu"
    pairs = [("recompute_flops", "held_bytes", "recompute in backward (GFLOP)", "activation memory held (MiB)",
              "checkpoint_memory_vs_recompute.png", 1e-9)]
    pairs.append(("time", "peak_bytes" if device == "cuda" else "held_bytes", "step time (ms)",
                  "peak memory (MiB)" if device == "cuda" else "activation memory held (MiB)",
                  "checkpoint_memory_vs_time.png", 1e3))
    for xm, ym, xlabel, ylabel, name, xscale in pairs:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ours = [(v, m) for v, m in by.items() if v.startswith("gradaccel-b") and xm in m and ym in m]
        others = [v for v in by if v.startswith("torch") or (v.startswith("gradaccel") and v not in dict(ours))]
        ours.sort(key=lambda vm: float(vm[0].removeprefix("gradaccel-b")))
        if ours:
            ax.plot([m[xm] * xscale for _, m in ours], [m[ym] / 2**20 for _, m in ours], "o-", color="tab:blue",
                    label="gradaccel.checkpoint (budget 0 … 1)")
            for v, m in ours:
                ax.annotate(v.removeprefix("gradaccel-b"), (m[xm] * xscale, m[ym] / 2**20),
                            textcoords="offset points", xytext=(5, 5), fontsize=8, color="tab:blue")
        for v in others:
            m = by[v]
            if xm in m and ym in m:
                marker = "s" if v.startswith("torch") else "^"
                ax.plot(m[xm] * xscale, m[ym] / 2**20, marker, markersize=8, label=v)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"gradaccel.checkpoint vs PyTorch ({device}, {rows[0]['case'] if rows else ''})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = save_figure(fig, out_dir, name)
        paths.append(path)
    return paths
