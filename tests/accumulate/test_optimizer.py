"""FusedAccumOptimizer against stock PyTorch: big-batch equivalence, items normalization,
clipping, bf16 master weights, non-finite skips, resume, LR schedulers and argument checks."""

import copy
import io
import math
import warnings

import pytest
import torch

from gradaccel.memory.counter import StorageLog
from gradaccel import FusedAccumOptimizer


def _mlp(seed=0, dtype=torch.float32, din=8, dh=16, dout=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(din, dh), torch.nn.Tanh(),
                               torch.nn.Linear(dh, dout)).to(dtype)


def _data(n, din=8, dout=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, din, generator=g), torch.randn(n, dout, generator=g)


def _max_diff(a, b):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_matches_big_batch(name):
    model, ref = _mlp(), _mlp()
    opt = FusedAccumOptimizer(OPTIMIZERS[name](model.parameters()), 4)
    ref_opt = OPTIMIZERS[name](ref.parameters())
    for window in range(4):
        x, y = _data(16, seed=window)
        results = []
        for k in range(4):
            loss = torch.nn.functional.mse_loss(model(x[4 * k: 4 * k + 4]), y[4 * k: 4 * k + 4])
            loss.backward()
            # No per-parameter .grad survives the backward: it lives in the flat buffer.
            assert all(p.grad is None for p in model.parameters())
            results.append(opt.step())
            opt.zero_grad()
        assert results == [False, False, False, True]
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert _max_diff(model, ref) < 2e-6
    # Nothing is left as .grad between windows, neither on params nor on what the inner optimizer holds.
    assert all(p.grad is None for g in opt.param_groups for p in g["params"])


