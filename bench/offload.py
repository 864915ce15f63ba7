"""Activation offload: step time and bytes held, gradaccel's store against stock PyTorch.

Variants, on a stack of GPT blocks (``bench.models.Block``), forward + backward:

- ``torch-keep``: no offload, autograd keeps every saved activation on the device;
- ``torch-save_on_cpu``: ``torch.autograd.graph.save_on_cpu`` (Hugging Face's offload:
  synchronous copies on the compute stream);
- ``gradaccel-offload``: ``gradaccel.recompute.offload.offload_saved_tensors`` (pooled host buffers, copies
  on side streams, prefetch in backward).

Metrics: ``time`` (s per step, median, interleaved); on CPU ``held_bytes``: what the forward
leaves for backward wherever it lies (torch storages created in the forward and still alive,
plus the store's buffers in use); on CUDA ``device_bytes`` (``memory_allocated`` after the
forward, less before) and, for the store, ``host_bytes``. On CPU the host *is* the device, so
offload cannot save memory there: the CPU rows measure the mechanism's overhead. Also the
measured copy bandwidth (``gradaccel.recompute.offload.copy_bandwidth``).
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench.common import progress, pyplot, row, save_figure, time_interleaved, tiny
from bench.models import Block, GPTConfig
from gradaccel.recompute.offload import ActivationStore, copy_bandwidth, offload_saved_tensors

SUITE = "offload"
BASELINE = "torch-keep"
TABLE_METRICS = ["time", "held_bytes", "device_bytes"]


def _configs(device: str, quick: bool) -> list[tuple[str, GPTConfig, int]]:
    """(case, config, batch) to run."""
    if tiny():
        return [("L2-C64-T32", GPTConfig(n_layer=2, n_embd=64, n_head=4, seq_len=32), 2)]
    if device.startswith("cuda"):
        seqs = [1024] if quick else [1024, 2048]
        return [(f"L4-C1024-T{t}", GPTConfig(n_layer=4, n_embd=1024, n_head=16, seq_len=t), 2) for t in seqs]
    sizes = [(128, 128)] if quick else [(128, 128), (256, 256)]
    return [(f"L4-C{c}-T{t}", GPTConfig(n_layer=4, n_embd=c, n_head=4, seq_len=t), 4) for c, t in sizes]


class _NewStorages(TorchDispatchMode):
    """Weak references to the storages of every op output: what a forward creates."""

    def __init__(self):
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.refs.append(weakref.ref(t.untyped_storage()))
        return out

    def alive_bytes(self, exclude: list[torch.Tensor]) -> int:
        # Keyed by address among the living only: a freed storage's address may be reused.
        alive = {s.data_ptr(): s.nbytes() for r in self.refs if (s := r()) is not None}
        for t in exclude:
            alive.pop(t.untyped_storage().data_ptr(), None)
        return sum(alive.values())


def _contexts(device: str, store: ActivationStore):
    cuda = device.startswith("cuda")
    return {
        "torch-keep": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        "torch-save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda),
        "gradaccel-offload": lambda: offload_saved_tensors(store),
    }


def _held_bytes(model, x, ctx, device: str, store: ActivationStore) -> dict[str, float]:
    """Bytes the forward leaves for backward (one forward, measured apart from the timing)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with ctx():
            loss = model(x).float().square().mean()
        store.synchronize()
        torch.cuda.synchronize()
        torch.empty(1, device=device)  # lets the caching allocator free blocks whose copies are done
        out = {"device_bytes": torch.cuda.memory_allocated() - before, "host_bytes": store.bytes_in_use}
    else:
        with _NewStorages() as mode, ctx():
            loss = model(x).float().square().mean()
        out = {"held_bytes": mode.alive_bytes([loss]) + store.bytes_in_use, "host_bytes": store.bytes_in_use}
    loss.backward()
    return out


def run(device: str, quick: bool) -> list[dict]:
    """Rows for each case and variant: ``time`` and bytes held (see the module docstring)."""
    rows = []
    configs = _configs(device, quick)
    for i, (case, cfg, batch) in enumerate(configs, 1):
        progress(case, i, len(configs))
        torch.manual_seed(0)
        model = nn.Sequential(*[Block(cfg) for _ in range(cfg.n_layer)]).to(device)
        x = torch.randn(batch, cfg.seq_len, cfg.n_embd, device=device)
        store = ActivationStore()
        contexts = _contexts(device, store)

        def step(ctx):
            model.zero_grad(set_to_none=True)
            with ctx():
                loss = model(x).float().square().mean()
            loss.backward()

        times = time_interleaved({name: (lambda c=ctx: step(c)) for name, ctx in contexts.items()}, device,
                                 warmup=1 if tiny() else 2, reps=2 if tiny() else (5 if quick else 9))
        for name, ctx in contexts.items():
            rows.append(row(SUITE, case, name, "time", times[name], "s", device))
            for metric, value in _held_bytes(model, x, ctx, device, store).items():
                if metric == "host_bytes" and name != "gradaccel-offload":
                    continue  # save_on_cpu's host copies are not visible from here
                rows.append(row(SUITE, case, name, metric, value, "B", device))
        s = store.stats()
        rows.append(row(SUITE, case, "gradaccel-offload", "pool_misses", s["misses"], "count", device))
        rows.append(row(SUITE, case, "gradaccel-offload", "pool_hits", s["hits"], "count", device))
    d2h, h2d = copy_bandwidth(device)
    rows.append(row(SUITE, "copy", "gradaccel-offload", "d2h_bandwidth", d2h, "B/s", device))
    rows.append(row(SUITE, "copy", "gradaccel-offload", "h2d_bandwidth", h2d, "B/s", device))
    return rows


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """One bar chart per case: step time of each variant relative to ``torch-keep``."""
    plt = pyplot()
    paths = []
    cases = sorted({r["case"] for r in rows if r["suite"] == SUITE and r["metric"] == "time"})
    for case in cases:
        t = {r["variant"]: r["value"] for r in rows if r["case"] == case and r["metric"] == "time"}
        if BASELINE not in t:
            continue
        names = list(t)
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(names, [t[n] / t[BASELINE] for n in names])
        ax.set_ylabel(f"step time / {BASELINE}")
        ax.set_title(f"offload {case} ({rows[0]['device']})")
        fig.tight_layout()
        path = save_figure(fig, out_dir, f"offload_{case}.png", dpi=100)
        paths.append(path)
    return paths
