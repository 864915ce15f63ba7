"""The vocabulary of plans (gradaccel/recompute/plan.py): where replay finds each tensor it reads.

An enum per question and a small frozen record, as torch's ``CheckpointPolicy`` names what its
selective checkpoint does with each op's output.
"""

import dataclasses
import enum
from typing import Any


class Source(enum.Enum):
    """Where a call finds a storage that replay starts from (a leaf of the replay program)."""

    ARG = "arg"  # an argument of the region
    OBJ = "obj"  # a tensor the region read from outside its arguments (a closure, a global)
    PACK = "pack"  # a saved tensor the forward kept
    OUT = "out"  # an output of the region
    OFFLOAD = "offload"  # a saved tensor sent to host memory


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A leaf's source, and ``at``: the index among the flattened arguments (ARG), a weak
    reference to the tensor (OBJ), the pack index (PACK), the index among the flattened outputs
    (OUT) or the storage id (OFFLOAD)."""

    source: Source
    at: Any


class Read(enum.Enum):
    """Where a replayed op's tensor argument comes from."""

    LEAF = "leaf"  # a leaf (see Leaf)
    REPLAY = "replay"  # the output of an op replayed before it
    META = "meta"  # nowhere: the op reads only its metadata, so an uninitialised stand-in does
