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

A second case, ``compiled ...``, has torch.compile on both sides (:func:`compiled_case`): compile's
``activation_memory_budget`` 1.0/0.5/0.25/0.1 against gradaccel's plans run by compile
(``gradaccel-compiled-budget<b>``, ``gradaccel-compiled-memory<f>``), on the Llama of issue 39
(GQA 8/4 heads, vocabulary 512, batch 2 x 512), plotted in ``frontier_compiled.png``; and the
fold's hooks on a compiled model against an eager one (``... fold x4``). ``GRADACCEL_FRONTIER=
compiled`` runs that case alone (bench/gpu.sh).
"""

import os
import time

import torch

import gradaccel
from bench.common import (backward_flops, hf_checkpointing, progress, pyplot, row, save_figure, stderr_without,
                          time_interleaved, tiny)

SUITE = "frontier"
BASELINE = ["torch-nockpt", "torch-eager-accum"]
TABLE_METRICS = ["peak_bytes", "time", "recompute_flops", "peak_over_target", "window_time", "fold_cost"]
ONLY_ENV = "GRADACCEL_FRONTIER"  # "compiled": run the compiled case alone
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
                                   num_attention_heads=s["heads"], num_key_value_heads=s.get("kv", s["heads"]),
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


def _stepper(m, ids):
    def loss():
        return m(input_ids=ids, labels=ids, use_cache=False).loss

    def step():
        m.zero_grad(set_to_none=True)
        loss().backward()
    return loss, step


def _backend():
    return "aot_eager_decomp_partition" if tiny() else "inductor"


def _compiled_rows(case, name, model, compiled, ids, ref, ref_step, base_time, device, budget=None):
    """A compiled variant's rows: its first step compiles (``compile_s``), its gradients are
    checked against ``ref``'s, its peak measured and its time taken beside ``ref_step``'s, then
    scaled to ``base_time`` (the baseline's time in the case's own interleaved run).
    ``budget``: torch.compile's ``activation_memory_budget``, else compile's default."""
    progress(f"{case} {name}")
    patch = {} if budget is None else {"activation_memory_budget": budget}
    with torch._functorch.config.patch(**patch):
        _, step = _stepper(compiled, ids)
        t0 = time.perf_counter()
        step()
        compile_s = time.perf_counter() - t0
        ref_step()
        err = _grad_error(model, ref)
        if err > GRAD_RTOL:
            raise AssertionError(f"{name}: gradients differ from torch-nockpt by {err:.2e} of the largest")
        peak = _peak(model, step, device)
        local = time_interleaved({"ref": ref_step, "c": step}, device, warmup=1, reps=1 if tiny() else 7)
    return [row(SUITE, case, name, "peak_bytes", peak, "B", device),
            row(SUITE, case, name, "time", local["c"] / local["ref"] * base_time, "s", device),
            row(SUITE, case, name, "compile_s", compile_s, "s", device)]


def run(device: str, quick: bool) -> list[dict]:
    if os.environ.get(ONLY_ENV) == "compiled":  # bench/gpu.sh's compiled row, in its own time limit
        return compiled_case(device, quick)
    s = _shape(quick)
    compile_budgets, fractions = _budgets(quick)
    case = f"llama{s['layers']}x(h{s['hidden']},V{s['vocab']}) T{s['seq']} mb1"
    ids = torch.randint(0, s["vocab"], (1, s["seq"]), device=device)

    rows = []
    ref = _model(s, device)
    ref_loss, ref_step = _stepper(ref, ids)
    ref_step()
    base_flops = backward_flops(ref_loss)
    progress(f"{case} torch-nockpt")
    base_peak = _peak(ref, ref_step, device)
    eager = {"torch-nockpt": (ref, ref_step)}

    hf = _model(s, device)
    hf_checkpointing(hf)
    eager["torch-hf-checkpointing"] = (hf, _stepper(hf, ids)[1])
    for f in fractions:
        m = gradaccel.checkpoint_blocks(_model(s, device), memory=int(f * base_peak))
        eager[f"gradaccel-memory{f}"] = (m, _stepper(m, ids)[1])
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
        flops[name] = backward_flops(_stepper(m, ids)[0]) - base_flops
        rows.append(row(SUITE, case, name, "recompute_flops", flops[name], "FLOP", device))
    reps = 1 if tiny() else 5
    times = time_interleaved({n: st for n, (_, st) in eager.items()}, device, warmup=1, reps=reps)
    for name, t in times.items():
        rows.append(row(SUITE, case, name, "time", t, "s", device))

    for b in compile_budgets:
        torch._dynamo.reset()
        m = _model(s, device)
        rows += _compiled_rows(case, f"torch-compile-amb{b}", m, torch.compile(m, backend=_backend()), ids, ref,
                               ref_step, times["torch-nockpt"], device, budget=b)
    torch._dynamo.reset()
    return rows + compiled_case(device, quick)


# -- torch.compile on both sides ------------------------------------------------------------------
def _compiled_shape():
    if tiny():
        return dict(hidden=32, inter=88, layers=2, heads=4, kv=2, vocab=128, seq=32, batch=2)
    return dict(hidden=256, inter=688, layers=4, heads=8, kv=4, vocab=512, seq=512, batch=2)


def _compiled_points(quick, device):
    """(torch.compile's activation_memory_budget values, gradaccel budgets, memory= fractions)."""
    if tiny():
        return (1.0, 0.5), (0.5,), (0.7,)
    if quick and device != "cpu":  # bench/gpu.sh: cold inductor (Triton) compiles take its time limit
        return (1.0, 0.5, 0.25, 0.1), (1.0, 0.25), (0.55,)
    return ((1.0, 0.5, 0.25, 0.1), (1.0, 0.5, 0.25, 0.1), (0.7, 0.55, 0.45)) if quick else \
        ((1.0, 0.5, 0.25, 0.1), (1.0, 0.5, 0.25, 0.1, 0.0), (0.7, 0.55, 0.45, 0.38))


def compiled_case(device: str, quick: bool) -> list[dict]:
    """The case with torch.compile (inductor) on both sides, on the 4-layer Llama of issue 39
    (hidden 256, GQA 8/4 heads, vocabulary 512, batch 2 x 512): ``torch-compile-amb<b>`` against
    ``gradaccel-compiled-budget<b>`` (``checkpoint_blocks(model, budget=b)``, then compiled: each
    layer a selective checkpoint with its plan's policy, gradaccel/recompute/compiled.py) and
    ``gradaccel-compiled-memory<f>`` (``memory=f * P``, ``P`` the eager baseline's peak; the
    metric ``peak_over_target`` is the measured peak over that target). Ratios are to eager
    ``torch-nockpt``. Then the fold's hooks, compiled and eager (:func:`_fold_rows`)."""
    s = _compiled_shape()
    compile_budgets, budgets, fractions = _compiled_points(quick, device)
    case = (f"compiled llama{s['layers']}x(h{s['hidden']},GQA{s['heads']}/{s['kv']},V{s['vocab']}) "
            f"T{s['seq']} mb{s['batch']}")
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=device)
    ref = _model(s, device)
    _, ref_step = _stepper(ref, ids)
    ref_step()
    progress(f"{case} torch-nockpt")
    base_peak = _peak(ref, ref_step, device)
    base_time = time_interleaved({"ref": ref_step}, device, warmup=1, reps=1 if tiny() else 3)["ref"]
    rows = [row(SUITE, case, "torch-nockpt", "peak_bytes", base_peak, "B", device),
            row(SUITE, case, "torch-nockpt", "time", base_time, "s", device)]
    for b in compile_budgets:
        torch._dynamo.reset()
        m = _model(s, device)
        compiled = torch.compile(m, backend=_backend())
        rows += _compiled_rows(case, f"torch-compile-amb{b}", m, compiled, ids, ref, ref_step, base_time, device, b)
        if b == 1.0:  # compile's default: the model the fold's hooks are timed on
            rows += _fold_rows(case, s, ids, device, m, compiled)
    for name, setting in [(f"budget{b}", {"budget": b}) for b in budgets] + \
            [(f"memory{f}", {"memory": int(f * base_peak)}) for f in fractions]:
        torch._dynamo.reset()
        m = gradaccel.checkpoint_blocks(_model(s, device), **setting)
        rows += _compiled_rows(case, f"gradaccel-compiled-{name}", m, torch.compile(m, backend=_backend()), ids,
                               ref, ref_step, base_time, device)
        if "memory" in setting:
            rows.append(row(SUITE, case, f"gradaccel-compiled-{name}", "peak_over_target",
                            rows[-3]["value"] / setting["memory"], "", device))
    torch._dynamo.reset()
    return rows


