"""The `lengths` suite: training on sequence lengths that change every step, as real fine-tuning does.

An HF Llama (4 layers, hidden 256, sdpa) trains on lengths drawn from a skewed distribution like
instruction data (log-normal, median ~120 tokens, clipped to [8, max]). After a warm-up on 4
lengths, every step is at a length that variant has never seen, planning included. Cases: batch
1 (each step the length of its text) and padded batches of 4 (each step padded to its longest
text, an attention mask on the padding).

Variants, each on its own copy of the same model:

- ``torch-nockpt``: no checkpointing;
- ``torch-hf-ckpt``: Hugging Face gradient checkpointing (whole blocks, torch's checkpoint): the
  baseline of the table;
- ``gradaccel-budget0.5``: ``checkpoint_blocks(model, budget=0.5)``;
- ``gradaccel-memory``: ``checkpoint_blocks(model, memory=0.6 x torch-nockpt's peak at the
  longest length, seq=max length)`` (the longest length stated, as TRL's ``max_length`` states
  it: the first call profiles the whole range; without it, each new longest length is profiled
  once more when it comes);
- ``gradaccel-fit``: ``gradaccel.fit.fit(model, seq=max length, batch, memory=same + the weights,
  window buffer and optimizer state that exist before the step, slack=0).apply()``.

Two more cases, at batch 1. Grouped-query attention (8 heads, 4 KV heads, vocabulary 512) with
``gradaccel-memory-noseq``: ``checkpoint_blocks(model, memory=same share)`` *without* ``seq``,
as a user who skips it writes it (the range it profiles grows ahead of the data), on issue #36's
lengths: warm-up 189, 509, 101 and 226 tokens, then lengths of 24 to 512 tokens, the longest
among them, where the target binds and the plans predicted across lengths go over it. And the script
this project started from, in small (bench/lengths_qlora.py): SFTTrainer, 4-bit QLoRA with peft,
paged 8-bit AdamW, stock against ``gradaccel.hf.enable(trainer, budget=0.5)``, each in a process
of its own (``time`` is the whole ``trainer.train()``; ``traced_per_layer`` and ``sized`` count
the regions' calls; ``loss_diff`` is the largest difference of a logged loss to stock's).

Metrics: ``time`` (seconds of the new-length steps, forward, backward and an SGD step),
``new_vs_planned``: those seconds over the seconds of a second step at each length (a planned
step; 1.00x means a new length costs nothing extra), and ``slowest_step_vs_hf``: the largest
ratio of one new length's step to HF checkpointing's step at that length (a stalled step). Each length is run by every variant in
turn (first call, then the planned call), so drifts in machine speed hit all alike. Then, on a
few more new lengths and the longest, under counters: ``peak_bytes`` (the most live tensor
bytes in a step, gradaccel.memory.LiveBytes), ``peak_vs_target`` (that peak over the memory
target, for the variants given one: at most 1 where the target holds) and ``recompute_flops``
(the step's backward FLOPs less no checkpointing's, torch's FlopCounterMode). The peak is taken
on the first call at each length, alone; the FLOPs on the second, which runs the same plan.
"""

import copy
import gc
import time

import numpy as np
import torch

import gradaccel
from bench import lengths_qlora
from bench.common import backward_flops, hf_checkpointing, progress, pyplot, row, save_figure, tiny

SUITE = "lengths"
BASELINE = "torch-hf-ckpt"
TABLE_METRICS = ["time", "new_vs_planned", "slowest_step_vs_hf", "peak_bytes", "peak_vs_target", "recompute_flops", "traced_per_layer", "sized",
                 "loss_diff"]
TARGETED = ("gradaccel-memory", "gradaccel-fit", "gradaccel-memory-noseq")  # the variants given the memory target
VARIANTS = ["torch-nockpt", "torch-hf-ckpt", "gradaccel-budget0.5", "gradaccel-memory", "gradaccel-fit"]
GQA_VARIANTS = ["torch-nockpt", "torch-hf-ckpt", "gradaccel-memory-noseq"]


def _config(quick):
    """(hidden, intermediate, layers, heads, vocab, max length, steps, warm-up, counted lengths)."""
    if tiny():
        return dict(hidden=64, inter=128, layers=2, heads=2, vocab=128, max_len=48, steps=2, warmup=1, counted=1)
    return dict(hidden=256, inter=688, layers=4, heads=4, vocab=2048, max_len=512, steps=40,
                warmup=4, counted=3)


