"""``gradaccel.hf.enable`` under DeepSpeed (ZeRO 0 to 3, through Trainer's ``deepspeed=`` or accelerate's plugin).

The split. DeepSpeed's engine owns the gradient: its hooks copy each parameter's gradient into a
bucket as backward produces it, reduce the bucket across the ranks on every micro-batch, and add
this rank's partition of the result into its accumulation buffer (ZeRO-2 and 3: each rank keeps
1/N of the gradient, in ``data_types.grad_accum_dtype``, the model's dtype unless set); it clips
and steps too. gradaccel takes none of that over here: no ``FusedAccumOptimizer``, no fold hooks,
``.grad`` is DeepSpeed's. It runs the activation checkpointing only: Hugging Face gradient
checkpointing, whoever turns it on, runs ``gradaccel.checkpoint`` at ``budget`` (a model already
checkpointed by ``checkpoint_blocks(model, budget=... or memory=...)`` keeps its own), at every
sequence length. Checkpointing is per layer and sees no gradient, so it does not care how the
gradient is reduced or partitioned. Under ZeRO-3 the parameters are partitioned too: the replay
then gathers the layer's parameters itself, through ZeRO-3's own ``GatheredParameters``
(``gradaccel/integrations/hf_zero3.py``).

Why gradaccel's accumulation does not fold into DeepSpeed's fp32 buffer. gradaccel's fold adds a
rank's own (unreduced) gradient into a full-size fp32 buffer and reduces once per window.
DeepSpeed's fp32 buffer holds only this rank's 1/N partition of the gradient *already reduced
over the ranks*: to land there a gradient must first cross the wire, which needs DeepSpeed's
bucket (a copy) and a reduction per micro-batch. Folding the local gradient in first would mean
a full fp32 gradient per rank (4 bytes per parameter, against ZeRO-2's 4/N) and one reduction
per window: that is gradaccel's DDP path (or FSDP2 with ``sync="window"``), not ZeRO. What is
left after the reduction is one add of the reduced bucket slice into the partition, which
DeepSpeed already does in fp32 (``partition.add_(reduced.to(float32))``, exact for a bf16
input); gradaccel's kernel there would change neither the result nor what is held.

Refused, naming what works: DeepSpeed's own activation checkpointing (``activation_checkpointing``
with ``partition_activations``, ``cpu_checkpointing``, ...: it applies to
``deepspeed.checkpointing.checkpoint`` only, which Hugging Face models never call, so it does
nothing there with or without gradaccel), and ZeRO-3 with its parameters offloaded to NVMe
(``offload_param.device: nvme``: ZeRO-Infinity swaps partitions in and out of a fixed set of
buffers in the order its trace of the modules predicts; the replay's gather is outside that
trace. Not tried here, where no NVMe swapper builds; CPU parameter offload is served).
"""

from __future__ import annotations

import warnings
from typing import Any

from gradaccel.integrations.hf_backend import Backend, Patches

NVME_ROUTE = ('"offload_param": {"device": "cpu"} (or none) keeps ZeRO-3 with gradaccel\'s checkpointing; '
              "or keep NVMe and Hugging Face's own checkpointing, without gradaccel.hf.enable")
AC_ROUTE = ("remove the \"activation_checkpointing\" section (or set its flags false) and checkpoint with "
            "gradient_checkpointing=True in TrainingArguments (model.activation_checkpointing_enable() in an "
            "accelerate loop): gradaccel.hf.enable(trainer, budget=...) then runs gradaccel.checkpoint at that "
            "budget; for CPU offload of what is kept, gradaccel.checkpoint_blocks(model, budget=..., offload=True)")
FP32_ACCUM = '"data_types": {"grad_accum_dtype": "fp32"}'
# DeepSpeed's activation_checkpointing flags that ask for something (its defaults are all off).
_AC_FLAGS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
             "synchronize_checkpoint_boundary", "profile")


def active(acc: Any) -> bool:
    """Whether accelerate runs this accelerator under DeepSpeed."""
    kind = acc.distributed_type
    return str(getattr(kind, "value", kind)) == "DEEPSPEED"


def config(acc: Any) -> dict:
    """The DeepSpeed config accelerate hands to ``deepspeed.initialize`` (Trainer fills its "auto"s)."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    cfg = getattr(plugin, "deepspeed_config", None)
    return cfg if isinstance(cfg, dict) else {}


def stage(cfg: dict) -> int:
    return int((cfg.get("zero_optimization") or {}).get("stage", 0))


def dtypes(acc: Any, cfg: dict) -> tuple[str, str]:
    """(model dtype, accumulation dtype) as DeepSpeed's engine decides them (``get_data_types``)."""
    def on(section):
        value = (cfg.get(section) or {}).get("enabled", False)
        if value == "auto":  # accelerate fills it from its mixed precision at prepare
            return str(getattr(acc, "mixed_precision", "no")) == section.replace("bfloat16", "bf16")
        return bool(value)

    model = "fp16" if on("fp16") else "bf16" if (on("bf16") or on("bfloat16")) else "fp32"
    accum = (cfg.get("data_types") or {}).get("grad_accum_dtype") or model
    accum = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(accum, accum)
    return model, accum


