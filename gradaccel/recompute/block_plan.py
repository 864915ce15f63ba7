"""One block's plan, typed: what a checkpointed block runs (:class:`BlockPlan`), held in one place.

A block that ``checkpoint_blocks`` checkpoints (either route: gradaccel/recompute/blocks.py)
holds its plan as one attribute, written by :func:`set_plan` alone and read by
:func:`plan_of`: the checkpointed forward (blocks.py), the parts (gradaccel/memory/parts.py),
the sliced forward (gradaccel/memory/sliced.py) and the parking (gradaccel/memory/parking.py)
read it. ``checkpoint_blocks`` sets it at install (its ``budget``, ``cost``, ``offload``,
``inputs_on_host``); ``memory=`` and ``Fit.apply`` set it per block (gradaccel/memory/target.py's
``set_plans``). A Hugging Face layer holds one only once ``memory=`` or a fit planned it; until
then the model's checkpoint function's settings apply.

Users and saved fits see a plan as its *setting* (``Fit.budgets``, ``estimate(budget=...)``,
``python -m gradaccel.fit --json``): an int of bytes (or a float share) for a checkpoint budget,
``None`` (or the profile's ``"all"``) for no checkpoint, ``"parts"``, ``"tiles:n"``,
``"nested:n"``, ``"sliced:n"``, or ``("offload", n)``. :meth:`BlockPlan.parse` reads every form
(the only place that does) and :meth:`BlockPlan.to_setting` writes it back.
"""

import dataclasses
import enum
import math

__all__ = ["Mode", "BlockPlan", "plan_of", "set_plan", "HOST", "DEVICE", "PAIR", "PAIRED", "PARKED"]

ATTR = "_gradaccel_plan"  # the one attribute a block's plan lives in

# Where a checkpointed block's input waits between its forward and its backward
# (gradaccel/memory/parking.py describes the layouts).
HOST, DEVICE, PAIR, PAIRED = "host", "device", "pair", "paired"
PARKED = (HOST, PAIR)  # roles whose input goes to the host
ROLES = (HOST, DEVICE, PAIR, PAIRED)


class Mode(enum.Enum):
    """How a block runs in training."""

    BUDGET = "budget"  # gradaccel.checkpoint at ``budget``
    NONE = "none"  # no checkpoint: it recomputes nothing
    PARTS = "parts"  # no checkpoint of its own; its parts (attention, MLP) keep-nothing checkpoints
    TILES = "tiles"  # parts, a token-wise part ``slices`` slices of the tokens at a time
    NESTED = "nested"  # a keep-nothing checkpoint of the block whose recompute runs it as tiles
    SLICED = "sliced"  # the whole block ``slices`` slices of the sequence at a time, K/V whole


