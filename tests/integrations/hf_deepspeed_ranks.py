"""The rank script of tests/integrations/test_hf_deepspeed.py, launched as a user launches a
DeepSpeed Trainer script: ``DS_ACCELERATOR=cpu torchrun --nproc_per_node 2
tests/integrations/hf_deepspeed_ranks.py OUT_DIR`` (DeepSpeed's CPU accelerator, gloo).

Every scenario runs on both ranks and each rank writes ``OUT_DIR/rank{r}.json``: {scenario: "ok"
or the traceback}. In each, stock DeepSpeed ZeRO-2 Trainer with Hugging Face's checkpointing and
the same Trainer with ``gradaccel.hf.enable`` run side by side; the model, the data (lengths 3 to
11) and the helpers are tests/integrations/hf_ddp_ranks.py's.
"""

import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
import deepspeed.ops  # noqa: E402
import transformers  # noqa: E402

import gradaccel  # noqa: E402
from bench.common import pad_collate  # noqa: E402
from gradaccel.recompute.blocks import _HFCheckpoint  # noqa: E402
from gradaccel.recompute.checkpoint import plan_rows, reset_plans  # noqa: E402
from hf_ddp_ranks import OUT, RANK, assert_same_on_every_rank, data, load, logged, model_dir  # noqa: E402

# DeepSpeed's CPU accelerator compiles a shared-memory all-reduce (minutes, on first use) that
# only its inference all-reduce calls; training reduces through gloo. Not building it keeps the
# launch short; what trains is unchanged.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

A, MICRO, WINDOWS = 4, 2, 3
LAYERS = 2  # hf_ddp_ranks' Llama


def ds_config(stage=2, **extra):
    """A ZeRO config as users write it: Trainer fills the "auto"s from TrainingArguments."""
    return {"zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"}, "data_types": {"grad_accum_dtype": "fp32"},
            "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            **extra}


def train(kind, use_gradaccel, out, accum=A, max_grad_norm=0.05, model=None, deepspeed=None, **kw):
    """A DeepSpeed Trainer run on 2 CPU processes: uneven lengths, accumulation, HF checkpointing on,
    clipping (DeepSpeed's, from max_grad_norm). ``model``: instead of ``load(kind)``; ``deepspeed``:
    instead of the ZeRO-2 config."""
    model = load(kind) if model is None else model  # before the arguments: a ZeRO-3 config makes
    # from_pretrained partition (zero.Init), before this CPU run has its process group
    args = dict(output_dir=os.path.join(OUT, out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=accum,
                max_steps=WINDOWS, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=0,
                data_seed=0, disable_tqdm=True, learning_rate=1e-2, gradient_checkpointing=True,
                max_grad_norm=max_grad_norm, deepspeed=deepspeed or ds_config())
    args.update(kw)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**args), train_dataset=data(),
                                   data_collator=pad_collate)
    trainer.said = []
    if use_gradaccel:
        reset_plans()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            gradaccel.hf.enable(trainer, budget=0.5)
        trainer.said = [str(w.message) for w in said]
    trainer.train()
    return trainer


