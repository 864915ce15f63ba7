"""torch.compile'd models that call gradaccel.checkpoint and step a FusedAccumOptimizer, against eager.

Under compile each region runs as torch's selective checkpoint with a policy made from its plan
(gradaccel/recompute/compiled.py), planned while dynamo traces: no graph break, also where the
call sits in a loop over blocks (checkpoint_blocks, HF checkpointing). Checked here: gradients,
no break, the plan is the eager plan, and what the compiled graph keeps is within the budget
(measured from the tensors it saves for backward). Hugging Face models: test_compile_hf.py.
"""

import copy
import functools
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import gradaccel
from gradaccel import FusedAccumOptimizer, checkpoint_blocks
from gradaccel.recompute import compiled
from gradaccel.recompute.own_forward import own_forward
from gradaccel.recompute.region import unwrap
from gradaccel.recompute.state import STATE
from gradaccel.recompute.storage import storage_key


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.fc1(self.ln(x))
        return x + self.fc2(F.gelu(h) * torch.sigmoid(h))


class Looped(nn.Module):
    """The usual shape: gradaccel.checkpoint called in a loop over the blocks."""

    def __init__(self, d=16, n=2, budget=0.5):
        super().__init__()
        self.inp, self.out, self.budget = nn.Linear(5, d), nn.Linear(d, 1), budget
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def run_blocks(self, h):
        for b in self.blocks:
            h = gradaccel.checkpoint(b, h, budget=self.budget)
        return h

    def forward(self, x):
        return self.out(self.run_blocks(torch.tanh(self.inp(x)))).square().mean()


class Unrolled(Looped):
    """No loop around the calls, and code between them."""

    def run_blocks(self, h):
        h = gradaccel.checkpoint(self.blocks[0], h * 2, budget=self.budget)
        return gradaccel.checkpoint(self.blocks[1], h.relu(), budget=self.budget)


class LoopInForward(Looped):
    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = gradaccel.checkpoint(b, h, budget=self.budget)
        return self.out(h).square().mean()


class PlainLoop(Looped):
    """Blocks called plainly, to be checkpointed by checkpoint_blocks."""

    def run_blocks(self, h):
        for b in self.blocks:
            h = b(h)
        return h