def test_bit_exact_vs_stock_accumulation_loop():
    # Same micro-batches, fp32, power-of-two window: the maths is unchanged, so the result is too.
    model, ref = _mlp(), _mlp()
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(12):
        x, y = _data(4, seed=step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        (torch.nn.functional.mse_loss(ref(x), y) / 4).backward()
        if step % 4 == 3:
            ref_opt.step()
            ref_opt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tensor_counts", [False, True])
def test_items_mode_uneven_micro_batches(tensor_counts):
    sizes = [3, 11, 1, 9, 16]
    model, ref = _mlp(), _mlp()
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), len(sizes), normalize="items")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for window in range(2):
        x, y = _data(sum(sizes), seed=window)
        start, out = 0, []
        for n in sizes:
            xb, yb = x[start: start + n], y[start: start + n]
            start += n
            # a sum over items: here every row is one item (3 outputs each, summed)
            torch.nn.functional.mse_loss(model(xb), yb, reduction="sum").backward()
            out.append(opt.step(num_items=torch.tensor(n) if tensor_counts else n))
        assert out == [False] * 4 + [True]
        (torch.nn.functional.mse_loss(ref(x), y, reduction="sum") / sum(sizes)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert _max_diff(model, ref) < 2e-6
    # the "mean of micro-batch means" that trainers compute is measurably different
    assert sizes != [sizes[0]] * len(sizes)


def test_items_mode_needs_num_items():
    model = _mlp()
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, normalize="items")
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(ValueError, match="num_items"):
        opt.step()
    for bad in (-1, "3", True, float("nan")):
        with pytest.raises(ValueError, match="num_items"):
            opt.step(num_items=bad)
    mean_opt = FusedAccumOptimizer(torch.optim.SGD(_mlp().parameters(), lr=0.1), 2)
    with pytest.raises(ValueError, match="num_items"):
        mean_opt.step(num_items=4)


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
def test_clipping_matches_clip_grad_norm(max_norm):
    model, ref = _mlp(), _mlp()
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, max_grad_norm=max_norm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    assert opt.last_grad_norm is None
    for window in range(3):
        x, y = _data(8, seed=window)
        for k in range(2):
            torch.nn.functional.mse_loss(model(x[4 * k: 4 * k + 4]), y[4 * k: 4 * k + 4]).backward()
            opt.step()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        assert isinstance(opt.last_grad_norm, float)
        assert opt.last_grad_norm == pytest.approx(ref_norm.item(), rel=1e-6)
        assert (ref_norm.item() > max_norm) == (max_norm == 0.05)  # both branches exercised
        assert _max_diff(model, ref) < 2e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_master_weights_are_exact_fp32_accumulation(dtype):
    steps = 64
    seen = []

    class Record(torch.optim.SGD):
        """SGD that also records the gradient it is handed."""

        def step(self, closure=None):
            seen.extend(p.grad.detach().double().clone() for g in self.param_groups for p in g["params"])
            return super().step(closure)

    model = _mlp(dtype=dtype, din=32, dh=64, dout=8)
    grads_ref = copy.deepcopy(model)   # per-micro-batch bf16 grads, summed in fp64
    plain = copy.deepcopy(model)       # stock: bf16 .grad accumulation
    opt = FusedAccumOptimizer(Record(model.parameters(), lr=0.01), steps, master_weights=True)
    masters = [p for g in opt.param_groups for p in g["params"]]
    # The inner optimizer holds fp32 masters, in the original order, equal to the params.
    assert [m.dtype for m in masters] == [torch.float32] * 4
    assert all(torch.equal(m, p.float()) for m, p in zip(masters, model.parameters()))
    exact = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    g = torch.Generator().manual_seed(0)
    for k in range(steps):
        x = torch.randn(4, 32, generator=g).to(dtype)
        model(x).float().square().mean().backward()
        for acc, gr in zip(exact, torch.autograd.grad(grads_ref(x).float().square().mean(),
                                                      list(grads_ref.parameters()))):
            acc += gr.double()
        plain(x).float().square().mean().backward()
        assert opt.step() == (k == steps - 1)
    exact = [e / steps for e in exact]

    def rel(got):
        num = sum((a - b.double()).square().sum() for a, b in zip(exact, got))
        return math.sqrt(num / sum(e.square().sum() for e in exact))

    assert rel(seen) < 1e-6
    assert rel([p.grad.double() / steps for p in plain.parameters()]) > 1e-4
    # After the update the params are the masters rounded to their dtype, bit for bit.
    for p, m in zip(model.parameters(), masters):
        assert p.dtype == dtype
        assert torch.equal(p, m.to(dtype))
        assert not torch.equal(m, m.to(dtype).float())  # the master keeps more bits


def test_non_finite_window_is_skipped():
    model, clean = _mlp(), _mlp()
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    opt, clean_opt = FusedAccumOptimizer(make(model.parameters()), 2), FusedAccumOptimizer(make(clean.parameters()), 2)
    before = copy.deepcopy(model.state_dict())
    x, y = _data(4)
    bad = x.clone()
    bad[2, 0] = float("inf")
    torch.nn.functional.mse_loss(model(x[:2]), y[:2]).backward()
    assert opt.step() is False
    torch.nn.functional.mse_loss(model(bad[2:]), y[2:]).backward()
    with pytest.warns(UserWarning, match="non-finite"):
        assert opt.step() is False
    assert opt.skipped_steps == 1
    assert not math.isfinite(opt.last_grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(before.values(), model.state_dict().values()))
    assert len(opt.state) == 0  # AdamW never ran: no step counters, no moments
    # The next window starts clean: it matches a run that never saw the bad window.
    for m, o in ((model, opt), (clean, clean_opt)):
        for k in range(2):
            torch.nn.functional.mse_loss(m(x[2 * k: 2 * k + 2]), y[2 * k: 2 * k + 2]).backward()
            o.step()
    for a, b in zip(model.parameters(), clean.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("config", ["fp32_adamw", "bf16_master_items_clip"])
def test_mid_window_resume_is_bit_exact(config):
    bf16 = config != "fp32_adamw"
    kw = dict(master_weights=True, normalize="items", max_grad_norm=0.5) if bf16 else {}
    dtype = torch.bfloat16 if bf16 else torch.float32

    def build():
        m = _mlp(dtype=dtype)
        return m, FusedAccumOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), 4, **kw)

    def micro(m, o, i):
        x, y = _data(3 + i % 2, seed=100 + i)
        torch.nn.functional.mse_loss(m(x.to(dtype)).float(), y, reduction="sum").backward()
        o.step(**({"num_items": x.shape[0]} if bf16 else {}))

    ref, ref_opt = build()
    for i in range(14):
        micro(ref, ref_opt, i)
    model, opt = build()
    for i in range(6):  # one window and a half
        micro(model, opt, i)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    del model, opt
    buf.seek(0)
    saved = torch.load(buf)
    model, opt = build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    assert opt.micro_step == 2
    for i in range(6, 14):
        micro(model, opt, i)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.param_groups[0]["params"], ref_opt.param_groups[0]["params"]):
        assert torch.equal(a, b)


