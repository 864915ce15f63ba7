"""FusedAccumOptimizer with a process group: 2 ranks on gloo (CPU) equal single-process
big-batch training, and a DistributedDataParallel-wrapped model is rejected with guidance."""

import pytest
import torch
import torch.distributed as dist
from _dist import WORLD, run_scenarios  # noqa: F401

from gradaccel import FusedAccumOptimizer

TIMEOUT_S = 180


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))


def _batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g)


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def _mean_mode(rank):
    # Each window: 2 ranks x 2 micro-batches x 4 rows = the reference's one batch of 16.
    model, ref = _model(), _model()
    opt = FusedAccumOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), 2,
                              process_group=dist.group.WORLD)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for window in range(3):
        x, y = _batch(16, window)
        for k in range(2):
            rows = slice(8 * rank + 4 * k, 8 * rank + 4 * k + 4)
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            assert opt.step() == (k == 1)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert _max_diff(model, ref) < 2e-6, _max_diff(model, ref)


def _items_mode(rank):
    # Uneven micro-batches, and uneven totals per rank (4 vs 27 rows): only the global count is right.
    sizes = [[1, 3], [11, 16]][rank]
    model, ref = _model(), _model()
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), 2,
                              normalize="items", max_grad_norm=0.3, process_group=dist.group.WORLD)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    for window in range(3):
        x, y = _batch(31, 10 + window)
        start = 0 if rank == 0 else 4
        for n in sizes:
            rows = slice(start, start + n)
            start += n
            torch.nn.functional.mse_loss(model(x[rows]), y[rows], reduction="sum").backward()
            opt.step(num_items=torch.tensor(n) if rank else n)
        (torch.nn.functional.mse_loss(ref(x), y, reduction="sum") / 31).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(opt.last_grad_norm - norm.item()) <= 1e-6 * norm.item()
        assert _max_diff(model, ref) < 2e-6, _max_diff(model, ref)


def _fused_wgrad(rank):
    # fuse_wgrad=True on 2 ranks: the Linear weights' GEMMs write the window buffer, which is
    # all-reduced once per window as before; equal to big-batch training.
    model, ref = _model(), _model()
    opt = FusedAccumOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), 2, max_grad_norm=0.5,
                              process_group=dist.group.WORLD, fuse_wgrad=True, module=model)
    assert opt.fused_layers == ["0", "2"]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for window in range(3):
        x, y = _batch(16, 20 + window)
        for k in range(2):
            rows = slice(8 * rank + 4 * k, 8 * rank + 4 * k + 4)
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            assert opt.step() == (k == 1)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        assert _max_diff(model, ref) < 2e-6, _max_diff(model, ref)


def _ddp_rejected(rank):
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = FusedAccumOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), 2, process_group=dist.group.WORLD)
    before = [p.clone() for p in model.parameters()]
    ddp(torch.randn(4, 6)).sum().backward()
    try:
        opt.step()
    except RuntimeError as e:
        msg = str(e)
        assert "DistributedDataParallel" in msg and "process_group" in msg, msg
    else:
        raise AssertionError("a DDP-wrapped model was not rejected")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _diverged_accumulation(rank):
    # Rank 1 accumulates 3 micro-batches, rank 0 2: both raise at their window's end, with the
    # counts, before summing anything (no hang, no sum paired with another collective).
    model = _model()
    opt = FusedAccumOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2 + rank, process_group=dist.group.WORLD)
    before = [p.clone() for p in model.parameters()]
    try:
        for k in range(2 + rank):
            x, y = _batch(4, k)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    except RuntimeError as e:
        assert "different numbers of micro-batches in window 0 (rank 0: 2, rank 1: 3)" in str(e), str(e)
    else:
        raise AssertionError("ranks with different accum_steps were not stopped")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


SCENARIOS = {"mean": _mean_mode, "items": _items_mode, "fused_wgrad": _fused_wgrad, "ddp": _ddp_rejected, "diverged": _diverged_accumulation}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # One spawn for all scenarios: starting ranks (importing torch) costs more than the tests.
    return run_scenarios(__name__, tmp_path_factory.mktemp("dist"), TIMEOUT_S)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks(results, scenario):
    for rank, res in enumerate(results):
        assert res.get(scenario) == "ok", f"rank {rank}:\n{res.get(scenario)}"
