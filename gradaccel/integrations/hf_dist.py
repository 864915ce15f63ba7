"""``gradaccel.hf.enable`` on several processes: accelerate's data parallelism without DDP's reducer.

Launched by ``torchrun`` or ``accelerate launch``, accelerate runs one process per device
(``MULTI_GPU``, ``MULTI_CPU``, ...) and wraps the model in ``DistributedDataParallel`` in
``prepare``. Under gradaccel it does not: ``prepare`` places the model, applies mixed precision
and ``torch.compile`` as it would, and instead of building DDP makes every rank start from rank
0's parameters and buffers (as DDP's constructor does, after the same shape check). The
optimizer becomes ``FusedAccumOptimizer(opt, 1, normalize="sum", process_group=WORLD)``: each
rank folds its micro-batches into its fp32 window buffer, and at the end of the window (in
``accelerator.clip_grad_norm_``, or in ``step()`` without clipping) the buffer is all-reduced
once and divided by the number of ranks, which is what DDP's average is.

Why not DDP with something inside it. DDP's reducer sees a gradient through a hook that runs
after the parameter's ``.grad`` is written, which is after gradaccel's fold hook has folded and
freed it (see ``gradaccel/accumulate/slots.py``):

- plain DDP would all-reduce, in the window's last backward, buckets the fold had already
  emptied (zeros, or one micro-batch's low-precision gradient with ``.grad`` kept), and then
  write the averaged bucket back into ``.grad``, where the next fold would count it again;
- a communication hook that sends nothing removes the traffic but not the reducer: it still
  copies every gradient of the synced micro-batch into its buckets and writes them back, and
  must be kept from reading ``.grad`` the fold has freed;
- ``no_sync()`` on every micro-batch leaves the reducer idle, but its buckets stay allocated:
  a copy of every trainable parameter's gradient in the parameter's dtype, held for the whole
  run (14 GB for a 7B model in bf16), the memory gradaccel exists to save.

Without DDP none of that exists: no reducer, no buckets, no per-micro-batch all-reduce, nothing
to double- or under-count, whatever ``find_unused_parameters``, ``static_graph`` or
``gradient_as_bucket_view`` say (a parameter that got a gradient on any rank gets the summed
one on every rank, which is DDP's ``find_unused_parameters`` result; those settings only
concern the reducer and are moot). What DDP's all-reduce overlapped with the last backward, the
window's one all-reduce does after it, in fp32: ``bench/distributed.py`` measures both.

What is refused, naming the route that works (``docs/huggingface-distributed.md``): FSDP (accelerate shards the model and points
the optimizer at the shards inside ``prepare``; gradaccel's FSDP2 path is
``FusedAccumOptimizer(sync="window", module=model)`` on a ``fully_shard``-ed model); a DDP
communication hook (there is no DDP to run it); models whose buffers change in forward
(BatchNorm statistics, which DDP re-broadcasts every forward).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from gradaccel.integrations.hf_backend import Backend, Patches

FSDP_ROUTE = ("shard the model yourself (torch.distributed.fsdp.fully_shard, per block then the root) "
              "and wrap the optimizer in gradaccel.FusedAccumOptimizer(opt, accum_steps, "
              "sync='window', module=model) in a plain PyTorch loop (docs/huggingface-distributed.md)")


def refusal(acc: Any) -> tuple[str, str] | None:
    """(engine, message naming the route that works) where gradaccel does not serve this
    accelerator's set-up: FSDP, tensor or context parallelism, XLA and the other multi-process
    kinds that are not DDP, a DDP communication hook. None where it does. (DeepSpeed is
    gradaccel/integrations/hf_deepspeed.py's.)"""
    from accelerate.utils import DistributedType

    kind = acc.distributed_type
    if kind == DistributedType.FSDP:
        version = getattr(getattr(acc.state, "fsdp_plugin", None), "fsdp_version", 1)
        return f"FSDP{version}", (
            f"gradaccel.hf.enable: FSDP{version} through accelerate is not supported: accelerate shards the model "
            "inside prepare() and points the optimizer at the shards, under the wrapper gradaccel would have "
            f"built. Instead, {FSDP_ROUTE}; or drop fsdp= and run DDP, which gradaccel serves")
    parallel = getattr(acc, "parallelism_config", None)
    if parallel is not None and (getattr(parallel, "tp_enabled", False) or getattr(parallel, "cp_enabled", False)):
        return "tensor/context parallelism", ("gradaccel.hf.enable: tensor or context parallelism "
                                              "(parallelism_config) is not supported; data parallelism (DDP) is")
    if acc.num_processes > 1 and not _ddp_kind(acc):
        return str(kind), (f"gradaccel.hf.enable: {kind} with {acc.num_processes} processes is not supported; "
                           "gradaccel serves accelerate's DDP (MULTI_GPU, MULTI_CPU and the other MULTI_* types), "
                           "launched with torchrun or accelerate launch")
    hook = getattr(getattr(acc, "ddp_handler", None), "comm_hook", None)
    if acc.num_processes > 1 and hook is not None and getattr(hook, "value", hook) not in (None, "no"):
        return "DDP communication hook", (
            f"gradaccel.hf.enable: DDP communication hook {hook} is not supported: gradaccel builds no DDP; it "
            "all-reduces its fp32 window buffer once per window. Drop comm_hook from DistributedDataParallelKwargs")
    return None


def _ddp_kind(acc: Any) -> bool:
    """Whether accelerate would wrap a trained model in DDP (its ``prepare_model``'s test)."""
    # MULTI_GPU, MULTI_CPU, MULTI_NPU, MULTI_XPU, ...: every accelerate release names DDP's kinds so.
    kind = acc.distributed_type
    return str(getattr(kind, "value", kind)).startswith("MULTI_")


class DataParallel(Backend):
    """accelerate's DDP (``MULTI_GPU``, ``MULTI_CPU``, ...) on several processes, without DDP: every
    rank starts from rank 0's weights and the fp32 window buffer is all-reduced once per window
    (see the module docstring)."""

    name = "DDP"

    @property
    def group(self):
        return dist.group.WORLD

    def say(self, budget) -> None:
        acc = self.acc
        if getattr(acc.state, "fsdp_plugin", None) is not None:
            warnings.warn("gradaccel.hf.enable: an FSDP plugin was given, but accelerate runs "
                          f"{acc.distributed_type} (on CPU it ignores FSDP); gradaccel serves it as data parallelism "
                          "(every rank holds the whole model)", UserWarning, stacklevel=5)

    def install(self, patches: Patches) -> None:
        """Makes ``acc.prepare_model`` replicate a trained model instead of wrapping it in DDP."""
        prepare_model = self.acc.prepare_model

        def prepare_model_(model, device_placement=None, evaluation_mode=False):
            if isinstance(model, nn.parallel.DistributedDataParallel):
                raise ValueError("gradaccel.hf: this model is already wrapped in DistributedDataParallel, "
                                 "whose reducer would all-reduce gradients gradaccel has folded and freed; "
                                 "pass the plain model (model.module)")
            trains = not evaluation_mode and not getattr(model, "_is_accelerate_prepared", False) and any(
                p.requires_grad for p in model.parameters())
            # evaluation_mode=True: placement, mixed precision and compile as for training, no DDP.
            out = prepare_model(model, device_placement=device_placement, evaluation_mode=True)
            if trains:
                replicate(model)
            return out

        patches.set(self.acc, "prepare_model", prepare_model_)


def replicate(model: nn.Module) -> None:
    """What DDP's constructor does for the ranks' models: checks they have the same parameter
    shapes, then copies rank 0's parameters and buffers to every rank.

    Raises:
        ValueError: a module whose buffers change in forward (BatchNorm's running statistics);
            DDP re-broadcasts those every forward, gradaccel does not.
    """
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            raise ValueError(f"gradaccel.hf: {name} ({type(m).__name__}) updates its running statistics in "
                             "forward, which DDP re-broadcasts from rank 0 every forward and gradaccel does "
                             "not; convert it with torch.nn.SyncBatchNorm.convert_sync_batchnorm or set "
                             "track_running_stats=False")
    from torch.distributed.utils import _sync_module_states, _verify_param_shape_across_processes
    pg = dist.group.WORLD
    _verify_param_shape_across_processes(pg, list(model.parameters()))
    # DDP's own broadcast: from rank 0, parameters and buffers, in its 250 MB buckets.
    _sync_module_states(model, pg, 250 * 1024 * 1024, 0, set(), broadcast_buffers=True)
