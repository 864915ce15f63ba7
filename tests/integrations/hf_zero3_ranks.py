"""The ZeRO-3 rank script of tests/integrations/test_hf_deepspeed.py, launched as a user launches a
DeepSpeed Trainer script: ``DS_ACCELERATOR=cpu torchrun --nproc_per_node 2
tests/integrations/hf_zero3_ranks.py OUT_DIR`` (DeepSpeed's CPU accelerator, gloo).

Every scenario runs on both ranks and each rank writes ``OUT_DIR/rank{r}.json``: {scenario: "ok"
or the traceback}. In each, stock DeepSpeed ZeRO-3 with Hugging Face's checkpointing and the same
script with ``gradaccel.hf.enable(..., budget=0.5)`` run side by side; the model (a 2-layer Llama),
the data (lengths 3 to 11) and the helpers are tests/integrations/hf_ddp_ranks.py's and
hf_deepspeed_ranks.py's.

ZeRO-3 as a large model meets it: every parameter partitioned and released between its module's
forward and its backward (no persistence threshold, no reuse distance, no prefetching). With
DeepSpeed's defaults a model this small is never released at all (its parameters are under the
persistence threshold, and within the reuse distance), and there would be nothing to gather.
"""

import os
import warnings

import torch

warnings.filterwarnings("ignore")
import transformers  # noqa: E402

import gradaccel  # noqa: E402
import hf_deepspeed_ranks as zero2  # noqa: E402  (DeepSpeed's CPU set-up, its Trainer and loop, main())
from bench.common import pad_collate  # noqa: E402
from gradaccel.memory import LiveBytes  # noqa: E402
from gradaccel.recompute.blocks import _HFCheckpoint  # noqa: E402
from gradaccel.recompute.checkpoint import plan_rows  # noqa: E402
from hf_ddp_ranks import OUT, RANK, close, data, load, logged  # noqa: E402

A, MICRO, WINDOWS, LAYERS = zero2.A, zero2.MICRO, zero2.WINDOWS, zero2.LAYERS
RELEASED = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0}
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def ds_config(**extra):
    return zero2.ds_config(zero_optimization=dict(RELEASED), **extra)


def model_of(kind):
    """The 2-layer Llama, or it with peft LoRA on every projection."""
    if kind != "lora":
        return load(kind)
    import peft
    model = load("full")
    torch.manual_seed(0)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=PROJECTIONS, task_type="CAUSAL_LM"))


def train(kind, use_gradaccel, out):
    """A ZeRO-3 Trainer on 2 CPU processes: uneven lengths, accumulation 4, HF checkpointing,
    clipping (DeepSpeed's, from max_grad_norm)."""
    return zero2.train(kind, use_gradaccel, out, model=model_of(kind), deepspeed=ds_config())


def assert_gradaccel_ran(engine, said, calls):
    """gradaccel's checkpoint ran every decoder layer of every micro-batch with a selective plan,
    each layer's replay gathered the layer's released parameters once (ZeRO-3's GatheredParameters),
    never more than one layer's, and the split was said once."""
    assert type(engine).__name__ == "DeepSpeedEngine" and engine.zero_optimization_stage() == 3
    layers = [m for m in engine.module.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert len(layers) == LAYERS and all(isinstance(m._gradient_checkpointing_func, _HFCheckpoint) for m in layers)
    rows = [r for r in plan_rows() if r["region"] == "LlamaDecoderLayer.forward"]
    assert sum(r["calls"] for r in rows) == calls, rows
    assert all(r["mode"] == "selective" for r in rows) and any(r["replayed_ops"] for r in rows), rows
    replay = engine._gradaccel_zero3
    assert replay.gathers == calls, (replay.gathers, calls)  # one all-gather per layer call in backward
    layer_bytes = max(sum(p.ds_numel * p.element_size() for p in m.parameters()) for m in layers)
    assert 0 < replay.gathered_bytes <= layer_bytes, (replay.gathered_bytes, layer_bytes)
    split = [m for m in said if "DeepSpeed ZeRO-3" in m]
    assert len(split) == 1 and "GatheredParameters" in split[0] and "DeepSpeed keeps the gradient" in split[0], said


def assert_same_partitions(ref, ours):
    """Each rank's partition of every parameter, bit for bit."""
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p.ds_tensor, q.ds_tensor), \
            f"{name}: max diff {(p.ds_tensor.float() - q.ds_tensor.float()).abs().max().item():.3e}"


def compare(kind):
    """Bit for bit against stock ZeRO-3 with HF checkpointing: the replay runs the forward's own
    kernels (aten mm, the same shapes and order) on the same gathered values, and the gradient's
    reduction, partitioning, clipping and step are DeepSpeed's in both runs."""
    ref = train(kind, False, f"{kind}-stock")
    ours = train(kind, True, f"{kind}-ga")
    _keep_replay(ours)
    assert_gradaccel_ran(ours.model_wrapped, ours.said, LAYERS * A * WINDOWS)
    assert len(logged(ref)) == WINDOWS and all(x[1] > 0.05 for x in logged(ref))  # every window clipped
    assert logged(ours) == logged(ref), f"logged (loss, grad_norm): {logged(ours)} vs stock {logged(ref)}"
    assert_same_partitions(ref.model, ours.model)
    zero2.assert_ranks_logged_the_same(ours)
    gradaccel.hf.disable(ours)  # the engine's hooks go, the model's checkpointing is HF's again
    assert "pre_sub_module_forward_function" not in vars(ours.model_wrapped._gradaccel_zero3.offload)


