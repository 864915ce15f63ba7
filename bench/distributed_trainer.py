"""The distributed suite's Trainer row: Hugging Face Trainer on the suite's ranks, stock DDP
against ``gradaccel.hf.enable``, same model, data and accumulation, with and without HF gradient
checkpointing.

- ``torch-ddp-trainer``: Trainer as launched by ``torchrun`` (accelerate wraps the model in DDP;
  Trainer's ``accelerator.accumulate`` skips the all-reduce but on each window's last micro-batch);
- ``gradaccel-trainer``: the same script plus ``gradaccel.hf.enable(trainer)`` (``budget=None``:
  the checkpoint keeps what HF's keeps, so only the gradient's path differs).

Metrics (rank 0's, per window): ``window_time`` (median over windows after the first, two runs of
each variant interleaved); ``grad_sent_bytes``: bytes this rank sends in gradient all-reduces
(ring: ``2 (w-1)/w`` of the tensor), counted at ``torch.distributed.all_reduce`` (stock DDP's
buckets go through it by a communication hook that is DDP's default all-reduce called from Python); ``grad_bytes``: the most gradient bytes held at a
micro-batch boundary: ``.grad`` tensors plus DDP's buckets (``bucket_sizes`` from DDP's own
logging data) for stock, the fp32 window buffer for gradaccel; ``grad_rel_err``: the first
window's gradient as the inner AdamW receives it against the big batch's (all ranks' micro-batches
in one loss, summed over tokens and divided by their count), worst tensor's largest difference
over its largest magnitude.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from bench.common import pad_collate

VARIANTS = ("torch-ddp-trainer", "gradaccel-trainer")


def configs(device: str, quick: bool, tiny: bool) -> list[tuple[str, dict, int, int]]:
    """(case, Llama config plus ``checkpointing``, sequences per micro-batch, accumulation steps).

    Each size twice: without gradient checkpointing (the gradient's path alone) and with HF's
    (``-ckpt``: stock runs ``torch.utils.checkpoint``, gradaccel its own at ``budget=None``)."""
    if tiny:
        return [("trainer-L2-C64-a2-ckpt", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                checkpointing=True), 2, 2)]
    if device.startswith("cuda"):
        size, micro, accum = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8), 4, 8
        name = "trainer-L8-C1024-a8"
    elif quick:
        size, micro, accum = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4), 4, 4
        name = "trainer-L4-C256-a4"
    else:
        size, micro, accum = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8), 4, 4
        name = "trainer-L8-C512-a4"
    return [(name + suffix, dict(size, checkpointing=on), micro, accum) for suffix, on in (("", False), ("-ckpt", True))]


def _data(n: int, vocab: int, seq: int):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(seq // 4, seq + 1, (n,), generator=gen).tolist()  # uneven, as fine-tuning is
    return [{"input_ids": torch.randint(2, vocab, (k,), generator=gen)} for k in lengths]


def _held(model, trainer, fused) -> int:
    grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
             for p in model.parameters() if p.grad is not None}
    held = sum(grads.values())
    ddp = trainer.model_wrapped
    if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        data = ddp._get_ddp_logging_data()
        buckets = sum(int(s) for s in str(data.get("bucket_sizes", "")).split(",") if s.strip())
        held = held + buckets if not data.get("gradient_as_bucket_view") else max(held, buckets)
    if fused is not None:
        held += fused.grad_buffer.untyped_storage().nbytes()
    return held


def _run(variant, base, data, out, micro, accum, windows, device, world, checkpointing):
    import transformers

    import gradaccel
    model = copy.deepcopy(base)
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=accum, max_steps=windows,
        use_cpu=not device.startswith("cuda"), ddp_backend=None if device.startswith("cuda") else "gloo",
        report_to=[], logging_strategy="no", save_strategy="no", seed=0, data_seed=0, disable_tqdm=True,
        learning_rate=1e-4, gradient_checkpointing=checkpointing, max_grad_norm=0.0, bf16=device.startswith("cuda"))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=pad_collate)
    if variant.startswith("gradaccel"):
        # budget=None: the checkpoint keeps what HF's does, so the row compares the gradient's path
        # alone (selective recompute is the checkpoint suites' business).
        gradaccel.hf.enable(trainer, budget=None)
    share = 2 * (world - 1) / world
    stats = {"sent": 0.0, "held": 0, "times": [], "first_grads": None, "batches": []}

    def python_allreduce(state, bucket):
        # DDP's default all-reduce, but from Python: through torch.distributed.all_reduce, where
        # it is counted as gradaccel's is (the built-in one runs in C++, out of sight).
        return torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook(state, bucket)

    def record(inner):
        names = {id(p): n for n, p in model.named_parameters()}

        def hook(opt, a, k):  # by name: Trainer orders its groups by weight decay, not as the model
            if stats["first_grads"] is None:
                stats["first_grads"] = {names[id(p)]: p.grad.detach().float().clone()
                                        for g in opt.param_groups for p in g["params"] if p.grad is not None}
        inner.register_step_pre_hook(hook)

    class Probe(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            if isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel):
                trainer.model_wrapped.register_comm_hook(dist.group.WORLD, python_allreduce)
            opt = trainer.optimizer.optimizer
            record(opt.optimizer if isinstance(opt, gradaccel.FusedAccumOptimizer) else opt)
            model.register_forward_pre_hook(
                lambda m, a, k: stats["batches"].append({n: t.cpu() for n, t in k.items() if torch.is_tensor(t)})
                if len(stats["batches"]) < accum else None, with_kwargs=True)

        def on_step_begin(self, *a, **k):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            stats["t0"] = time.perf_counter()

        def on_substep_end(self, *a, **k):
            fused = getattr(trainer.optimizer, "optimizer", None)
            fused = fused if isinstance(fused, gradaccel.FusedAccumOptimizer) else None
            stats["held"] = max(stats["held"], _held(model, trainer, fused))

        def on_step_end(self, *a, **k):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            stats["times"].append(time.perf_counter() - stats["t0"])

    trainer.add_callback(Probe())
    real = dist.all_reduce

    def all_reduce(tensor, *a, **k):  # gradaccel's window (and its small count) go through here
        stats["sent"] += share * tensor.nbytes
        return real(tensor, *a, **k)
    dist.all_reduce = all_reduce
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    finally:
        dist.all_reduce = real
    stats["sent"] /= windows
    return stats


def _big_batch_grads(base, batches_per_rank, device):
    """The window's gradient in one loss over every rank's micro-batches: token sum / token count."""
    model = copy.deepcopy(base).to(device)
    model.train()
    batches = [b for rank in batches_per_rank for b in rank]
    tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    for b in batches:
        out = model(**{k: v.to(device) for k, v in b.items() if k != "labels"})
        logits = out.logits[:, :-1].float()
        labels = b["labels"][:, 1:].to(device)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum") / tokens
        loss.backward()
    return {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def case(rank: int, device, name: str, cfg: dict, micro: int, accum: int, windows: int, out_dir: str) -> dict:
    """Runs both variants twice (interleaved) on every rank; returns rank's metrics per variant."""
    import transformers
    world = dist.get_world_size()
    cfg = dict(cfg)
    checkpointing = cfg.pop("checkpointing")
    config = transformers.LlamaConfig(vocab_size=1024, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=256, pad_token_id=0, **cfg)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config)
    if device.type == "cuda":
        base = base.to(torch.bfloat16)
    data = _data(world * micro * accum * windows, config.vocab_size, 64 if cfg["hidden_size"] < 1024 else 512)
    runs = {v: [] for v in VARIANTS}
    for rep in range(2):
        for v in VARIANTS:
            runs[v].append(_run(v, base, data, os.path.join(out_dir, f"{v}-{rep}"), micro, accum, windows,
                                str(device), world, checkpointing))
    first = runs[VARIANTS[0]][0]
    batches = [None] * world
    dist.all_gather_object(batches, first["batches"])
    ref = _big_batch_grads(base, batches, device)
    results = {}
    for v in VARIANTS:
        r = runs[v][0]
        grads = r["first_grads"]
        assert grads.keys() == ref.keys(), sorted(set(grads) ^ set(ref))
        err = max(((grads[n].to(q.device) - q).abs().max() / q.abs().max()).item() for n, q in ref.items())
        times = [t for run in runs[v] for t in run["times"][1:]] or [t for run in runs[v] for t in run["times"]]
        results[v] = {"window_time": statistics.median(times), "grad_sent_bytes": r["sent"],
                      "grad_bytes": r["held"], "grad_rel_err": err}
    return results
