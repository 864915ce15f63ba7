"""`finetune` suite: the QLoRA-shaped Hugging Face stack, stock vs ``gradaccel.hf.enable``.

One model, two runs from the same start: a small random Llama saved locally, loaded in 4-bit
(``BitsAndBytesConfig``: nf4, bf16 compute), ``peft.prepare_model_for_kbit_training`` with its
defaults (it turns HF checkpointing on), LoRA, bitsandbytes' paged 8-bit AdamW, and the accelerate
loop (``accelerator.accumulate``, ``backward``, ``clip_grad_norm_``) over ``accum`` micro-batches.

- ``torch``: that stack as it is (HF's torch checkpointing, ``.grad`` accumulation).
- ``gradaccel-b0.0`` / ``gradaccel-b0.5``: the same script plus ``gradaccel.hf.enable(accelerator,
  budget=...)``: at 0.0 the checkpoint keeps what HF's does (nothing inside a layer), at 0.5 up to
  half of each layer's activations, to recompute less.
- ``gradaccel-b0.0-fused``: ``b0.0`` with ``fuse_wgrad=True``: the LoRA adapters' weight gradients
  go from their GEMM straight into the fp32 buffer (docs/accumulation.md). Two routed layers per
  adapted projection, each a small GEMM: where the per-layer cost shows.

Per case: ``held_bytes`` (activation bytes one micro-batch's forward leaves for backward, by
storage, after the plan is made), ``grad_memory`` (gradient bytes held between micro-batches),
``window_time`` and its ratio, the loss curve (``loss@i``), ``final_loss`` and ``loss_max_abs_diff``.
"""

from __future__ import annotations

import tempfile
import warnings

import torch

from bench import common
from bench.common import pyplot, row, save_figure, time_interleaved

SUITE = "finetune"
BASELINE = "torch"
# name: (gradaccel's budget, fuse_wgrad)
VARIANTS = {"torch": (None, False), "gradaccel-b0.0": (0.0, False), "gradaccel-b0.5": (0.5, False),
            "gradaccel-b0.0-fused": (0.0, True)}
TABLE_METRICS = ["held_bytes", "grad_memory", "window_time", "window_time_ratio", "final_loss", "loss_max_abs_diff"]


def _case(device: str, quick: bool) -> dict:
    if common.tiny():
        return dict(name="qlora-tiny", hidden=64, layers=1, seq=16, micro=2, accum=2, windows=2, reps=1)
    if device.startswith("cuda"):
        return dict(name="qlora-8x512", hidden=512, layers=8, seq=512, micro=4, accum=8, windows=8, reps=5)
    return dict(name="qlora-2x128", hidden=128, layers=2, seq=64, micro=4, accum=4, windows=6 if quick else 12, reps=3)


class _Run:
    """One variant of the stack, trained window by window on the same data."""

    def __init__(self, path: str, c: dict, device: str, budget: float | None, fuse: bool, data: torch.Tensor) -> None:
        import accelerate
        import peft
        import transformers

        import gradaccel

        quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                bnb_4bit_compute_dtype=torch.bfloat16)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map=device)
        model = peft.prepare_model_for_kbit_training(model)
        torch.manual_seed(0)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
        self.acc = accelerate.Accelerator(gradient_accumulation_steps=c["accum"], cpu=device == "cpu")
        if budget is not None:
            gradaccel.hf.enable(self.acc, budget=budget, fuse_wgrad=fuse)
        import bitsandbytes as bnb
        opt = bnb.optim.PagedAdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        self.model, self.opt = self.acc.prepare(model, opt)
        self.model.train()
        self.c, self.data, self.cursor, self.fused = c, data, 0, budget is not None

    def _ids(self) -> torch.Tensor:
        n = self.c["micro"]
        if self.cursor + n > self.data.shape[0]:
            self.cursor = 0
        self.cursor += n
        return self.data[self.cursor - n:self.cursor]

    def micro(self, probe=None) -> torch.Tensor:
        ids = self._ids()
        with self.acc.accumulate(self.model):
            loss = self.model(input_ids=ids, labels=ids).loss
            self.acc.backward(loss)
            if probe is not None:
                probe()
            if self.acc.sync_gradients:
                self.acc.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad()
        return loss.detach()

    def window(self) -> float:
        return torch.stack([self.micro() for _ in range(self.c["accum"])]).float().mean().item()

    def grad_bytes(self) -> int:
        storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                    for g in (p.grad for p in self.model.parameters()) if g is not None}
        if self.fused:
            flat = self.opt.optimizer.grad_buffer
            storages[flat.untyped_storage().data_ptr()] = flat.untyped_storage().nbytes()
        return sum(storages.values())

    def held_bytes(self) -> int:
        from gradaccel.memory.counter import StorageLog, held_activation_bytes

        ids = self._ids()
        with self.acc.accumulate(self.model):
            loss, held = held_activation_bytes(lambda: self.model(input_ids=ids, labels=ids).loss)
            with StorageLog():  # the backward sees a dispatch mode too, as the forward did
                self.acc.backward(loss)
            self.opt.step()
            self.opt.zero_grad()
        return held


