"""The `fit` suite: gradaccel.fit's predicted peak of a training step against the real one.

Per case (a tiny Hugging Face Llama, a sequence length, a micro-batch, a per-block budget as a
fraction of a block's activation bytes), side by side:

- ``gradaccel-measured``: the real peak of live tensor bytes (gradaccel.memory.LiveBytes, a
  dispatch-mode counter, plus the weights, fp32 window buffer and optimizer state that exist
  before) over a window of steps, blocks checkpointed at that budget, FusedAccumOptimizer;
- ``gradaccel-predicted``: gradaccel.fit's prediction, made on fake tensors before any step;
- ``torch-nockpt``: the same model and batch trained stock (no checkpointing, AdamW with its
  own ``.grad``), measured the same way: what the checkpointed plans are saving.

The table divides by ``gradaccel-measured``: the predicted column is predicted/measured.
One case runs the blocks with ``offload=True`` (device peak and host bytes, see ``_offload_rows``).
One more case compares ``checkpoint_blocks(memory=...)`` with equal per-block fractions of the
same total on blocks that differ (see ``_split_rows``).
On CUDA the measured variant is also taken with ``torch.cuda.max_memory_allocated``.
"""

import torch

import gradaccel
from bench.common import backward_flops, hf_checkpointing, progress, pyplot, row, save_figure, tiny
from gradaccel.memory.fit import Planner, find_blocks, hf_step
from gradaccel.memory.counter import measured_peak
from gradaccel.recompute.block_plan import BlockPlan, set_plan

SUITE = "fit"
BASELINE = ["gradaccel-measured", "gradaccel-equal-fraction"]
TABLE_METRICS = ["peak_bytes", "host_bytes", "held_bytes", "recompute_flops"]


def _cases(quick: bool):
    shapes = [(64, 176, 3, 4, 2, 512)] if tiny() or quick else [(64, 176, 3, 4, 2, 512), (128, 344, 4, 8, 4, 2048)]
    seqs = (64,) if tiny() else (128, 512)
    fractions = (0.25,) if tiny() else (0.05, 0.5, 1.0)
    return [(s, q, mb, f) for s in shapes for q in seqs for mb in ((2,) if tiny() else (1, 4)) for f in fractions]


def _model(shape, device):
    import transformers

    hidden, inter, layers, heads, kv, vocab = shape
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                   max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(cfg).to(device).train()


def run(device: str, quick: bool) -> list[dict]:
    rows, planners = [], {}
    cases = _cases(quick)
    for i, (shape, seq, mb, frac) in enumerate(cases, 1):
        h, _, layers, _, _, vocab = shape
        case = f"llama{layers}x(h{h},V{vocab}) T{seq} mb{mb} b{frac}"
        progress(case, i, len(cases))
        if shape not in planners:
            gradaccel.reset_plans()
            model = _model(shape, device)
            gradaccel.checkpoint_blocks(model, budget=1)
            planners[shape] = (model, Planner(model, optim=torch.optim.AdamW(model.parameters())))
        model, planner = planners[shape]
        prof = planner.profile(seq, mb)
        budgets = [max(1, int(frac * prof.kind_of[j].graph.activation_bytes)) for j in range(len(prof.blocks))]
        predicted = planner.estimate(seq, mb, budgets).peak
        ids = torch.randint(0, vocab, (mb, seq), device=device)
        batch = {"input_ids": ids, "labels": ids}
        for block, b in zip(find_blocks(model), budgets):
            set_plan(block, BlockPlan.parse(b))
        opt = gradaccel.FusedAccumOptimizer(torch.optim.AdamW(model.parameters()), 1)
        measured = measured_peak(model, opt, hf_step, batch)
        del opt
        rows.append(row(SUITE, case, "gradaccel-predicted", "peak_bytes", predicted, "B", device))
        rows.append(row(SUITE, case, "gradaccel-measured", "peak_bytes", measured, "B", device))
        stock = _model(shape, device)
        rows.append(row(SUITE, case, "torch-nockpt", "peak_bytes",
                        measured_peak(stock, torch.optim.AdamW(stock.parameters()), hf_step, batch), "B", device))
        model.zero_grad(set_to_none=True)
    return rows + _offload_rows(device, planners, quick) + _split_rows(device)


