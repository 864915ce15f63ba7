"""torch.compile'd models that call gradaccel.checkpoint and step a FusedAccumOptimizer, against eager.

Where dynamo breaks the graph (the README's torch.compile note, checked by
test_graph_breaks_are_at_checkpoint_calls): every gradaccel.checkpoint call is a break and its
region runs eagerly. When the call sits in a Python loop (a loop over blocks, and so
checkpoint_blocks and HF gradient checkpointing), dynamo cannot resume inside the loop and runs
the whole function holding the loop eagerly; the code around the call to that function, and
code between checkpoint calls outside loops, is compiled.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import gradaccel
from gradaccel import checkpoint_blocks
from gradaccel import FusedAccumOptimizer


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


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
    """No loop around the calls: dynamo compiles the code between them."""

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
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{name}: {m}")


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


def assert_same_grads(ref, model, compiled, steps=2):
    for step in range(steps):
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(step))
        ref.zero_grad(), model.zero_grad()
        a, b = ref(x), compiled(x)
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


def test_inductor_grads_match_eager():
    # The real backend once (it compiles C++ on CPU: slow), on the model it has graphs for.
    ref, model, compiled = eager_and_compiled(Unrolled, "inductor", 0.5)
    assert_same_grads(ref, model, compiled)
    assert counters["stats"]["unique_graphs"] >= 1


@pytest.mark.parametrize("cls,prepare", CASES[:3], ids=[c.__name__ for c, _ in CASES[:3]])
def test_compiled_training_with_fused_accum_matches_eager(cls, prepare):
    ref, model, compiled = eager_and_compiled(cls, "aot_eager", 0.5, prepare)
    opts = [FusedAccumOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), 3) for m in (ref, model)]
    gen = torch.Generator().manual_seed(0)
    for micro in range(6):
        x = torch.randn(4, 5, generator=gen)
        for m, opt in zip((ref, compiled), opts):
            m(x).backward()
            assert opt.step() == (micro % 3 == 2)
            opt.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert_close_scaled(q, p, name)


def test_graph_breaks_are_at_checkpoint_calls():
    # What the README says: one break per gradaccel.checkpoint call, the code around compiled...
    ref, model, compiled = eager_and_compiled(Unrolled, "aot_eager", 0.5)
    compiled(torch.randn(6, 5)).backward()
    # Compiled: inp+tanh, `h * 2`, `h.relu()` between the calls, and out+loss after them.
    assert counters["stats"]["unique_graphs"] == 4
    assert sum(counters["graph_break"].values()) >= 2
    # Every break is dynamo refusing to trace into gradaccel.checkpoint, nothing else.
    assert all("`checkpoint`" in reason for reason in counters["graph_break"]), list(counters["graph_break"])
    # ...a loop around the calls makes the function holding the loop run eagerly; the code
    # around the call to that function is still compiled (inp+tanh before, out+loss after)...
    ref, model, compiled = eager_and_compiled(Looped, "aot_eager", 0.5)
    compiled(torch.randn(6, 5)).backward()
    assert counters["stats"]["unique_graphs"] == 2
    # ...so a loop written in forward itself leaves nothing compiled.
    ref, model, compiled = eager_and_compiled(LoopInForward, "aot_eager", 0.5)
    compiled(torch.randn(6, 5)).backward()
    assert counters["stats"]["unique_graphs"] == 0


def test_hf_llama_compiled_with_checkpoint_blocks():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model = checkpoint_blocks(copy.deepcopy(ref), budget=0.5)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        ref.zero_grad(), model.zero_grad()
        a = ref(input_ids=ids, labels=ids, use_cache=False).loss
        b = compiled(input_ids=ids, labels=ids, use_cache=False).loss
        a.backward(), b.backward()
        assert_close_scaled(b.detach(), a.detach(), "loss")
        for (name, p), q in zip(ref.named_parameters(), model.parameters()):
            assert_close_scaled(q.grad, p.grad, name)