def run(device: str, quick: bool) -> list[dict]:
    """Runs the case on ``device``.

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        quick: the small configuration (on CPU, well under a minute).

    Returns:
        rows made by ``bench.common.row`` (see the module docstring for the metrics).
    """
    import transformers

    c = _case(device, quick)
    common.progress(c["name"], 1, 1)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=c["hidden"], intermediate_size=2 * c["hidden"],
                                   num_hidden_layers=c["layers"], num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=c["seq"], pad_token_id=0)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(1, 256, (c["micro"] * c["accum"] * 4, c["seq"]), generator=gen).to(device)
    rows = []
    with tempfile.TemporaryDirectory() as path, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged optimizers fall back to unpaged on CPU, with a warning
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
        runs = {name: _Run(path, c, device, budget, fuse, data) for name, (budget, fuse) in VARIANTS.items()}
        curves = {}
        for name, r in runs.items():  # the same data in the same order, from the same start
            curves[name] = [r.window() for _ in range(c["windows"])]
            for i, v in enumerate(curves[name]):
                rows.append(row(SUITE, c["name"], name, f"loss@{i + 1}", v, "nats", device))
            rows.append(row(SUITE, c["name"], name, "final_loss", curves[name][-1], "nats", device))
        for name in runs:
            if name != "torch":
                diff = max(abs(a - b) for a, b in zip(curves["torch"], curves[name]))
                rows.append(row(SUITE, c["name"], name, "loss_max_abs_diff", diff, "nats", device))
        for name, r in runs.items():
            rows.append(row(SUITE, c["name"], name, "held_bytes", r.held_bytes(), "B", device))
            held = []
            r.micro(probe=lambda r=r: held.append(r.grad_bytes()))  # after the first backward of a window
            for _ in range(c["accum"] - 1):
                r.micro()
            rows.append(row(SUITE, c["name"], name, "grad_memory", held[0], "B", device))
        times = time_interleaved({n: r.window for n, r in runs.items()}, device, warmup=1, reps=c["reps"])
        for name, t in times.items():
            rows.append(row(SUITE, c["name"], name, "window_time", t, "s", device))
        for name in runs:
            if name != "torch":
                rows.append(row(SUITE, c["name"], name, "window_time_ratio", times[name] / times["torch"], "x", device))
    return rows


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """The loss curve of both variants (one PNG).

    Args:
        rows: this suite's rows (from ``run``).
        out_dir: an existing folder.

    Returns:
        the paths written.
    """
    plt = pyplot()

    curves: dict[str, list[tuple[int, float]]] = {}
    case = ""
    for r in rows:
        if r["suite"] == SUITE and r["metric"].startswith("loss@"):
            curves.setdefault(r["variant"], []).append((int(r["metric"][5:]), r["value"]))
            case = r["case"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, (variant, pts) in enumerate(sorted(curves.items())):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=variant,
                **([dict(lw=3.0, alpha=0.5), dict(lw=1.2, ls="--", marker=".")][k % 2]))
    ax.set_xlabel("window (optimizer update)")
    ax.set_ylabel("training loss (nats, window mean)")
    ax.set_title(f"finetune: {case}: stock HF vs gradaccel.hf.enable")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = save_figure(fig, out_dir, f"finetune_loss_{case}.png")
    return [path]
