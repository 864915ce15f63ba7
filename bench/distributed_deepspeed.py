"""The distributed suite's DeepSpeed rows: Hugging Face Trainer under DeepSpeed ZeRO-2 and ZeRO-3 on
the suite's ranks, stock against ``gradaccel.hf.enable``, same model, data and accumulation, HF
gradient checkpointing on in both.

- ``torch-deepspeed-trainer``: Trainer with ``deepspeed={"zero_optimization": {"stage": 2},
  "data_types": {"grad_accum_dtype": "fp32"}, ...}``; HF's checkpointing (``torch.utils.checkpoint``);
- ``gradaccel-deepspeed-b0.5``: the same plus ``gradaccel.hf.enable(trainer, budget=0.5)``: the
  layers run ``gradaccel.checkpoint`` keeping half their activation bytes; the gradient, its
  reduction, accumulation and partitioning stay DeepSpeed's (gradaccel/integrations/hf_deepspeed.py).
- ``torch-zero3-trainer`` and ``gradaccel-zero3-b0.5`` (``zero3-…`` cases): the same at ZeRO-3,
  every parameter released between its module's forward and its backward, as a model larger than
  a rank's share meets it (``stage3_param_persistence_threshold`` and ``stage3_max_reuse_distance``
  0; prefetching on). gradaccel's replay gathers each layer's parameters once through ZeRO-3's
  ``GatheredParameters`` (gradaccel/integrations/hf_zero3.py); stock reruns the layer, each
  module gathering its own. Metrics: ``window_time`` and ``peak_bytes``.

Run the DeepSpeed rows alone: ``python -m bench.distributed_deepspeed [--quick]`` (2 CPU ranks).

Data: the Trainer row's uneven lengths, padded to a multiple of 16 tokens (``collate``).

Metrics (rank 0's): ``window_time`` (median over windows after the first, two runs of each
variant interleaved); ``peak_bytes``: on CUDA ``torch.cuda.max_memory_allocated`` over the run
above what was allocated at its start, on CPU the most bytes alive during a further run of two
windows, by ``gradaccel.memory.LiveBytes`` (storages made during training: activations, the
gradient, DeepSpeed's buckets and partitions, optimizer state; not the weights); ``grad_bytes``:
the most gradient bytes held at a micro-batch boundary: ``.grad``, and DeepSpeed's ZeRO-2
buckets, reduced partitions and accumulation buffers (its optimizer's own records), each storage
once. The gradient is DeepSpeed's in both variants: ``grad_bytes`` measures that gradaccel adds none.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
import warnings

import torch

from bench.common import pad_collate

VARIANTS = {2: ("torch-deepspeed-trainer", "gradaccel-deepspeed-b0.5"), 3: ("torch-zero3-trainer", "gradaccel-zero3-b0.5")}
BUDGET = 0.5
# DeepSpeed's ZeRO-2 optimizer's gradient records (stage_1_and_2.py): its per-dtype reduction
# buckets, the reduced partition (fp32 with grad_accum_dtype fp32 and a bf16 model), and the
# partition copies it accumulates into.
_DS_GRAD_ATTRS = ("ipg_buckets", "averaged_gradients", "all_grad_tensors", "grads_in_partition")


def available() -> bool:
    import importlib.util
    return importlib.util.find_spec("deepspeed") is not None


def configs(device: str, quick: bool, tiny: bool) -> list[tuple[str, dict, int, int]]:
    """(case, Llama config, sequences per micro-batch, accumulation steps): the Trainer row's sizes,
    at ZeRO-2 (``deepspeed-…``) and ZeRO-3 (``zero3-…``)."""
    if tiny:
        size = ("L2-C64-a2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2), 2, 2)
    elif device.startswith("cuda"):
        size = ("L8-C1024-a8", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8), 4, 8)
    elif quick:
        size = ("L4-C256-a4", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4), 4, 4)
    else:
        size = ("L8-C512-a4", dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8), 4, 4)
    name, cfg, micro, accum = size
    return [(f"deepspeed-{name}", cfg, micro, accum), (f"zero3-{name}", cfg, micro, accum)]


def stage_of(case: str) -> int:
    return 3 if case.startswith("zero3-") else 2


def prepare_cpu() -> None:
    """DeepSpeed's CPU accelerator, without its shared-memory all-reduce: it compiles for minutes
    on first use and only DeepSpeed's inference all-reduce calls it (training reduces through gloo)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def ds_config(stage: int = 2) -> dict:
    # reduce_bucket_size "auto": Trainer sets hidden_size², as its DeepSpeed docs advise (the default,
    # 5e8 elements, allocates a 2 GB fp32 bucket whatever the model).
    zero = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:  # released between forward and backward, as in a model larger than a rank's share
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                    stage3_prefetch_bucket_size="auto")
    return {"zero_optimization": zero, "data_types": {"grad_accum_dtype": "fp32"},
            "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True}


def collate(items: list[dict], multiple: int = 16) -> dict:
    """``pad_collate``, padded on to a multiple of 16 tokens (a collator's ``pad_to_multiple_of``):
    a handful of lengths, so the timed windows run plans already made (gradaccel plans each new
    length once; the lengths suite measures that first step)."""
    batch = pad_collate(items)
    extra = -batch["input_ids"].shape[1] % multiple
    pads = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {k: torch.nn.functional.pad(v, (0, extra), value=pads[k]) for k, v in batch.items()}


def _tensors(obj, depth=0):
    if torch.is_tensor(obj):
        yield obj
    elif depth < 4 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth + 1)
    elif depth < 4 and type(obj).__name__ == "IPGBucket":
        yield from _tensors(obj.buffer, depth + 1)