def _model(c, device):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=c["hidden"], intermediate_size=c["inter"], num_hidden_layers=c["layers"],
                                   num_attention_heads=c["heads"], num_key_value_heads=c.get("kv", c["heads"]),
                                   vocab_size=c["vocab"],
                                   max_position_embeddings=1024)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device).train()


def _lengths(c, n, seen, rng):
    """``n`` lengths none of which is in ``seen``, log-normal (instruction data's long tail), from
    ``c["shortest"]`` (8 by default) to the longest."""
    out = []
    while len(out) < n:
        t = int(np.clip(rng.lognormal(np.log(120), 0.8), c.get("shortest", 8), c["max_len"]))
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def _batch(c, longest, batch, rng, device):
    """Token ids padded to ``longest`` (the longest text of the batch), mask and labels."""
    ids = torch.from_numpy(rng.integers(1, c["vocab"], (batch, longest))).to(device)
    mask = torch.ones(batch, longest, dtype=torch.long, device=device)
    for b in range(1, batch):  # the others shorter: padded at the end
        mask[b, int(rng.integers(max(1, longest // 4), longest + 1)):] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)


class _Variant:
    def __init__(self, name, base, c, device, target, batch):
        self.name = name
        self.model = copy.deepcopy(base)
        opt = torch.optim.SGD(self.model.parameters(), lr=0.0)
        if name == "torch-hf-ckpt":
            hf_checkpointing(self.model)
        elif name == "gradaccel-budget0.5":
            gradaccel.checkpoint_blocks(self.model, budget=0.5)
        elif name == "gradaccel-memory":
            gradaccel.checkpoint_blocks(self.model, memory=target, seq=c["max_len"])
        elif name == "gradaccel-memory-noseq":
            gradaccel.checkpoint_blocks(self.model, memory=target)
        elif name == "gradaccel-fit":
            from gradaccel.memory.fit import Planner

            # The fit's memory is the device's: the step's target plus what exists before the step
            # (weights, the window buffer, optimizer state), which memory= leaves out.
            planner = Planner(self.model, optim=opt)
            plan = planner.fit(c["max_len"], batch, target + planner.static.total, slack=0, micro_batches=[batch])
            self.model, opt = plan.apply(self.model, opt)
        self.opt = opt

    def step(self, inputs):
        loss = self.model(**inputs).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _peak(variant, inputs) -> int:
    """Peak live bytes of one step (forward and backward), nothing else watching: under torch's
    FlopCounterMode this suite read memory='s peak at 1.10x its target (batch 1), 0.99x alone."""
    from gradaccel.memory.counter import LiveBytes

    with LiveBytes() as live:
        variant.model(**inputs).loss.backward()
    variant.opt.step()
    variant.opt.zero_grad(set_to_none=True)
    return live.peak


def _backward_flops(variant, inputs) -> int:
    """FLOPs of one step's backward (recompute included)."""
    flops = backward_flops(lambda: variant.model(**inputs).loss)
    variant.opt.step()
    variant.opt.zero_grad(set_to_none=True)
    return flops


def _case(c, batch, device, rows, fails, variant_names=VARIANTS):
    kv = c.get("kv", c["heads"])
    gqa = f" gqa{c['heads']}/{kv} v{c['vocab']}" if kv != c["heads"] else ""
    case = f"llama{c['layers']}x h{c['hidden']}{gqa} batch {batch}" + (
        f" lengths {c['shortest']}-{c['max_len']}" if "warm" in c else "")
    rng = np.random.default_rng(batch)
    base = _model(c, device)
    seen = set()
    gradaccel.reset_plans()
    # The memory target: 0.6 x no checkpointing's peak at the longest length.
    probe = _Variant("torch-nockpt", base, c, device, None, batch)
    target = int(0.6 * _peak(probe, _batch(c, c["max_len"], batch, rng, device)))
    variants = {}
    for name in variant_names:
        try:
            variants[name] = _Variant(name, base, c, device, target, batch)
        except Exception as e:  # noqa: BLE001 (a variant that cannot be set up is reported, not fatal)
            fails[name] = f"{type(e).__name__}: {e}"
    warm = list(c["warm"]) if "warm" in c else _lengths(c, c["warmup"], seen, rng)
    seen.update(warm)
    new = _lengths(c, c["steps"], seen, rng)
    if "warm" in c and c["max_len"] not in new:
        new[-1] = c["max_len"]  # the longest among the new lengths: where the target binds
    counted = _lengths(c, c["counted"], seen, rng) + [c["max_len"]]  # and the longest, where a target is tightest
    first = {n: 0.0 for n in variants}
    again = {n: 0.0 for n in variants}
    slowest = {n: 0.0 for n in variants}  # the largest ratio of a new length's step to HF checkpointing's
    for i, t in enumerate(warm + new, 1):
        progress(f"{case} T{t}", i, len(warm) + len(new))
        if i == len(warm) + 1:
            # This process holds every variant and every earlier suite's objects: a full garbage
            # collection (0.3 s here) would land in whichever step runs then. Frozen, they are
            # not scanned; what the steps make still is.
            gc.collect()
            gc.freeze()
        inputs = _batch(c, t, batch, rng, device)
        took = {}
        for name, v in list(variants.items()):
            try:
                t0 = time.perf_counter()
                v.step(inputs)
                t1 = time.perf_counter()
                v.step(inputs)
                t2 = time.perf_counter()
            except Exception as e:  # noqa: BLE001
                fails[name] = f"{type(e).__name__}: {e}"
                del variants[name]
                continue
            if i > len(warm):
                first[name] += t1 - t0
                again[name] += t2 - t1
                took[name] = t1 - t0
        for name, seconds in took.items():
            if BASELINE in took:
                slowest[name] = max(slowest[name], seconds / took[BASELINE])
    gc.unfreeze()
    peaks = {n: 0 for n in variants}
    flops = {n: 0 for n in variants}
    for t in counted:
        inputs = _batch(c, t, batch, rng, device)
        plain = None
        for name, v in variants.items():
            peak, f = _peak(v, inputs), _backward_flops(v, inputs)
            if name == "torch-nockpt":
                plain = f
            peaks[name] = max(peaks[name], peak)
            flops[name] += f - plain
    for name in variants:
        rows += [row(SUITE, case, name, "time", first[name], "s", device),
                 row(SUITE, case, name, "new_vs_planned", first[name] / again[name], "x", device),
                 row(SUITE, case, name, "slowest_step_vs_hf", slowest[name], "x", device),
                 row(SUITE, case, name, "peak_bytes", peaks[name], "B", device),
                 row(SUITE, case, name, "recompute_flops", max(0, flops[name]), "FLOP", device)]
        if name in TARGETED:
            rows.append(row(SUITE, case, name, "peak_vs_target", peaks[name] / target, "x", device))


def run(device: str, quick: bool) -> list[dict]:
    """Runs the batch-1 and padded-batch-of-4 cases on ``device`` (see the module docstring).

    Returns:
        rows made by ``bench.common.row``.
    """
    c = _config(quick)
    rows, fails = [], {}
    for batch in (1,) if tiny() else (1, 4):
        _case(c, batch, device, rows, fails)
    # The case (#36): warm-up lengths 189, 509, 101, 226, then lengths of 24 to 512 tokens,
    # the longest among them, where the target binds and predicted plans go over it.
    tight = dict(warm=(189, 509, 101, 226), shortest=24) if not tiny() else {}
    _case(dict(c, heads=8, kv=4, vocab=512, **tight) if not tiny() else dict(c, heads=4, kv=2), 1, device, rows,
          fails, GQA_VARIANTS)
    try:
        rows += lengths_qlora.rows(quick, device)
    except Exception as e:  # noqa: BLE001 (peft/bitsandbytes/trl missing, or the run failed: reported)
        fails["qlora-sft"] = f"{type(e).__name__}: {e}"
    for name, why in fails.items():
        print(f"bench lengths: {name} left out: {why}")
    return rows


def plot(rows: list[dict], out_dir: str) -> list[str]:
    plt = pyplot()
    cases = sorted({r["case"] for r in rows})
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        times = {r["variant"]: r["value"] for r in rows if r["case"] == case and r["metric"] == "time"}
        names = [n for n in VARIANTS + GQA_VARIANTS + list(lengths_qlora.VARIANTS) if n in times]
        names = list(dict.fromkeys(names))
        ax.bar(range(len(names)), [times[n] for n in names])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set(title=case, ylabel="seconds over the new lengths")
    fig.tight_layout()
    return [save_figure(fig, out_dir, "lengths_time.png")]
