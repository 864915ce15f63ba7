"""A fitted plan (:class:`Fit`): the micro-batch, accumulation steps and per-block settings the fit
chose, its predicted peak part by part, how to apply it to a model (checked against what it was
made for: gradaccel/memory/fit_check.py), and its table. Made by gradaccel/memory/fit.py.
"""

import dataclasses

import torch
import torch.nn as nn

from gradaccel.accumulate.optimizer import FusedAccumOptimizer
from gradaccel.memory.chunked_loss import install_head
from gradaccel.memory import fit_table
from gradaccel.memory.fit_check import MicroBatchGuard, check
from gradaccel.memory.fit_lengths import FittedLengths
from gradaccel.memory.parking import HOST
from gradaccel.memory.profile import find_blocks
from gradaccel.memory.target import set_plans
from gradaccel.recompute import blocks as blocks_mod

__all__ = ["Fit"]


@dataclasses.dataclass
class Fit:
    """A training configuration and its predicted peak. See :func:`fit`."""

    seq: int
    micro_batch: int
    accum_steps: int
    budgets: list  # per block, its plan's setting: an int budget (bytes) for gradaccel.checkpoint, or a plan named
    # in parts.py (gradaccel/recompute/block_plan.py's BlockPlan.parse reads them)
    kept: int  # bytes the blocks keep in total beyond their inputs
    peak: int  # predicted peak of the step, slack excluded
    parts: dict  # what the peak is made of (bytes)
    phase: str
    time: float  # predicted step time relative to the same micro-batch without checkpointing
    recompute_flops: int  # per micro-batch
    step_cost: float = 0.0  # planner's cost units per optimizer step (what the fit minimises)
    measured_cost: float = 0.0  # the part of step_cost priced by a measured speed (copies to host memory)
    memory: int | None = None  # the target, if fitted to one
    slack: int = 0
    fits: bool = True
    suggestions: list = dataclasses.field(default_factory=list)
    host: dict = dataclasses.field(default_factory=dict)  # bytes held in host memory, not in ``peak``
    offload: bool = False  # the blocks run gradaccel.checkpoint(..., offload=True)
    inputs_on_host: bool = False  # the blocks' inputs wait on the host (checkpoint_blocks(inputs_on_host=True))
    chunked_loss: bool = False  # the LM loss in chunks, no whole logits made (gradaccel/memory/chunked_loss.py)
    options: list = dataclasses.field(default_factory=list)  # other plans worth knowing (Fit each)
    longer: tuple | None = None  # max_seq: (the first length found not to fit, its least predicted peak)
    parts_notes: list = dataclasses.field(default_factory=list)  # how blocks run as parts (parts.structure_notes)
    made_for: dict = dataclasses.field(default_factory=dict)  # what apply() checks (gradaccel/memory/fit_check.py)
    why: str = ""  # why this plan and not the next one (gradaccel/memory/fit_choice.py)
    notes: list = dataclasses.field(default_factory=list)  # what the fit did not offer, and why
    zero3: int | None = None  # DeepSpeed ZeRO-3 over this many ranks (gradaccel/memory/zero3.py)
    parking: tuple | None = None  # per block, its role where not every input is parked (gradaccel/memory/parking.py)
    host_memory: int | None = None  # the host budget the plan's host bytes stay within (None: no limit)
    host_note: str = ""  # where the host budget comes from
    host_cost: tuple | None = None  # max_seq: (the longest length without the host budget, its host bytes)
    context: int | None = None  # the model's trained context (its config's max_position_embeddings)

    def apply(self, model: nn.Module, optimizer: torch.optim.Optimizer, force: bool = False, **kwargs):
        """Checkpoints ``model``'s blocks with the fitted budgets (``checkpoint_blocks``: the model
        must not be checkpointed already), computes its loss in chunks if ``chunked_loss``, and
        wraps ``optimizer`` in a ``FusedAccumOptimizer`` of ``accum_steps`` (``kwargs`` go to it).
        Returns both.

        First checks ``model`` and ``optimizer`` against what the plan was made for (trainable
        parameters, 4-bit weights, LoRA rank, the weights' dtype, the number of blocks; see
        gradaccel/memory/fit_check.py) and that the plan fits: one ValueError names every
        difference. ``force=True`` applies it anyway, with a warning. A training call with more
        sequences than ``micro_batch`` raises at its forward (or warns once, forced).

        A training call at another sequence length than ``seq`` (same micro-batch) gets that
        length's own plan, re-planned for the same target from the length profile
        (gradaccel/memory/lengths.py: no fake-tensor run for lengths the fit profiled around, up to
        ``seq``); a length past ``seq`` is profiled once on fake tensors (warned about).
        Plans with offload or inputs on the host keep their budgets at every length. Under
        ``zero3`` the optimizer is returned as it is: DeepSpeed accumulates (``accum_steps`` is its
        ``gradient_accumulation_steps``) and holds the gradient."""
        check(self, model, optimizer, len(find_blocks(model)), force)
        if self.chunked_loss and not install_head(model):
            raise ValueError("this plan computes the loss in chunks (chunked_loss), which needs a Hugging Face "
                             "causal LM with its stock loss")
        blocks_mod.install(model, offload=self.offload, inputs_on_host=self.inputs_on_host)
        blocks = find_blocks(model)
        set_plans(model, blocks, self.chunked_loss, self.budgets,
                  (self.parking or (HOST,) * len(blocks)) if self.inputs_on_host else None)
        model.register_forward_pre_hook(MicroBatchGuard(self.micro_batch, force), with_kwargs=True)
        planner = getattr(self, "_planner", None)  # set by Planner.fit; not a field (to_dict)
        if planner is not None and not (self.offload or self.inputs_on_host) and self.memory is not None:
            planner.lengths(self.seq, self.micro_batch, self.chunked_loss)  # profiled now, not mid-training
            model.register_forward_pre_hook(FittedLengths(self, planner, blocks), with_kwargs=True)
        if not isinstance(optimizer, FusedAccumOptimizer) and not self.zero3:
            optimizer = FusedAccumOptimizer(optimizer, self.accum_steps, **kwargs)
        return model, optimizer

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        """The plan and its breakdown, as a readable table (gradaccel/memory/fit_table.py)."""
        return fit_table.table(self)

    def modes(self) -> str:
        """Each block's plan, runs of equal plans together: "0-13: keep up to 1.00 KiB; 14-31: parts"."""
        return fit_table.modes(self)

    def summary(self) -> str:
        """One line: micro-batch, offload, predicted device peak, host bytes and step time."""
        return fit_table.summary(self)