def assert_engaged(trainer, accum=A):
    """gradaccel's checkpoint ran every decoder layer of every micro-batch; the gradient, its
    accumulation and the step stayed DeepSpeed's."""
    assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine", type(trainer.model_wrapped)
    assert trainer.model_wrapped.zero_optimization_stage() == 2
    assert not any(isinstance(o, gradaccel.FusedAccumOptimizer)
                   for o in (trainer.optimizer, getattr(trainer.optimizer, "optimizer", None)))
    layers = [m for m in trainer.model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert len(layers) == LAYERS and all(m.gradient_checkpointing for m in layers)
    assert all(isinstance(m._gradient_checkpointing_func, _HFCheckpoint) for m in layers)
    rows = [r for r in plan_rows() if r["region"] == "LlamaDecoderLayer.forward"]
    assert sum(r["calls"] for r in rows) == LAYERS * accum * WINDOWS, rows
    assert any(r["mode"] == "selective" for r in rows), rows  # the budget kept something
    split = [m for m in trainer.said if "DeepSpeed ZeRO-2" in m]
    assert len(split) == 1 and "DeepSpeed keeps the gradient" in split[0], trainer.said


def assert_ranks_logged_the_same(trainer):
    mine = torch.tensor([x for pair in logged(trainer) for x in pair], dtype=torch.float64)
    theirs = mine.clone()
    dist.broadcast(theirs, 0)
    assert torch.equal(mine, theirs), f"rank {RANK} logged {mine.tolist()}, rank 0 {theirs.tolist()}"


STOCK = {}


def stock(kind):
    if kind not in STOCK:
        STOCK[kind] = train(kind, False, f"{kind}-stock")
    return STOCK[kind]


def compare(ref, ours, clipped=0.05):
    """Bit for bit: gradaccel's checkpoint recomputes with the same kernels in the same order, and
    the gradient's reduction, accumulation, clipping and step are DeepSpeed's in both runs."""
    assert len(logged(ref)) == WINDOWS
    assert logged(ours) == logged(ref), f"logged (loss, grad_norm): {logged(ours)} vs stock {logged(ref)}"
    assert all(x[1] > clipped for x in logged(ref))  # every window clipped
    for (name, p), q in zip(ref.model.named_parameters(), ours.model.parameters()):
        assert torch.equal(p, q), f"{name}: max diff {(p.float() - q.float()).abs().max().item():.3e}"
    assert_same_on_every_rank(ours.model)
    assert_ranks_logged_the_same(ours)


def full():
    ours = train("full", True, "full-ga")
    assert_engaged(ours)
    compare(stock("full"), ours)


def lora():
    ours = train("lora", True, "lora-ga")
    assert_engaged(ours)
    compare(stock("lora"), ours)


def bf16():
    """The set-up of a DeepSpeed user: bf16, ZeRO-2, grad_accum_dtype fp32, accumulation 2, HF
    checkpointing on; both ranks log the same losses, stock's."""
    kw = dict(bf16=True, accum=2, max_grad_norm=1.0)
    ref = train("full", False, "bf16-stock", **kw)
    ours = train("full", True, "bf16-ga", **kw)
    assert_engaged(ours, accum=2)
    opt = ours.model_wrapped.optimizer  # DeepSpeed's ZeRO-2 optimizer: bf16 weights, fp32 accumulation
    assert opt.dtype == torch.bfloat16 and opt.gradient_accumulation_dtype == torch.float32
    assert all("grad_accum_dtype" not in m for m in ours.said), ours.said  # fp32 already: nothing to advise
    compare(ref, ours, clipped=1.0)


def accelerate_loop(use_gradaccel, zero=None, lengths=None, live=None):
    """The accelerate recipe with a DeepSpeed plugin: accumulate(), backward(), step(); each rank on
    its own data. ``zero``: the zero_optimization section (ZeRO-2's by default); ``lengths``: one
    length for every micro-batch (else uneven); ``live``: a LiveBytes entered around the forward and
    backward of the last window's micro-batches but its last (whose backward steps the optimizer:
    accelerate's engine wrapper), noting in ``live.held`` what each forward left for its backward.
    Returns the engine, the losses, what enable said, and the accelerator."""
    import accelerate
    from accelerate.utils import DeepSpeedPlugin
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir())
    model.activation_checkpointing_enable()
    accelerate.state.AcceleratorState._reset_state()
    accelerate.state.GradientState._reset_state()
    cfg = dict(ds_config(), train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=A, gradient_clipping=0.5)
    for k in ("train_batch_size", "bf16"):
        cfg.pop(k)
    cfg["zero_optimization"] = zero or {"stage": 2}
    # Not cpu=True: accelerate then ignores the plugin. DS_ACCELERATOR=cpu keeps DeepSpeed on the CPU.
    accelerator = accelerate.Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), gradient_accumulation_steps=A)
    said = []
    if use_gradaccel:
        reset_plans()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            gradaccel.hf.enable(accelerator, budget=0.5)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    model.train()
    gen = torch.Generator().manual_seed(100 + RANK)
    losses = []
    for k in range(A * WINDOWS):
        ids = torch.randint(2, 64, (MICRO, lengths or 5 + (3 * k + RANK) % 7), generator=gen)
        measured = live is not None and k >= A * (WINDOWS - 1) and (k + 1) % A
        with accelerator.accumulate(model):
            if measured:
                live.__enter__()
                before = live.live
            loss = model(input_ids=ids, labels=ids).loss
            if measured:
                live.held.append(live.live - before)
            accelerator.backward(loss)
            if measured:
                live.__exit__(None, None, None)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return model, losses, [str(w.message) for w in said], accelerator


