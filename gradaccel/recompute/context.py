"""What a replay or a recompute runs under, as the forward it rebuilds did: the generator state
and autocast. Shared by the trace (gradaccel/recompute/trace.py), the replay
(gradaccel/recompute/plan.py) and a call recomputed whole (gradaccel/recompute/frames.py)."""

import contextlib

import torch

_AUTOCAST_KEYS = {"cpu": torch._C.DispatchKey.AutocastCPU, "cuda": torch._C.DispatchKey.AutocastCUDA}


def autocast_state() -> tuple:
    """The autocast in force now: ((device type, dtype), ...) for each device type it is on for."""
    return tuple((kind, torch.get_autocast_dtype(kind)) for kind in _AUTOCAST_KEYS if torch.is_autocast_enabled(kind))


@contextlib.contextmanager
def autocast_as(state: tuple):
    """Autocast on exactly for the device types and dtypes of ``state`` (:func:`autocast_state`)."""
    with contextlib.ExitStack() as stack:
        for kind, dtype in state:
            stack.enter_context(torch.autocast(kind, dtype=dtype))
        yield


@contextlib.contextmanager
def autocast_keys(state: tuple):
    """Inside ``__torch_dispatch__`` the dispatch keys above the Python mode are excluded,
    autocast's among them. An aten op has been through autocast already; an op from another
    library runs aten ops of its own (bitsandbytes' CPU gemm_4bit calls ``F.linear``), which
    autocast casts in a plain forward. They must be cast here too, or the traced call computes
    in another dtype than every call after it."""
    if not state:
        yield
        return
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for kind, _ in state:
        exclude = exclude.remove(_AUTOCAST_KEYS[kind])
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


@contextlib.contextmanager
def autocast_off(devices):
    """Autocast off for the device types of ``devices`` (a replay runs below autocast: the trace
    recorded its casts as ops of their own)."""
    with contextlib.ExitStack() as stack:
        for kind in sorted({d.type for d in devices}):
            stack.enter_context(torch.autocast(kind, enabled=False))
        yield


def capture_rng(devices) -> tuple:
    """Generator states at region entry (CPU, and each CUDA device the region touches)."""
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    return torch.get_rng_state(), [(i, torch.cuda.get_rng_state(i)) for i in cuda]


@contextlib.contextmanager
def rng_restored(state):
    """The generator states of :func:`capture_rng` (None: as they are) while it is active, and
    the states before it afterwards."""
    if state is None:
        yield
        return
    cpu, cuda = state
    with torch.random.fork_rng(devices=[i for i, _ in cuda], device_type="cuda"):
        torch.set_rng_state(cpu)
        for i, s in cuda:
            torch.cuda.set_rng_state(s, i)
        yield


def rng_state_bytes(graph) -> int:
    """Bytes of the generator states a call saves for a replay of random ops (their size is
    fixed per device: read once per set of devices)."""
    found = _RNG_BYTES.get(graph.devices)
    if found is None:
        cpu, cuda = capture_rng(graph.devices)
        found = _RNG_BYTES[graph.devices] = cpu.numel() + sum(s.numel() for _, s in cuda)
    return found


_RNG_BYTES: dict = {}  # frozenset of devices -> bytes of their generator states
