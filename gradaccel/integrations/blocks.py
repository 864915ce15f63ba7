"""``gradaccel.checkpoint_blocks``: checkpoint every repeated block of a model, at a per-block
``budget`` or to one ``memory`` target for the whole training step.

The blocks are found and wrapped by gradaccel/recompute/blocks.py; a ``memory`` target is planned
at the first training call by gradaccel/memory/target.py.
"""

import torch.nn as nn

from gradaccel.memory.counter import check_count, parse_bytes
from gradaccel.memory.profile import find_blocks
from gradaccel.memory.target import MemoryTarget
from gradaccel.recompute import blocks

__all__ = ["checkpoint_blocks"]


def checkpoint_blocks(model, budget=None, block_types=None, memory=None, cost="flops", offload=False, seq=None,
                      inputs_on_host=False, host_memory=None):
    """Checkpoint each repeated block of ``model`` in place, through ``gradaccel.checkpoint``.

    In training mode with grad enabled, each block's forward runs inside
    ``gradaccel.checkpoint(..., budget=budget)``; in eval mode or under ``torch.no_grad()`` it
    runs as before, so ``model.eval()`` and ``generate()`` keep working. Outputs and gradients are
    those of the model without checkpointing.

    Which blocks:

    - A Hugging Face ``PreTrainedModel`` with ``supports_gradient_checkpointing`` goes through its
      own hook (``_set_gradient_checkpointing(gradient_checkpointing_func=...)``), which picks its
      layers itself, plus ``enable_input_require_grads()`` for models fed ``input_ids``. (Remote
      code that overrides that hook with its pre-4.35 signature is handled as a plain model.) A plain
      module holding such models (a custom head around ``AutoModel``) gets the same treatment for
      each of them when ``block_types`` is None.
    - Any other model: every outermost module matching ``block_types``, or if that is None the
      entries of the ``nn.ModuleList`` objects whose entries all have one class, for the class
      whose lists hold the most parameters (all of them: a model in stages has every block
      found, inside its lists of lists). The block's class is swapped for a subclass whose
      ``forward`` is checkpointed; its parameters and ``state_dict`` keys do not change, and
      module hooks run outside the checkpointed region (once per step, not again during
      recompute).
      ``state_dict()``, ``copy.deepcopy`` and ``torch.save(model)`` keep working.

    Hugging Face checkpointing already on (turned on by peft's ``prepare_model_for_kbit_training``,
    Trainer or TRL) is taken over: the layers it checkpoints now run ``gradaccel.checkpoint`` at
    ``budget`` instead of torch's, once, and a later ``activation_checkpointing_enable()`` /
    ``gradient_checkpointing_enable()`` on the model installs gradaccel's too (see
    :func:`release` to undo). Calling it again on a model it already checkpoints, or on one
    wrapped by torch's ``checkpoint_wrapper``, raises ``RuntimeError`` (use :func:`set_budget` to
    change the budget); finding no block raises ``ValueError``. Nothing is ever wrapped twice.

    Args:
        model (nn.Module): the model, changed in place.
        budget (None | float | int): per block, as :func:`gradaccel.checkpoint` defines it (``None``
            keeps nothing inside a block: ``torch.utils.checkpoint``'s memory).
        block_types (None | type | str | sequence of them): block classes, or class names such as
            ``"LlamaDecoderLayer"``. Must be None for Hugging Face models that support
            gradient checkpointing (their own hook picks the layers).
        memory (None | int | str): instead of ``budget``, one memory target for the training step,
            in bytes or as a string such as ``"6GiB"``: the most bytes one forward and backward
            may add above what exists before it (activations held for backward, backward's working
            set and the parameters' gradients, as ``gradaccel.memory.LiveBytes`` counts them). At
            the first training call for an input shape the model is profiled on fake tensors and
            the plan with the least recompute whose peak fits is chosen: per block, a checkpoint
            budget or the block's parts as their own checkpoints, split on the peak's own terms
            (gradaccel/memory/split.py), and a causal LM's loss computed in chunks without the
            whole logits where the loss would set the peak (see gradaccel/memory/target.py; the
            training call's ``outputs.logits`` is then a stand-in that raises when read).
            ``model.train()`` with a loss the model computes (``labels``) is what is profiled;
            for a plain module, its output summed.
        seq (None | int): with ``memory``, the longest sequence length training will see (TRL's
            ``max_length``, a tokenizer's truncation length). The first training call profiles
            lengths from 8 tokens up to ``seq``, and every length in that range is then planned
            with no fake-tensor run. None: the range is the longest length seen so far, and a
            longer one is profiled once more when it comes (seconds, mid-training). See
            docs/memory-lengths.md.
        cost ("flops" | "measured" | callable): the recompute cost model, as in
            :func:`gradaccel.checkpoint`.
        offload (bool): as in :func:`gradaccel.checkpoint`: what a block's budget leaves out may
            go to host memory where copying beats recomputing (``gradaccel.fit`` proposes it).
        inputs_on_host (bool): each checkpointed block's input (its hidden state, the one tensor a
            keep-nothing block holds between forward and backward) waits in pinned host memory
            from the end of the block's forward until its backward starts, copied on a side
            stream and brought back one block ahead (gradaccel/recompute/host_inputs.py). Device
            memory drops by one hidden state per block; ``gradaccel.fit`` chooses it where only
            then a plan fits. Blocks run as their parts (``memory=`` below the per-block floor)
            keep their inputs.
        host_memory (None | int | str): with ``memory``, the most host memory the parked inputs may
            take (default: this machine's available memory less a margin). Where parking every
            block's input would go over it, ``memory=`` parks fewer, or nests two blocks under
            one parked input, whichever recomputes less (gradaccel/memory/parking.py).

    Returns:
        nn.Module: ``model`` itself.

    Raises:
        ValueError: bad ``budget``, ``cost``, ``memory`` or ``seq`` (or both budget and memory given, or
            ``seq`` without ``memory``), no block found, or ``block_types``
            given for a Hugging Face model.
        RuntimeError: ``model`` is already checkpointed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if memory is not None:
        if budget is not None:
            raise ValueError("give checkpoint_blocks either budget (per block) or memory (for all blocks), not both")
        memory = parse_bytes(memory, "memory")
        budget = 0  # keep nothing until the first training call splits memory across the blocks
    if host_memory is not None and memory is None:
        raise ValueError("host_memory is what memory= plans may pin on the host: give it with memory=")
    if seq is not None:
        if memory is None:
            raise ValueError("seq is the longest length memory= plans for: give it with memory=")
        check_count(seq, "seq")
    blocks.install(model, budget, block_types, cost, offload, inputs_on_host)
    if memory is not None:
        model.register_forward_pre_hook(MemoryTarget(memory, find_blocks(model), model, seq, inputs_on_host,
                                                     host_memory), with_kwargs=True)
    return model
