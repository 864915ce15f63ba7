"""The recompute cost model: what replaying one traced op costs, as ``checkpoint(cost=...)`` chooses.

Every op of a region is priced once, in its traced call, and the price stays with the trace and
its plan (see the ``cost`` argument of :func:`gradaccel.checkpoint` for the three models).
Offload's copies are priced in the same units (gradaccel/recompute/plan.py ``offload_cost_per_byte``).
"""

import dataclasses
import math
import numbers
import time

import torch
from torch.utils._pytree import tree_flatten

# Machine balance of the "flops" model: one byte moved costs as much as this many FLOPs.
FLOPS_PER_BYTE = {"cpu": 8.0, "cuda": 100.0}
MODELS = ("flops", "measured")
# The round trip a cost callable prices for offload: bytes sent to host memory and back.
OFFLOAD_PROBE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class OpCost:
    """What a ``cost`` callable is told about one op of a traced region (see
    :func:`gradaccel.checkpoint`).

    Attributes:
        name: the op, e.g. ``"aten.mm.default"``; ``"gradaccel.offload"`` for the round trip of
            ``bytes`` bytes to host memory and back that ``offload=True`` prices.
        flops: its FLOPs by torch's formula (0 for elementwise ops and data movement; for an op
            outside aten, estimated from its time or bounded: see ``plan_rows()['priced_ops']``).
        bytes: the bytes it reads and writes (tensor arguments and outputs).
        device: the device of its first tensor argument (CPU for an op with none).
    """

    name: str
    flops: int
    bytes: int
    device: torch.device


def check_cost(cost):
    """``"flops"``, ``"measured"`` or a hashable callable; else ValueError/TypeError naming ``cost``."""
    if isinstance(cost, str):
        if cost not in MODELS:
            raise ValueError(f"cost must be 'flops', 'measured' or a callable, got {cost!r}")
        return cost
    if not callable(cost):
        raise TypeError(f"cost must be 'flops', 'measured' or a callable, got {type(cost).__name__}")
    try:
        hash(cost)
    except TypeError:
        raise TypeError("cost must be hashable (it is part of the plan cache's key), "
                        f"got an unhashable {type(cost).__name__}") from None
    return cost


def price(cost, op: OpCost, seconds: float | None) -> float:
    """The cost of ``op`` under the model ``cost``; ``seconds``: its time in the traced call
    (required by ``"measured"``)."""
    if isinstance(cost, str) and cost == "flops":
        balance = FLOPS_PER_BYTE["cpu" if op.device.type == "cpu" else "cuda"]
        return op.flops + balance * op.bytes
    if isinstance(cost, str):  # "measured"
        return seconds
    value = cost(op)
    # bool is an int to Python, and almost certainly a bug here.
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < math.inf:
        raise ValueError(f"cost returned {value!r} for {op.name}: it must return a finite float >= 0")
    return float(value)


def run_timed(func, args, kwargs, sync: bool):
    """``(func(*args, **kwargs), seconds)``. With ``sync``, the CUDA devices its tensors are on
    are synchronised before and after, so that ``seconds`` is the kernel's time (``"measured"``);
    without, ``seconds`` is None where an output is off the CPU (a host timer misses the kernel)."""
    before = _devices((args, kwargs), "cuda") if sync else set()
    for d in before:
        torch.cuda.synchronize(d)
    t0 = time.perf_counter()
    out = func(*args, **kwargs)
    if sync:
        for d in _devices(out, "cuda") | before:
            torch.cuda.synchronize(d)
    seconds = time.perf_counter() - t0
    if not sync and any(d.type != "cpu" for d in _devices(out)):
        return out, None
    return out, seconds


def _devices(tree, kind=None) -> set:
    return {t.device for t in tree_flatten(tree)[0]
            if isinstance(t, torch.Tensor) and (kind is None or t.device.type == kind)}
