"""The `frontier` suite: step time against peak memory, gradaccel's and torch.compile's.

One Hugging Face Llama (4 layers, hidden 256, intermediate 688, 4 heads, sequence 512,
micro-batch 1, fp32, CPU), one training step (forward with ``labels``, backward), per variant:

- ``torch-nockpt``: stock, nothing checkpointed (the baseline every ratio divides by);
- ``torch-hf-checkpointing``: ``model.gradient_checkpointing_enable()`` (torch.utils.checkpoint
  around every layer);
- ``torch-compile-amb<b>``: ``torch.compile(model)`` (inductor) with
  ``torch._functorch.config.activation_memory_budget = b``: forward and backward compiled,
  the partitioner choosing what to recompute; dynamo is reset between budgets;
- ``gradaccel-memory<f>``: ``gradaccel.checkpoint_blocks(model, memory=f * P)``, ``P`` the
  measured peak of ``torch-nockpt``: per-block plans, or below their floor the block's parts
  and a chunked loss (gradaccel/memory/target.py).

Metrics: ``peak_bytes``, the peak of bytes allocated during the step (torch's profiler with
``profile_memory``, which sees inductor's buffers too; gradients included, ``.grad`` is None
before the step); ``time``, the median step time, measured round-robin against
``torch-nockpt`` (compiled variants against a ``torch-nockpt`` timed beside each of them, then
scaled to the common baseline); ``recompute_flops``, the backward's FLOPs beyond
``torch-nockpt``'s (FlopCounterMode; not known for compiled code). Every variant's gradients are
checked against ``torch-nockpt``'s before it is timed.

The vocabulary is 2048 (8x the hidden size, Llama-2-7B's ratio; the logits and loss are then
about the share of a step's activations they are in Llama-3-8B at 32 layers). At 32k the loss
would dominate this 4-layer model's memory, which no real model's 32+ layers let it do.
"""

import time

import torch

import gradaccel
from bench.common import (backward_flops, hf_checkpointing, progress, pyplot, row, save_figure, stderr_without,
                          time_interleaved, tiny)

SUITE = "frontier"
BASELINE = "torch-nockpt"
TABLE_METRICS = ["peak_bytes", "time", "recompute_flops"]
GRAD_RTOL = 2e-3  # compiled kernels fuse and reorder sums: relative to the largest gradient


def _shape(quick):
    if tiny():
        return dict(hidden=32, inter=88, layers=2, heads=2, vocab=256, seq=32)
    return dict(hidden=256, inter=688, layers=4, heads=4, vocab=2048, seq=512)


def _budgets(quick):
    if tiny():
        return (0.5,), (0.6,)
    return ((0.5, 0.25, 0.1), (0.8, 0.6, 0.55, 0.45, 0.38)) if quick else \
        ((1.0, 0.5, 0.25, 0.1, 0.0), (0.9, 0.8, 0.7, 0.6, 0.55, 0.5, 0.45, 0.4, 0.38))


def _model(s, device):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                                   num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                                   vocab_size=s["vocab"], max_position_embeddings=max(1024, s["seq"]))
    return transformers.LlamaForCausalLM(cfg).to(device).train()


def profiled_peak(fn) -> int:
    """Peak of bytes allocated while ``fn()`` runs, from torch's profiler (any device's CPU
    allocations; on CUDA, use ``torch.cuda.max_memory_allocated`` instead)."""
    from torch.profiler import ProfilerActivity, profile

    with stderr_without(r"^USDT:.*profiler_(start|stop)"):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def _peak(model, step, device):
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return profiled_peak(step)


def _grad_error(model, ref) -> float:
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        scale = q.grad.abs().max().item() or 1.0
        worst = max(worst, (p.grad - q.grad).abs().max().item() / scale)
    return worst


