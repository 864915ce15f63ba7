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

Under DeepSpeed (ZeRO 0 to 3: Trainer's ``deepspeed=`` or accelerate's DeepSpeed plugin) the
gradient stays DeepSpeed's: its engine reduces it every micro-batch, accumulates its partition,
clips and steps. gradaccel runs the checkpointing only and says so once, in a warning
(``gradaccel/integrations/hf_deepspeed.py``: why, and what is refused: DeepSpeed's own activation
checkpointing, ZeRO-3 parameters on NVMe). Under ZeRO-3 each layer's replay gathers the layer's
parameters itself (``gradaccel/integrations/hf_zero3.py``).

Each engine is one backend object (``gradaccel/integrations/hf_backend.py``), picked once per
accelerator by :func:`pick`; every patch goes through ``hf_backend.Patches``, and
:func:`disable` undoes them all.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from typing import Any

import torch
import torch.nn as nn

from gradaccel.accumulate.optimizer import FusedAccumOptimizer
from gradaccel.integrations import hf_deepspeed as _hf_ds
from gradaccel.integrations import hf_dist as _hf_dist
from gradaccel.integrations.hf_backend import Backend, OneProcess, Patches, Refused
from gradaccel.recompute import blocks
from gradaccel.recompute.checkpoint import _check_budget

__all__ = ["enable", "disable"]


