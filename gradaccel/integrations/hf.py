"""Hugging Face entry point: one line turns a Trainer (TRL's too) or an accelerate loop over to gradaccel.

```python
trainer = SFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds, peft_config=lora)
gradaccel.hf.enable(trainer, budget=0.5)        # the one line
trainer.train()
```

The framework keeps its own accumulation loop, its loss normalisation (Trainer divides each
micro-batch's loss by the window's token count, ``num_items_in_batch``), its optimizer (whatever
``optim=`` builds, 8-bit and paged included), LR schedule, logging, saving and resuming.
gradaccel takes over three things underneath:

- the gradient: the optimizer is wrapped in ``FusedAccumOptimizer(opt, 1, normalize="sum")``, so
  each micro-batch's gradient folds into one fp32 buffer as backward produces it and ``.grad``
  is freed; the framework's one ``step()`` per window applies the sum, as its own ``.grad``
  accumulation would;
- the clipping: ``accelerator.clip_grad_norm_`` (which Trainer calls every window, to log
  ``grad_norm`` even without clipping) measures and clips that buffer in the same pass;
- the checkpoint: Hugging Face gradient checkpointing, whoever turns it on (``TrainingArguments
  (gradient_checkpointing=True)``, SFTConfig's default, peft's ``prepare_model_for_kbit_training``,
  a later ``activation_checkpointing_enable()``), runs ``gradaccel.checkpoint`` at ``budget``.

On several processes (``torchrun`` / ``accelerate launch``: accelerate's DDP, ``MULTI_GPU`` or
``MULTI_CPU``) accelerate builds no ``DistributedDataParallel``: every rank starts from rank 0's
weights, folds its micro-batches into its own fp32 buffer, and the buffer is all-reduced once per
window, after the ranks agreed they ended the same window (``gradaccel/integrations/hf_dist.py`` says why, and
what is refused: FSDP through accelerate).

Under DeepSpeed (ZeRO 0, 1, 2: Trainer's ``deepspeed=`` or accelerate's DeepSpeed plugin) the
gradient stays DeepSpeed's: its engine reduces it every micro-batch, accumulates its partition,
clips and steps. gradaccel runs the checkpointing only and says so once, in a warning
(``gradaccel/integrations/hf_deepspeed.py``: why, and what is refused: ZeRO-3, DeepSpeed's own
activation checkpointing).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import torch
import torch.nn as nn

from gradaccel.integrations import hf_deepspeed as _hf_ds
from gradaccel.integrations import hf_dist as _hf_dist
from gradaccel.recompute import blocks
from gradaccel.recompute.checkpoint import _check_budget
from gradaccel.accumulate.optimizer import FusedAccumOptimizer

__all__ = ["enable"]


def enable(target: Any, budget: None | float | int = None, *, fuse_wgrad: bool = False,
           inputs_on_host: bool = False) -> Any:
    """Puts gradaccel under a Hugging Face ``Trainer`` (or ``trl.SFTTrainer``) or an ``accelerate.Accelerator``.

    Call it on the trainer after building it and before ``train()``; on an accelerator before
    ``accelerator.prepare(...)``. Nothing else in the script changes.

    Args:
        target: a ``transformers.Trainer`` (any subclass) or an ``accelerate.Accelerator``.
        budget: the checkpoint budget per layer, as :func:`gradaccel.checkpoint` defines it
            (``None`` keeps nothing: the memory of HF's checkpointing). It applies
            where HF gradient checkpointing is (or later gets) turned on; with it off, a budget
            other than None is warned about. A model that ``checkpoint_blocks`` already
            checkpoints keeps its budget (``gradaccel.recompute.blocks.set_budget`` changes it).
        fuse_wgrad: the weight gradients of the model's ``nn.Linear`` and ``nn.Embedding``
            layers go from their GEMM straight into the fp32 window
            (``FusedAccumOptimizer(fuse_wgrad=True)``, docs/accumulation.md); not under
            DeepSpeed, which owns the gradient there.
        inputs_on_host: each checkpointed layer's input hidden state waits in pinned host memory
            between its forward and its backward (``checkpoint_blocks(..., inputs_on_host=True)``,
            gradaccel/recompute/host_inputs.py). As ``budget``, it applies where HF checkpointing
            is on, and a model ``checkpoint_blocks`` already checkpoints keeps its own setting.

    Returns:
        ``target``.

    Raises:
        TypeError: ``target`` is neither; the trainer already holds a ``FusedAccumOptimizer`` that
            accumulates by itself.
        ValueError: a set-up gradaccel cannot serve: fp16 with a gradient scaler (outside
            DeepSpeed), DeepSpeed ZeRO-3 or DeepSpeed's own activation checkpointing, FSDP
            through accelerate, a DDP communication hook, a bad ``budget`` (each message
            names the route that works); or, at ``prepare``, an optimizer that misses
            parameters the model trains (built before peft added its adapters), a model with
            BatchNorm running statistics on several processes.
        RuntimeError: during training on several processes, ranks that diverged (another
            number of micro-batches in a window, a rank that raised or stopped): at the end of
            the window, or after the process group's timeout, never a hang.
    """
    _check_budget(budget)
    if not isinstance(fuse_wgrad, bool):
        raise TypeError(f"fuse_wgrad must be a bool, got {type(fuse_wgrad).__name__}")
    if not isinstance(inputs_on_host, bool):
        raise TypeError(f"inputs_on_host must be a bool, got {type(inputs_on_host).__name__}")
    accelerate = sys.modules.get("accelerate")
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(target, transformers.Trainer):
        _enable_trainer(target, budget, fuse_wgrad, inputs_on_host)
    elif accelerate is not None and isinstance(target, accelerate.Accelerator):
        _patch_accelerator(target, budget, fuse_wgrad, inputs_on_host)
    else:
        raise TypeError(f"gradaccel.hf.enable takes a transformers.Trainer or an accelerate.Accelerator, "
                        f"got {type(target).__name__}")
    return target


def _enable_trainer(trainer, budget, fuse_wgrad=False, inputs_on_host=False) -> None:
    args = trainer.args
    # Under DeepSpeed its engine keeps .grad and its own loss scaler: fp16 is DeepSpeed's business.
    if getattr(args, "fp16", False) and not _hf_ds.active(trainer.accelerator):
        raise ValueError("gradaccel.hf.enable: fp16=True trains with a gradient scaler that unscales and "
                         "checks .grad, which gradaccel frees; use bf16=True (no scaler)")
    if isinstance(trainer.optimizer, FusedAccumOptimizer) or isinstance(
            getattr(trainer.optimizer, "optimizer", None), FusedAccumOptimizer):
        raise TypeError("gradaccel.hf.enable: the trainer's optimizer is already a FusedAccumOptimizer. Pass the "
                        "plain optimizer (or none: optim= builds it); Trainer keeps its own accumulation "
                        "(gradient_accumulation_steps) and gradaccel wraps the optimizer itself")
    model = trainer.model
    checkpointing = bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None))
    _checkpoint(model, budget, on=checkpointing, inputs_on_host=inputs_on_host)
    _patch_accelerator(trainer.accelerator, budget, fuse_wgrad, inputs_on_host)
    if "create_accelerator_and_postprocess" not in vars(trainer):
        # A hyper-parameter search builds a new accelerator per trial: it gets gradaccel too.
        create = trainer.create_accelerator_and_postprocess

        def create_accelerator_and_postprocess():
            create()
            _patch_accelerator(trainer.accelerator, trainer._gradaccel_budget, trainer._gradaccel_fuse_wgrad,
                               inputs_on_host)

        trainer.create_accelerator_and_postprocess = create_accelerator_and_postprocess
    if "train" not in vars(trainer):
        train = trainer.train

        def train_(*args, **kwargs):
            try:
                return train(*args, **kwargs)
            except BaseException as exc:  # several processes: the others stop with this message
                state = getattr(trainer.accelerator, "_gradaccel", None)
                if state is not None:
                    state.abort(exc)
                raise

        train_.__doc__ = train.__doc__
        trainer.train = train_
    trainer._gradaccel_budget, trainer._gradaccel_fuse_wgrad = budget, fuse_wgrad


def _checkpoint(model: nn.Module, budget, on: bool, inputs_on_host: bool = False) -> None:
    """HF checkpointing on (or asked for): gradaccel's at ``budget``. Off: stays off, but whoever
    turns it on later gets gradaccel's."""
    if any("_gradaccel_checkpoint" in vars(m) for m in model.modules()):
        return  # checkpoint_blocks was called already, with the user's budget
    hf = blocks._hf_models(model)
    was_on = any(getattr(m, "gradient_checkpointing", False) is True for h in hf for m in h.modules())
    if on or was_on:
        blocks.install(model, budget=budget, inputs_on_host=inputs_on_host)
        return
    for m in hf:
        blocks._take_over(m, budget, inputs_on_host=inputs_on_host)
    if budget:
        warnings.warn(f"gradaccel.hf.enable: budget={budget!r} has no effect, gradient checkpointing is off; "
                      "turn it on (gradient_checkpointing=True in TrainingArguments/SFTConfig, or "
                      "model.activation_checkpointing_enable()) to checkpoint under it", UserWarning, stacklevel=4)


class _State:
    """What gradaccel keeps on a patched accelerator: its budget and the optimizers it wrapped."""

    def __init__(self, budget, fuse_wgrad=False):
        self.budget, self.fuse_wgrad = budget, fuse_wgrad
        self.inputs_on_host = False  # checkpointed layers park their inputs on the host
        self.model = None  # the model prepared with the optimizer (fuse_wgrad routes its layers)
        self.optimizers: list[weakref.ref] = []
        self.deepspeed = False  # True: checkpointing only, the gradient is DeepSpeed's

    def fused(self) -> list[FusedAccumOptimizer]:
        return [o for o in (r() for r in self.optimizers) if o is not None]

    def abort(self, exc: BaseException) -> None:
        """Tells the other ranks that this one stopped mid-window (they raise at once, not hang)."""
        for opt in self.fused():
            agreement = getattr(opt._sync, "agreement", None)
            if agreement is not None:
                agreement.abort(exc)


def _patch_accelerator(acc, budget, fuse_wgrad=False, inputs_on_host=False) -> None:
    state = getattr(acc, "_gradaccel", None)
    if state is not None:
        state.budget, state.inputs_on_host = budget, inputs_on_host
        return
    if _hf_ds.active(acc):
        if fuse_wgrad:
            raise ValueError("gradaccel.hf.enable: fuse_wgrad=True under DeepSpeed: DeepSpeed makes, reduces and "
                             "partitions the gradient itself; leave fuse_wgrad off there (one process or DDP take it; FSDP2 does not)")
        _patch_deepspeed(acc, budget)
        acc._gradaccel.inputs_on_host = inputs_on_host
        return
    _hf_dist.check(acc)  # FSDP, ...: refused with the route that works
    if getattr(acc, "scaler", None) is not None:
        raise ValueError("gradaccel.hf.enable: mixed_precision='fp16' uses a gradient scaler that reads .grad, "
                         "which gradaccel frees; use bf16")
    state = acc._gradaccel = _State(budget, fuse_wgrad)
    state.inputs_on_host = inputs_on_host
    group = _hf_dist.group(acc)  # several processes: the window buffer is summed over them
    _hf_dist.patch_prepare_model(acc)  # ... and accelerate builds no DDP (see gradaccel/integrations/hf_dist.py)
    prepare, prepare_optimizer = acc.prepare, acc.prepare_optimizer
    clip_grad_norm_, backward = acc.clip_grad_norm_, acc.backward

    def prepare_optimizer_(optimizer, device_placement=None):
        if not getattr(optimizer, "_is_accelerate_prepared", False):
            optimizer = _wrap(optimizer, group, state)
            state.optimizers.append(weakref.ref(optimizer))
        elif not isinstance(optimizer.optimizer, FusedAccumOptimizer):
            # Prepared before gradaccel was enabled (a Trainer trained once already): wrap inside.
            optimizer.optimizer = _wrap(optimizer.optimizer, group, state)
            state.optimizers.append(weakref.ref(optimizer.optimizer))
        return prepare_optimizer(optimizer, device_placement=device_placement)

    def prepare_(*args, device_placement=None):
        for a in args:
            if isinstance(a, nn.Module):
                _checkpoint(a, state.budget, on=False, inputs_on_host=state.inputs_on_host)
                state.model = state.model or a  # prepared beside the optimizer: the one fuse_wgrad routes
        out = prepare(*args, device_placement=device_placement)
        models = [m for m in (*args, *acc._models) if isinstance(m, nn.Module)]
        for opt in state.fused():
            for m in models:
                _check_covers(m, opt)
        return out

    def clip_grad_norm__(parameters, max_norm, norm_type=2):
        fused = state.fused()
        if not fused:
            return clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        if float(norm_type) != 2.0 or len(fused) > 1:
            raise ValueError("gradaccel: accelerator.clip_grad_norm_ supports norm_type=2 and one optimizer")
        return fused[0].clip_grad_norm_(max_norm)

    def clip_grad_value__(parameters, clip_value):
        raise NotImplementedError("gradaccel: clip_grad_value_ would read .grad, which gradaccel frees "
                                  "(the window's gradient lives in one fp32 buffer); use clip_grad_norm_")

    def backward_(loss, **kwargs):
        backward(loss, **kwargs)
        # What was differentiated (accelerate divides by its accumulation steps): summed over the
        # window it is the window's loss, as the "sum" gradient is the window's gradient.
        for opt in state.fused():
            if not opt._sync.sharded:
                opt._sync.count_backward()  # the ranks check at the window's end that they ran as many
            opt._add_loss(loss.detach() / acc.gradient_accumulation_steps)

    acc.prepare, acc.prepare_optimizer = prepare_, prepare_optimizer_
    acc.clip_grad_norm_, acc.clip_grad_value_, acc.backward = clip_grad_norm__, clip_grad_value__, backward_


def _patch_deepspeed(acc, budget) -> None:
    """Under DeepSpeed (ZeRO 0-2): gradaccel's checkpointing only; the gradient stays DeepSpeed's
    (gradaccel/integrations/hf_deepspeed.py says why it cannot be folded into DeepSpeed's buffer)."""
    _hf_ds.check(acc)  # ZeRO-3, DeepSpeed's activation checkpointing: refused, naming what works
    state = acc._gradaccel = _State(budget)
    state.deepspeed = True
    _hf_ds.say_split(acc, budget)
    prepare = acc.prepare

    def prepare_(*args, device_placement=None):
        for a in args:
            if isinstance(a, nn.Module):
                _checkpoint(a, state.budget, on=False, inputs_on_host=state.inputs_on_host)
        out = prepare(*args, device_placement=device_placement)
        from gradaccel.integrations.hf_zero3 import Zero3Replay, offload_of
        for m in (out if isinstance(out, tuple) else (out,)):
            if type(m).__name__ == "DeepSpeedEngine" and m.zero_optimization_stage() == 3 and "_gradaccel_zero3" not in vars(m):
                m._gradaccel_zero3 = Zero3Replay(m)
                m._gradaccel_zero3.install()
        return out

    acc.prepare = prepare_


def _wrap(optimizer: torch.optim.Optimizer, group=None, state: _State | None = None) -> FusedAccumOptimizer:
    if isinstance(optimizer, FusedAccumOptimizer):
        if group is not None and optimizer._sync.process_group() is None:
            raise TypeError("gradaccel.hf: this FusedAccumOptimizer has no process_group while accelerate "
                            "runs several processes; pass the plain optimizer and let gradaccel.hf.enable wrap it")
        if optimizer.accum_steps == 1 and optimizer.normalize == "sum":
            return optimizer
        raise TypeError("gradaccel.hf: this FusedAccumOptimizer accumulates by itself (accum_steps="
                        f"{optimizer.accum_steps}, normalize={optimizer.normalize!r}) while the framework "
                        "accumulates too; pass the plain optimizer and let gradaccel.hf.enable wrap it")
    if state is not None and state.fuse_wgrad:
        if state.model is None:
            raise ValueError("gradaccel.hf.enable(fuse_wgrad=True): the optimizer was prepared without its model; "
                             "prepare them together (accelerator.prepare(model, optimizer))")
        return FusedAccumOptimizer(optimizer, 1, normalize="sum", process_group=group, fuse_wgrad=True,
                                   module=state.model)
    return FusedAccumOptimizer(optimizer, 1, normalize="sum", process_group=group)


def _check_covers(model: nn.Module, optimizer: FusedAccumOptimizer) -> None:
    """Raises where the optimizer cannot see what the model trains: it would silently train nothing."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    held |= {id(p) for p in optimizer._slots.params}  # the model's own where masters are held
    params = list(model.named_parameters())
    if not any(id(p) in held for _, p in params):
        return  # another model (a frozen reference, a teacher): not this optimizer's
    missing = [n for n, p in params if p.requires_grad and id(p) not in held]
    if missing:
        raise ValueError(
            f"gradaccel.hf: {len(missing)} parameters that {type(model).__name__} trains are not in the optimizer "
            f"(first: {missing[0]}), so they would never be updated. The optimizer was built before they were "
            "made (peft adds its adapters in SFTTrainer(peft_config=...) / get_peft_model): let the trainer "
            "build it (optim=...), or build it on model.parameters() after get_peft_model")
