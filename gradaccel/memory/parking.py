"""Which blocks' inputs wait on the host, within the host memory the machine has.

``inputs_on_host`` (gradaccel/recompute/host_inputs.py) parks a checkpointed block's input in
pinned host memory from the end of its forward to the start of its backward: one hidden state per
block (8 KiB a token for Llama-3.1-8B in bf16: 32 GiB over 32 blocks at 128K tokens). Pinned
memory is the machine's RAM, and there is only so much of it: a plan's parked bytes stay within a
host budget (:func:`host_budget`: by default this machine's available memory less a margin).
Where parking every block's input would go over it, each block gets a role:

- ``HOST``: its input is parked (``inputs_on_host``);
- ``DEVICE``: its input stays on the device, as a checkpoint without ``inputs_on_host`` holds it;
- ``PAIR`` and ``PAIRED``: two consecutive blocks nested under one keep-nothing checkpoint whose
  input alone is parked (gradaccel/memory/sliced.py runs them: both blocks sliced). The second
  block's input is not held at all; backward runs both blocks' forwards once more to rebuild it.

:func:`parkings` lists the layouts worth planning under a budget: every block parked where that
fits; else, for each number of pairs (first in the model), the remaining blocks parked in order
while the budget lasts, the rest on the device (last: their inputs are live for the fewest
phases). Fewer pairs recompute less; more pairs hold less on the device. The split plans each
(gradaccel/memory/split.py, on the profile's step terms for that layout:
``Profile.step_terms``), and the fit keeps the one with the least recompute that fits.
"""

import dataclasses

from gradaccel.memory.counter import format_bytes, parse_bytes
from gradaccel.memory.sliced import why_not
# The roles are a block plan's parking (gradaccel/recompute/block_plan.py).
from gradaccel.recompute.block_plan import DEVICE, HOST, PAIR, PAIRED, PARKED, BlockPlan, plan_of, set_plan

__all__ = ["HOST", "DEVICE", "PAIR", "PAIRED", "PARKED", "host_budget", "default_host_memory", "parkings",
           "parked", "layouts", "describe", "check_roles", "parked_plan", "set_parking"]
MARGIN = (0.10, 2 << 30)  # of the available memory kept for everything else: a share, and at least this


def _available() -> int | None:
    """This machine's available memory in bytes (Linux ``MemAvailable``; else psutil's), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


def default_host_memory() -> tuple:
    """``(bytes, how)``: the host memory a plan may pin by default, this machine's available
    memory less a margin (10 %, and at least 2 GiB), and a line saying so. Where the available
    memory cannot be read, no limit (``None``)."""
    available = _available()
    if available is None:
        return None, "no limit: this machine's available memory could not be read"
    margin = max(int(available * MARGIN[0]), MARGIN[1])
    budget = max(0, available - margin)
    return budget, (f"this machine's available memory ({format_bytes(available)}) less "
                    f"{format_bytes(margin)}")


def host_budget(value) -> tuple:
    """``(bytes or None, how)`` for a ``host_memory`` argument: bytes or a string such as
    ``"64GiB"`` (given), ``None`` (:func:`default_host_memory`), or ``float("inf")`` (no limit)."""
    if value is None:
        return default_host_memory()
    if isinstance(value, float) and value == float("inf"):
        return None, "no limit"
    return parse_bytes(value, "host_memory"), "given"


def parkings(inputs: list, budget, can_pair: list) -> list:
    """The layouts of roles worth planning (see the module docstring), each a tuple of one role
    per block, whose parked bytes fit ``budget`` (None: no limit).

    Args:
        inputs: per block, the bytes its input takes on the host if parked (0 where it would stay:
            a leaf that requires grad, a small input).
        budget: the bytes the parked inputs may take, or None.
        can_pair: per block, whether it may be one of a pair (it runs sliced).
    """
    n = len(inputs)
    if budget is None or sum(inputs) <= budget:
        return [(HOST,) * n]
    out = []
    for p in range(n // 2 + 1):
        roles = []
        while len(roles) < 2 * p:
            i = len(roles)
            if i + 1 >= n or not (can_pair[i] and can_pair[i + 1]):
                return out
            roles += [PAIR, PAIRED]
        used = sum(inputs[i] for i, r in enumerate(roles) if r == PAIR)
        for i in range(len(roles), n):
            fits = used + inputs[i] <= budget and DEVICE not in roles
            roles.append(HOST if fits else DEVICE)
            used += inputs[i] if fits else 0
        if used <= budget:
            out.append(tuple(roles))
        if DEVICE not in roles:
            break  # more pairs would only recompute more
    return out


def layouts(prof, budget, layout=None) -> list:
    """:func:`parkings` for a profile's blocks (``layout``: the model's blocks as profiled ones,
    ``Profile.step_terms``'), with ``True`` for the layout that parks every input."""
    layout = list(range(len(prof.blocks))) if layout is None else list(layout)
    inputs = [prof.parked_bytes(s) for s in layout]
    found = parkings(inputs, budget, [why_not(prof.blocks[s]) is None for s in layout])
    return [True if all(r == HOST for r in roles) else roles for roles in found]


