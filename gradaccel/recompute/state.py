"""gradaccel's module-level state, in one registry: :meth:`State.reset` clears all of it, and
``gradaccel.reset_plans()`` calls it.

Not here, on purpose: what lives only while a forward runs (gradaccel/recompute/split_off.py's stack of active
frames), facts about the machine (measured copy speeds), loaded libraries (gradaccel/ops/accumulate.py) and
the checkpointed block classes of gradaccel/recompute/blocks.py (a class, once made, must stay the same).
"""

import warnings
import weakref


class State:
    """Plans, warnings given once, and offload's host-buffer stores."""

    def __init__(self):
        self.regions = weakref.WeakKeyDictionary()  # owner (module or function) -> {signature: region.Region}
        self.shapes = weakref.WeakKeyDictionary()  # owner -> {structure key: structure.Structure}
        self.kinds: dict = {}  # module kind -> size formulas that modules of that kind share
        self.in_order: list = []  # weak references to every region, in creation order (plan_rows)
        self.warned: set = set()  # tags of the warnings given once
        self.stores: dict = {}  # host_budget -> ActivationStore, shared by every region that offloads
        self.previous_offload = None  # weak reference to the last frame that offloaded (prefetched next)

    def reset(self) -> None:
        """Forgets every plan and warning, and gives the stores' idle host buffers back to the
        system (buffers still holding a live frame's tensors go when that frame's graph dies)."""
        self.regions.clear()
        self.shapes.clear()
        self.kinds.clear()
        self.in_order.clear()
        self.warned.clear()
        for store in self.stores.values():
            store.trim()
        self.stores.clear()
        self.previous_offload = None


STATE = State()


def warn_once(tag, message: str) -> None:
    """Warns ``message`` (a UserWarning) the first time ``tag`` is seen since the last reset.

    Args:
        tag: a hashable naming the warning and what it is about (``("fits", region name)``).
        message: the warning's text.
    """
    if tag not in STATE.warned:
        STATE.warned.add(tag)
        warnings.warn(message, UserWarning, stacklevel=3)
