"""gradaccel.offload: the activation store and its saved-tensor hooks, against plain PyTorch."""

import gc
import threading
import time
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccel.recompute import offload as offload_module
from gradaccel.recompute.offload import ActivationStore, HostAllocationError, copy_bandwidth, offload_saved_tensors

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as raw bytes in logical order (bit-exact comparisons, NaNs included)."""
    return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).cpu()


def _random(shape, dtype, device="cpu"):
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.randint(-100, 100, shape, device=device).to(dtype)


def _roundtrip(store, t, prefetch=False):
    h = store.offload(t)
    assert h is not None
    if prefetch:
        store.prefetch(h)
    out = store.fetch(h)
    store.release(h)
    return out


class Block(nn.Module):
    """A small GPT block: pre-norm causal self-attention and an MLP, with dropout."""

    def __init__(self, hidden=64, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / (h // self.heads) ** 0.5
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = F.dropout(att.softmax(-1), 0.1, self.training) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def _model(device="cpu", layers=2, hidden=64):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(hidden) for _ in range(layers)]).to(device)


def _step(model, x, ctx=None, seed=1):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = model(x).square().mean()
    else:
        with ctx:
            loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


# ---- values ------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.int8,
          torch.int64, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (17,), (4099,), (2**16 + 3,), (3, 0, 5), (7, 13)])
def test_roundtrip_bit_exact(device, dtype, shape):
    store = ActivationStore()
    t = _random(shape, dtype, device)
    for prefetch in (False, True):
        out = _roundtrip(store, t, prefetch)
        assert out.shape == t.shape and out.dtype == t.dtype and out.device == t.device
        assert out.stride() == t.stride()
        assert torch.equal(_bits(out), _bits(t))


def test_nan_payloads_and_signed_zeros_survive(device):
    t = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45], device=device)
    t.view(torch.int32)[0] = 0x7FC00123  # a NaN with a payload
    assert torch.equal(_bits(_roundtrip(ActivationStore(), t)), _bits(t))


def test_non_contiguous_inputs(device):
    store = ActivationStore()
    base = torch.randn(6, 10, 4, device=device)
    dense = base.permute(2, 0, 1)  # dense, not contiguous: strides kept
    out = _roundtrip(store, dense)
    assert out.stride() == dense.stride() and torch.equal(out, dense)
    for t in (base[:, ::3], base[1:4, 2:7, 1], base[:, :1].expand(6, 5, 4), torch.randn(5, 5, device=device).diagonal()):
        out = _roundtrip(store, t)  # not dense: comes back contiguous, same values
        assert out.shape == t.shape and out.is_contiguous() and torch.equal(out, t)
    z = torch.randn(4, 3, dtype=torch.complex64, device=device)
    assert torch.equal(_roundtrip(store, z.conj()), z.conj())
    # Offloading copies: later writes to the source do not reach the stored values.
    src = torch.randn(100, device=device)
    expected = src.clone()
    h = store.offload(src)
    src.fill_(3.0)
    assert torch.equal(store.fetch(h), expected)
    store.release(h)


def test_handle_lifecycle():
    store = ActivationStore()
    t = torch.randn(1000)
    h = store.offload(t)
    a, b = store.fetch(h), store.fetch(h)  # fetch may repeat until release
    assert torch.equal(a, t) and torch.equal(b, t) and a.data_ptr() != b.data_ptr()
    store.prefetch(h)
    store.prefetch(h)  # staged already: no second copy
    store.release(h)
    for op in (store.fetch, store.prefetch, store.release):
        with pytest.raises(RuntimeError, match="unknown or already released handle"):
            op(h)
    with pytest.raises(RuntimeError, match="strided"):
        store.offload(torch.randn(3, 3).to_sparse())
    assert store.stats()["handles"] == 0


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1"])
def test_size_arguments(bad):
    with pytest.raises(ValueError, match="host_budget"):
        ActivationStore(host_budget=bad)
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        ActivationStore(max_inflight_bytes=bad)


# ---- pool and accounting ----------------------------------------------------------------------


def test_accounting_matches():
    store = ActivationStore()
    tensors = [torch.randn(n) for n in (1, 100, 1000, 1000, 5000)] + [torch.empty(0)]
    handles = [store.offload(t) for t in tensors]
    s = store.stats()
    assert s["handles"] == len(tensors)
    assert s["bytes_in_use"] == sum(t.nbytes for t in tensors)
    assert s["misses"] == 5 and s["hits"] == 0 and s["buffers"] == 5  # the empty tensor takes no buffer
    assert s["bytes_in_use"] <= s["bytes_reserved"] <= s["bytes_in_use"] * 1.125 + 5 * 512
    for h in handles:
        store.release(h)
    s = store.stats()
    assert s["handles"] == 0 and s["bytes_in_use"] == 0 and s["buffers_idle"] == 5
    assert s["bytes_idle"] == s["bytes_reserved"]
    # The same sizes again: served by the pool.
    handles = [store.offload(t) for t in tensors]
    s = store.stats()
    assert s["hits"] == 5 and s["misses"] == 5 and s["buffers"] == 5
    for h in handles:
        store.release(h)
    assert store.trim() == s["bytes_reserved"]
    assert store.stats()["buffers"] == 0 and store.bytes_reserved == 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_pool_flat_over_100_steps():
    model = _model()
    x = torch.randn(2, 32, 64)
    store = ActivationStore()
    _step(model, x, offload_saved_tensors(store, min_bytes=0))
    first = store.stats()
    assert first["misses"] > 0 and first["handles"] == 0  # every saved tensor released after backward
    for i in range(99):
        _step(model, x, offload_saved_tensors(store, min_bytes=0))
        if i == 9:
            rss = _rss()
    assert _rss() - rss < 1 << 20  # host memory flat (the pool holds about 0.6 MiB)
    last = store.stats()
    assert last["misses"] == first["misses"] and last["buffers"] == first["buffers"]
    assert last["bytes_reserved"] == first["bytes_reserved"] and last["handles"] == 0
    assert last["hits"] == 99 * first["misses"] + first["hits"] * 100


def test_pending_buffer_is_waited_for_not_duplicated():
    store = ActivationStore()
    store._defer_cpu_events(True)  # CPU copies behave like CUDA copies still in flight
    t = torch.randn(1000)
    store.release(store.offload(t))  # released while its copy is "in flight"
    s = store.stats()
    assert s["buffers_pending"] == 1 and s["buffers_idle"] == 0
    h = store.offload(t)  # same size class: waits for that buffer rather than allocating
    s = store.stats()
    assert s["buffers"] == 1 and s["waits"] == 1 and s["hits"] == 1 and s["buffers_pending"] == 0
    assert torch.equal(store.fetch(h), t)
    store.release(h)
    store.release(store.offload(torch.randn(10)))
    store.synchronize()
    assert store.stats()["buffers_pending"] == 0 and store.stats()["buffers_idle"] == 2


def test_inflight_copies_are_bounded():
    store = ActivationStore(max_inflight_bytes=10_000)
    store._defer_cpu_events(True)  # copies stay "in flight" until waited for
    tensors = [torch.randn(1000) for _ in range(5)]  # 4000 bytes each
    handles = [store.offload(t) for t in tensors]
    s = store.stats()
    assert s["bytes_inflight"] <= 10_000 and s["throttled"] == 3  # the 3rd, 4th, 5th waited for one each
    for h, t in zip(handles, tensors):
        assert torch.equal(store.fetch(h), t)
        store.release(h)
    assert store.stats()["bytes_inflight"] == 0  # released: no longer counted, without another offload
    unbounded = ActivationStore(max_inflight_bytes=None)
    unbounded._defer_cpu_events(True)
    handles = [unbounded.offload(t) for t in tensors]
    assert unbounded.stats()["throttled"] == 0
    for h in handles:
        unbounded.release(h)


def test_threads_share_one_store():
    store = ActivationStore()
    errors = []

    def work(seed):
        try:
            g = torch.Generator().manual_seed(seed)
            for n in range(1, 200):
                t = torch.randn(n * 7, generator=g)
                h = store.offload(t)
                assert torch.equal(store.fetch(h), t)
                store.release(h)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    s = store.stats()
    assert not errors and s["handles"] == 0 and s["bytes_in_use"] == 0 and s["hits"] + s["misses"] == 4 * 199


# ---- gradients through the hooks --------------------------------------------------------------


@pytest.mark.parametrize("prefetch_ahead", [0, 2])
def test_hooks_gradients_equal(device, prefetch_ahead):
    model = _model(device)
    x = torch.randn(2, 33, 64, device=device)
    loss_ref, grads_ref = _step(model, x)
    store = ActivationStore()
    loss, grads = _step(model, x, offload_saved_tensors(store, min_bytes=0, prefetch_ahead=prefetch_ahead))
    assert torch.equal(loss, loss_ref)
    for g, r in zip(grads, grads_ref):
        assert torch.equal(g, r)
    s = store.stats()
    assert s["bytes_offloaded"] > 0 and s["handles"] == 0 and s["bytes_in_use"] == 0


def test_hooks_skip_parameters_and_small_tensors():
    lin = nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    store = ActivationStore()
    with offload_saved_tensors(store, min_bytes=0):
        y = torch.relu(lin(x))  # saves x (input requiring grad), weight (a view of a parameter), y
        assert store.stats()["handles"] == 1 and store.bytes_in_use == y.nbytes
    with offload_saved_tensors(store, min_bytes=y.nbytes + 1):
        torch.relu(lin(x))
        assert store.stats()["handles"] == 1  # only the earlier graph's tensor
    del y
    gc.collect()
    assert store.stats()["handles"] == 0  # dropping a graph without backward releases its buffers


def test_hooks_are_saved_tensors_hooks_that_enter_as_the_store():
    hooks = offload_saved_tensors(min_bytes=0)
    assert isinstance(hooks, torch.autograd.graph.saved_tensors_hooks)
    x = torch.randn(64, 64, requires_grad=True)
    with hooks as store:
        y = (x * 2).exp()  # exp saves its output: offloaded
    assert store is hooks.store and store.stats()["handles"] == 1
    y.sum().backward()
    assert torch.equal(x.grad, 2 * (x.detach() * 2).exp())  # the same kernels, so bit for bit
    with pytest.raises(ValueError, match="min_bytes"):
        offload_saved_tensors(min_bytes=-1)


def test_hooks_copy_each_storage_once():
    torch.manual_seed(0)
    inp, w = torch.randn(64, 64), torch.randn(64, 192, requires_grad=True)

    def f():
        h = inp @ w
        q, k, v = h.split(64, dim=1)  # three views of h's storage, saved by two products
        big = inp @ w.repeat(1, 10)
        small = big[:, :10]  # a small view of a big storage: only the view is copied
        return (q * k).sum() + (k * v.t().t()).sum() + small.sin().sum(), h, small

    loss, h, small = f()
    ref = torch.autograd.grad(loss, w)[0]
    store = ActivationStore()
    with offload_saved_tensors(store, min_bytes=0):
        loss2, h, small = f()
    # h's storage once for its three views, inp (saved by both products) once, the small view.
    assert store.stats()["handles"] == 3 and store.bytes_in_use == h.nbytes + inp.nbytes + small.nbytes
    del h, small
    assert torch.equal(loss2, loss) and torch.equal(torch.autograd.grad(loss2, w)[0], ref)
    del loss2
    assert store.stats()["handles"] == 0


def test_hooks_views_unpacked_together_share_one_copy():
    torch.manual_seed(0)
    inp, w = torch.randn(64, 64), torch.randn(64, 128, requires_grad=True)
    q, k = (inp @ w).split(64, dim=1)
    ref = torch.autograd.grad((q * k).sum(), w)[0]
    store = ActivationStore()
    fetches = []
    fetch = store.fetch
    store.fetch = lambda h: fetches.append(h) or fetch(h)
    with offload_saved_tensors(store, min_bytes=0):
        q, k = (inp @ w).split(64, dim=1)
        loss = (q * k).sum()
    del q, k
    assert torch.equal(torch.autograd.grad(loss, w)[0], ref)
    assert len(fetches) == 2  # the product's q and k: one copy of their storage; inp for the matmul


def test_hooks_retain_graph_double_backward():
    model = _model(layers=1)
    x = torch.randn(2, 16, 64)
    _, ref = _step(model, x)
    store = ActivationStore()
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    with offload_saved_tensors(store, min_bytes=0):
        loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, 2 * r)
    del loss
    gc.collect()
    assert store.stats()["handles"] == 0


# ---- failure paths ----------------------------------------------------------------------------


def test_host_budget_exhausted_returns_none_once_warned():
    store = ActivationStore(host_budget=8192)
    a = torch.randn(1500)  # 6000 bytes: class 6144
    ha = store.offload(a)
    with pytest.warns(RuntimeWarning, match="host_budget=8192") as record:
        assert store.offload(torch.randn(1500)) is None
        assert store.offload(torch.randn(1500)) is None
    assert len(record) == 1
    s = store.stats()
    assert s["refused"] == 2 and s["bytes_reserved"] <= 8192 and s["handles"] == 1
    assert s["buffers"] == 1 and s["bytes_in_use"] == a.nbytes
    store.release(ha)
    # Room again. Idle buffers of another size make way for a new one within the budget.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = torch.randn(2000)
        hb = store.offload(b)
        assert hb is not None and torch.equal(store.fetch(hb), b)
    s = store.stats()
    assert s["buffers"] == 1 and s["bytes_reserved"] <= 8192
    store.release(hb)
    assert store.offload(torch.randn(4000)) is None  # larger than the whole budget


def test_injected_allocation_failure_leaks_nothing():
    store = ActivationStore()
    store._fail_next_allocations(1)
    with pytest.raises(HostAllocationError, match="could not allocate") as info:
        store.offload(torch.randn(1000))
    assert isinstance(info.value, torch.OutOfMemoryError)
    s = store.stats()
    assert s["alloc_failures"] == 1 and s["buffers"] == 0 and s["bytes_reserved"] == 0 and s["handles"] == 0
    t = torch.randn(1000)
    assert torch.equal(_roundtrip(store, t), t)  # usable afterwards
    # With idle buffers of other sizes, one failure frees them and the retry succeeds.
    store._fail_next_allocations(1)
    h = store.offload(torch.randn(50))
    s = store.stats()
    assert h is not None and s["buffers"] == 1 and s["alloc_failures"] == 1
    store.release(h)
    store._fail_next_allocations(2)
    with pytest.raises(HostAllocationError):
        store.offload(torch.randn(3000))
    s = store.stats()
    assert s["buffers"] == 0 and s["bytes_reserved"] == 0 and s["alloc_failures"] == 2
    assert torch.equal(_roundtrip(store, t), t)


def test_hooks_fall_back_on_budget_and_allocation_failure():
    model = _model()
    x = torch.randn(2, 32, 64)
    _, ref = _step(model, x)
    store = ActivationStore(host_budget=64 << 10)
    with pytest.warns(RuntimeWarning, match="host_budget") as record:
        _, grads = _step(model, x, offload_saved_tensors(store, min_bytes=0))
    assert len(record) == 1 and store.stats()["refused"] > 0
    assert all(torch.equal(g, r) for g, r in zip(grads, ref))
    store = ActivationStore()
    store._fail_next_allocations(1000)
    with pytest.warns(RuntimeWarning, match="could not allocate") as record:
        _, grads = _step(model, x, offload_saved_tensors(store, min_bytes=0))
    assert len(record) == 1 and store.stats()["buffers"] == 0
    assert all(torch.equal(g, r) for g, r in zip(grads, ref))
    store._fail_next_allocations(0)
    _, grads = _step(model, x, offload_saved_tensors(store, min_bytes=0))
    assert store.stats()["buffers"] > 0 and all(torch.equal(g, r) for g, r in zip(grads, ref))


def test_copy_bandwidth_cpu_cached_and_leaves_the_random_stream_alone():
    offload_module._measure_bandwidth.cache_clear()  # measured for real, here
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    d2h, h2d = copy_bandwidth("cpu")  # runs inside the first offloading step: must not draw numbers
    assert torch.equal(torch.rand(3), expected)
    assert d2h > 1e8 and h2d > 1e8  # any machine copies more than 100 MB/s
    assert copy_bandwidth(torch.device("cpu")) == (d2h, h2d)
    with pytest.raises(ValueError, match="device"):
        copy_bandwidth("meta")


# ---- CUDA -------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_source_freed_early_is_not_overwritten():
    store = ActivationStore()
    src = torch.randn(32 << 20, device="cuda")  # 128 MiB: the copy takes a while
    expected = src.clone()
    h = store.offload(src)
    del src  # the caching allocator must not hand this block out while the copy reads it
    junk = torch.full((32 << 20,), 7.0, device="cuda")
    assert torch.equal(store.fetch(h), expected)
    store.release(h)
    del junk


@needs_cuda
def test_cuda_offload_does_not_block_the_host():
    store = ActivationStore()
    x = torch.randn(64 << 20, device="cuda")  # 256 MiB
    store.release(store.offload(x))  # allocate the pinned buffer once
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    h = store.offload(x)
    t1 = time.perf_counter()
    store.synchronize()
    t2 = time.perf_counter()
    print(f"offload call {1e3 * (t1 - t0):.3f} ms, copy {1e3 * (t2 - t0):.3f} ms")
    assert t1 - t0 < 0.5 * (t2 - t0)
    assert torch.equal(store.fetch(h), x)
    store.release(h)
    d2h, h2d = copy_bandwidth("cuda")
    print(f"copy bandwidth d2h {d2h / 1e9:.1f} GB/s, h2d {h2d / 1e9:.1f} GB/s")
    assert d2h > 1e9 and h2d > 1e9


@needs_cuda
def test_cuda_hooks_lower_peak_memory_and_overlap():
    model = _model("cuda", layers=8, hidden=512)  # about 240 MiB of saved activations per block
    x = torch.randn(8, 512, 512, device="cuda")
    store = ActivationStore()

    def measure(ctx_fn):
        _step(model, x, ctx_fn())  # warm-up (and the pool's buffers)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss, grads = _step(model, x, ctx_fn())
        torch.cuda.synchronize()
        return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base, grads

    t_keep, peak_keep, ref = measure(lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    t_off, peak_off, grads = measure(lambda: offload_saved_tensors(store))
    print(f"step time offload/keep = {t_off / t_keep:.2f}; peak {peak_off / 2**20:.0f} MiB vs {peak_keep / 2**20:.0f} MiB")
    assert all(torch.equal(g, r) for g, r in zip(grads, ref))
    assert peak_off < 0.75 * peak_keep
    assert store.stats()["handles"] == 0