class CompiledInside(Looped):
    """The blocks themselves compiled, each called through gradaccel.checkpoint."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.compiled = [torch.compile(b, backend="aot_eager") for b in self.blocks]

    def run_blocks(self, h):
        for b in self.compiled:
            h = gradaccel.checkpoint(b, h, budget=self.budget)
        return h


def assert_close_scaled(actual, expected, name):
    """Equal within 1e-5, relative to the largest element of ``expected``."""
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")


def eager_and_compiled(cls, backend, budget, prepare=None):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    ref = cls(budget=budget)
    model = copy.deepcopy(ref)
    if isinstance(ref, CompiledInside):
        ref.compiled = list(ref.blocks)  # the reference is all eager
    if prepare is not None:
        prepare(ref), prepare(model)
    return ref, model, torch.compile(model, backend=backend)


def assert_same_grads(ref, model, compiled_model, steps=2):
    for step in range(steps):
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(step))
        ref.zero_grad(), model.zero_grad()
        a, b = ref(x), compiled_model(x)
        a.backward(), b.backward()
        assert_close_scaled(b.detach(), a.detach(), "loss")
        for (name, p), q in zip(ref.named_parameters(), model.parameters()):
            assert_close_scaled(q.grad, p.grad, name)


def checkpointed(m):
    checkpoint_blocks(m, budget=m.budget)


CASES = [(Looped, None), (Unrolled, None), (PlainLoop, checkpointed), (LoopInForward, None), (CompiledInside, None)]


@pytest.mark.parametrize("budget", [0.0, 0.5])
@pytest.mark.parametrize("cls,prepare", CASES, ids=[c.__name__ for c, _ in CASES])
def test_compiled_grads_match_eager(cls, prepare, budget):
    assert_same_grads(*eager_and_compiled(cls, "aot_eager", budget, prepare))


@pytest.mark.parametrize("budget", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("cls,prepare", CASES[:4], ids=[c.__name__ for c, _ in CASES[:4]])
def test_no_graph_break(cls, prepare, budget):
    # A loop over checkpointed blocks compiles whole: one graph, no break, from the first call.
    ref, model, compiled_model = eager_and_compiled(cls, "aot_eager", budget, prepare)
    compiled_model(torch.randn(6, 5)).backward()
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1


def test_own_forward_is_one_owner_eagerly_and_compiled():
    # A block's own forward is a bound method eagerly and a partial while dynamo traces (torch
    # 2.11's dynamo cannot trace function.__get__): both key the region on the block and its
    # class's forward, and the compiled call traces whole on every torch.
    block = Block(4)
    eager = own_forward(block)
    assert eager.__self__ is block and eager.__func__ is Block.forward
    fn, args, _ = unwrap(functools.partial(Block.forward, block), (torch.randn(2, 4),), {})
    assert compiled.owner_of(fn, args) == compiled.owner_of(eager, (torch.randn(2, 4),)) == (block, Block.forward)
    x = torch.randn(2, 4)
    torch._dynamo.reset()
    out = torch.compile(lambda x: own_forward(block)(x), backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(out, block(x), rtol=0, atol=0)
    # Python that runs eagerly while compiling (a region planned on fake tensors) gets the method.
    from torch._dynamo.comptime import comptime

    _WHILE_COMPILING.update(block=block, seen=None)

    def planned_while_compiling(x):
        comptime(_own_forward_while_compiling)
        return x + 1

    torch.compile(planned_while_compiling, backend="eager", fullgraph=True)(x)
    assert _WHILE_COMPILING["seen"].__self__ is block


_WHILE_COMPILING = {}


def _own_forward_while_compiling(ctx):  # (a comptime function has no free variables)
    _WHILE_COMPILING["seen"] = own_forward(_WHILE_COMPILING["block"])


def test_inductor_grads_match_eager():
    # The real backend once (it compiles C++ on CPU: slow).
    ref, model, compiled_model = eager_and_compiled(Looped, "inductor", 0.5)
    assert_same_grads(ref, model, compiled_model)
    assert counters["stats"]["unique_graphs"] == 1 and dict(counters["graph_break"]) == {}


@pytest.mark.parametrize("cls,prepare", CASES[:3], ids=[c.__name__ for c, _ in CASES[:3]])
def test_compiled_training_with_fused_accum_matches_eager(cls, prepare):
    ref, model, compiled_model = eager_and_compiled(cls, "aot_eager", 0.5, prepare)
    opts = [FusedAccumOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), 3) for m in (ref, model)]
    gen = torch.Generator().manual_seed(0)
    for micro in range(6):
        x = torch.randn(4, 5, generator=gen)
        for m, opt in zip((ref, compiled_model), opts):
            m(x).backward()
            assert opt.step() == (micro % 3 == 2)
            opt.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert_close_scaled(q, p, name)


def test_the_compiled_plan_is_the_eager_plan():
    # Planned at trace time on fake tensors, the region keeps what its eager trace's plan keeps.
    ref, model, compiled_model = eager_and_compiled(Looped, "aot_eager", 0.5)
    x = torch.randn(6, 5)
    gradaccel.reset_plans()
    ref(x).backward()
    compiled_model(x).backward()
    for eager_block, block in zip(ref.blocks, model.blocks):
        (region,) = STATE.regions[eager_block].values()
        policy = compiled.find(block, None, 0.5, True, "flops")
        assert isinstance(policy, compiled.Policy)
        assert policy is compiled.policy_of(region.plan)  # interned: equal plans, one object


def _saved_activation_bytes(fn, x, module):
    """Bytes of the storages autograd saves for ``fn(x)``'s backward, but for ``module``'s
    parameters, the input and the output (what a checkpointed region holds for backward)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fn(x)
    held = {storage_key(t) for t in [*module.parameters(), x, y]}
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in saved if storage_key(t) not in held}.values())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_region_keeps_within_its_budget(backend):
    # The budget means bytes under compile too: what the compiled graph saves for backward,
    # measured, is within the plan's budget, and a lower budget never keeps more.
    torch.manual_seed(0)
    block, x = Block(32), torch.randn(4, 17, 32, requires_grad=True)
    kept = []
    for budget in (0.1, 0.3, 0.5, 0.8):
        torch._dynamo.reset()
        counters.clear()
        plan = compiled.plan_on_fakes(block, (x,), {}, budget, True, "flops", module=block)
        fn = torch.compile(lambda h, b=budget: gradaccel.checkpoint(block, h, budget=b), backend=backend)
        kept.append(_saved_activation_bytes(fn, x, block))
        assert dict(counters["graph_break"]) == {}
        assert kept[-1] <= plan.budget_bytes, (budget, kept[-1], plan.budget_bytes)
    assert kept == sorted(kept) and kept[0] < kept[-1]


def test_policies_survive_copy_and_pickle():
    torch.manual_seed(0)
    block, x = Block(8), torch.randn(3, 8, requires_grad=True)
    policy = compiled.policy_of(compiled.plan_on_fakes(block, (x,), {}, 0.5, True, "flops", module=block))
    assert isinstance(policy, compiled.Policy)
    assert copy.deepcopy(policy) is policy and pickle.loads(pickle.dumps(policy)) is policy


def test_region_that_reads_data_falls_back_eagerly():
    # .item() cannot be planned on fake tensors: warned, and the region runs eagerly (a graph
    # break), with the gradients of eager mode.
    class Reads(Block):
        def forward(self, x):
            return super().forward(x) * (1 + x.detach().abs().max().item())

    torch.manual_seed(0)
    block = Reads(8)
    ref = copy.deepcopy(block)
    x = torch.randn(3, 8, requires_grad=True)
    torch._dynamo.reset()
    fn = torch.compile(lambda h: gradaccel.checkpoint(block, h, budget=0.5), backend="aot_eager")
    with pytest.warns(UserWarning, match="could not be planned while compiling"):
        fn(x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    ref(x).sum().backward()
    assert_close_scaled(expected, x.grad, "x.grad")