def _fold_rows(case, s, ids, device, model, compiled, micro=4):
    """FusedAccumOptimizer's hooks on a compiled model against on an eager one: a window of
    ``micro`` micro-batches with torch's own accumulation (``.grad`` summed, one step) and with
    the fold (a hook per parameter, outside the compiled graph, in autograd), four variants timed
    in one interleaved run. ``fold_cost``: the fold's window time minus accumulation's, eager and
    compiled (the second compiled model reuses the first one's compiled code from inductor's cache)."""
    case = f"{case} fold x{micro}"
    progress(case)
    fold_model = _model(s, device)
    runs = {"torch-eager-accum": [_model(s, device)], "gradaccel-eager-fold": [_model(s, device)],
            "torch-compiled-accum": [model, compiled],
            "gradaccel-compiled-fold": [fold_model, torch.compile(fold_model, backend=_backend())]}
    windows = {}
    for name, (m, *called) in runs.items():
        fold = "fold" in name
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        opt = gradaccel.FusedAccumOptimizer(opt, micro) if fold else opt
        loss, _ = _stepper(called[0] if called else m, ids)

        def window(loss=loss, opt=opt, fold=fold):
            for _ in range(micro):
                loss().backward()
                if fold:  # the fold's own loop: a step per micro-batch (it applies one per window)
                    opt.step()
                    opt.zero_grad()
            if not fold:
                opt.step()
                opt.zero_grad()
        windows[name] = window
    # The hooks cost a few percent of a window: more rounds than the steps above, to see it over noise.
    times = time_interleaved(windows, device, warmup=1, reps=1 if tiny() else 7)
    rows = [row(SUITE, case, n, "window_time", t, "s", device) for n, t in times.items()]
    for side in ("eager", "compiled"):
        cost = times[f"gradaccel-{side}-fold"] - times[f"torch-{side}-accum"]
        rows.append(row(SUITE, case, f"gradaccel-{side}-fold", "fold_cost", cost, "s", device))
    return rows


