"""Memory accounting, one place for every count of bytes: live tensor bytes and their peak, the
storages a forward leaves alive for backward, and a training step's fixed parts.

:class:`LiveBytes` counts the bytes of tensor storages created while it is active and still
alive (a weak reference on each storage tells it when one dies), and the peak of that count,
per phase. It runs the same on real tensors (the measured peak of a training step on CPU) and
on fake ones (``FakeTensorMode``: a full-size model without allocating), which is how
:mod:`gradaccel.fit` predicts a step's peak from a step it does not run.

What it counts: storages made by aten ops, each once however many views share it. What it
cannot see: scratch memory an op allocates and frees inside its kernel, and the allocator's
own slack (rounding, fragmentation, the CUDA context); :mod:`gradaccel.fit` states those apart.

:class:`StorageLog` keeps the storages themselves (weakly) rather than a running count, for a
look at them later at their size then (FSDP2 frees a storage by resizing it to 0);
:func:`held_activation_bytes` uses it to measure what a forward holds for backward, as the
checkpoint bench and tests do.
"""

import functools
import re
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten

from gradaccel.recompute import host_inputs as _host_inputs
from gradaccel.recompute.storage import StorageMap, storage_key

__all__ = ["LiveBytes", "Trajectory", "StorageLog", "held_activation_bytes", "measured_peak", "parse_bytes", "check_count",
           "format_bytes", "storage_bytes", "optimizer_state_bytes"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def check_count(value, name: str) -> int:
    """``value`` where it is an int >= 1 (a length, a batch), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def parse_bytes(value, name: str = "memory") -> int:
    """``value`` in bytes: an int, or a string such as ``"24GiB"``, ``"6 GB"``, ``"512MiB"``.

    Raises:
        ValueError: not a non-negative int or such a string (the message names ``name``).
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be bytes (an int) or a string such as '24GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value!r}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"{name} must be bytes (an int) or a string such as '24GiB' or '6GB', got {value!r}")


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared weights once)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                total += st.nbytes()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (the inner optimizer's, for a wrapper)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return storage_bytes(t for s in inner.state.values() for t in tree_flatten(s)[0])


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages created while active that are still alive, and their peak.

    Attributes:
        live: bytes of counted storages alive now.
        peak: the most ``live`` has been since creation or :meth:`reset_peak`, taken after
            every op (its outputs made, its inputs not yet freed).
        phase: a label the caller sets; ``phases[label]`` is ``(live when the phase began,
            peak during it)``.

    A storage that existed before the mode (parameters, inputs) is never counted, even when
    an op returns a view of it or writes it in place. Entered under a ``FakeTensorMode`` it
    counts fake tensors (a profile); entered outside one it counts real tensors only, so a
    fake-tensor run inside a real count (``checkpoint_blocks(memory=...)`` planning in the
    first step's forward) adds nothing, as on the device.
    """

    def __init__(self):
        super().__init__()
        self._real_only = True
        self.live = 0
        self.peak = 0
        self.phase = None
        self.phases: dict = {}
        self._refs: dict = {}
        self._sizes: dict = {}  # storage key -> its bytes now (resized ones differ from at birth)

    def __enter__(self):
        self._real_only = not any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())
        return super().__enter__()

    def set_phase(self, label) -> None:
        self.phase = label
        start, peak = self.phases.get(label, (self.live, 0))
        self.phases[label] = (start, max(peak, self.live))

    def reset_peak(self) -> None:
        self.peak = self.live
        self.phases = {}
        if self.phase is not None:
            self.set_phase(self.phase)

    def _free(self, key, nbytes, _ref) -> None:
        if self._refs.get(key) is _ref:
            del self._refs[key]
            self.live -= self._sizes.pop(key, nbytes)

    def _resized(self, key, delta: int) -> None:
        # A counted storage resized in place (a block input parked on the host and brought
        # back: gradaccel/recompute/host_inputs.py); no aten op does that, so it is told.
        if key in self._refs:
            self._sizes[key] = self._sizes.get(key, 0) + delta
            self.live += delta
            self._note_peak()

    def _note_peak(self) -> None:
        if self.live > self.peak:
            self.peak = self.live
        if self.phase is not None:
            start, peak = self.phases[self.phase]
            if self.live > peak:
                self.phases[self.phase] = (start, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or self._real_only and (isinstance(t, FakeTensor) or t.is_meta):
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in inputs or key in self._refs:
                continue
            n = st.nbytes()
            self._refs[key] = weakref.ref(st, functools.partial(self._free, key, n))
            self._sizes[key] = n
            self.live += n
        self._note_peak()
        return out


def _tell_counters(storage, delta: int) -> None:
    """Every active :class:`LiveBytes` hears of ``storage`` resized by ``delta`` bytes."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, LiveBytes):
            mode._resized(storage._cdata, delta)


_host_inputs.add_resize_listener(_tell_counters)


class Trajectory(LiveBytes):
    """:class:`LiveBytes` that also records the live bytes after every op (``trace``) and where
    each phase was set (``marks``: (index in ``trace``, label))."""

    def __init__(self):
        super().__init__()
        self.trace, self.marks = [], []

    def set_phase(self, label) -> None:
        super().set_phase(label)
        self.marks.append((len(self.trace), label))
        self.trace.append(self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.trace.append(self.live)
        return out


def measured_peak(model, optimizer, step, batch, windows: int = 2, by: str = "live") -> int:
    """The real peak of a training window's memory, on any device.

    Runs ``windows`` windows of ``optimizer.accum_steps`` micro-steps (``step(model, batch)``
    returns the loss; then ``backward``, ``optimizer.step()``, ``zero_grad()``) and returns what
    exists before the last window (parameters, buffers, the fp32 window buffer, optimizer
    state) plus the peak reached during that window above what was allocated when it began.

    Args:
        by: ``"live"``: the bytes of storages aten ops make (:class:`LiveBytes`, what a
            fake-tensor profile counts too); ``"allocator"``: the allocator's own count, which
            also sees what a kernel allocates and frees inside itself (on CPU the profiler's
            memory events, ``torch.profiler.profile(profile_memory=True)``; on CUDA
            ``torch.cuda.max_memory_allocated``): what the device holds.
    """
    if by not in ("live", "allocator"):
        raise ValueError(f"by must be 'live' or 'allocator', got {by!r}")
    accum = getattr(optimizer, "accum_steps", 1)
    inner = getattr(optimizer, "optimizer", optimizer)

    def before():
        return storage_bytes(list(model.parameters()) + list(model.buffers())
                             + [getattr(optimizer, "grad_buffer", None)]
                             + [t for s in inner.state.values() for t in tree_flatten(s)[0]])

    def window():
        for _ in range(accum):
            loss = step(model, batch)
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad()

    if by == "allocator":
        for _ in range(windows - 1):
            window()
        with _AllocatorPeak(next(iter(model.parameters())).device) as counted:
            window()
        return before() + counted.peak  # the optimizer state made in the first window included
    existed = before()
    live = LiveBytes()
    with live:
        for w in range(windows):
            if w == windows - 1:
                live.reset_peak()
            window()
    return existed + live.peak


class _AllocatorPeak:
    """The peak of the device allocator's count while entered, above its count on entry
    (``peak``): CUDA's own statistics, or on CPU the running sum of the profiler's allocation
    and free events (frees of blocks allocated before entry are not reported to it)."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
            return False
        self.prof.__exit__(*exc)
        events = sorted((e.start_ns(), e.nbytes()) for e in self.prof.profiler.kineto_results.events()
                        if e.name() == "[memory]")
        run = 0
        for _, n in events:
            run += n
            self.peak = max(self.peak, run)
        return False


# -- which storages: a log of them, for what a forward leaves alive ---------------------------------
class StorageLog(TorchDispatchMode):
    """Logs every storage created while active (weakly; views and in-place results excluded).

    It is a dispatch mode: code whose behaviour depends on whether one is active (torch's
    selective checkpoint replays ops by index) must see one in its backward too; running that
    backward under another ``StorageLog`` keeps the two passes alike.
    """

    def __init__(self):
        super().__init__()
        self.created = StorageMap()  # storage -> its bytes (while it lives)
        self.largest = 0  # the bytes of the largest storage created, freed since or not

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an input's storage: only new storages count.
        inputs = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                if storage_key(t) not in inputs and self.created.get(t) is None:
                    n = t.untyped_storage().nbytes()
                    self.created.set(t, n)
                    self.largest = max(self.largest, n)
        return out


def held_activation_bytes(fn, *args, **kwargs):
    """Runs ``fn(*args, **kwargs)`` and measures what its forward leaves alive for backward.

    Counts the bytes of storages created inside the forward that are still alive after it,
    each storage once however many views share it, excluding the storages of the outputs
    (the caller holds those) and anything that existed before (parameters, inputs).

    Returns:
        ``(output, bytes)``.
    """
    existing = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    log = StorageLog()
    with log:
        out = fn(*args, **kwargs)
    outputs = {storage_key(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
    held = sum(nbytes for key, nbytes in log.created.items() if key not in outputs and key not in existing)
    return out, held