def _offload_rows(device: str, planners: dict, quick: bool) -> list[dict]:
    """Blocks checkpointed with ``offload=True`` at a small budget: the predicted device peak
    and host bytes against the measured peak and the store's offloaded bytes. The copy's cost
    (which decides what is offloaded) is this machine's, measured once per process."""
    import functools

    from gradaccel.recompute.offload_frame import store_for

    rows = []
    shape = next(iter(planners))
    _, planner = planners[shape]
    seq, mb = (64, 2) if tiny() else (512, 1)
    h, _, layers, _, _, vocab = shape
    case = f"llama{layers}x(h{h},V{vocab}) T{seq} mb{mb} b0.05 offload"
    progress(case)
    prof = planner.profile(seq, mb)
    budgets = [max(1, int(0.05 * prof.kind_of[j].graph.activation_bytes)) for j in range(len(prof.blocks))]
    predicted = planner.estimate(seq, mb, budgets, offload=True)
    gradaccel.reset_plans()
    model = _model(shape, device)
    hf_checkpointing(model)
    for block, b in zip(find_blocks(model), budgets):
        block._gradient_checkpointing_func = functools.partial(gradaccel.checkpoint, budget=b, offload=True)
    store = store_for(None)
    before = store.stats()["bytes_offloaded"]
    ids = torch.randint(0, vocab, (mb, seq), device=device)
    measured = measured_peak(model, gradaccel.FusedAccumOptimizer(torch.optim.AdamW(model.parameters()), 1), hf_step,
                             {"input_ids": ids, "labels": ids})
    host = store.stats()["bytes_offloaded"] - before  # the second step's (the first one traces)
    rows.append(row(SUITE, case, "gradaccel-predicted", "peak_bytes", predicted.peak, "B", device))
    rows.append(row(SUITE, case, "gradaccel-measured", "peak_bytes", measured, "B", device))
    rows.append(row(SUITE, case, "gradaccel-predicted", "host_bytes", sum(predicted.host.values()), "B", device))
    rows.append(row(SUITE, case, "gradaccel-measured", "host_bytes", host, "B", device))
    return rows


