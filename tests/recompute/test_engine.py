"""gradaccel.recompute.engine: a region whose parameters an engine releases after each forward
(ZeRO-3's way) replays against parameters the engine's hook gathers, and pins none of them.

``Shards`` stands in for ZeRO-3 on one process: a module's parameters hold their values only
while its forward runs (a pre-hook gathers, a hook releases, both through ``param.data``), and
again from when backward reaches the module's output; the real engine is tested on two ranks
in tests/integrations/test_hf_deepspeed.py (hf_zero3_ranks.py)."""

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

import gradaccel
from _models import Block, GPTConfig
from gradaccel.recompute import engine
from gradaccel.recompute.checkpoint import plan_rows, reset_plans


@pytest.fixture(autouse=True)
def _fresh_plans():
    reset_plans()
    yield
    reset_plans()


class Shards:
    """Each module's own parameters, released outside its forward and its backward."""

    def __init__(self, model: nn.Module):
        self.full = {p: p.detach().clone() for p in model.parameters()}
        self.gathered = []  # weak references to the storages made by gathering, in forward
        self.hook_calls, self.hook_params = 0, []
        for p in model.parameters():
            self.release(p)
        for m in model.modules():
            if any(True for _ in m.parameters(recurse=False)):
                m.register_forward_pre_hook(self.pre)
                m.register_forward_hook(self.post)
        self.handle = engine.around_replay(self.around)

    def gather(self, p):
        if p.numel() == 0:
            p.data = self.full[p].clone()  # a new storage, as an all-gather makes
            self.gathered.append(StorageWeakRef(p.untyped_storage()))

    @staticmethod
    def release(p):
        p.data = torch.empty(0, dtype=p.dtype)

    def pre(self, module, args):
        with engine.outside_regions():
            for p in module.parameters(recurse=False):
                self.gather(p)

    def post(self, module, args, out):
        with engine.outside_regions():
            for p in module.parameters(recurse=False):
                self.release(p)
        if out.requires_grad:  # backward reaches the module: its parameters again (ZeRO-3's pre-backward fetch)
            out.register_hook(lambda g, m=module: [self.gather(p) for p in m.parameters(recurse=False)] and None)

    def around(self, tensors):
        self.hook_calls += 1
        released = [t for t in tensors if t in self.full and t.numel() == 0]
        self.hook_params.append(len(released))
        return _Gathered(self, released)

    def release_all(self):
        for p in self.full:
            self.release(p)


class _Gathered:
    def __init__(self, shards, params):
        self.shards, self.params = shards, params

    def __enter__(self):
        for p in self.params:
            self.shards.gather(p)

    def __exit__(self, *exc):
        for p in self.params:
            self.shards.release(p)


def blocks(n=2, seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList(Block(GPTConfig(seq_len=16, n_embd=32, n_head=4, dropout=0.0)) for _ in range(n))


def step(model, x, budget, checkpointed=True):
    h = x
    for b in model:
        h = gradaccel.checkpoint(b, h, budget=budget) if checkpointed else b(h)
    h.square().mean().backward()


@pytest.mark.parametrize("budget", [None, 0.5, 1.0])
def test_replay_against_released_parameters_matches_stock(budget):
    ref = blocks()
    x = torch.randn(2, 16, 32)
    step(ref, x, None, checkpointed=False)
    model = blocks()
    shards = Shards(model)
    try:
        for call in range(2):  # the traced call, then the planned one
            model.zero_grad()
            step(model, x, budget)
            shards.release_all()
            for p, q in zip(ref.parameters(), model.parameters()):
                assert torch.equal(q.grad, p.grad), f"call {call}: {(q.grad - p.grad).abs().max()}"
        if budget is None:  # torch.utils.checkpoint: the forward runs again, module hooks and all
            assert shards.hook_calls == 0 and not plan_rows()
            return
        # once per region call in backward, whether or not it replays (budget=1.0 keeps all)
        assert shards.hook_calls == 2 * len(model)
        rows = plan_rows()
        assert rows and all(r["mode"] == "selective" for r in rows)
        if budget == 1.0:
            assert all(not r["replayed_ops"] for r in rows)
        else:
            assert all(r["replayed_ops"] for r in rows)
        # the engine's gathering (a clone per parameter here) is not part of any region
        assert all("aten.clone.default" not in r["replayed_ops"] for r in rows)
    finally:
        shards.handle.remove()


def test_kept_tensors_pin_no_gathered_parameter():
    model = blocks()
    shards = Shards(model)
    x = torch.randn(2, 16, 32)
    try:
        for _ in range(2):
            shards.gathered.clear()
            h = x
            for b in model:
                h = gradaccel.checkpoint(b, h, budget=1.0)  # keeps everything it may
            assert shards.gathered and all(ref.expired() for ref in shards.gathered)
            h.square().mean().backward()
            shards.release_all()
    finally:
        shards.handle.remove()


def test_no_hook_no_change():
    assert not engine.active()
    shards = Shards(blocks())
    shards.handle.remove()
    assert not engine.active()
    x = torch.randn(2, 16, 32, requires_grad=True)
    gradaccel.checkpoint(nn.Linear(32, 32), x, budget=0.5).sum().backward()
    assert shards.hook_calls == 0


class _Strays(nn.Module):
    """A region whose saves hang on a dict entry (outside the plan's signature): switching it
    makes the planned call stray from its trace after a dropped tensor (tests/recompute/test_divergence.py)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.path = {"mode": "cos"}

    def forward(self, x):
        a = self.lin(x)
        b = a.exp()
        c = b.sin() if self.path["mode"] == "sin" else b.cos()
        return a * c


def test_a_call_that_strays_reruns_inside_the_engines_gather():
    """The rerun of a call that strayed reads the released parameters: the engine's hook gathers
    them around it, at the same point as for any other call (a collective on every rank)."""
    model, ref = _Strays(), _Strays()
    x = torch.randn(4, 8)
    shards = Shards(model)
    try:
        import warnings

        for mode in ("cos", "sin"):  # traced and planned on cos; the third call strays
            model.path["mode"] = ref.path["mode"] = mode
            for _ in range(2 if mode == "cos" else 1):
                model.zero_grad()
                ref.zero_grad()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    gradaccel.checkpoint(model, x, budget=0.34).square().sum().backward()
                shards.release_all()
                ref(x).square().sum().backward()
                for p, q in zip(ref.parameters(), model.parameters()):
                    assert torch.equal(q.grad, p.grad)
        assert shards.hook_calls == 3  # once per call in backward, the strayed one included
        assert shards.hook_params[-1] == 2  # it gathered the released weight and bias for the rerun
    finally:
        shards.handle.remove()