def refusal(acc: Any) -> tuple[str, str] | None:
    """(what, message naming the route that works) for what gradaccel cannot serve under
    DeepSpeed: its own activation checkpointing turned on in the config, ZeRO-3 with parameters
    on NVMe. None where it serves the config."""
    cfg = config(acc)
    ac = cfg.get("activation_checkpointing") or {}
    asked = [k for k in _AC_FLAGS if ac.get(k) not in (None, False, "auto")]
    if asked:
        return "DeepSpeed activation checkpointing", (
            f"gradaccel.hf.enable: DeepSpeed's activation checkpointing ({', '.join(asked)}) is not supported: it "
            "applies to deepspeed.checkpointing.checkpoint only, which Hugging Face models never call (it does "
            f"nothing for them, with or without gradaccel). Instead, {AC_ROUTE}")
    device = ((cfg.get("zero_optimization") or {}).get("offload_param") or {}).get("device")
    if stage(cfg) == 3 and str(device).lower() == "nvme":
        return "ZeRO-3 with parameters on NVMe", (
            "gradaccel.hf.enable: DeepSpeed ZeRO-3 with offload_param on NVMe is not supported: ZeRO-Infinity swaps "
            "parameter partitions through a fixed set of buffers in the order of its own trace of the modules, and "
            "gradaccel's replay gathers a layer's parameters outside that order. Instead, " + NVME_ROUTE)
    return None


class DeepSpeed(Backend):
    """DeepSpeed ZeRO 0-3: gradaccel's checkpointing only, the gradient DeepSpeed's (see the
    module docstring); under ZeRO-3, the replay's gathering (gradaccel/integrations/hf_zero3.py)."""

    owns_gradient = False

    def __init__(self, acc: Any):
        super().__init__(acc)
        self.stage = stage(config(acc))
        self.name = f"DeepSpeed ZeRO-{self.stage}"
        self.replays: list = []  # hf_zero3.Zero3Replay of each ZeRO-3 engine prepared
        self.patches: Patches | None = None

    def check(self, fuse_wgrad: bool) -> None:
        if fuse_wgrad:
            raise ValueError("gradaccel.hf.enable: fuse_wgrad=True under DeepSpeed: DeepSpeed makes, reduces and "
                             "partitions the gradient itself; leave fuse_wgrad off there (one process or DDP take "
                             "it; FSDP2 does not)")

    def say(self, budget) -> None:
        say_split(self.acc, budget)

    def install(self, patches: Patches) -> None:
        self.patches = patches  # ZeRO-3 engines are patched as prepare makes them

    def prepared(self, objs: list) -> None:
        from gradaccel.integrations.hf_zero3 import Zero3Replay, zero3_engine

        for obj in objs:
            if zero3_engine(obj) and not any(r.engine is obj for r in self.replays):
                replay = Zero3Replay(obj)
                replay.install(self.patches)
                self.replays.append(replay)

    def remove(self) -> None:
        self.replays.clear()  # their patches are undone with the accelerator's


def say_split(acc: Any, budget) -> str:
    """Warns who owns what (once per accelerator: ``hf.enable`` patches one once); returns the message."""
    cfg = config(acc)
    model, accum = dtypes(acc, cfg)
    zero3 = stage(cfg) == 3
    msg = (f"gradaccel.hf.enable under DeepSpeed ZeRO-{stage(cfg)}: gradaccel runs the activation checkpointing "
           f"(gradaccel.checkpoint, budget={budget!r}, where Hugging Face gradient checkpointing is on"
           + ("; each layer's replay gathers the layer's parameters through ZeRO-3's GatheredParameters and "
              "releases them after it" if zero3 else "")
           + f"); DeepSpeed keeps the gradient: its reduction, its accumulation (in {accum}), its partitioning, "
           "clipping and the optimizer step" + (", and the parameters' partitioning" if zero3 else "")
           + ". gradaccel's fp32 window buffer is not used (DeepSpeed reduces every micro-batch and accumulates "
           "its partition of the reduced gradient: docs/huggingface-distributed.md#deepspeed)")
    if accum in ("bf16", "fp16"):
        msg += (f". This config accumulates the gradient in {accum}: add {FP32_ACCUM} to the DeepSpeed config "
                "to sum the micro-batches in fp32")
    warnings.warn(msg, UserWarning, stacklevel=5)
    return msg
