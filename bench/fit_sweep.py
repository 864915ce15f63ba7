"""The `fit_sweep` suite: every plan the fit can return, applied and measured against its prediction.

A small Hugging Face Llama (fp32, 3 layers, hidden 192, vocabulary 1536: the model of issue
#36), batch 8 x 256 tokens, AdamW. Targets: 0.35, 0.6 and 0.9 of no checkpointing's predicted
peak at micro-batch 8, with the fit's default slack (5%). For each micro-batch size that divides
the batch and each loss (the model's own, and in chunks), the fit's fastest plan at that
micro-batch and loss that fits (``gradaccel.memory.fit._best_for``, the step of ``fit`` that
``micro_batches=[mb]`` takes), applied to a fresh model and trained for two windows:

- ``gradaccel-measured``: the step's peak as the allocator counts it
  (``measured_peak(..., by="allocator")``: torch's profiler's memory events on CPU, kernels'
  own scratch included; ``torch.cuda.max_memory_allocated`` on CUDA); the table's baseline;
- ``gradaccel-predicted``: the fit's prediction (its ratio is predicted / measured);
- ``torch-nockpt``: stock training at that micro-batch (no checkpointing, AdamW with its own
  ``.grad``), measured the same way: what the plans save.

``measured_vs_target`` is the measured peak over the target (at most 1 where the plan holds; the
default slack leaves 5% of it to the allocator). A micro-batch and loss at which nothing fits
has no rows.

    python -m bench --suite fit_sweep
"""

import torch

import gradaccel
from bench.common import progress, pyplot, row, save_figure, tiny
from gradaccel.memory.counter import measured_peak
from gradaccel.memory.fit import Planner, _best_for, _evaluate, hf_step, memory_and_slack

SUITE = "fit_sweep"
BASELINE = "gradaccel-measured"
TABLE_METRICS = ["peak_bytes", "measured_vs_target"]
FRACTIONS = (0.35, 0.6, 0.9)


def _shape():
    """(hidden, intermediate, layers, heads, kv heads, vocabulary, seq, batch)."""
    if tiny():
        return 64, 176, 2, 4, 2, 256, 64, 2
    return 192, 512, 3, 4, 2, 1536, 256, 8


def _model(shape, device):
    import transformers

    hidden, inter, layers, heads, kv, vocab = shape[:6]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                   max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(cfg).float().to(device).train()


def _batch(vocab, mb, seq, device):
    ids = torch.randint(0, vocab, (mb, seq), device=device)
    return {"input_ids": ids, "labels": ids}


def run(device: str, quick: bool) -> list[dict]:
    shape = _shape()
    vocab, seq, batch = shape[5], shape[6], shape[7]
    model = _model(shape, device)
    planner = Planner(model, optim=torch.optim.AdamW(model.parameters()))
    prof = planner.profile(seq, batch)
    full = _evaluate(planner, seq, batch, batch, [prof.uncheckpointed(prof.kind_of[i])
                                                  for i in range(len(prof.blocks))]).peak
    sizes = [d for d in range(1, batch + 1) if batch % d == 0]
    cases = [(f, mb, c) for f in FRACTIONS for mb in sizes for c in (False, True)]
    rows, stock = [], {}
    for i, (frac, mb, chunked) in enumerate(cases, 1):
        case = f"target {frac} mb{mb} {'chunked' if chunked else 'model'} loss"
        progress(case, i, len(cases))
        memory, slack = memory_and_slack(int(frac * full))
        plan = _best_for(planner, seq, mb, batch, memory - slack, chunked_loss=chunked)
        if plan is None:
            continue
        plan.memory, plan.slack = memory, slack
        gradaccel.reset_plans()
        fresh = _model(shape, device)
        fresh, opt = plan.apply(fresh, torch.optim.AdamW(fresh.parameters()))
        measured = measured_peak(fresh, opt, hf_step, _batch(vocab, mb, seq, device), by="allocator")
        if mb not in stock:
            plain = _model(shape, device)
            stock[mb] = measured_peak(plain, torch.optim.AdamW(plain.parameters()), hf_step,
                                      _batch(vocab, mb, seq, device), by="allocator")
        rows += [row(SUITE, case, "gradaccel-measured", "peak_bytes", measured, "B", device),
                 row(SUITE, case, "gradaccel-predicted", "peak_bytes", plan.peak, "B", device),
                 row(SUITE, case, "torch-nockpt", "peak_bytes", stock[mb], "B", device),
                 row(SUITE, case, "gradaccel-measured", "measured_vs_target", measured / memory, "x", device)]
    return rows


def plot(rows: list[dict], out_dir: str) -> list[str]:
    plt = pyplot()
    measured = {r["case"]: r["value"] for r in rows if r["variant"] == "gradaccel-measured" and r["metric"] == "peak_bytes"}
    predicted = {r["case"]: r["value"] for r in rows if r["variant"] == "gradaccel-predicted"}
    cases = sorted(measured)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([predicted[c] / 2**20 for c in cases], [measured[c] / 2**20 for c in cases])
    top = max(list(measured.values()) + list(predicted.values()), default=1) / 2**20
    ax.plot([0, top], [0, top], "k--", lw=0.8)
    ax.set(xlabel="predicted peak (MiB)", ylabel="allocated peak (MiB)", title="every plan of the fit")
    fig.tight_layout()
    return [save_figure(fig, out_dir, "fit_sweep.png")]
