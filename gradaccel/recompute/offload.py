"""Activation offload: park saved tensors in host memory and bring them back for backward.

The store (``gradaccel/ops/csrc/store.cpp``, its pool ``gradaccel/ops/csrc/host_pool.cpp``, ``gradaccel/ops/csrc/store_cuda.cpp``) keeps a
pool of host buffers, pinned for CUDA tensors, that is reused from step to step. On CUDA every copy runs on a side stream,
ordered by events: ``offload`` returns before the device-to-host copy ends, ``prefetch``
starts the host-to-device copy early, and only ``fetch`` makes the current stream wait. CPU
tensors run the same logic with plain copies.

Three entry points:

- :class:`ActivationStore`: offload / prefetch / fetch / release by handle (the planner of
  ``gradaccel.checkpoint`` uses it for the tensors it sends to host memory);
- :class:`offload_saved_tensors`: a ``saved_tensors_hooks`` context that offloads every saved
  activation, the asynchronous counterpart of ``torch.autograd.graph.save_on_cpu``;
- :func:`copy_bandwidth`: measured copy speeds, for the planner's cost model.
"""

from __future__ import annotations

import functools
import itertools
import time
import warnings
import weakref

import torch

from gradaccel.ops import extension as _ext
from gradaccel.recompute.storage import lazy_bits

__all__ = ["ActivationStore", "HostAllocationError", "copy_bandwidth", "offload_saved_tensors"]

_ALLOC_FAILED = "gradaccel ActivationStore: could not allocate"


class HostAllocationError(torch.OutOfMemoryError):
    """The system refused host (pinned) memory to the store. Nothing leaked; the store is usable."""


def _store_class():
    _ext.load()
    return torch.classes.gradaccel.ActivationStore