def _keep_replay(trainer):
    """The engine's Zero3Replay on the engine, for the checks (disable() drops the backend)."""
    engine = trainer.model_wrapped
    replay = trainer.accelerator._gradaccel.backend.replays
    assert [r.engine for r in replay] == [engine]
    engine._gradaccel_zero3 = replay[0]


def full():
    compare("full")


def lora():
    compare("lora")


def accelerate_loop(use_gradaccel, lengths=None, live=None, **zero):
    """hf_deepspeed_ranks' accelerate loop with a DeepSpeedPlugin at stage 3 (``zero``: more of its
    settings); the engine holds its Zero3Replay as ``_gradaccel_zero3``."""
    model, losses, said, accelerator = zero2.accelerate_loop(use_gradaccel, {**RELEASED, **zero}, lengths, live)
    if use_gradaccel:
        model._gradaccel_zero3 = accelerator._gradaccel.backend.replays[0]
    return model, losses, said


def accelerate_run():
    ref, ref_losses, _ = accelerate_loop(False)
    model, losses, said = accelerate_loop(True)
    assert_gradaccel_ran(model, said, LAYERS * A * WINDOWS)
    assert losses == ref_losses, f"{losses} vs stock {ref_losses}"
    assert_same_partitions(ref.module, model.module)


def memory():
    """checkpoint_blocks(model, memory=...) under a ZeRO-3 Trainer (HF's checkpointing on, as a
    user's script has it): the memory target plans each length at the first training calls, on
    fake copies at the parameters' whole shapes, and the run logs stock ZeRO-3's losses and grad
    norms (fp32; a plan may run the MLP in slices, which changes the order of its sums)."""
    from gradaccel.memory.target import MemoryTarget

    ref = train("full", False, "memory-stock")
    model = model_of("full")
    gradaccel.checkpoint_blocks(model, memory=1 << 20)
    ours = zero2.train("full", False, "memory-ga", model=model, deepspeed=ds_config())
    target = next(h for h in ours.model._forward_pre_hooks.values() if isinstance(h, MemoryTarget))
    assert target.chosen, "the memory target planned no call"
    (l1, g1), (l2, g2) = zip(*logged(ours)), zip(*logged(ref))
    close(l1, l2, "loss"), close(g1, g2, "grad_norm")


class _Live(LiveBytes):
    """LiveBytes, and what each measured forward left alive for its backward (``held``)."""

    def __init__(self):
        super().__init__()
        self.held = []


def peak():
    """At budget 0.5, on a micro-batch's forward and backward (LiveBytes; the last window, every
    call planned: one length): the forward leaves alive what stock ZeRO-3 with HF checkpointing
    leaves plus the activations the plans keep (within 1%: plan_rows' kept bytes), and the peak is
    stock's plus at most those activations and one layer's gathered parameters."""
    # The longest sequence the model takes, and gradient buckets of 4096 values (reduce_bucket_size:
    # the 2-layer model's whole gradient in one bucket would be the step's peak, with no activation alive).
    L, bucket = 64, 4096
    stock_live, ours_live = _Live(), _Live()
    accelerate_loop(False, lengths=L, live=stock_live, reduce_bucket_size=bucket)
    model, _, _ = accelerate_loop(True, lengths=L, live=ours_live, reduce_bucket_size=bucket)
    # Each layer's plan now (a layer's first call is traced: its own region, retired once planned).
    rows = [r for r in plan_rows() if r["region"] == "LlamaDecoderLayer.forward" and r["calls"] > 1]
    assert len(rows) == LAYERS, rows
    kept = sum(r["kept_bytes"] for r in rows)
    layer_bytes = model._gradaccel_zero3.gathered_bytes
    held = ours_live.held[-1] - stock_live.held[-1]
    extra = ours_live.peak - stock_live.peak
    report = (f"peak: stock {stock_live.peak} B, gradaccel {ours_live.peak} B (+{extra}); held after forward: stock "
              f"{stock_live.held[-1]} B, gradaccel {ours_live.held[-1]} B (+{held}); kept by the plans {kept} B, "
              f"one layer's parameters gathered by a replay {layer_bytes} B")
    with open(os.path.join(OUT, f"peak{RANK}.txt"), "w") as f:
        f.write(report + "\n")
    assert kept > 0 and layer_bytes > 0, report
    # DeepSpeed's gradient bucket (bucket fp32 values) is alive after some forwards and not after
    # others, in stock's run and in ours alike (seen: both runs' held bytes move by 16384 B between
    # runs): one bucket either way is the engine's, not the plans'.
    assert abs(held - kept) <= 0.01 * kept + 4 * bucket, report
    assert 0 <= extra <= kept + layer_bytes, report


def refused():
    """ZeRO-3 with the parameters on NVMe is refused at hf.enable, naming what works."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    model = load("full")
    cfg = zero2.ds_config(zero_optimization={**RELEASED, "offload_param": {"device": "nvme", "nvme_path": OUT}})
    args = transformers.TrainingArguments(output_dir=os.path.join(OUT, "refused"), use_cpu=True, report_to=[],
                                          deepspeed=cfg)
    try:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data(), data_collator=pad_collate)
        try:
            gradaccel.hf.enable(trainer, budget=0.5)
        except ValueError as e:
            assert "NVMe" in str(e) and '"device": "cpu"' in str(e), str(e)
        else:
            raise AssertionError("ZeRO-3 with NVMe parameter offload was not refused")
        assert "_gradaccel" not in vars(trainer.accelerator)  # nothing patched
    finally:
        unset_hf_deepspeed_config()


# The accelerate loops after the Trainers (they reset accelerate's state, which the Trainers made).
SCENARIOS = {"full": full, "lora": lora, "accelerate": accelerate_run, "peak": peak, "refused": refused,
             "memory": memory}

if __name__ == "__main__":
    zero2.main(SCENARIOS)