def run(device: str, quick: bool) -> list[dict]:
    s = _shape(quick)
    compile_budgets, fractions = _budgets(quick)
    case = f"llama{s['layers']}x(h{s['hidden']},V{s['vocab']}) T{s['seq']} mb1"
    ids = torch.randint(0, s["vocab"], (1, s["seq"]), device=device)

    def stepper(m):
        def loss():
            return m(input_ids=ids, labels=ids, use_cache=False).loss

        def step():
            m.zero_grad(set_to_none=True)
            loss().backward()
        return loss, step

    rows = []
    ref = _model(s, device)
    ref_loss, ref_step = stepper(ref)
    ref_step()
    base_flops = backward_flops(ref_loss)
    progress(f"{case} torch-nockpt")
    base_peak = _peak(ref, ref_step, device)
    eager = {"torch-nockpt": (ref, ref_step)}

    hf = _model(s, device)
    hf_checkpointing(hf)
    eager["torch-hf-checkpointing"] = (hf, stepper(hf)[1])
    for f in fractions:
        m = gradaccel.checkpoint_blocks(_model(s, device), memory=int(f * base_peak))
        eager[f"gradaccel-memory{f}"] = (m, stepper(m)[1])
    flops = {}
    for name, (m, step) in eager.items():
        progress(f"{case} {name}")
        step()  # gradaccel: traces and plans at its first call
        ref_step()
        err = _grad_error(m, ref)
        if err > GRAD_RTOL:
            raise AssertionError(f"{name}: gradients differ from torch-nockpt by {err:.2e} of the largest")
        rows.append(row(SUITE, case, name, "peak_bytes", _peak(m, step, device) if m is not ref else base_peak,
                        "B", device))
        flops[name] = backward_flops(stepper(m)[0]) - base_flops
        rows.append(row(SUITE, case, name, "recompute_flops", flops[name], "FLOP", device))
    reps = 1 if tiny() else 5
    times = time_interleaved({n: st for n, (_, st) in eager.items()}, device, warmup=1, reps=reps)
    for name, t in times.items():
        rows.append(row(SUITE, case, name, "time", t, "s", device))

    for b in compile_budgets:
        name = f"torch-compile-amb{b}"
        progress(f"{case} {name}")
        torch._dynamo.reset()
        m = _model(s, device)
        compiled = torch.compile(m, backend="aot_eager_decomp_partition" if tiny() else "inductor")
        with torch._functorch.config.patch(activation_memory_budget=b):
            _, step = stepper(compiled)
            t0 = time.perf_counter()
            step()
            compile_s = time.perf_counter() - t0
            ref_step()
            err = _grad_error(m, ref)
            if err > GRAD_RTOL:
                raise AssertionError(f"{name}: gradients differ from torch-nockpt by {err:.2e} of the largest")
            rows.append(row(SUITE, case, name, "peak_bytes", _peak(m, step, device), "B", device))
            local = time_interleaved({"ref": ref_step, "c": step}, device, warmup=1, reps=max(1, reps - 2))
        rows.append(row(SUITE, case, name, "time", local["c"] / local["ref"] * times["torch-nockpt"], "s", device))
        rows.append(row(SUITE, case, name, "compile_s", compile_s, "s", device))
    torch._dynamo.reset()
    return rows


def plot(rows: list[dict], out_dir: str) -> list[str]:
    plt = pyplot()

    by = {}
    for r in rows:
        by.setdefault(r["variant"], {})[r["metric"]] = r["value"]
    base = by.get("torch-nockpt", {})
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for prefix, style, label in (("gradaccel-memory", "o-", "gradaccel memory="),
                                 ("torch-compile-amb", "s--", "torch.compile activation_memory_budget"),
                                 ("torch-hf", "^", "HF gradient checkpointing"),
                                 ("torch-nockpt", "k*", "no checkpointing")):
        pts = sorted((v["peak_bytes"] / base["peak_bytes"], v["time"] / base["time"])
                     for n, v in by.items() if n.startswith(prefix) and "time" in v and "peak_bytes" in v)
        if pts:
            ax.plot([p for p, _ in pts], [t for _, t in pts], style, label=label)
    ax.set_xlabel("peak memory of a step / no checkpointing")
    ax.set_ylabel("step time / no checkpointing")
    ax.set_title("frontier: time against memory (lower left is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = save_figure(fig, out_dir, "frontier.png")
    return [path]
