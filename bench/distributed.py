"""Distributed suite: gradient accumulation on an FSDP2 (``fully_shard``) model, 2 ranks.

A GPT (``bench.models.GPT``, no biases) sharded per block and at the root trains with AdamW,
``accum_steps`` micro-batches per window, each rank on its share of the global batch:

- ``torch-fsdp2``: stock FSDP2 accumulation, a reduce-scatter per micro-batch into the sharded
  fp32 ``.grad`` (loss divided by ``accum_steps``);
- ``torch-fsdp2-nosync``: stock, with ``set_requires_gradient_sync(False)`` but on the window's
  last micro-batch (unsharded fp32 gradients held, one reduce-scatter);
- ``gradaccel-micro_batch``: ``FusedAccumOptimizer(sync="micro_batch")``: FSDP2's reduce-scatter
  per micro-batch, each shard folded into this rank's flat fp32 buffer at once;
- ``gradaccel-window``: ``FusedAccumOptimizer(sync="window", module=model)``.

Metrics, per rank (rank 0's): ``window_time`` (s per window, median, interleaved);
``grad_bytes``: the most gradient bytes held at a micro-batch boundary (sharded ``.grad``, FSDP2's
unsharded gradients, gradaccel's buffer), counted from the live tensors; ``sent_bytes`` and
``grad_sent_bytes``: bytes a rank sends per window in all collectives, and in the gradient ones
(everything but the parameter all-gathers), counting a ring: ``(w-1)/w`` of an all-gather's
output or a reduce-scatter's input, twice that for an all-reduce; ``grad_rel_err``: the first
window's gradient as AdamW receives it against the single-process big-batch gradient (largest
difference over the tensor's largest magnitude, worst tensor). 2 gloo ranks on CPU; 2 NCCL
ranks where 2 GPUs are present.

And a Hugging Face Trainer row (``trainer-…`` cases, where transformers is installed): stock DDP
Trainer (``torch-ddp-trainer``) against ``gradaccel.hf.enable`` (``gradaccel-trainer``), same
metrics but ``sent_bytes``; see ``bench/distributed_trainer.py``. And a DeepSpeed ZeRO-2 Trainer row
(``deepspeed-…`` cases, where deepspeed is installed): stock DeepSpeed with HF checkpointing
(``torch-deepspeed-trainer``) against ``gradaccel.hf.enable(budget=0.5)`` (``gradaccel-deepspeed-b0.5``):
window time, peak bytes and gradient bytes held; and the same at ZeRO-3 (``zero3-…`` cases,
``torch-zero3-trainer`` against ``gradaccel-zero3-b0.5``): window time and peak bytes; see
``bench/distributed_deepspeed.py``.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from bench import distributed_deepspeed, distributed_trainer
from bench.common import progress, pyplot, row, save_figure, time_interleaved, tiny
from bench.models import GPT, GPTConfig

SUITE = "distributed"
BASELINE = ["torch-fsdp2", "torch-ddp-trainer", "torch-deepspeed-trainer", "torch-zero3-trainer"]
TABLE_METRICS = ["window_time", "grad_bytes", "peak_bytes", "sent_bytes", "grad_sent_bytes", "grad_rel_err"]
VARIANTS = ("torch-fsdp2", "torch-fsdp2-nosync", "gradaccel-micro_batch", "gradaccel-window")
WORLD = 2


def _configs(device: str, quick: bool) -> list[tuple[str, GPTConfig, int, int]]:
    """(case, config, sequences per micro-batch, accum_steps)."""
    if tiny():
        return [("L2-C32-T16-a2", GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16, bias=False), 2, 2)]
    if device.startswith("cuda"):
        return [("L8-C1024-T512-a8", GPTConfig(n_layer=8, n_embd=1024, n_head=16, seq_len=512,
                                               vocab_size=32000, bias=False), 4, 8)]
    sizes = [(4, 128)] if quick else [(4, 128), (4, 256)]
    return [(f"L{n}-C{c}-T64-a4", GPTConfig(n_layer=n, n_embd=c, n_head=4, seq_len=64, bias=False), 4, 4)
            for n, c in sizes]


class _Traffic:
    """Counts what this rank sends in torch.distributed collectives (ring model), while active."""

    # FSDP2's collectives: the *_single ones in torch 2.13, the *_tensor ones in 2.11.
    GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    NAMES = (GATHER, SCATTER, "all_reduce", "all_gather")

    def __init__(self) -> None:
        self.total = self.grads = 0.0
        self._real = {}

    def __enter__(self):
        share = (WORLD - 1) / WORLD
        for name in self.NAMES:
            real = self._real[name] = getattr(dist, name)

            def counted(*args, _name=name, _real=real, **kwargs):
                bound = inspect.signature(_real).bind(*args, **kwargs).arguments
                if _name == self.GATHER:
                    sent = bound["output_tensor"].nbytes * share
                elif _name == self.SCATTER:
                    sent = bound["input"].nbytes * share
                elif _name == "all_reduce":
                    sent = 2 * bound["tensor"].nbytes * share
                else:
                    sent = sum(t.nbytes for t in bound["tensor_list"]) * share
                self.total += sent
                if _name != self.GATHER:  # parameter all-gathers are not gradient traffic
                    self.grads += sent
                return _real(*args, **kwargs)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, real in self._real.items():
            setattr(dist, name, real)
        return False


def _grad_bytes(model, opt) -> int:
    """Gradient bytes this rank holds now: sharded .grad, FSDP2's unsharded ones, our buffer."""
    from gradaccel.accumulate.sharded import _fsdp_params
    held = sum(p.grad._local_tensor.nbytes for p in model.parameters() if p.grad is not None)
    for _, fp in _fsdp_params(model):  # FSDP2's private records: the only place these live
        if fp.unsharded_accumulated_grad is not None:
            held += fp.unsharded_accumulated_grad.nbytes
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None and unsharded.grad is not None:
            held += unsharded.grad.nbytes
    buffer = getattr(opt, "grad_buffer", None)
    return held + (buffer.untyped_storage().nbytes() if buffer is not None else 0)  # may be released


