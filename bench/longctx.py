"""The `longctx` suite: one small Hugging Face Llama trained at long contexts, 2K to 16K tokens.

The model: 4 layers, hidden 256, MLP 1024, 4 heads, vocabulary 512, sdpa, fp32, batch 1 (the
issue 28 model, with a narrower MLP so that the suite runs in minutes on 2 cores); and then the
issue's own model (MLP 2048) at 8K tokens, with no checkpointing, HF checkpointing and the
``memory=`` plan only (case ``... i2048 T8192``, not plotted). At each length
every variant runs on its own copy of the same weights, with the same tokens:

- ``torch-nockpt``: no checkpointing;
- ``torch-hf-ckpt``: Hugging Face gradient checkpointing (non-reentrant): the table's baseline;
- ``torch-ckpt-block``: ``torch.utils.checkpoint`` around each decoder layer, by hand. (This is
  also what ``gradaccel.checkpoint_blocks(model, budget=0)`` runs: budget 0 is
  ``torch.utils.checkpoint`` by contract.)
- ``gradaccel-keepleast``: ``checkpoint_blocks(model, budget=1)`` (one byte: the plan that keeps
  least, so gradaccel's own replay rebuilds everything the blocks saved);
- ``gradaccel-memory``: ``checkpoint_blocks(model, memory=0.35 x torch-hf-ckpt's measured step
  peak at that length)``, as issue 28 asks it; where the target is below what gradaccel's plans
  reach, it warns and runs its lowest plan.
- ``gradaccel-least``: ``checkpoint_blocks(model, memory=1)``: a target no plan meets, so the
  plan of least predicted peak runs (warned): blocks sliced or nested (gradaccel/memory/sliced.py,
  parts.py), inputs on the host where that lowers the peak, the loss in chunks.
- ``gradaccel-sliced``: every block sliced (the whole block a slice of the sequence at a time,
  keys and values whole: gradaccel/memory/sliced.py), at the finest slice count the planner offers
  (slices of 1024 tokens and more), inputs on the host, the loss in chunks; its predicted peak is
  ``memory=``'s own prediction for that plan (``Profile.predict`` on fake tensors).

gradaccel variants run one step first (their trace, or the memory target's profile), and every
variant is measured on one step under ``gradaccel.memory.LiveBytes``. Metrics: ``peak_bytes``
(the most bytes alive at once that the step made: activations, working set, gradients; weights
excluded), ``time`` (that step's seconds, the table shows it over HF checkpointing's: one step per variant,
so on a busy machine it is the noisiest figure here),
``grad_rel_err`` (the largest parameter-gradient difference from ``torch-nockpt``, over the
largest gradient), ``predicted_peak`` (the memory target's own prediction of the step peak,
made on fake tensors: of the plan it chose for ``gradaccel-memory`` and ``gradaccel-least``, of
every block at its keep-least plan, which ``gradaccel-keepleast`` runs, and of the sliced plan)
with ``peak_vs_predicted``, and
``peak_vs_target`` for ``gradaccel-memory``.
"""

import copy
import time
import warnings

import torch
import torch.utils.checkpoint as tc

import gradaccel
from bench.common import hf_checkpointing, progress, pyplot, row, save_figure, tiny
from gradaccel.memory import LiveBytes

SUITE = "longctx"
BASELINE = "torch-hf-ckpt"
TABLE_METRICS = ["peak_bytes", "time", "predicted_peak", "peak_vs_predicted", "peak_vs_target", "grad_rel_err"]
VARIANTS = ["torch-nockpt", "torch-hf-ckpt", "torch-ckpt-block", "gradaccel-keepleast", "gradaccel-memory",
            "gradaccel-least", "gradaccel-sliced"]
TARGET_SHARE = 0.35  # of HF checkpointing's measured peak: issue 28's target


def _config():
    if tiny():
        return dict(hidden=64, inter=128, layers=2, heads=2, vocab=128, lengths=(64, 128))
    return dict(hidden=256, inter=1024, layers=4, heads=4, vocab=512, lengths=(2048, 4096, 8192, 16384))


# Issue 28's model and length as it states them (MLP 2048): one more case, three variants.
ISSUE = dict(hidden=256, inter=2048, layers=4, heads=4, vocab=512, lengths=(8192,))
ISSUE_VARIANTS = ["torch-nockpt", "torch-hf-ckpt", "gradaccel-memory"]