def test_lr_scheduler_and_shared_objects():
    model, ref = _mlp(), _mlp()
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.state is opt.optimizer.state
    assert opt.defaults is opt.optimizer.defaults
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for window in range(3):
            x, y = _data(8, seed=window)
            for k in range(2):
                torch.nn.functional.mse_loss(model(x[4 * k: 4 * k + 4]), y[4 * k: 4 * k + 4]).backward()
                if opt.step():
                    sched.step()
                opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_sched.step()
            ref_opt.zero_grad()
    assert opt.optimizer.param_groups[0]["lr"] == 0.1 * 0.5 ** 3
    assert _max_diff(model, ref) < 2e-6
    opt.param_groups[0]["lr"] = 0.25  # through the wrapper reaches the inner optimizer
    assert opt.optimizer.param_groups[0]["lr"] == 0.25


def test_unused_params_grads_arriving_twice_and_add_param_group():
    torch.manual_seed(0)
    a, unused, extra = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    mods = torch.nn.ModuleList([a, unused, extra])
    ref = copy.deepcopy(mods)
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.5)  # noqa: E731
    opt = FusedAccumOptimizer(make(list(mods[0].parameters()) + list(mods[1].parameters())), 2)
    ref_opt = make(list(ref[0].parameters()) + list(ref[1].parameters()))
    frozen_before = [p.clone() for p in unused.parameters()]

    def run(ms, o, stock, x):
        for k in range(2):
            xb = x[4 * k: 4 * k + 4]
            # `a` is used by two separate backward passes: its grad arrives twice per micro-batch.
            l1 = ms[0](xb).square().mean() / (1 if not stock else 2)
            l2 = ms[2](ms[0](xb)).mean() / (1 if not stock else 2)
            l1.backward()
            l2.backward()
            if not stock:
                o.step()
                o.zero_grad()
        if stock:
            o.step()
            o.zero_grad()

    for window in range(2):
        x = _data(8, seed=window)[0]
        run(mods, opt, False, x)
        run(ref, ref_opt, True, x)
        if window == 0:
            opt.add_param_group({"params": list(extra.parameters()), "lr": 5e-3})
            ref_opt.add_param_group({"params": list(ref[2].parameters()), "lr": 5e-3})
    # A parameter without a gradient in a window gets none from the wrapper either: no decay.
    assert all(torch.equal(p, q) for p, q in zip(unused.parameters(), frozen_before))
    assert all(p not in opt.state for p in unused.parameters())
    assert _max_diff(mods, ref) < 2e-6


def test_manual_grads_are_folded_and_zero_grad_keeps_window():
    model, ref = _mlp(), _mlp()
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # set by hand: no hook fires
    assert opt.step() is False
    opt.zero_grad(set_to_none=False)
    opt.zero_grad()
    x, y = _data(4)
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert opt.step() is True
    torch.nn.functional.mse_loss(ref(x), y).backward()
    for p in ref.parameters():
        p.grad = (p.grad + 1) / 2
    ref_opt.step()
    assert _max_diff(model, ref) < 1e-7


