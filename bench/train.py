"""`train` suite: a small GPT trained for a few windows, stock accumulation vs FusedAccumOptimizer.

Per case it reports the time of one window (``accum`` micro-batches and the update) of each
loop and their ratio, the final loss of each from the same initialisation (they must match),
the gradient memory held between micro-batches, and on CUDA the peak memory of a window.

Stock loop (what trainers do)::

    for micro-batch: (loss / accum).backward()
    opt.step(); opt.zero_grad()

gradaccel loop (the stock per-micro-batch loop, with the wrapper deciding when to update)::

    for micro-batch: loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from bench import common
from bench.common import row, time_interleaved
from bench.models import GPT, GPTConfig, synthetic_tokens
from gradaccel import FusedAccumOptimizer

SUITE = "train"
TABLE_METRICS = ["window_time", "window_time_ratio", "final_loss", "loss_max_abs_diff",
                 "grad_memory", "grad_tensors_between_micro", "peak_memory"]


@dataclass
class Case:
    name: str
    cfg: GPTConfig
    micro_batch: int
    accum: int
    windows: int           # windows of the loss curve
    reps: int              # timed windows per variant
    dtype: torch.dtype = torch.float32
    lr: float = 3e-3


def _cases(device: str, quick: bool) -> list[Case]:
    if common.tiny():
        return [Case("gpt-tiny", GPTConfig(seq_len=16, n_layer=1, n_embd=32, n_head=2), 2, 2, 2, 3)]
    if device.startswith("cuda"):
        big = GPTConfig(seq_len=256, n_layer=6 if quick else 12, n_embd=768, n_head=12,
                        vocab_size=8192, dropout=0.1)
        n = 10 if quick else 30
        return [Case(f"gpt-{big.n_layer}x{big.n_embd}-fp32", big, 8, 8, n, n, lr=6e-4),
                Case(f"gpt-{big.n_layer}x{big.n_embd}-bf16", big, 8, 8, n, n, torch.bfloat16, lr=6e-4)]
    if quick:
        cfg = GPTConfig(seq_len=64, n_layer=2, n_embd=128, n_head=4, dropout=0.1)
        return [Case("gpt-2x128-fp32", cfg, 8, 4, 16, 25)]
    cfg = GPTConfig(seq_len=128, n_layer=4, n_embd=256, n_head=8, dropout=0.1)
    return [Case("gpt-4x256-fp32", cfg, 8, 4, 30, 21, lr=1e-3),
            Case("gpt-4x256-bf16", cfg, 8, 4, 30, 21, torch.bfloat16, lr=1e-3)]


class _Loop:
    """One variant: a model, its optimizer, and a ``window()`` that trains one window."""

    def __init__(self, model: GPT, fused: bool, case: Case, data: torch.Tensor) -> None:
        self.model, self.fused, self.case, self.data = model, fused, case, data
        inner = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=0.1)
        master = case.dtype != torch.float32
        self.opt = FusedAccumOptimizer(inner, case.accum, master_weights=master) if fused else inner
        self.cursor = 0

    def _micro(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.case.micro_batch
        if self.cursor + n > self.data.shape[0]:
            self.cursor = 0
        seq = self.data[self.cursor: self.cursor + n]
        self.cursor += n
        return seq[:, :-1], seq[:, 1:]

    def window(self, probe=None) -> list[torch.Tensor]:
        """Trains one window; returns the micro-batch losses (0-d tensors, not synced)."""
        losses = []
        for k in range(self.case.accum):
            x, y = self._micro()
            _, loss = self.model(x, y)
            if self.fused:
                loss.backward()
                self.opt.step()
                self.opt.zero_grad()
            else:
                (loss / self.case.accum).backward()
            losses.append(loss.detach())
            if probe is not None and k == 0:
                probe(self)  # between micro-batches: what gradient memory is held now
        if not self.fused:
            self.opt.step()
            self.opt.zero_grad()
        return losses


def _grad_memory(loop: _Loop) -> tuple[int, int]:
    """Bytes of gradient storage alive, and the number of ``.grad`` tensors held."""
    storages = {}
    grads = [p.grad for p in loop.model.parameters() if p.grad is not None]
    for g in grads:
        s = g.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    if loop.fused:
        flat = loop.opt.grad_buffer  # the one fp32 window buffer
        storages[flat.untyped_storage().data_ptr()] = flat.untyped_storage().nbytes()
    return sum(storages.values()), len(grads)


def _run_case(case: Case, device: str) -> tuple[list[dict], dict[str, list[float]]]:
    data = synthetic_tokens(case.cfg, n_seq=case.micro_batch * case.accum * 8, seed=1).to(device)
    torch.manual_seed(0)
    base = GPT(case.cfg).to(device=device, dtype=case.dtype)
    loops = {"torch": _Loop(copy.deepcopy(base), False, case, data),
             "gradaccel": _Loop(copy.deepcopy(base), True, case, data)}
    if case.dtype != torch.float32:
        loops = {"torch-bf16": loops["torch"], "gradaccel-bf16-master": loops["gradaccel"]}
    rows, curves = [], {}
    # Loss curves from the same initialisation and the same RNG stream (dropout), one loop at a time.
    for name, loop in loops.items():
        torch.manual_seed(1234)
        per_window = [torch.stack(loop.window()).float().mean() for _ in range(case.windows)]
        curves[name] = torch.stack(per_window).tolist()
        for i, v in enumerate(curves[name]):
            rows.append(row(SUITE, case.name, name, f"loss@{i + 1}", v, "nats", device))
        rows.append(row(SUITE, case.name, name, "final_loss", curves[name][-1], "nats", device))
    names = list(loops)
    diff = max(abs(a - b) for a, b in zip(curves[names[0]], curves[names[1]]))
    rows.append(row(SUITE, case.name, names[1], "loss_max_abs_diff", diff, "nats", device))

    for name, loop in loops.items():
        held = []
        loop.window(probe=lambda lp: held.append(_grad_memory(lp)))
        rows.append(row(SUITE, case.name, name, "grad_memory", held[0][0], "bytes", device))
        rows.append(row(SUITE, case.name, name, "grad_tensors_between_micro", held[0][1], "tensors", device))

    times = time_interleaved({n: lp.window for n, lp in loops.items()}, device, warmup=2, reps=case.reps)
    for name, t in times.items():
        rows.append(row(SUITE, case.name, name, "window_time", t, "s", device))
    rows.append(row(SUITE, case.name, names[1], "window_time_ratio", times[names[1]] / times[names[0]],
                    "x", device))

    if device.startswith("cuda"):
        for name, loop in loops.items():
            loop.window()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            loop.window()
            torch.cuda.synchronize()
            rows.append(row(SUITE, case.name, name, "peak_memory", torch.cuda.max_memory_allocated(),
                            "bytes", device))
    return rows, curves


def run(device: str, quick: bool) -> list[dict]:
    """Runs every case of the suite on ``device``.

    Args:
        device: ``"cpu"`` or ``"cuda"`` (or ``"cuda:N"``).
        quick: the small configuration (on CPU, under 1.5 minutes).

    Returns:
        rows made by ``bench.common.row``: per case and variant ``window_time`` (s),
        ``final_loss`` and the ``loss@i`` curve (nats), ``grad_memory`` (bytes) and
        ``grad_tensors_between_micro``, on CUDA ``peak_memory`` (bytes); for the gradaccel
        variant ``window_time_ratio`` (x, over the stock loop) and ``loss_max_abs_diff``.
    """
    cases = _cases(device, quick)
    rows = []
    for i, case in enumerate(cases, 1):
        common.progress(case.name, i, len(cases))
        case_rows, _ = _run_case(case, device)
        rows.extend(case_rows)
    return rows


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """One PNG per case: the per-window training loss of every variant on one plot.

    Args:
        rows: this suite's rows (from ``run``).
        out_dir: an existing folder.

    Returns:
        the paths written.
    """
    plt = common.pyplot()

    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    device = ""
    for r in rows:
        if r["suite"] == SUITE and r["metric"].startswith("loss@"):
            curves.setdefault(r["case"], {}).setdefault(r["variant"], []).append(
                (int(r["metric"][5:]), r["value"]))
            device = r["device"]
    paths = []
    for case, variants in curves.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        styles = [dict(lw=3.0, alpha=0.5), dict(lw=1.2, ls="--", marker=".")]
        for k, (variant, pts) in enumerate(sorted(variants.items(), key=lambda kv: not kv[0].startswith("torch"))):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=variant, **styles[k % 2])
        ax.set_xlabel("window (optimizer update)")
        ax.set_ylabel("training loss (nats, window mean)")
        ax.set_title(f"train: {case} on {device}: stock vs gradaccel")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = common.save_figure(fig, out_dir, f"train_loss_{case}.png")
        paths.append(path)
    return paths