def _model(c, device):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=c["hidden"], intermediate_size=c["inter"], num_hidden_layers=c["layers"],
                                   num_attention_heads=c["heads"], num_key_value_heads=c["heads"], vocab_size=c["vocab"],
                                   max_position_embeddings=max(c["lengths"]))
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device).train()


def _checkpoint_each_layer(model) -> None:
    """``torch.utils.checkpoint`` around each decoder layer's forward."""
    for layer in model.model.layers:
        inner = layer.forward
        layer.forward = lambda *a, _f=inner, **k: tc.checkpoint(_f, *a, use_reentrant=False, **k)


def _sliced(model, inputs) -> int:
    """Every block of ``model`` sliced at the finest count, inputs on the host, the loss in chunks
    (as ``memory=`` sets a plan); returns ``memory=``'s prediction of that step's peak."""
    from gradaccel.memory.chunked_loss import install_head, set_head
    from gradaccel.memory.parking import HOST, set_parking
    from gradaccel.memory.parts import sliced, sliced_count
    from gradaccel.memory.profile import Profile, find_blocks
    from gradaccel.memory.target import _step, set_plans

    gradaccel.checkpoint_blocks(model, budget=0, inputs_on_host=True)
    install_head(model)
    prof = Profile(model, _step, ((), inputs), grad_hooks=False, prepare=lambda m: set_head(m, True))
    prof.inputs_on_host = True
    tokens = inputs["input_ids"].shape[1]
    plan = sliced(sliced_count(tokens))  # the count the planner offers
    points = [prof.piece_point(prof.kind_of[i], plan) for i in range(len(prof.blocks))]
    blocks = find_blocks(model)
    set_plans(model, blocks, True, [p.plan for p in points])
    set_parking(blocks, (HOST,) * len(blocks))
    return prof.predict(points)["peak"]


def _variant(name, base, target, inputs):
    model = copy.deepcopy(base)
    if name == "torch-hf-ckpt":
        hf_checkpointing(model)
    elif name == "torch-ckpt-block":
        _checkpoint_each_layer(model)
    elif name == "gradaccel-keepleast":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # budget=1 is an int: one byte, as meant
            gradaccel.checkpoint_blocks(model, budget=1)
    elif name == "gradaccel-memory":
        gradaccel.checkpoint_blocks(model, memory=target)
    elif name == "gradaccel-least":
        # A target no plan meets (warned): the plan of least predicted peak, inputs on the host
        # where that lowers it, nested blocks, loss in chunks.
        gradaccel.checkpoint_blocks(model, memory=1)
    elif name == "gradaccel-sliced":
        model._bench_predicted = _sliced(model, inputs)
    return model


def _step(model, inputs):
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # memory= warns where its target is below its lowest plan
        model(**inputs).loss.backward()


def _measured(model, inputs):
    """(peak bytes, seconds) of one step."""
    live = LiveBytes()
    with live:
        t0 = time.perf_counter()
        _step(model, inputs)
        seconds = time.perf_counter() - t0
    return live.peak, seconds


def _predicted(model, inputs):
    """The memory target's predicted step peaks for ``inputs`` (planned at the first step): of
    the plan it chose, and of every block at its keep-least plan with the model's own loss."""
    from gradaccel.memory.target import MemoryTarget, _key

    hook = next(h for h in model._forward_pre_hooks.values() if isinstance(h, MemoryTarget))
    _, chosen, floor = hook.chosen[_key((), inputs)]
    return chosen, floor


def _grad_err(model, reference) -> float:
    worst = max(g.abs().max().item() for g in reference.values())
    return max((p.grad - reference[n]).abs().max().item() for n, p in model.named_parameters()) / worst


def run(device: str, quick: bool) -> list[dict]:
    """Every length and variant on ``device`` (see the module docstring), then issue 28's own
    case (``ISSUE``: the MLP twice as wide, 8K tokens; HF checkpointing and the ``memory=`` plan,
    beside no checkpointing for the gradients).

    Returns:
        rows made by ``bench.common.row``.
    """
    c = _config()
    base = _model(c, device)
    rows = []
    lengths = c["lengths"]
    gen = torch.Generator().manual_seed(0)
    for i, t in enumerate(lengths, 1):
        progress(f"llama{c['layers']}x h{c['hidden']} T{t}", i, len(lengths) + 1)
        rows += _case(f"llama{c['layers']}x h{c['hidden']} T{t}", base, c, t, VARIANTS, gen, device)
    if not tiny():
        c = ISSUE
        case = f"llama{c['layers']}x h{c['hidden']} i{c['inter']} T{c['lengths'][0]}"
        progress(case, len(lengths) + 1, len(lengths) + 1)
        rows += _case(case, _model(c, device), c, c["lengths"][0], ISSUE_VARIANTS, gen, device)
    return rows