_NAMED = {"tiles": Mode.TILES, "nested": Mode.NESTED, "sliced": Mode.SLICED}  # "name:n" settings


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """What one block runs (see the module docstring).

    Attributes:
        mode: how it runs.
        budget: BUDGET: ``gradaccel.checkpoint``'s budget (None, a float share or an int of
            bytes); NESTED: the budget around its parts (0: keep nothing); else unused.
        slices: PARTS 1; TILES/NESTED: slices of its token-wise parts; SLICED: slices of the
            sequence; else 0.
        offload: its checkpoint may send what the budget leaves out to host memory.
        parking: where its input waits (HOST, DEVICE, PAIR, PAIRED); None: as ``checkpoint_blocks``
            was told (``inputs_on_host``).
        pair: PAIR: the next block, run with this one under one checkpoint; else None.
        cost: ``gradaccel.checkpoint``'s ``cost`` (a Hugging Face layer uses its model's).
        policy: under torch.compile, the selective-checkpoint policy of its plan
            (gradaccel/recompute/compiled.py), else None.
    """

    mode: Mode = Mode.BUDGET
    budget: object = None
    slices: int = 0
    offload: bool = False
    parking: str | None = None
    pair: object = dataclasses.field(default=None, repr=False)
    cost: object = "flops"
    policy: object = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if not isinstance(self.mode, Mode):
            raise TypeError(f"mode must be a Mode, got {self.mode!r}")
        if self.parking is not None and self.parking not in ROLES:
            raise ValueError(f"parking must be one of {ROLES} or None, got {self.parking!r}")
        if (self.pair is not None) != (self.parking == PAIR):
            raise ValueError("pair: the next block, given exactly when parking is 'pair'")

    @classmethod
    def parse(cls, value) -> "BlockPlan":
        """The plan a setting names (see the module docstring); a BlockPlan is returned as is.

        Args:
            value: an int of bytes >= 0 or a float in [0, 1] (a checkpoint budget), None or
                ``"all"`` (no checkpoint), ``"parts"``, ``"tiles:n"``, ``"nested:n"``,
                ``"sliced:n"`` (n >= 1), or ``("offload", budget)`` (a list too, as JSON has it).

        Returns:
            BlockPlan: its mode and numbers; offload, parking and cost at their defaults but
            for ``("offload", n)``.

        Raises:
            ValueError: any other value.
        """
        if isinstance(value, BlockPlan):
            return value
        if value is None or value == "all":
            return cls(Mode.NONE)
        if value == "parts":
            return cls(Mode.PARTS, slices=1)
        if isinstance(value, str):
            name, _, n = value.partition(":")
            if name in _NAMED and n.isdigit() and int(n) >= 1 and str(int(n)) == n:
                return cls(_NAMED[name], budget=0 if name == "nested" else None, slices=int(n))
        elif isinstance(value, (tuple, list)) and len(value) == 2 and value[0] == "offload" and _budget(value[1]):
            return cls(Mode.BUDGET, budget=value[1], offload=True)
        elif _budget(value):
            return cls(Mode.BUDGET, budget=value)
        raise ValueError(f"a block's plan must be an int of bytes >= 0, a float in [0, 1], None, 'all', 'parts', "
                         f"'tiles:n', 'nested:n', 'sliced:n' (n >= 1) or ('offload', budget), got {value!r}")

    def to_setting(self):
        """The plan as :meth:`parse` reads it: an int/float budget, ``("offload", budget)``,
        None, ``"parts"``, ``"tiles:n"``, ``"nested:n"`` or ``"sliced:n"``."""
        if self.mode is Mode.BUDGET:
            return ("offload", self.budget) if self.offload else self.budget
        if self.mode is Mode.NONE:
            return None
        if self.mode is Mode.PARTS:
            return "parts"
        return f"{self.mode.value}:{self.slices}"

    def __str__(self):
        return str(self.to_setting())

    @property
    def checkpointed(self) -> bool:
        """Whether the block runs inside a checkpoint of its own (BUDGET, NESTED)."""
        return self.mode in (Mode.BUDGET, Mode.NESTED)

    @property
    def as_parts(self) -> bool:
        """Whether its parts run as checkpoints of their own (PARTS, TILES, NESTED)."""
        return self.mode in (Mode.PARTS, Mode.TILES, Mode.NESTED)

    @property
    def parked(self) -> bool | None:
        """Whether its input waits on the host (None: as ``checkpoint_blocks`` was told)."""
        return None if self.parking is None else self.parking in PARKED

    @property
    def traced(self) -> tuple:
        """What of the plan a trace of the block depends on (gradaccel/recompute/checkpoint.py's
        state): all but the budget (keyed as the budget) and the compiled policy."""
        return self.mode.value, self.slices, self.offload, self.parking, self.cost if isinstance(self.cost, str) else None

    def run_as(self, other: "BlockPlan") -> "BlockPlan":
        """This plan's parking and cost (set at install or by the parking) with ``other``'s
        mode, budget and slices; offload if either offloads."""
        return dataclasses.replace(self, mode=other.mode, budget=other.budget, slices=other.slices,
                                   offload=self.offload or other.offload, policy=None)


def _budget(value) -> bool:
    """Whether ``value`` is a checkpoint budget of a setting: an int >= 0 or a float in [0, 1]."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    return isinstance(value, float) and not math.isnan(value) and 0.0 <= value <= 1.0


def plan_of(block) -> BlockPlan | None:
    """``block``'s plan, or None where it has none (a Hugging Face layer nothing planned)."""
    return block.__dict__.get(ATTR) if block is not None else None


def set_plan(block, plan: BlockPlan | None) -> None:
    """Gives ``block`` ``plan`` (None: takes its plan away): the one writer of a block's plan.
    An equal plan already held is kept, so that torch.compile's guards see the same object."""
    if plan is None:
        block.__dict__.pop(ATTR, None)
    elif not isinstance(plan, BlockPlan):
        raise TypeError(f"plan must be a BlockPlan, got {type(plan).__name__}")
    elif block.__dict__.get(ATTR) != plan:
        # A plain __dict__ entry: a plan holds a pair's next block, which must not become a child.
        block.__dict__[ATTR] = plan