def test_frozen_then_unfrozen_param_is_an_error():
    model = _mlp()
    model[0].weight.requires_grad_(False)
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    model[0].weight.requires_grad_(True)
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="requires_grad"):
        opt.step()


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(optimizer="sgd"), TypeError, "optimizer"),
    (dict(optimizer=torch.nn.Linear(2, 2)), TypeError, "optimizer"),
    (dict(accum_steps=0), ValueError, "accum_steps"),
    (dict(accum_steps=-3), ValueError, "accum_steps"),
    (dict(accum_steps=2.0), ValueError, "accum_steps"),
    (dict(accum_steps="4"), ValueError, "accum_steps"),
    (dict(accum_steps=True), ValueError, "accum_steps"),
    (dict(normalize="median"), ValueError, "normalize"),
    (dict(normalize=None), ValueError, "normalize"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm"),
    (dict(max_grad_norm=-1), ValueError, "max_grad_norm"),
    (dict(max_grad_norm=float("nan")), ValueError, "max_grad_norm"),
    (dict(max_grad_norm="1"), ValueError, "max_grad_norm"),
    (dict(master_weights="yes"), TypeError, "master_weights"),
    (dict(process_group=object()), ValueError, "process_group"),
])
def test_bad_arguments(kwargs, exc, name):
    args = dict(optimizer=torch.optim.SGD(_mlp().parameters(), lr=0.1), accum_steps=4)
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        FusedAccumOptimizer(args.pop("optimizer"), args.pop("accum_steps"), **args)


def test_bad_parameters():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        FusedAccumOptimizer(torch.optim.SGD(_mlp(dtype=torch.float64).parameters(), lr=0.1), 2)
    inner = FusedAccumOptimizer(torch.optim.SGD(_mlp().parameters(), lr=0.1), 2)
    with pytest.raises(TypeError, match="optimizer"):
        FusedAccumOptimizer(inner, 2)


def test_slices_of_earlier_windows_do_not_leak():
    # Window 0 uses both branches; window 1 uses only `a` by backward and gives `b` a hand-set
    # grad: the stale window-0 values of `b`'s slice must count neither in the update nor the norm.
    torch.manual_seed(0)
    mods = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    ref = copy.deepcopy(mods)
    opt = FusedAccumOptimizer(torch.optim.SGD(mods.parameters(), lr=0.1), 2, max_grad_norm=1e6)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = _data(4, din=4)[0]
    for window in range(3):
        for ms, fused in ((mods, True), (ref, False)):
            for k in range(2):
                used = ms if window == 0 else ms[:1]
                loss = sum(m(x[2 * k: 2 * k + 2]).square().mean() for m in used)
                (loss if fused else loss / 2).backward()
                if window == 1 and k == 1:
                    for p in ms[1].parameters():
                        p.grad = torch.full_like(p, 0.5 if fused else 0.25)
                if fused:
                    opt.step()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e6)
        ref_opt.step()
        ref_opt.zero_grad()
        assert opt.last_grad_norm == pytest.approx(ref_norm.item(), rel=1e-6)
        assert _max_diff(mods, ref) < 1e-7


def test_masters_follow_params_changed_outside_and_new_groups_get_masters():
    model = _mlp(dtype=torch.bfloat16)
    head = torch.nn.Linear(3, 2).to(torch.bfloat16)
    start = copy.deepcopy(model.state_dict())
    fresh = _mlp(dtype=torch.bfloat16)
    fresh_opt = FusedAccumOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1), 1, master_weights=True)
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 1, master_weights=True)
    x = torch.randn(4, 8).to(torch.bfloat16)
    model(x).float().sum().backward()
    assert opt.step()
    # Loading weights after the optimizer was built: the next update starts from them, not from
    # the stale masters (SGD without momentum has no state, so this equals a fresh run).
    model.load_state_dict(start)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x).float().sum().backward()
        assert o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    opt.add_param_group({"params": head.parameters(), "lr": 0.5})
    assert [p.dtype for p in opt.param_groups[1]["params"]] == [torch.float32] * 2
    before = head.weight.clone()
    head(model(x)).float().sum().backward()
    assert opt.step()
    assert not torch.equal(before, head.weight)
    assert torch.equal(head.weight, opt.param_groups[1]["params"][0].to(torch.bfloat16))