def grad_bytes(model, engine) -> int:
    """Gradient bytes held now: ``.grad`` (and ZeRO's ``grad_accum``) and DeepSpeed's records, each storage once."""
    found = [t for p in model.parameters() for t in (p.grad, getattr(p, "grad_accum", None)) if t is not None]
    opt = getattr(engine, "optimizer", None)
    for name in _DS_GRAD_ATTRS:
        found.extend(_tensors(getattr(opt, name, None)))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found}
    return sum(storages.values())


def _run(variant, base, data, out, micro, accum, windows, device, live=False, stage=2):
    import transformers
    from accelerate.state import AcceleratorState

    import gradaccel
    from gradaccel.memory import LiveBytes
    cuda = device.startswith("cuda")
    model = copy.deepcopy(base)
    # The suite's DDP Trainer rows ran in this process first: accelerate's state (a singleton) must
    # be made again for DeepSpeed (the process group stays).
    AcceleratorState._reset_state(reset_partial_state=True)
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=accum, max_steps=windows,
        use_cpu=not cuda, report_to=[], logging_strategy="no", save_strategy="no", seed=0, data_seed=0,
        disable_tqdm=True, learning_rate=1e-4, gradient_checkpointing=True, max_grad_norm=1.0, bf16=cuda,
        deepspeed=ds_config(stage))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    if variant.startswith("gradaccel"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the split, said once: the suite knows it
            gradaccel.hf.enable(trainer, budget=BUDGET)
    stats = {"held": 0, "times": [], "peak": 0}

    class Probe(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
                stats["base"] = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            stats["t0"] = time.perf_counter()

        def on_substep_end(self, *a, **k):
            if stage == 2:  # its optimizer's records are ZeRO-2's
                stats["held"] = max(stats["held"], grad_bytes(model, trainer.model_wrapped))

        def on_step_end(self, *a, **k):
            if stage == 2:
                stats["held"] = max(stats["held"], grad_bytes(model, trainer.model_wrapped))
            if cuda:
                torch.cuda.synchronize()
            stats["times"].append(time.perf_counter() - stats["t0"])

    trainer.add_callback(Probe())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if live:
            with LiveBytes() as counter:
                trainer.train()
            stats["peak"] = counter.peak
        else:
            trainer.train()
    if cuda:
        stats["peak"] = torch.cuda.max_memory_allocated() - stats["base"]
    return stats


def case(rank: int, device, name: str, cfg: dict, micro: int, accum: int, windows: int, out_dir: str) -> dict:
    """Both variants twice (interleaved) for time, once more on CPU for bytes; rank's metrics per variant."""
    import torch.distributed as dist
    import transformers

    from bench.distributed_trainer import _data
    config = transformers.LlamaConfig(vocab_size=1024, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=256, pad_token_id=0, **cfg)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config)
    world = dist.get_world_size()
    data = _data(world * micro * accum * windows, config.vocab_size, 64 if cfg["hidden_size"] < 1024 else 512)
    stage = stage_of(name)
    runs = {v: [] for v in VARIANTS[stage]}
    for rep in range(2):
        for v in VARIANTS[stage]:
            runs[v].append(_run(v, base, data, os.path.join(out_dir, f"{v}-{rep}"), micro, accum, windows, str(device),
                                stage=stage))
    results = {}
    for v in VARIANTS[stage]:
        times = [t for run in runs[v] for t in run["times"][1:]] or [t for run in runs[v] for t in run["times"]]
        peak = runs[v][0]["peak"]
        if device.type != "cuda":
            peak = _run(v, base, data, os.path.join(out_dir, f"{v}-live"), micro, accum, 2, str(device), live=True,
                        stage=stage)["peak"]
        results[v] = {"window_time": statistics.median(times), "peak_bytes": peak}
        if stage == 2:
            results[v]["grad_bytes"] = max(run["held"] for run in runs[v])
    return results


if __name__ == "__main__":  # this file's rows alone, on 2 CPU ranks: python -m bench.distributed_deepspeed [--quick]
    import sys

    from bench import distributed, report
    rows = distributed.run("cpu", "--quick" in sys.argv, only="ds")
    print(report.suite_table(rows, distributed.BASELINE))