class ActivationStore:
    """A pool of host buffers holding offloaded tensors, addressed by integer handles.

    Life of a handle: ``h = offload(t)`` (the caller may drop ``t`` at once), optionally
    ``prefetch(h)`` ahead of need, ``fetch(h)`` (any number of times), ``release(h)`` once.

    Args:
        host_budget: most bytes of host buffers the store may hold (idle buffers included;
            sizes are rounded up to a size class, at most 12.5 % more). ``None``: no bound.
            When a tensor does not fit, idle buffers are freed first; if it still does not
            fit, :meth:`offload` returns ``None`` and warns once.
        pin_memory: pinned (page-locked) buffers, needed to offload CUDA tensors and to
            copy asynchronously. ``None``: pinned when CUDA is available and gradaccel was
            built with it.
        max_inflight_bytes: most bytes of device-to-host copies in flight. An offloaded
            tensor's device memory is free only once its copy is done, so a forward that runs
            ahead of the copies would still hold it all; past this bound :meth:`offload` waits
            for the oldest copies. ``None``: no bound.

    Raises:
        ValueError: ``host_budget`` or ``max_inflight_bytes`` is not ``None`` or an int >= 0.
    """

    def __init__(self, host_budget: int | None = None, *, pin_memory: bool | None = None,
                 max_inflight_bytes: int | None = 256 << 20):
        for name, value in (("host_budget", host_budget), ("max_inflight_bytes", max_inflight_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be None or an int >= 0 (bytes), got {value!r}")
        cls = _store_class()
        if pin_memory is None:
            pin_memory = bool(_ext.load().with_cuda) and torch.cuda.is_available()
        self.host_budget = host_budget
        self.pin_memory = bool(pin_memory)
        self.max_inflight_bytes = max_inflight_bytes
        self._store = cls(-1 if host_budget is None else host_budget, self.pin_memory,
                          -1 if max_inflight_bytes is None else max_inflight_bytes)
        self._warned = False

    def offload(self, tensor: torch.Tensor) -> int | None:
        """Start copying ``tensor`` into a host buffer.

        Args:
            tensor: a strided CPU or CUDA tensor, any dtype, shape and strides. It is not
                modified; the store copies its values (views are materialized only if their
                layout is not dense).

        Returns:
            A handle for :meth:`prefetch`, :meth:`fetch` and :meth:`release`; or ``None``
            when ``host_budget`` cannot hold the tensor (the caller keeps or recomputes it;
            a ``RuntimeWarning`` says so once per store).

        Raises:
            HostAllocationError: (a ``torch.OutOfMemoryError``) the system refused the host
                memory. Nothing leaks; the store stays usable.
        """
        try:
            handle = self._store.offload(tensor)
        except torch.OutOfMemoryError as exc:  # the store's, or the device's (non-dense input made dense)
            if str(exc).startswith(_ALLOC_FAILED):
                raise HostAllocationError(str(exc)) from None
            raise
        if handle >= 0:
            return handle
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"gradaccel ActivationStore: host_budget={self.host_budget} bytes is exhausted; tensors that do "
                "not fit stay on the device or are recomputed (warned once per store)",
                RuntimeWarning,
                stacklevel=2,
            )
        return None

    def prefetch(self, handle: int) -> None:
        """Start bringing a tensor back to its device now, on a side stream (CUDA), so that
        :meth:`fetch` finds it there. A no-op if it is already staged."""
        self._store.prefetch(handle)

    def fetch(self, handle: int) -> torch.Tensor:
        """The offloaded tensor on its original device.

        Returns:
            A new tensor with the original shape, dtype and bit-exact values; its strides are
            the original ones when the original was dense, contiguous otherwise. On CUDA the
            current stream waits for the copy (the host does not). The handle stays valid
            until :meth:`release`.
        """
        return self._store.fetch(handle)

    def release(self, handle: int) -> None:
        """Give the handle's buffer back to the pool (reused once no copy reads it)."""
        self._store.release(handle)

    def synchronize(self) -> None:
        """Wait for every copy in flight (for tests and measurements)."""
        self._store.synchronize()

    def trim(self) -> int:
        """Free the idle buffers; returns the bytes given back to the system."""
        return self._store.trim()

    def stats(self) -> dict[str, int]:
        """Accounting. Keys: ``handles`` (live), ``bytes_in_use`` (bytes of live tensors),
        ``bytes_reserved`` (all host buffers held), ``bytes_idle``, ``buffers``,
        ``buffers_idle``, ``buffers_pending`` (released, a copy still reads them), ``hits`` /
        ``misses`` (buffer requests served by the pool / by a new allocation), ``waits`` (hits
        that waited for a copy), ``refused`` (host_budget), ``alloc_failures``,
        ``bytes_offloaded`` (total), ``host_budget`` (-1: none), ``pinned``, ``bytes_inflight``
        (device-to-host copies maybe still running), ``throttled`` (times :meth:`offload`
        waited for a copy), ``max_inflight_bytes`` (-1: none)."""
        return dict(self._store.stats())

    @property
    def bytes_in_use(self) -> int:
        """Bytes of the tensors currently offloaded (live handles)."""
        return self.stats()["bytes_in_use"]

    @property
    def bytes_reserved(self) -> int:
        """Bytes of host buffers the store holds, in use or idle (what ``host_budget`` bounds)."""
        return self.stats()["bytes_reserved"]

    @property
    def buffer_count(self) -> int:
        """Host buffers the store holds."""
        return self.stats()["buffers"]

    @property
    def hits(self) -> int:
        """Buffer requests served from the pool."""
        return self.stats()["hits"]

    @property
    def misses(self) -> int:
        """Buffer requests that allocated a new buffer."""
        return self.stats()["misses"]

    def _fail_next_allocations(self, n: int) -> None:
        """Test hook: the next ``n`` host allocations fail as if the system refused them."""
        self._store._fail_next_allocations(n)

    def _defer_cpu_events(self, on: bool) -> None:
        """Test hook: CPU copies count as in flight until waited for, like CUDA copies."""
        self._store._defer_cpu_events(on)


# ---- saved-tensor hooks ------------------------------------------------------------------------


class _Stored:
    """Bytes parked in the store under one handle (a whole storage, or one tensor); released
    when the last saved tensor that uses them is dropped by autograd."""

    __slots__ = ("store", "handle", "index", "staged", "views", "_unpacked", "_on_device", "__weakref__")

    def __init__(self, store: ActivationStore, handle: int, index: int):
        self.store, self.handle, self.index, self.staged = store, handle, index, False
        self.views = 0  # saved views of this storage
        # Its views share the storage brought back until each is unpacked once (in one backward):
        # one host-to-device copy per storage, held no longer than autograd holds the original.
        self._unpacked, self._on_device = 0, None

    def fetch(self) -> torch.Tensor:
        self.staged = False  # fetch hands the staged copy out; the next one copies again
        return self.store.fetch(self.handle)

    def view(self, dtype: torch.dtype, offset: int, size, stride) -> torch.Tensor:
        if self._on_device is None:
            self._on_device = self.fetch().untyped_storage()
        storage = self._on_device
        self._unpacked += 1
        if self._unpacked % self.views == 0:
            self._on_device = None
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)

    def __del__(self):
        try:
            self.store.release(self.handle)
        except Exception:  # interpreter shutdown: the store may be gone already
            pass