def _case(case, base, c, t, variants, gen, device) -> list[dict]:
    """One length: each of ``variants`` on its own copy of ``base``, the same tokens."""
    ids = torch.randint(0, c["vocab"], (1, t), generator=gen).to(device)
    inputs = dict(input_ids=ids, labels=ids, use_cache=False)
    gradaccel.reset_plans()
    reference, target, measured, rows = None, None, {}, []
    for name in variants:
        model = _variant(name, base, target, inputs)
        if name.startswith("gradaccel"):
            _step(model, inputs)  # its trace, or its target's profile and plan
        peak, seconds = _measured(model, inputs)
        if name == "torch-nockpt":
            reference = {n: p.grad.clone() for n, p in model.named_parameters()}
        if name == "torch-hf-ckpt":
            target = int(TARGET_SHARE * peak)
        rows += [row(SUITE, case, name, "peak_bytes", peak, "B", device),
                 row(SUITE, case, name, "time", seconds, "s", device),
                 row(SUITE, case, name, "grad_rel_err", _grad_err(model, reference), "", device)]
        measured[name] = peak
        if name in ("gradaccel-memory", "gradaccel-least"):
            chosen, floor = _predicted(model, inputs)
            predicted = {name: chosen, "gradaccel-keepleast": floor} if name == "gradaccel-memory" else {name: chosen}
            for v, p in predicted.items():
                if v in measured:
                    rows += [row(SUITE, case, v, "predicted_peak", p, "B", device),
                             row(SUITE, case, v, "peak_vs_predicted", measured[v] / p, "x", device)]
        if name == "gradaccel-sliced":
            p = model._bench_predicted
            rows += [row(SUITE, case, name, "predicted_peak", p, "B", device),
                     row(SUITE, case, name, "peak_vs_predicted", peak / p, "x", device)]
        if name == "gradaccel-memory":
            rows.append(row(SUITE, case, name, "peak_vs_target", peak / target, "x", device))
        del model
    return rows


def _length(case: str) -> int:
    return int(case.rsplit("T", 1)[1])


def _length_ticks(plt, ax, lengths) -> None:
    ticker = plt.matplotlib.ticker
    ax.set_xticks(lengths, [str(t) for t in lengths])
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """Step peak against the length (and the memory target's prediction), and time over HF's."""
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    by = {}
    for r in rows:
        if " i" in r["case"]:  # issue 28's own case (another model) is in the table, not the plot
            continue
        by.setdefault((r["variant"], r["metric"]), []).append((_length(r["case"]), r["value"]))
    for name in VARIANTS:
        pts = sorted(by.get((name, "peak_bytes"), []))
        if pts:
            line, = ax.plot([p[0] for p in pts], [p[1] / 2**20 for p in pts], "o-", label=name)
            predicted = sorted(by.get((name, "predicted_peak"), []))
            if predicted:
                ax.plot([p[0] for p in predicted], [p[1] / 2**20 for p in predicted], "x--", color=line.get_color(),
                        label=f"{name}, predicted")
    ax.set(xscale="log", yscale="log", xlabel="tokens (batch 1)", ylabel="step peak, MiB (LiveBytes)",
           title="small Llama: step peak against context length")
    _length_ticks(plt, ax, sorted({p[0] for v in by.values() for p in v}))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    base = dict(by.get((BASELINE, "time"), []))
    for name in VARIANTS:
        pts = sorted((t, s / base[t]) for t, s in by.get((name, "time"), []) if t in base)
        if pts:
            bx.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
    bx.set(xscale="log", xlabel="tokens (batch 1)", ylabel=f"step time / {BASELINE}", title="time")
    _length_ticks(plt, bx, sorted(base))
    bx.grid(alpha=0.3)
    fig.tight_layout()
    return [save_figure(fig, out_dir, "longctx_peak.png")]