def test_closure_hooks_removed_when_dropped_and_takeover():
    model = _mlp()
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    x = torch.randn(2, 8)

    def closure():
        loss = model(x).sum()
        loss.backward()
        return loss

    assert opt.step(closure) is False
    with pytest.warns(UserWarning, match="another FusedAccumOptimizer"):
        opt2 = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    model(x).sum().backward()  # only the new wrapper folds it
    assert all(p.grad is None for p in model.parameters())
    assert opt2.micro_step == 0 and opt2.step() is False
    del opt, opt2
    import gc
    gc.collect()
    model(x).sum().backward()  # no wrapper left: stock .grad accumulation again
    assert all(p.grad is not None for p in model.parameters())


def test_refused_param_group_leaves_no_hooks():
    model, extra = _mlp(), torch.nn.Linear(3, 1)
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    with pytest.raises(ValueError):  # refused half-way: the first one was already adopted
        opt.add_param_group({"params": [extra.weight, extra.weight]})
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [model[0].weight]})
    extra(torch.randn(2, 3)).sum().backward()
    assert extra.weight.grad is not None  # no hook of ours took it
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": extra.parameters()})
    assert len(opt.param_groups) == 2 and opt.grad_buffer.numel() == sum(p.numel() for p in model.parameters()) + 4


def test_bf16_params_without_masters_get_a_bf16_grad_of_the_fp32_sum():
    model = _mlp(dtype=torch.bfloat16)
    start = [p.clone() for p in model.parameters()]
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), 3)
    total = [torch.zeros(p.shape) for p in model.parameters()]
    for k in range(3):
        x = torch.randn(2, 8).to(torch.bfloat16)
        grads = torch.autograd.grad(model(x).float().sum(), list(model.parameters()))
        for t, g in zip(total, grads):
            t += g.float()
        model(x).float().sum().backward()
        opt.step(num_items=None)
    assert opt.param_groups[0]["params"][0] is model[0].weight  # no masters: the params themselves
    for p, p0, t in zip(model.parameters(), start, total):
        assert torch.equal(p, p0 - 0.5 * (t / 3).to(torch.bfloat16))


class _PeakLog(StorageLog):
    """The peak bytes of the storages created while active and still alive, checked after each op."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.peak = max(self.peak, sum(st.nbytes() for _, st, _ in self.created.live()))
        return out


class _Mixed(torch.nn.Module):
    """bf16, fp16 (one channels_last) and fp32 parameters in one buffer, of odd sizes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(300, 257, dtype=torch.bfloat16) / 16)
        self.conv = torch.nn.Conv2d(3, 5, 3).to(torch.float16).to(memory_format=torch.channels_last)
        self.v = torch.nn.Parameter(torch.randn(17))

    def forward(self, x, img):
        return ((x @ self.w).float().tanh().sum(1) * self.v[:1]).square().mean() + self.conv(img).float().mean()