def accelerate_run():
    ref, ref_losses, _, _ = accelerate_loop(False)
    model, losses, said, _ = accelerate_loop(True)
    assert type(model).__name__ == "DeepSpeedEngine" and model.zero_optimization_stage() == 2
    layers = [m for m in model.module.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert all(isinstance(m._gradient_checkpointing_func, _HFCheckpoint) for m in layers)
    rows = [r for r in plan_rows() if r["region"] == "LlamaDecoderLayer.forward"]
    assert sum(r["calls"] for r in rows) == LAYERS * A * WINDOWS, rows
    assert len([m for m in said if "DeepSpeed ZeRO-2" in m]) == 1, said
    assert losses == ref_losses, f"{losses} vs stock {ref_losses}"
    for (name, p), q in zip(ref.module.named_parameters(), model.module.parameters()):
        assert torch.equal(p, q), f"{name}: max diff {(p.float() - q.float()).abs().max().item():.3e}"
    assert_same_on_every_rank(model.module)


def refused():
    """On real DeepSpeed Trainers: DeepSpeed's activation checkpointing and ZeRO-3 parameters on
    NVMe are refused at hf.enable, naming what works; bf16 accumulation is pointed at grad_accum_dtype."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    def trainer(cfg, **kw):
        model = load("full")  # before the arguments: a ZeRO-3 config makes from_pretrained partition (zero.Init)
        args = transformers.TrainingArguments(output_dir=os.path.join(OUT, "refused"), use_cpu=True, report_to=[],
                                              deepspeed=cfg, **kw)
        return transformers.Trainer(model=model, args=args, train_dataset=data(), data_collator=pad_collate)
    nvme = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": OUT}}
    for cfg, words in [(ds_config(zero_optimization=nvme), ["ZeRO-3", "NVMe", '"device": "cpu"']),
                       (ds_config(activation_checkpointing={"partition_activations": True}),
                        ["partition_activations", "gradient_checkpointing=True"])]:
        try:
            gradaccel.hf.enable(trainer(cfg), budget=0.5)
        except ValueError as e:
            assert all(w in str(e) for w in words), str(e)
        else:
            raise AssertionError(f"not refused: {cfg}")
        finally:  # the arguments' DeepSpeed config is global in transformers (a ZeRO-3 one partitions loads)
            unset_hf_deepspeed_config()
    cfg = {k: v for k, v in ds_config().items() if k != "data_types"}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        gradaccel.hf.enable(trainer(cfg, bf16=True), budget=0.5)
    said = [str(w.message) for w in said if "DeepSpeed ZeRO-2" in str(w.message)]
    assert len(said) == 1 and '"data_types": {"grad_accum_dtype": "fp32"}' in said[0] and "in bf16" in said[0], said


# The accelerate loop after the Trainers (it resets accelerate's state, which they made), the
# refusals last (they leave DeepSpeed configs that no run follows).
SCENARIOS = {"full": full, "lora": lora, "bf16": bf16, "accelerate": accelerate_run, "refused": refused}


def main(scenarios=None):
    """Runs ``scenarios`` (this script's by default; ``argv[2]``: a comma-separated choice) and
    writes ``OUT/rank{r}.json``."""
    scenarios = scenarios or SCENARIOS
    model_dir()  # before the process group: save_pretrained writes on the main process only
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(scenarios)
    results = {}
    for name in only:
        t0 = time.monotonic()
        try:
            scenarios[name]()
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()
        results[name + ".s"] = round(time.monotonic() - t0, 2)
        if dist.is_initialized():
            dist.barrier()
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(results, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort a rank in interpreter teardown (see tests/_dist.py)


if __name__ == "__main__":
    main()