def _case(rank: int, device: torch.device, cfg: GPTConfig, micro: int, accum: int, windows: int, reps: int):
    from torch.distributed.fsdp import fully_shard

    from gradaccel import FusedAccumOptimizer
    torch.manual_seed(0)
    ref = GPT(cfg).to(device)
    models, opts, first_grads = {}, {}, {}

    def record(name):  # the gradients the inner AdamW steps with, once (a collective: all ranks)
        def hook(opt, args, kwargs):
            if name not in first_grads:
                first_grads[name] = [p.grad.full_tensor() for g in opt.param_groups for p in g["params"]]
        return hook
    for v in VARIANTS:
        model = copy.deepcopy(ref)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        inner.register_step_pre_hook(record(v))
        if v.startswith("gradaccel"):
            sync = v.split("-", 1)[1]
            inner = FusedAccumOptimizer(inner, accum, sync=sync, module=model if sync == "window" else None)
        models[v], opts[v] = model, inner
    rows_per_window = WORLD * accum * micro
    data = torch.randint(cfg.vocab_size, (rows_per_window * (windows + 2 + 2 * reps), cfg.seq_len + 1),
                         generator=torch.Generator().manual_seed(1)).to(device)
    counter = {"window": 0}
    held = {v: 0 for v in VARIANTS}

    def window(v, w):
        model, opt = models[v], opts[v]
        batch = data[w * rows_per_window: (w + 1) * rows_per_window]
        for k in range(accum):
            rows = batch[(rank * accum + k) * micro: (rank * accum + k + 1) * micro]
            if v == "torch-fsdp2-nosync":
                model.set_requires_gradient_sync(k == accum - 1)
            loss = model(rows[:, :-1], rows[:, 1:])[1]
            (loss / accum if v.startswith("torch") else loss).backward()
            held[v] = max(held[v], _grad_bytes(model, opt))
            if v.startswith("gradaccel"):
                opt.step()
                opt.zero_grad()
        if v.startswith("torch"):
            opt.step()
            opt.zero_grad()

    out = {v: {} for v in VARIANTS}
    for v in VARIANTS:
        with _Traffic() as traffic:
            for w in range(windows):
                window(v, w)
        out[v]["sent_bytes"] = traffic.total / windows
        out[v]["grad_sent_bytes"] = traffic.grads / windows
        out[v]["grad_bytes"] = held[v]
    ref(data[:rows_per_window, :-1], data[:rows_per_window, 1:])[1].backward()
    for v in VARIANTS:
        out[v]["grad_rel_err"] = max(((g - q.grad).abs().max() / q.grad.abs().max()).item()
                                     for g, q in zip(first_grads[v], ref.parameters()))
    counter["window"] = windows

    def timed(v):
        def fn():
            window(v, counter["window"] % (windows + 2 + 2 * reps))
        return fn
    times = time_interleaved({v: timed(v) for v in VARIANTS}, device.type, warmup=1, reps=reps)
    for v in VARIANTS:
        out[v]["window_time"] = times[v]
    return out