def parked(roles, inputs: list) -> int:
    """Bytes the blocks in ``roles`` park on the host."""
    return sum(b for r, b in zip(roles, inputs) if r in PARKED)


def describe(roles) -> str:
    """``roles`` in a few words: "all parked", or runs such as "0-3 in pairs; 4-27 parked; 28-31 on device"."""
    if all(r == HOST for r in roles):
        return "all parked"
    names = {HOST: "parked", DEVICE: "on device", PAIR: "in pairs", PAIRED: "in pairs"}
    runs = []
    for i, r in enumerate(roles):
        if runs and runs[-1][2] == names[r]:
            runs[-1][1] = i
        else:
            runs.append([i, i, names[r]])
    return "; ".join((f"{a}" if a == z else f"{a}-{z}") + f" {name}" for a, z, name in runs)


def check_roles(roles, n: int) -> tuple:
    """``roles`` as a tuple of ``n`` roles, each a pair's first only before its second; else ValueError."""
    roles = tuple(roles)
    if len(roles) != n:
        raise ValueError(f"roles: {len(roles)} given for {n} blocks")
    for i, role in enumerate(roles):
        if role not in (HOST, DEVICE, PAIR, PAIRED):
            raise ValueError(f"roles[{i}] must be one of {HOST!r}, {DEVICE!r}, {PAIR!r}, {PAIRED!r}, got {role!r}")
        if role == PAIR and (i + 1 == len(roles) or roles[i + 1] != PAIRED):
            raise ValueError(f"roles[{i}] is {PAIR!r}: the next block must be {PAIRED!r}")
    return roles


def parked_plan(plan: BlockPlan, blocks: list, i: int, role: str) -> BlockPlan:
    """Block ``i``'s ``plan`` with its input waiting as ``role`` says: a pair's first block runs
    both under one checkpoint (gradaccel/memory/sliced.py); the second then hands its input,
    the pair's output, on."""
    return dataclasses.replace(plan, parking=role, pair=blocks[i + 1] if role == PAIR else None)


def set_parking(blocks: list, roles) -> None:
    """Sets where each of ``blocks``' inputs waits between forward and backward: its role in
    ``roles`` (one per block), in the plan each already holds (``set_plans`` gives them one)."""
    roles = check_roles(roles, len(blocks))
    for i, (block, role) in enumerate(zip(blocks, roles)):
        plan = plan_of(block)
        if plan is None:
            raise ValueError(f"blocks[{i}] has no plan to park: give the blocks plans first (set_plans)")
        block.__dict__.pop("_gradaccel_pending", None)
        set_plan(block, parked_plan(plan, blocks, i, role))