class _View:
    """A saved tensor that is a view into an offloaded storage."""

    __slots__ = ("stored", "dtype", "offset", "size", "stride")

    def __init__(self, stored: _Stored, t: torch.Tensor):
        self.stored, self.dtype = stored, t.dtype
        stored.views += 1
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()

    def unpack(self) -> torch.Tensor:
        return self.stored.view(self.dtype, self.offset, self.size, self.stride)


def _worth_offloading(t: torch.Tensor, min_bytes: int) -> bool:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
        return False  # subclasses (DTensor, fake tensors...) and sparse layouts stay as they are
    if t.device.type not in ("cpu", "cuda") or t.numel() * t.element_size() < min_bytes:
        return False
    base = t._base if t._base is not None else t
    # Parameters and inputs that require grad (and views of them) stay alive anyway.
    return not (base.is_leaf and base.requires_grad)


class offload_saved_tensors(torch.autograd.graph.saved_tensors_hooks):  # noqa: N801 (named like torch's save_on_cpu)
    """Offload every activation autograd saves inside the block, through ``store``.

    The asynchronous counterpart of ``torch.autograd.graph.save_on_cpu``: the device-to-host
    copies run on a side stream while the forward goes on, and in backward each unpacked
    tensor starts the copies of the ``prefetch_ahead`` storages saved just before it (the next
    ones backward needs). Bytes belong to storages: views of one storage (``q``, ``k``, ``v``
    of one projection; a tensor and its reshape) are copied once, as the whole storage, unless
    the view covers less than a quarter of it (then the view alone is copied); in backward the
    views share one copy. Tensors under ``min_bytes``, parameters and inputs that require grad
    (and views of them) are kept as they are. A tensor the store refuses (``host_budget``
    exhausted, or host memory refused) is kept on its device, with one warning.

    Args:
        store: the store to use (``None``: a new one with default settings).
        min_bytes: smallest tensor worth a copy.
        prefetch_ahead: how many storages to bring back ahead of backward's need (0: none).

    Returns:
        A ``saved_tensors_hooks`` context manager; entering it returns the store. Buffers go
        back to the pool as autograd frees the saved tensors (after backward, or when the
        graph is dropped).

    Raises:
        ValueError: ``min_bytes`` or ``prefetch_ahead`` is not an int >= 0.
    """

    def __init__(self, store: ActivationStore | None = None, *, min_bytes: int = 1 << 16, prefetch_ahead: int = 2):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
        if isinstance(prefetch_ahead, bool) or not isinstance(prefetch_ahead, int) or prefetch_ahead < 0:
            raise ValueError(f"prefetch_ahead must be an int >= 0, got {prefetch_ahead!r}")
        self.store = ActivationStore() if store is None else store
        self.min_bytes, self.prefetch_ahead = min_bytes, prefetch_ahead
        self._by_index: weakref.WeakValueDictionary[int, _Stored] = weakref.WeakValueDictionary()
        # One copy per storage (or per tensor, for small views). Storages' Python objects are not
        # kept alive, tensors' are: id(base or tensor) -> (weakref to it, its version, the copy).
        self._copied: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}
        self._counter = itertools.count()
        self._alloc_warned = False
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> ActivationStore:
        super().__enter__()
        return self.store

    def _lookup(self, key: torch.Tensor, t: torch.Tensor):
        hit = self._copied.get(id(key))
        if hit is None:
            return None
        key_ref, version, stored_ref = hit
        stored = stored_ref()
        return stored if key_ref() is key and version == t._version else None

    def _remember(self, key: torch.Tensor, t: torch.Tensor, stored: _Stored) -> None:
        copied = self._copied
        if len(copied) > 2 * len(self._by_index) + 64:  # forget what died
            for k in [k for k, (r, _, q) in copied.items() if r() is None or q() is None]:
                del copied[k]
        copied[id(key)] = (weakref.ref(key), t._version, weakref.ref(stored))

    def _offload(self, t: torch.Tensor) -> _Stored | None:
        try:
            handle = self.store.offload(t)
        except HostAllocationError as exc:
            if not self._alloc_warned:
                self._alloc_warned = True
                warnings.warn(f"gradaccel offload_saved_tensors: keeping tensors on the device: {exc}", RuntimeWarning,
                              stacklevel=3)
            return None
        if handle is None:
            return None
        stored = _Stored(self.store, handle, next(self._counter))
        self._by_index[stored.index] = stored
        return stored

    def _pack(self, t: torch.Tensor):
        if not _worth_offloading(t, self.min_bytes):
            return t
        if lazy_bits(t):  # copy the values, not the storage
            stored = self._offload(t)
            return t if stored is None else stored
        base = t._base if t._base is not None else t
        stored = self._lookup(base, t)
        if stored is not None:
            return _View(stored, t)
        storage = t.untyped_storage()
        if storage.nbytes() > 4 * t.numel() * t.element_size():
            # A small view of a big storage: copy just the view (once, if saved twice).
            stored = self._lookup(t, t) or self._offload(t)
            if stored is None:
                return t
            self._remember(t, t, stored)
            return stored
        stored = self._offload(t.new_empty(0, dtype=torch.uint8).set_(storage))
        if stored is None:
            return t
        self._remember(base, t, stored)
        return _View(stored, t)

    def _unpack(self, p):
        if isinstance(p, _View):
            stored = p.stored
        elif isinstance(p, _Stored):
            stored = p
        else:
            return p
        for i in range(stored.index - 1, stored.index - 1 - self.prefetch_ahead, -1):
            q = self._by_index.get(i)
            if q is not None and not q.staged:
                q.staged = True
                self.store.prefetch(q.handle)
        return p.unpack() if isinstance(p, _View) else stored.fetch()