def enable(target: Any, budget: None | float | int = None, *, fuse_wgrad: bool = False,
           inputs_on_host: bool = False) -> Any:
    """Puts gradaccel under a Hugging Face ``Trainer`` (or ``trl.SFTTrainer``) or an ``accelerate.Accelerator``.

    Call it on the trainer after building it and before ``train()``; on an accelerator before
    ``accelerator.prepare(...)``. Nothing else in the script changes. :func:`disable` undoes it.

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
            DeepSpeed), DeepSpeed's own activation checkpointing, ZeRO-3 parameters on NVMe,
            FSDP through accelerate, a DDP communication hook, a bad ``budget`` (each message
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
    kind = _kind(target, "enable")
    if kind == "trainer":
        _enable_trainer(target, budget, fuse_wgrad, inputs_on_host)
    else:
        _enable_accelerator(target, budget, fuse_wgrad, inputs_on_host)
    return target


def disable(target: Any) -> Any:
    """Undoes :func:`enable`: the trainer's and accelerator's methods are their own again, the
    engine's hooks (ZeRO-3's) are removed, the models' checkpointing is as it was before
    ``enable``, and an optimizer ``enable`` wrapped is unwrapped (accelerate's holds the inner one).
    Nothing happens to a target ``enable`` was not called on.

    Args:
        target: the ``transformers.Trainer`` or ``accelerate.Accelerator`` given to ``enable``.

    Returns:
        ``target``.

    Raises:
        TypeError: ``target`` is neither.
        RuntimeError: a window is in progress (gradients folded, not applied): call it between
            windows (after ``train()``, or before the next ``accumulate`` block).
    """
    if _kind(target, "disable") == "trainer":
        acc = target.accelerator
        patches = vars(target).get("_gradaccel_patches")
    else:
        acc, patches = target, None
    state = vars(acc).get("_gradaccel")
    if state is not None:
        state.undo()
        del acc._gradaccel
    if patches is not None:
        patches.undo()
    return target


def _kind(target: Any, verb: str) -> str:
    accelerate = sys.modules.get("accelerate")
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(target, transformers.Trainer):
        return "trainer"
    if accelerate is not None and isinstance(target, accelerate.Accelerator):
        return "accelerator"
    raise TypeError(f"gradaccel.hf.{verb} takes a transformers.Trainer or an accelerate.Accelerator, "
                    f"got {type(target).__name__}")


def pick(acc: Any) -> Backend:
    """The backend of ``acc``'s engine (gradaccel/integrations/hf_backend.py lists them): DeepSpeed,
    DDP on several processes, one process, or :class:`~gradaccel.integrations.hf_backend.Refused`
    with the route that works."""
    if _hf_ds.active(acc):
        refused = _hf_ds.refusal(acc)
        return Refused(acc, *refused) if refused else _hf_ds.DeepSpeed(acc)
    refused = _hf_dist.refusal(acc)
    if refused:
        return Refused(acc, *refused)
    return _hf_dist.DataParallel(acc) if acc.num_processes > 1 else OneProcess(acc)


def _enable_trainer(trainer, budget, fuse_wgrad=False, inputs_on_host=False) -> None:
    args = trainer.args
    backend = pick(trainer.accelerator)
    backend.check(fuse_wgrad)
    # Under DeepSpeed its engine keeps .grad and its own loss scaler: fp16 is DeepSpeed's business.
    if getattr(args, "fp16", False) and backend.owns_gradient:
        raise ValueError("gradaccel.hf.enable: fp16=True trains with a gradient scaler that unscales and "
                         "checks .grad, which gradaccel frees; use bf16=True (no scaler)")
    if isinstance(trainer.optimizer, FusedAccumOptimizer) or isinstance(
            getattr(trainer.optimizer, "optimizer", None), FusedAccumOptimizer):
        raise TypeError("gradaccel.hf.enable: the trainer's optimizer is already a FusedAccumOptimizer. Pass the "
                        "plain optimizer (or none: optim= builds it); Trainer keeps its own accumulation "
                        "(gradient_accumulation_steps) and gradaccel wraps the optimizer itself")
    state = _enable_accelerator(trainer.accelerator, budget, fuse_wgrad, inputs_on_host, backend)
    checkpointing = bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None))
    state.checkpoint(trainer.model, on=checkpointing)
    patches = vars(trainer).get("_gradaccel_patches")
    if patches is not None:  # enabled before: the new settings only
        trainer._gradaccel_settings = (budget, fuse_wgrad, inputs_on_host)
        return
    patches = Patches()
    patches.set(trainer, "_gradaccel_patches", patches)
    patches.set(trainer, "_gradaccel_settings", (budget, fuse_wgrad, inputs_on_host))
    # A hyper-parameter search builds a new accelerator per trial: it gets gradaccel too.
    create = trainer.create_accelerator_and_postprocess

    def create_accelerator_and_postprocess():
        create()
        _enable_accelerator(trainer.accelerator, *trainer._gradaccel_settings)

    patches.set(trainer, "create_accelerator_and_postprocess", create_accelerator_and_postprocess)
    train = trainer.train

    @functools.wraps(train)
    def train_(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        except BaseException as exc:  # several processes: the others stop with this message
            state = vars(trainer.accelerator).get("_gradaccel")
            if state is not None:
                state.abort(exc)
            raise

    patches.set(trainer, "train", train_)


class _State:
    """What gradaccel keeps on an enabled accelerator: its settings, its backend, the optimizers it
    wrapped (and who holds each), the models whose checkpointing it took over, and its patches."""

    def __init__(self, budget, fuse_wgrad, inputs_on_host, backend: Backend):
        self.budget, self.fuse_wgrad, self.inputs_on_host = budget, fuse_wgrad, inputs_on_host
        self.backend = backend
        self.patches = Patches()
        self.model = None  # the model prepared with the optimizer (fuse_wgrad routes its layers)
        self.wrapped: list[tuple] = []  # (weakref to FusedAccumOptimizer, weakref to who holds it or None)
        self.taken: list[tuple] = []  # (model, its HF layers' checkpointing before, its input-grads hook before)

    def fused(self) -> list[FusedAccumOptimizer]:
        return [o for o in (r() for r, _ in self.wrapped) if o is not None]

    def abort(self, exc: BaseException) -> None:
        """Tells the other ranks that this one stopped mid-window (they raise at once, not hang)."""
        for opt in self.fused():
            opt.abort(exc)

    def checkpoint(self, model: nn.Module, on: bool) -> None:
        """HF checkpointing on (or asked for): gradaccel's at the budget. Off: stays off, but
        whoever turns it on later gets gradaccel's. A model ``checkpoint_blocks`` checkpoints keeps its own."""
        if any("_gradaccel_checkpoint" in vars(m) for m in model.modules()):
            return  # checkpoint_blocks was called already (with the user's budget), or this enable took it
        hf = blocks._hf_models(model)
        before = [(m, m.gradient_checkpointing, vars(m).get("_gradient_checkpointing_func"))
                  for h in hf for m in h.modules() if hasattr(m, "gradient_checkpointing")]
        self.taken.append((model, before, hasattr(model, "_require_grads_hook")))
        if on or any(flag is True for _, flag, _ in before):
            blocks.install(model, budget=self.budget, inputs_on_host=self.inputs_on_host)
            return
        for m in hf:
            blocks._take_over(m, self.budget, inputs_on_host=self.inputs_on_host)
        if self.budget:
            warnings.warn(f"gradaccel.hf.enable: budget={self.budget!r} has no effect, gradient checkpointing is off; "
                          "turn it on (gradient_checkpointing=True in TrainingArguments/SFTConfig, or "
                          "model.activation_checkpointing_enable()) to checkpoint under it", UserWarning, stacklevel=5)

    def undo(self) -> None:
        """Unwraps the optimizers, undoes the patches and the engine's hooks, gives the models
        their checkpointing back as it was."""
        for ref, holder in self.wrapped:
            opt, owner = ref(), holder() if holder is not None else None
            if opt is not None:
                inner = opt.release()  # raises mid-window, before anything is undone
                if owner is not None:
                    owner.optimizer = inner
        self.wrapped.clear()
        self.patches.undo()
        self.backend.remove()
        for model, before, had_hook in self.taken:
            blocks.release(model)
            for m, flag, func in before:
                m.gradient_checkpointing = flag
                if func is None:
                    vars(m).pop("_gradient_checkpointing_func", None)
                else:
                    m._gradient_checkpointing_func = func
            if not had_hook and hasattr(model, "_require_grads_hook"):
                model.disable_input_require_grads()
        self.taken.clear()


def _enable_accelerator(acc, budget, fuse_wgrad=False, inputs_on_host=False, backend: Backend | None = None) -> _State:
    state = vars(acc).get("_gradaccel")
    if state is not None:
        state.budget, state.inputs_on_host = budget, inputs_on_host
        return state
    if backend is None:
        backend = pick(acc)
        backend.check(fuse_wgrad)  # refused set-ups raise here, naming the route
    state = _State(budget, fuse_wgrad, inputs_on_host, backend)
    backend.say(budget)
    backend.install(state.patches)
    _patch_prepare(acc, state)
    if backend.owns_gradient:
        _patch_gradient(acc, state)
    acc._gradaccel = state
    return state


def _patch_prepare(acc, state: _State) -> None:
    """``prepare`` hands gradaccel's checkpointing to each model, and what it made to the backend."""
    prepare = acc.prepare

    def prepare_(*args, device_placement=None):
        for a in args:
            if isinstance(a, nn.Module):
                state.checkpoint(a, on=False)
                state.model = state.model or a  # prepared beside the optimizer: the one fuse_wgrad routes
        out = prepare(*args, device_placement=device_placement)
        made = list(out) if isinstance(out, (tuple, list)) else [out]
        state.backend.prepared(made)
        models = [m for m in (*args, *acc._models) if isinstance(m, nn.Module)]
        for opt in state.fused():
            for m in models:
                _check_covers(m, opt)
        return out

    state.patches.set(acc, "prepare", prepare_)


def _patch_gradient(acc, state: _State) -> None:
    """Where gradaccel holds the gradient: the optimizer becomes a FusedAccumOptimizer, and
    accelerate's clipping and backward go through it."""
    group = state.backend.group  # several processes: the window buffer is summed over them
    prepare_optimizer = acc.prepare_optimizer
    clip_grad_norm_, backward = acc.clip_grad_norm_, acc.backward

    def prepare_optimizer_(optimizer, device_placement=None):
        if not getattr(optimizer, "_is_accelerate_prepared", False):
            fused = _wrap(optimizer, group, state)
            optimizer = prepare_optimizer(fused, device_placement=device_placement)
            holder = optimizer if getattr(optimizer, "optimizer", None) is fused else None
            state.wrapped.append((weakref.ref(fused), holder and weakref.ref(holder)))
            return optimizer
        if not isinstance(optimizer.optimizer, FusedAccumOptimizer):
            # Prepared before gradaccel was enabled (a Trainer trained once already): wrap inside.
            optimizer.optimizer = fused = _wrap(optimizer.optimizer, group, state)
            state.wrapped.append((weakref.ref(fused), weakref.ref(optimizer)))
        return prepare_optimizer(optimizer, device_placement=device_placement)

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
            opt.note_backward(loss.detach() / acc.gradient_accumulation_steps)

    for name, fn in (("prepare_optimizer", prepare_optimizer_), ("clip_grad_norm_", clip_grad_norm__),
                     ("clip_grad_value_", clip_grad_value__), ("backward", backward_)):
        state.patches.set(acc, name, fn)


def _wrap(optimizer: torch.optim.Optimizer, group=None, state: _State | None = None) -> FusedAccumOptimizer:
    if isinstance(optimizer, FusedAccumOptimizer):
        if group is not None and optimizer.process_group is None:
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
    held |= {id(p) for p in optimizer.folded_params}  # the model's own where masters are held
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
