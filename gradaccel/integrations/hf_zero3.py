"""gradaccel's checkpoint under DeepSpeed ZeRO-3: the replay runs against gathered parameters.

ZeRO-3 keeps 1/N of every parameter on each rank. Its module hooks gather a module's parameters
before the module's forward (``param.data`` becomes the whole tensor) and release them after it
(``param.data`` becomes an empty tensor); in backward, a hook on the module's outputs gathers them
again for the module's own backward. Hugging Face's checkpointing reruns each layer's forward in
backward, module hooks and all, so each module gathers its parameters again. gradaccel's replays
only the ops it did not keep, as aten ops, with no module hooks: it must gather what those ops
read itself. Here, for one engine:

- **The trace stays the region's.** The first call of a layer is traced op by op, and ZeRO-3's
  gathering runs inside it (an all-gather into a new buffer that becomes ``param.data``). The
  engine's fetch and release run inside ``gradaccel.recompute.engine.outside_regions``, so they
  are not recorded: a gathered parameter is a tensor the region reads from outside, as any
  parameter is, and the replay reads it through the parameter object.
- **Fetch once before a region's replay, release after.** ``around_replay`` gathers, with
  ``deepspeed.zero.GatheredParameters`` (one coalesced all-gather), the parameters of the layer
  that are released at that point, and releases them once the replay has run. Parameters that
  ZeRO-3 holds gathered itself (the module whose backward asked, persistent small ones, those kept
  for reuse) are used as they are and left to it; one it is prefetching is waited for and left to
  it. The hook runs once per layer call in backward, at its first saved tensor, on every rank
  alike (the all-gather is a collective, and ranks with other sequence lengths may have plans that
  replay other ops). Frozen (peft's base) and trainable parameters alike.
- **A kept tensor never pins a gathered parameter.** Under an engine, a saved tensor on a storage
  the region read from outside (a parameter, or a view of one) is kept as where it lies
  (``gradaccel.recompute.frames.ByReference``) and viewed again at unpack, when ZeRO-3 has gathered
  the module's parameters for its backward: the storage ZeRO-3 releases is released.
- **No size formulas.** Each new sequence length is traced rather than sized by a symbolic pass
  (gradaccel/recompute/symbolic.py): outside their modules' hooks the parameters are released, and
  reading one there would start a collective on one rank alone.

What is held at once, over stock ZeRO-3 with Hugging Face checkpointing: one layer's gathered
parameters during its replay (stock gathers one module's at a time while it reruns the layer),
plus the activations the budget keeps.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from gradaccel.integrations.hf_backend import Patches
from gradaccel.recompute import engine as _engine

# The hooks of DeepSpeedZeRoOffload that gather or release a module's parameters.
_FETCH_RELEASE = ("pre_sub_module_forward_function", "post_sub_module_forward_function",
                  "pre_sub_module_backward_function", "post_sub_module_backward_function")


def zero3_engine(obj: Any) -> bool:
    """Whether ``obj`` is a DeepSpeed engine running ZeRO-3."""
    from deepspeed import DeepSpeedEngine

    return isinstance(obj, DeepSpeedEngine) and obj.zero_optimization_stage() == 3


def offload_of(engine: Any):
    """The engine's ``DeepSpeedZeRoOffload`` (the object whose hooks gather parameters), or None."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    for obj in (getattr(engine, "optimizer", None), getattr(getattr(engine, "optimizer", None), "parameter_offload", None)):
        if isinstance(obj, DeepSpeedZeRoOffload):
            return obj
    return None


class Zero3Replay:
    """ZeRO-3's side of gradaccel's checkpoint for one engine, installed through ``Patches``
    (``gradaccel.hf.disable`` undoes it)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.offload = offload_of(engine)
        if self.offload is None:
            raise ValueError("gradaccel: this DeepSpeed engine runs ZeRO-3 but holds no DeepSpeedZeRoOffload "
                             "(the object whose hooks gather parameters); gradaccel cannot follow its gathering")
        self.params = {id(p): p for p in engine.module.parameters()}
        self.gathers = 0  # the replays that gathered (tests, the bench)
        self.gathered_bytes = 0  # the most bytes one replay gathered (one layer's released parameters)

    def install(self, patches: Patches) -> None:
        """ZeRO-3's gathering and releasing run outside any region being traced: the module hooks'
        fetch and release, and each parameter's own ``all_gather`` and ``partition`` (a parameter
        read outside its module's forward, peft's ``lora_A.weight`` read by the LoRA layer, is
        gathered on access by ZeRO-3's ``ZeROOrderedDict``). Registers the replay's gathering."""
        for name in _FETCH_RELEASE:
            patches.set(self.offload, name, _unrecorded(getattr(self.offload, name)))
        for p in self.params.values():
            for name in ("all_gather", "partition"):
                if name in vars(p):
                    patches.set(p, name, _unrecorded(vars(p)[name]))
        patches.on_undo(_engine.around_replay(self.gathered).remove)

    def gathered(self, tensors):
        """The parameters among ``tensors`` readable for a replay: gathers those ZeRO-3 has released,
        and releases them after."""
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

        mine = [t for t in tensors if id(t) in self.params and hasattr(t, "ds_status")]
        inflight = [p for p in mine if p.ds_status == ZeroParamStatus.INFLIGHT]
        if inflight:
            self._wait(inflight)
        released = [p for p in mine if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if not released:
            return contextlib.nullcontext()
        self.gathers += 1
        self.gathered_bytes = max(self.gathered_bytes, sum(p.ds_numel * p.element_size() for p in released))
        return GatheredParameters(released)

    def _wait(self, params) -> None:
        """Waits for parameters ZeRO-3 is prefetching; they stay ZeRO-3's (its own fetch waits again, at no cost)."""
        coordinator = self.offload.get_param_coordinator()
        registry = getattr(coordinator, "_PartitionedParameterCoordinator__inflight_param_registry", {})
        for p in params:
            handle = registry.get(p)
            if handle is None:
                raise RuntimeError(f"gradaccel: ZeRO-3 parameter {p.ds_id} is being gathered, but its all-gather "
                                   "is not in the coordinator's registry (a DeepSpeed version gradaccel does not "
                                   "know); set \"stage3_prefetch_bucket_size\": 0 to run without prefetching")
            handle.wait()


def _unrecorded(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with _engine.outside_regions():
            return fn(*args, **kwargs)
    return run