class _Stack(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _split_rows(device: str) -> list[dict]:
    """One memory target for blocks that differ: GPT blocks with 1 and 8 attention heads
    alternating (8 heads hold 8x the attention scores). Every block at the fraction 0.3, against
    ``checkpoint_blocks(memory=P)`` with ``P`` the step peak that the fraction measured: at the
    same memory, the recompute FLOPs (the backward's FLOPs beyond those without checkpointing)
    and the step peak (``gradaccel.memory.LiveBytes``, gradients included), both measured."""

    from bench.models import Block, GPTConfig
    from gradaccel.memory.counter import LiveBytes

    T, C = (32, 32) if tiny() else (256, 128)
    heads = (1, 8, 1, 8)
    case = f"gpt4x(T{T},C{C},heads {'/'.join(map(str, heads))}) at fraction 0.3's peak"
    progress(case)

    def make():
        torch.manual_seed(0)
        return _Stack([Block(GPTConfig(seq_len=T, n_embd=C, n_head=h)) for h in heads]).to(device).train()

    x = torch.randn(2, T, C, device=device, requires_grad=True)

    def measure(model):
        """(backward FLOPs, step peak) of a planned step (the first call traces and plans)."""
        model(x).sum().backward()
        for t in [x, *model.parameters()]:
            t.grad = None
        with LiveBytes() as live:  # alone: under FlopCounterMode a recomputing step's peak is higher
            model(x).sum().backward()  # what memory= profiles a plain module's step with
        for t in [x, *model.parameters()]:
            t.grad = None
        flops = backward_flops(lambda: model(x).sum())
        for t in [x, *model.parameters()]:
            t.grad = None
        return flops, live.peak

    base_flops, base_peak = measure(make())
    rows = [row(SUITE, case, "torch-nockpt", "peak_bytes", base_peak, "B", device)]
    gradaccel.reset_plans()
    flops, peak = measure(gradaccel.checkpoint_blocks(make(), budget=0.3))
    rows += [row(SUITE, case, "gradaccel-equal-fraction", "recompute_flops", flops - base_flops, "FLOP", device),
             row(SUITE, case, "gradaccel-equal-fraction", "peak_bytes", peak, "B", device)]
    gradaccel.reset_plans()
    flops, split_peak = measure(gradaccel.checkpoint_blocks(make(), memory=peak))
    rows += [row(SUITE, case, "gradaccel-memory-split", "recompute_flops", flops - base_flops, "FLOP", device),
             row(SUITE, case, "gradaccel-memory-split", "peak_bytes", split_peak, "B", device)]
    return rows


def plot(rows: list[dict], out_dir: str) -> list[str]:
    plt = pyplot()

    by = {}
    for r in rows:
        by.setdefault(r["case"], {})[r["variant"]] = r["value"]
    pairs = [(v["gradaccel-measured"], v["gradaccel-predicted"]) for v in by.values()
             if "gradaccel-measured" in v and "gradaccel-predicted" in v]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    if pairs:
        xs, ys = [m / 2**20 for m, _ in pairs], [p / 2**20 for _, p in pairs]
        ax.plot(xs, ys, "o", color="tab:blue", label="cases")
        top = max(xs + ys) * 1.05
        ax.plot([0, top], [0, top], "-", color="gray", lw=0.8, label="predicted = measured")
        ax.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="gray", alpha=0.15, label="±10%")
    ax.set_xlabel("measured peak (MiB)")
    ax.set_ylabel("predicted peak (MiB)")
    ax.set_title(f"gradaccel.fit: predicted vs measured ({rows[0]['device'] if rows else ''})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = save_figure(fig, out_dir, "fit_predicted_vs_measured.png")
    return [path]


# -- the seed table: predictions for the setups the project's starting texts quote ---------------
SEED = [  # (preset, what the seed claimed without optimisation, with everything)
    ("llama-2-7b", "14 GB", "4-6 GB"),
    ("llama-2-13b", "26 GB", "8-10 GB"),
    ("llama-2-70b", "140 GB", "40-48 GB"),
]


def seed_table(seq: int = 2048) -> str:
    """Predicted peaks (fake tensors, nothing allocated) for the seed's two setups per size:
    bf16 full fine-tuning with AdamW and nothing checkpointed, and "everything" (nf4 weights,
    LoRA r=16 on every linear layer, 8-bit AdamW, micro-batch 1) with keep-nothing checkpoints
    and with the least plan gradaccel has (``fit`` to 1 byte: the loss in chunks, blocks as
    their parts where that lowers the peak; no offload). ``python -m bench.fit`` prints it."""
    from gradaccel.memory.fit import Planner, estimate
    from gradaccel.memory.counter import format_bytes

    lines = [f"| model | seed: plain | predicted: bf16 AdamW, no checkpointing, T{seq} | seed: everything | "
             f"predicted: QLoRA r16 + 8-bit AdamW + checkpointing, T{seq} | the same, least gradaccel plan | "
             "weights alone |",
             "|---|---|---:|---|---:|---:|---:|"]
    for preset, plain, everything in SEED:
        full = estimate(preset, seq, 1, 1.0, optim="adamw")
        qlora = Planner(preset, optim="adamw8bit", lora=16, load_in_4bit=True)
        small = qlora.estimate(seq, 1, None)
        least = qlora.fit(seq, 1, 1, slack=0)
        lines.append(f"| {preset} | {plain} | {format_bytes(full.peak)} | {everything} | {format_bytes(small.peak)} "
                     f"| {format_bytes(least.peak)} | {format_bytes(full.parts['weights'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(seed_table())