def _worker(rank: int, port: int, cases: list, trainer_cases: list, ds_cases: list, device_type: str, path: str) -> None:
    torch.set_num_threads(1)
    cuda = device_type == "cuda"
    # What torchrun sets, so that accelerate (the Trainer row) sees these ranks as its processes.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD)
    results = {}
    try:
        for name, cfg, micro, accum in cases:
            windows, reps = (2, 1) if tiny() else (3, 9)
            results[name] = _case(rank, device, cfg, micro, accum, windows, reps)
            dist.barrier()
        for name, cfg, micro, accum in trainer_cases:
            with tempfile.TemporaryDirectory() as out:
                windows = 2 if tiny() else 4
                results[name] = distributed_trainer.case(rank, device, name, cfg, micro, accum, windows, out)
            dist.barrier()
        if ds_cases and not cuda:
            distributed_deepspeed.prepare_cpu()
        for name, cfg, micro, accum in ds_cases:
            with tempfile.TemporaryDirectory() as out:
                windows = 2 if tiny() else 4
                results[name] = distributed_deepspeed.case(rank, device, name, cfg, micro, accum, windows, out)
            dist.barrier()
    finally:
        if rank == 0:
            with open(path, "w") as f:
                json.dump(results, f)
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip finalization: gloo threads can abort a rank at exit (see tests/_dist.py)


def run(device: str, quick: bool, only: str | None = None) -> list[dict]:
    """The suite's rows; ``only="ds"``: its DeepSpeed rows alone (``python -m bench.distributed_deepspeed``)."""
    import torch.multiprocessing as mp
    if device.startswith("cuda") and torch.cuda.device_count() < WORLD:
        raise RuntimeError(f"the distributed suite needs {WORLD} GPUs on CUDA; run it with --device cpu")
    hf = importlib.util.find_spec("transformers") and importlib.util.find_spec("accelerate")
    cases = [] if only == "ds" else _configs(device, quick)
    trainer_cases = distributed_trainer.configs(device, quick, tiny()) if hf and only != "ds" else []
    ds_cases = distributed_deepspeed.configs(device, quick, tiny()) if hf and distributed_deepspeed.available() else []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        progress(f"{len(cases) + len(trainer_cases) + len(ds_cases)} case(s) on {WORLD} ranks: "
                 + ", ".join(c[0] for c in cases + trainer_cases + ds_cases))
        ctx = mp.spawn(_worker, args=(port, cases, trainer_cases, ds_cases, device, path), nprocs=WORLD, join=False)
        deadline = time.monotonic() + (300 if tiny() else 1800)
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise RuntimeError("the distributed suite's ranks did not finish in time")
        with open(path) as f:
            results = json.load(f)
    units = {"window_time": "s", "grad_bytes": "B", "peak_bytes": "B", "sent_bytes": "B", "grad_sent_bytes": "B",
             "grad_rel_err": ""}
    rows = []
    for case, per_variant in results.items():
        for v, metrics in per_variant.items():
            for metric, value in metrics.items():
                rows.append(row(SUITE, case, v, metric, value, units[metric], device))
    return rows


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """Per case: window time relative to stock FSDP2, gradient bytes held, bytes sent per window."""
    plt = pyplot()
    rows = [r for r in rows if r["suite"] == SUITE]
    paths = []
    for case in dict.fromkeys(r["case"] for r in rows):
        sel = [r for r in rows if r["case"] == case]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for ax, metric, label in zip(axes, ("window_time", "grad_bytes", "grad_sent_bytes"),
                                     ("s per window", "gradient bytes held per rank", "gradient bytes sent per window")):
            rs = [r for r in sel if r["metric"] == metric]
            names = [r["variant"] for r in rs]
            ax.bar(range(len(rs)), [r["value"] for r in rs],
                   color=["tab:orange" if n.startswith("gradaccel") else "tab:gray" for n in names])
            ax.set_xticks(range(len(rs)), names, rotation=25, ha="right")
            ax.set_ylabel(label)
        fig.suptitle(f"distributed {case} ({WORLD} ranks)")
        fig.tight_layout()
        path = save_figure(fig, out_dir, f"distributed_{case}.png", dpi=100)
        paths.append(path)
    return paths