def test_bf16_update_without_masters_makes_no_gradient_sized_copy(monkeypatch):
    # At the update a bf16/fp16 parameter without a master gets its window gradient rounded in its
    # own slice of the buffer: the step allocates a small temporary per slice, never a copy of the
    # gradients (at 8B bf16 parameters a copy is 15 GiB), and the update is the stock optimizer's
    # on the rounded fp32 mean, bit for bit.
    from gradaccel.accumulate import flat as _flat
    monkeypatch.setattr(_flat, "NARROW_HEAD", 1000)  # several in-place copies per slice
    model, ref = _Mixed(), _Mixed()
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), 4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    for window in range(2):
        total = [torch.zeros(p.shape).to(memory_format=torch.channels_last) if p.dim() == 4
                 else torch.zeros(p.shape) for p in ref.parameters()]
        for k in range(4):
            x = torch.randn(3, 300, generator=g).to(torch.bfloat16)
            img = torch.randn(2, 3, 6, 6, generator=g).to(torch.float16)
            model(x, img).backward()
            for t, gr in zip(total, torch.autograd.grad(ref(x, img), list(ref.parameters()))):
                t += gr.float()  # the fold's sum: fp32, in micro-batch order
            if k < 3:
                assert opt.step() is False
        log = _PeakLog()
        with log:
            assert opt.step() is True
        for q, t in zip(ref.parameters(), total):
            q.grad = (t * 0.25).to(q.dtype)  # 1/accum_steps is exact: the finalize pass's product
        ref_opt.step()
        ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.dtype == q.dtype and p.stride() == q.stride() and torch.equal(p, q)
        if window:  # the first update also makes SGD's momentum buffers, gradient-sized
            grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # 155 KB
            # The temporaries: 2 bytes per head element, a few scalars; a copy of the gradients
            # (what the update made before) would be grad_bytes.
            assert log.peak <= 2 * 1000 + 1024 < grad_bytes / 50, (log.peak, grad_bytes)


def test_pickling_is_refused_with_guidance():
    opt = FusedAccumOptimizer(torch.optim.SGD(_mlp().parameters(), lr=0.1), 2)
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(opt)


def test_load_state_dict_refuses_another_layout():
    fp32 = FusedAccumOptimizer(torch.optim.SGD(_mlp().parameters(), lr=0.1), 2)
    bf16 = FusedAccumOptimizer(torch.optim.SGD(_mlp(dtype=torch.bfloat16).parameters(), lr=0.1), 2,
                               master_weights=True)
    bigger = FusedAccumOptimizer(torch.optim.SGD(_mlp(dh=17).parameters(), lr=0.1), 2)
    with pytest.raises(ValueError, match="master_weights"):
        bf16.load_state_dict(fp32.state_dict())
    with pytest.raises(ValueError, match="different parameters"):
        bigger.load_state_dict(fp32.state_dict())
    with pytest.raises(ValueError, match="gradaccel"):
        fp32.load_state_dict(fp32.optimizer.state_dict())


def test_per_window_scheduler_steps_once_per_window():
    model = _mlp()
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), 3)
    sched = opt.per_window(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    x, y = _data(4)
    lrs = []
    for _ in range(7):  # a trainer's loop: the scheduler after every optimizer step
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]
    assert sched.get_last_lr() == [0.25] and sched.state_dict()["last_epoch"] == 2
    fresh = FusedAccumOptimizer(torch.optim.SGD(_mlp().parameters(), lr=1.0), 3)
    restored = fresh.per_window(torch.optim.lr_scheduler.StepLR(fresh.optimizer, step_size=1, gamma=0.5))
    restored.load_state_dict(sched.state_dict())  # built on the inner optimizer: accepted too
    assert restored.last_epoch == 2
    with pytest.raises(ValueError, match="built on this FusedAccumOptimizer"):
        opt.per_window(torch.optim.lr_scheduler.StepLR(fresh, step_size=1))


def test_reset_window_drops_a_failed_micro_batch_and_sparse_grads_lose_nothing():
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("out of memory, say")

    model, ref = _mlp(), _mlp()
    x, y = _data(4)
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert opt.step() is False
    with pytest.raises(RuntimeError, match="out of memory"):  # the last layer's grad is folded, then it fails
        torch.nn.functional.mse_loss(model[2](Boom.apply(model[1](model[0](x)))), y).backward()
    opt.reset_window()
    assert opt.micro_step == 0
    for _ in range(2):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        (torch.nn.functional.mse_loss(ref(x), y) / 2).backward()
    ref_opt.step()
    assert _max_diff(model, ref) < 1e-7
    # A refused sparse grad set by hand: the other parameters' grads are not lost with it.
    model[0].weight.grad = torch.ones_like(model[0].weight).to_sparse()
    model[2].bias.grad = torch.ones_like(model[2].bias)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert model[2].bias.grad is not None