# ---- copy bandwidth ----------------------------------------------------------------------------


def copy_bandwidth(device: str | torch.device) -> tuple[float, float]:
    """Measured speed of the store's copies, once per process and device (cached).

    Args:
        device: ``"cpu"`` (host memcpy through the store) or a CUDA device (pinned
            device-to-host and host-to-device copies through the store).

    Returns:
        ``(d2h_bytes_per_s, h2d_bytes_per_s)``: offload and fetch speeds, best of a few runs.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {device!r}")
    return _measure_bandwidth(str(dev))


@functools.cache
def _measure_bandwidth(device: str) -> tuple[float, float]:
    cuda = device.startswith("cuda")
    nbytes = (64 if cuda else 16) << 20
    # Not random data: this runs inside the user's step, whose random stream must not move
    # (a copy's speed does not depend on the bytes).
    x = torch.full((nbytes // 4,), 1.5, dtype=torch.float32, device=device)
    store = ActivationStore(pin_memory=cuda)

    def sync():
        store.synchronize()
        if cuda:
            torch.cuda.synchronize(device)

    d2h, h2d = [], []
    for _ in range(6):  # the first run allocates the buffer; the best of the rest counts
        sync()
        t0 = time.perf_counter()
        h = store.offload(x)
        sync()
        t1 = time.perf_counter()
        y = store.fetch(h)
        sync()
        t2 = time.perf_counter()
        store.release(h)
        del y
        d2h.append(t1 - t0)
        h2d.append(t2 - t1)
    store.trim()
    return nbytes / min(d2h[1:]), nbytes / min(h2d[1:])
