"""Planning under DeepSpeed ZeRO-3: what a rank holds when the parameters are sharded over N ranks.

Each rank keeps 1/N of every parameter, of the gradient (DeepSpeed's partition, in fp32 with
``"data_types": {"grad_accum_dtype": "fp32"}``), of the fp32 master copy DeepSpeed's ZeRO-3
optimizer keeps of the trainable parameters, and of the optimizer's state. A module's parameters
are gathered whole for its forward and its backward; gradaccel's replay gathers one block's at
once (gradaccel/integrations/hf_zero3.py), so at most one block's parameters (or one module's
outside the blocks, where that is larger: a large vocabulary's embedding) are whole at a time:
that is counted on top of the 1/N. ``gradaccel.fit``'s ``zero3=N`` plans so, and its table
names each part as held (1/N, gathered).

``checkpoint_blocks(model, memory=...)`` on a model ZeRO-3 has sharded (a DeepSpeed engine's,
under ``gradaccel.hf.enable``): the step's profile runs a fake copy at the parameters' whole shapes
(:func:`whole_shape`) without ZeRO-3's module hooks (:func:`without_engine_hooks`), and the
target leaves room for what is gathered at once (:func:`gathered_at_once`), which the step makes.

Not counted: DeepSpeed's gradient buckets (``reduce_bucket_size`` values, its setting) and
prefetched parameters (``stage3_prefetch_bucket_size``): set them small against the activations,
or leave ``slack`` for them.
"""

import dataclasses
import math

import torch

from gradaccel.memory.counter import check_count

__all__ = ["sharded", "check_ranks", "gathered_at_once", "whole_shape", "without_engine_hooks", "is_sharded"]

# The module hook dicts of torch.nn.Module a copy may carry an engine's hooks in.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def check_ranks(zero3) -> int | None:
    """``zero3`` where it is None or an int >= 1 (the ranks DeepSpeed ZeRO-3 shards over), else ValueError."""
    return None if zero3 is None else check_count(zero3, "zero3")


def whole_shape(t: torch.Tensor) -> torch.Size:
    """The shape of ``t`` gathered: a ZeRO-3 parameter's ``ds_shape`` (its ``shape`` is its local
    placeholder's, empty while released), else its own."""
    shape = getattr(t, "ds_shape", None)
    return torch.Size(shape) if shape is not None else t.shape


def is_sharded(model) -> bool:
    """Whether ZeRO-3 holds ``model``'s parameters sharded."""
    return any(hasattr(p, "ds_shape") for p in model.parameters())


def without_engine_hooks(model) -> None:
    """Removes DeepSpeed's module hooks from ``model`` (a copy: they would gather and release the
    original's parameters, through its coordinator)."""
    for m in model.modules():
        for name in _HOOK_DICTS:
            hooks = getattr(m, name, None)
            for key in [k for k, fn in (hooks or {}).items() if getattr(fn, "__module__", "").startswith("deepspeed.")]:
                del hooks[key]


def sharded(static, model, blocks: list, ranks: int):
    """``static`` (gradaccel/memory/fixed_parts.py's ``Static``) as one of ``ranks`` ZeRO-3 ranks holds it.

    Args:
        static: the fixed parts of one process holding the whole model.
        model: the model, and ``blocks``, its blocks (:func:`gathered_at_once`).
        ranks: the ranks the parameters are sharded over.

    Returns:
        A ``Static`` whose weights, gradient partition, fp32 masters, optimizer state and update
        working set are 1/``ranks``, with ``gathered`` what is whole at once (:func:`gathered_at_once`).
    """
    def share(n: int) -> int:
        return math.ceil(n / ranks)

    return dataclasses.replace(static, weights=share(static.weights), buffer=share(4 * static.trainable),
                               state=share(static.state), masters=share(4 * static.trainable),
                               step=share(static.step), gathered=gathered_at_once(model, blocks), ranks=ranks)


def gathered_at_once(model, blocks: list) -> int:
    """The most parameter bytes whole at once: a block's (gradaccel's replay gathers a block), or
    a module's outside the blocks (ZeRO-3 gathers each for its forward and backward: the embedding,
    the LM head), the larger, at their whole shapes."""
    inside = {id(m) for b in blocks for m in b.modules()}

    def nbytes(params):
        return sum(whole_shape(p).numel() * p.element_size() for p in params)

    return max([nbytes(b.parameters()) for b in blocks]
               + [nbytes(m.parameters(recurse=False)) for m in model.modules() if id(m) not in inside], default=0)


def parts(static) -> dict:
    """The fixed parts as the fit's table names them, under ZeRO-3 over ``static.ranks`` ranks."""
    n = static.ranks
    return {f"weights (1/{n} of each, ZeRO-3)": static.weights,
            "weights gathered whole at once (ZeRO-3)": static.gathered,
            f"gradient partition (fp32, 1/{n}, DeepSpeed's)": static.buffer,
            f"optimizer state (1/{n})": static.state,
            f"fp32 master weights (1/{n}, DeepSpeed's)": static.masters}