def test_optimizer_hooks_and_internals_are_torchs_own():
    # The wrapper does not call Optimizer.__init__ (it shares the inner optimizer's param_groups):
    # what __init__ sets besides those comes from a real Optimizer, so a torch release that
    # adds an attribute does not break hooks or profiling on the wrapper.
    model = torch.nn.Linear(3, 2)
    stock = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    shared = {"param_groups", "state", "defaults"}
    assert set(vars(stock)) - shared <= set(vars(opt)), set(vars(stock)) - shared - set(vars(opt))
    assert not [k for p in model.parameters() for k in vars(p)]  # nothing written onto the user's Parameters
    calls = []
    handles = [
        opt.register_step_pre_hook(lambda o, a, k: calls.append("step_pre")),
        opt.register_step_post_hook(lambda o, a, k: calls.append("step_post")),
        opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre")),
        opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd_post")),
        opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre")),
        opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post")),
    ]
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert calls == ["step_pre", "step_post", "sd_pre", "sd_post", "load_pre", "load_post"]
    for h in handles:
        h.remove()
    with torch.profiler.profile() as prof:
        opt.step()
    assert any("FusedAccumOptimizer.step" in e.name for e in prof.events())


@pytest.mark.parametrize("normalize", ["mean", "items"])
def test_window_loss_is_the_big_batch_loss(normalize):
    F = torch.nn.functional
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 3, normalize=normalize)
    x, y = torch.randn(12, 6), torch.randn(12, 3)
    # Uneven micro-batches with "items" (weighted per item), equal ones with "mean".
    cuts = [0, 2, 7, 12] if normalize == "items" else [0, 4, 8, 12]
    big = F.mse_loss(model(x), y).item()  # before the update
    for k in range(3):
        out, target = model(x[cuts[k]:cuts[k + 1]]), y[cuts[k]:cuts[k + 1]]
        if normalize == "items":
            loss = F.mse_loss(out, target, reduction="sum")
            loss.backward()
            updated = opt.step(num_items=out.numel(), loss=loss)
        else:
            loss = F.mse_loss(out, target)
            loss.backward()
            updated = opt.step(loss=loss)
        assert updated == (k == 2)
        opt.zero_grad()
    assert opt.window_loss == pytest.approx(big, rel=1e-6)
    for _ in range(3):  # no losses handed in: none reported
        model(x).sum().backward()
        opt.step(**({"num_items": 1} if normalize == "items" else {}))
    assert opt.window_loss is None


def test_clip_grad_norm_before_the_ending_step_matches_torch():
    # For loops that clip before step() (accelerate, Trainer): the window's gradient is finished
    # and clipped at that call, and the next step() applies it.
    torch.manual_seed(0)
    ref, model = torch.nn.Linear(5, 4), torch.nn.Linear(5, 4)
    model.load_state_dict(ref.state_dict())
    x = torch.randn(6, 5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    (ref(x).square().mean()).backward()
    expect = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    ref_opt.step()
    model(x[:3]).square().mean().backward()
    with pytest.raises(RuntimeError, match="just before the step"):
        opt.clip_grad_norm_(0.1)  # mid-window: the window's gradient is not complete yet
    assert opt.step() is False
    model(x[3:]).square().mean().backward()
    norm = opt.clip_grad_norm_(0.1)
    assert norm.item() == pytest.approx(expect.item(), rel=1e-6)
    assert opt.step() is True
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    items = FusedAccumOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), 1, normalize="items")
    with pytest.raises(RuntimeError, match="normalize='mean' or 'sum'"):
        items.clip_grad_norm_(1.0)