SERIES = (("gradaccel-compiled-memory", "o-", "gradaccel memory=, compiled"),
          ("gradaccel-compiled-budget", "D-", "gradaccel budget=, compiled"),
          ("gradaccel-memory", "o-", "gradaccel memory="),
          ("torch-compile-amb", "s--", "torch.compile activation_memory_budget"),
          ("torch-hf", "^", "HF gradient checkpointing"),
          ("torch-nockpt", "k*", "no checkpointing (eager)"))


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """One figure per case with a time/peak frontier: ``frontier.png`` (eager gradaccel) and
    ``frontier_compiled.png`` (torch.compile on both sides)."""
    plt = pyplot()
    cases = {}
    for r in rows:
        cases.setdefault(r["case"], {}).setdefault(r["variant"], {})[r["metric"]] = r["value"]
    paths = []
    for case, by in cases.items():
        base = by.get("torch-nockpt", {})
        if "peak_bytes" not in base or "time" not in base:
            continue  # the fold's case: a table, no frontier
        fig, ax = plt.subplots(figsize=(6, 4.5))
        taken = set()
        for prefix, style, label in SERIES:
            names = [n for n in by if n.startswith(prefix) and n not in taken]
            taken.update(names)
            pts = sorted((by[n]["peak_bytes"] / base["peak_bytes"], by[n]["time"] / base["time"])
                         for n in names if "time" in by[n] and "peak_bytes" in by[n])
            if pts:
                ax.plot([p for p, _ in pts], [t for _, t in pts], style, label=label)
        ax.set_xlabel("peak memory of a step / no checkpointing (eager)")
        ax.set_ylabel("step time / no checkpointing (eager)")
        ax.set_title(f"frontier: {case}" if len(case) < 48 else f"frontier: {case[:45]}...", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = "frontier_compiled.png" if case.startswith("compiled") else "frontier.png"
        paths.append(save_figure(fig, out_dir, name))
    return paths
