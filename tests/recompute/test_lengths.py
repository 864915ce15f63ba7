"""Plans across sequence lengths: one trace per structure, every new length planned from size
formulas (gradaccel/recompute/structure.py, symbolic.py, formulas.py), checked against no checkpointing at each length."""

import copy
import math
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import gradaccel
from _models import Block, GPTConfig, assert_grads_match
from gradaccel.recompute import formulas as _formulas
from gradaccel.recompute import structure as _structure
from gradaccel.recompute.state import STATE
from gradaccel.recompute.roles import Source
from gradaccel.recompute.checkpoint import plan_rows, reset_plans
from gradaccel.recompute.region import MAX_PLANS
from gradaccel.memory.counter import held_activation_bytes
from gradaccel.recompute.block_plan import BlockPlan, set_plan

# Traced at the first; then shorter and longer than any seen, one equal to n_embd (64).
LENGTHS = [24, 9, 40, 64, 3, 57, 24, 31]


@pytest.fixture(autouse=True)
def _fresh_plans():
    reset_plans()
    yield
    reset_plans()


def traces(owner) -> list:
    """Traced calls of each structure of ``owner``."""
    return [s.traces for s in STATE.shapes.get(owner, {}).values()]


def outside_reads(plan) -> set:
    """ids of the tensors ``plan``'s replay reads from outside its region's arguments."""
    return {id(src.at()) for src in plan.leaf_sources.values() if src.source is Source.OBJ}


def step(fn, module, inputs, seed):
    """One step: (output, gradients of parameters then inputs, activation bytes its forward
    leaves alive, FLOPs of its backward)."""
    torch.manual_seed(seed)
    out, held = held_activation_bytes(fn, *inputs)
    wrt = [p for p in module.parameters() if p.requires_grad] + [x for x in inputs if x.requires_grad]
    with FlopCounterMode(display=False) as counter:
        grads = torch.autograd.grad(out.float().square().sum(), wrt)
    return out, grads, held, counter.get_total_flops()


def check_length(fn, module, inputs, budget, seed, owner, exact=True, diverged=False) -> bool:
    """The first call at a length: the same outputs and gradients as no checkpointing (bit for
    bit where the same kernels run), held bytes within the budget, and, unless the call traced
    (a new structure), recompute within that length's plan. Returns whether it traced."""
    before = sum(traces(owner))
    out, grads, held, flops = step(fn, module, inputs, seed)
    traced = sum(traces(owner)) > before
    ref_out, ref_grads, full, plain = step(module, module, inputs, seed)
    for a, b in zip((ref_out, *ref_grads), (out, *grads), strict=True):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * (a.abs().max().item() or 1.0))
    if diverged:  # kept what it saved from where it strayed: no plan to hold it to
        return traced
    shape = str(tuple(inputs[0].shape))
    (row,) = [r for r in plan_rows() if r["signature"].startswith(shape)]
    outside = full - row["total_bytes"]  # made outside the region (a mask, rotary tables), held by both
    assert row["kept_bytes"] <= row["budget_bytes"] <= budget * row["total_bytes"]
    assert held <= outside + row["budget_bytes"]
    if not traced:
        assert 0 <= flops - plain <= row["recompute_flops"]
    return traced


@pytest.mark.parametrize("budget", [0.3, 0.6])
def test_gpt_block_every_length_matches_and_stays_within_plan(budget):
    torch.manual_seed(0)
    block = Block(GPTConfig(seq_len=128, n_embd=64, n_head=4, dropout=0.1))  # a mask sliced to each length
    fn = lambda t: gradaccel.checkpoint(block, t, budget=budget)  # noqa: E731
    for seed, T in enumerate(LENGTHS):
        check_length(fn, block, [torch.randn(2, T, 64, requires_grad=True)], budget, seed, block)
    assert traces(block) == [1]  # one structure, traced once; every other length from formulas
    assert sum(s.sized for s in STATE.shapes[block].values()) == len(set(LENGTHS)) - 1


def _llama(attn, layers=1):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   attention_dropout=0.1, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)


class _Layer(nn.Module):
    """An HF Llama decoder layer called as HF calls it, on (hidden, padding mask) of any length:
    rotary embeddings and a 4D causal mask with padding made per call (both depend on T)."""

    def __init__(self, model):
        super().__init__()
        self.layer, self.rotary = model.model.layers[0], model.model.rotary_emb

    def inputs(self, h, keep):
        B, T, _ = h.shape
        cos, sin = self.rotary(h, torch.arange(T).expand(B, T))
        allowed = torch.ones(T, T, dtype=torch.bool).tril() & keep[:, None, None, :].bool()
        mask = torch.zeros(B, 1, T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)
        return mask, cos, sin

    def forward(self, h, keep):
        mask, cos, sin = self.inputs(h, keep)
        return gradaccel.checkpoint(self.layer, h, attention_mask=mask, position_embeddings=(cos, sin),
                                    budget=self.budget) if self.budget is not None else \
            self.layer(h, attention_mask=mask, position_embeddings=(cos, sin))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_llama_layer_every_length_matches_and_stays_within_plan(attn):
    layer = _Layer(_llama(attn)).train()
    checkpointed = copy.copy(layer)
    layer.budget, checkpointed.budget = None, 0.5
    # The baseline is the same layer: gradients land in the same parameters.
    for seed, T in enumerate(LENGTHS):
        for B in (1, 3):
            h = torch.randn(B, T, 32, requires_grad=True)
            keep = torch.ones(B, T)
            keep[B - 1, T - T // 3:] = 0  # the last row padded (batch 1: its own tail): the mask changes with T
            module = _Bound(layer, keep)
            check_length(_Bound(checkpointed, keep), module, [h], 0.5, seed, layer.layer, exact=False)
    assert traces(layer.layer) == [1, 1]  # batch 1 and batch 3 (size 1 is specialised): one trace each


class _Bound(nn.Module):
    """``layer`` with its padding fixed, as a one-argument function of the hidden states."""

    def __init__(self, layer, keep):
        super().__init__()
        self.inner, self.keep = layer, keep

    def forward(self, h):
        return self.inner(h, self.keep)


def test_hf_model_over_lengths_traces_each_layer_once():
    ref = _llama("sdpa", layers=2)
    model = copy.deepcopy(ref)
    gradaccel.checkpoint_blocks(model, budget=0.5)
    ref.train(), model.train()
    for seed, T in enumerate([12, 5, 33, 12, 20]):
        ids = torch.randint(1, 64, (2, T), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones(2, T, dtype=torch.long)
        mask[1, T // 2:] = 0
        for m in (ref, model):
            torch.manual_seed(seed)
            m(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
        assert_grads_match(ref, model)
        ref.zero_grad(), model.zero_grad()
    for layer in model.model.layers:
        assert traces(layer) == [1]
    assert len(plan_rows()) == 2 * 4  # a plan per layer and length, none traced twice
    # The layers, called one after another at a new length (20), size and plan it once: the
    # second layer's trace holds the first's sized ops, and its plan is the first's choice and
    # replay program, reading the second layer's own parameters.
    regions = [list(STATE.regions[layer].values())[-1] for layer in model.model.layers]
    first, second = (r.graph for r in regions)
    assert first.sized and second.sized and first.shared is second.shared and first.shared.arrays
    assert first.ops is second.ops and any(isinstance(op, _formulas._SizedOp) for op in first.ops)
    a, b = regions[0].plan, regions[1].plan
    assert a.steps is b.steps and a.reads is b.reads and a.steps
    params = [{id(p) for p in layer.parameters()} for layer in model.model.layers]
    objs = [outside_reads(p) for p in (a, b)]
    assert objs[0] and len(objs[0]) == len(objs[1])
    assert objs[0] <= params[0] and objs[1] <= params[1]


def test_blocks_given_their_own_budgets_are_sized_and_planned_once_per_length():
    """memory= and fit give each block its own budget (bytes, or a share): an input of the plan,
    not of the trace, so the blocks stay one kind. One symbolic pass serves both, and at a new
    length the second is sized from the first's trace; at an equal budget it gets the first's
    plan, reading its own weights."""
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=128, n_embd=64, n_head=4)
    blocks = nn.Sequential(Block(cfg), Block(cfg))
    ref = copy.deepcopy(blocks)

    def run(budgets, t):
        x = torch.randn(2, t, 64, generator=torch.Generator().manual_seed(t))
        y, z = x.clone().requires_grad_(), x.clone().requires_grad_()
        for block, budget in zip(blocks, budgets):
            set_plan(block, BlockPlan.parse(budget))  # as memory= sets it
            y = gradaccel.checkpoint(block, y, budget=budget)
        y.square().sum().backward(), ref(z).square().sum().backward()
        assert_grads_match(ref, blocks)
        ref.zero_grad(), blocks.zero_grad()

    for t in (24, 9, 40):
        run((30_000, 0.5), t)
    structures = [s for block in blocks for s in STATE.shapes[block].values()]
    assert [s.traces for s in structures] == [1, 1] and sum(s.passes for s in structures) == 1
    run((0.5, 0.5), 33)
    first, second = (list(STATE.regions[block].values())[-1] for block in blocks)
    assert first.graph.sized and second.graph.sized and first.graph.ops is second.graph.ops
    assert first.plan.steps is second.plan.steps and first.plan.steps
    weights = [{id(p) for p in block.parameters()} for block in blocks]
    for plan, own in zip((first.plan, second.plan), weights):
        read = outside_reads(plan)
        assert read and read <= own


class _Branchy(nn.Module):
    """A block whose path depends on the length (a guard) and on an attribute the plan cache
    cannot see (a list): both are structure changes."""

    def __init__(self):
        super().__init__()
        self.lin, self.mode = nn.Linear(16, 16), ["sigmoid"]

    def forward(self, x):
        h = self.lin(x)
        if x.shape[1] > 20:  # a branch on the length: the symbolic pass records it as a guard
            h = F.gelu(h) * h
        return (h.sigmoid() if self.mode[0] == "sigmoid" else h.tanh()) * h.exp()


def test_structure_change_with_the_length_is_traced_again():
    m = _Branchy()
    fn = lambda t: gradaccel.checkpoint(m, t, budget=0.3)  # noqa: E731
    for seed, T in enumerate([8, 12, 30, 17, 25, 40, 9]):
        x = torch.randn(2, T, 16, requires_grad=True)
        check_length(fn, m, [x], 0.3, seed, m)
    assert traces(m) == [2]  # T <= 20, then T > 20: each path traced once, the rest sized
    # A change the formulas cannot see: the sized call notices the saved tensors differ, keeps
    # what it saves (correct gradients), and the next call at that length traces again.
    m.mode[0] = "tanh"
    with pytest.warns(UserWarning, match="saved different tensors"):
        check_length(fn, m, [torch.randn(2, 13, 16, requires_grad=True)], 0.3, 7, m, diverged=True)
    assert check_length(fn, m, [torch.randn(2, 13, 16, requires_grad=True)], 0.3, 8, m)
    assert traces(m) == [3]


def test_length_equal_to_hidden_size_is_no_formula_mixup():
    # Traced at T = n_embd: one symbol per size, so T and the hidden size stay apart.
    torch.manual_seed(0)
    block = Block(GPTConfig(seq_len=128, n_embd=32, n_head=4, dropout=0.0))
    fn = lambda t: gradaccel.checkpoint(block, t, budget=0.5)  # noqa: E731
    for seed, T in enumerate([32, 20, 45, 32]):
        check_length(fn, block, [torch.randn(2, T, 32, requires_grad=True)], 0.5, seed, block)
    assert traces(block) == [1]


def test_thousand_lengths_keep_state_flat():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    x0 = torch.randn(1001, 4)
    counts = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the structure does not change
        for T in range(2, 1002):
            gradaccel.checkpoint(net, x0[:T].clone().requires_grad_(), budget=0.5).sum().backward()
            if T in (301, 1001):
                gc.collect()
                counts.append(len(gc.get_objects()))
    assert traces(net) == [1]
    assert len(STATE.regions[net]) <= MAX_PLANS and len(STATE.shapes[net]) == 1
    assert len(STATE.in_order) < 2 * MAX_PLANS and len(STATE.kinds) == 1  # dead references swept out
    assert len(STATE.shapes[net][next(iter(STATE.shapes[net]))].templates) <= _structure.MAX_TEMPLATES
    assert counts[1] - counts[0] < 500  # host objects flat: plans per length are dropped, not kept


def _cheap_cost(op):
    """A cost callable: FLOPs plus bytes, and host copies priced as free (so offload is used)."""
    return 0.0 if op.name == "gradaccel.offload" else float(op.flops + op.bytes)


@pytest.mark.parametrize("options", [dict(offload=True, cost=_cheap_cost), dict(cost=_cheap_cost)])
def test_offload_and_cost_callable_across_lengths(options):
    torch.manual_seed(0)
    block = Block(GPTConfig(seq_len=128, n_embd=64, n_head=4, dropout=0.1))
    fn = lambda t: gradaccel.checkpoint(block, t, budget=0.2, **options)  # noqa: E731
    for seed, T in enumerate([24, 9, 40, 17]):
        check_length(fn, block, [torch.randn(2, T, 64, requires_grad=True)], 0.2, seed, block)
    assert traces(block) == [1]
    if options.get("offload"):  # the sized plans offload too, each by its own length's bytes
        assert all(r["offloaded_bytes"] > 0 for r in plan_rows())


class _Pinned(nn.Module):
    """Scales by a Python float computed from the length: each length is its own path."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return (h * (1.0 / math.sqrt(x.shape[1]))).sin() * h


def test_size_pinned_by_python_arithmetic_is_traced_per_length_and_warned_about():
    m = _Pinned()
    fn = lambda t: gradaccel.checkpoint(m, t, budget=0.5)  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed, T in enumerate(range(3, 3 + 4 * _structure.MAX_TEMPLATES + 2)):
            check_length(fn, m, [torch.randn(2, T, 8, requires_grad=True)], 0.5, seed, m)
    (structure,) = STATE.shapes[m].values()
    assert structure.traces == 4 * _structure.MAX_TEMPLATES + 2 and structure.sized == 0
    assert structure.passes == _structure.MAX_TEMPLATES  # not one symbolic pass per length
    assert sum("for one structure" in str(w.message) for w in caught) == 1


def test_new_length_under_autocast_reads_no_cast_from_the_symbolic_pass():
    # One autocast region over several lengths: autocast caches each weight's bf16 cast for the
    # whole region, and a cast made on fake tensors must not be what the real forward reads.
    torch.manual_seed(0)
    block = Block(GPTConfig(seq_len=64, n_embd=32, n_head=4, dropout=0.0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for seed, T in enumerate([12, 20, 7]):
            x = torch.randn(2, T, 32, requires_grad=True)
            torch.manual_seed(seed)
            ref = block(x)
            torch.manual_seed(seed)
            out = gradaccel.checkpoint(block, x, budget=0.5)
            assert type(out) is torch.Tensor and torch.equal(out, ref)
            out.float().sum().backward()


def test_symbolic_pass_leaves_autocast_cache_alone():
    # Under autocast, a cast of a parameter is cached until the outermost autocast exits. The
    # symbolic pass at a new length casts the parameters on fake tensors: had those casts gone
    # into the cache, the real forward right after it (same autocast region) would read fake
    # weights (garbage numbers: SFTTrainer's bf16 default). Stock runs the same autocast.
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    for seed, T in enumerate([12, 7, 20]):
        x = torch.randn(2, T, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.manual_seed(seed)
            out = gradaccel.checkpoint(mlp, x, budget=0.5)
            assert type(out) is torch.Tensor  # not a FakeTensor of the symbolic pass
            ref = mlp(x)
        assert torch.equal(out, ref), T
        grads = torch.autograd.grad(out.float().sum(), [x, *mlp.parameters()])
        ref_grads = torch.autograd.grad(ref.float().sum(), [x, *mlp.parameters()])
        for a, b in zip(grads, ref_grads, strict=True):
            assert torch.equal(a, b)
    assert traces(mlp) == [1]  # the later lengths came from formulas


def test_symbolic_pass_nested_autocast_falls_back_to_tracing():
    # A region that turns autocast's cache on itself (cache_enabled=True) turns it back on inside
    # the symbolic pass: that pass cannot keep its casts out of the cache, so it is not used
    # (traced per length).
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)

    def region(t):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
            return lin(t).relu()

    for T in (12, 7, 20):
        x = torch.randn(2, T, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = gradaccel.checkpoint(region, x, budget=0.5)
            assert type(out) is torch.Tensor
            ref = region(x)
        assert torch.equal(out, ref), T
    assert traces(region) == [3]


def test_symbolic_pass_runs_no_module_hooks():
    # Hooks of modules inside the region (HF's output capturing, a user's probe) are Python with
    # side effects on real objects: the symbolic pass must not run them, or they would see (and
    # keep) fake tensors and run once more than stock. Each call runs them once, on real tensors.
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    seen, pre = [], []
    mlp[0].register_forward_hook(lambda m, a, o: seen.append(o))
    mlp[2].register_forward_pre_hook(lambda m, a: pre.append(a[0]))
    for T in (12, 7, 20):
        x = torch.randn(2, T, 16, requires_grad=True)
        out = gradaccel.checkpoint(mlp, x, budget=0.5)
        assert torch.equal(out, mlp[2](mlp[1](mlp[0](x).detach())))  # the hooks ran too: three more entries
        torch.autograd.grad(out.sum(), [x, *mlp.parameters()])
    assert [type(t) for t in seen + pre] == [torch.Tensor] * 12
    assert [t.shape[1] for t in seen] == [12, 12, 7, 7, 20, 20]
    assert traces(mlp) == [1]  # hooks that only observe leave the sizes to formulas


def test_hook_that_changes_the_output_is_traced_per_length():
    # Skipped by the symbolic pass, a hook that computes leaves that pass unlike the template:
    # its formulas are not used, and each length is traced (right numbers, never fake weights).
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    mlp[0].register_forward_hook(lambda m, a, o: o * 2)
    for T in (12, 7, 20):
        x = torch.randn(2, T, 16, requires_grad=True)
        out = gradaccel.checkpoint(mlp, x, budget=0.5)
        ref = mlp(x)
        assert torch.equal(out, ref), T
        for a, b in zip(torch.autograd.grad(out.sum(), [x, *mlp.parameters()]),
                        torch.autograd.grad(ref.sum(), [x, *mlp.parameters()]), strict=True):
            assert torch.equal(a, b)
    assert traces(mlp) == [3]


class _Memo(nn.Module):
    """Keeps a statistic of its last output as a tensor attribute, read by its next call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.last = None

    def forward(self, t):
        out = self.lin(t).relu()
        if self.last is not None:
            out = out + self.last
        self.last = out.detach().mean(dim=(0, 1))
        return out


def test_symbolic_pass_leaves_module_attributes_as_they_were():
    # The pass must not leave its writes on the module: its fake ``last`` would be what the real
    # forward right after it reads (a fake output). Attributes it rebinds are put back.
    torch.manual_seed(0)
    m, ref = _Memo(), _Memo()
    ref.load_state_dict(m.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the region reads state beyond its arguments: warned about
        for T in (12, 7, 20):
            x = torch.randn(2, T, 16, requires_grad=True)
            out = gradaccel.checkpoint(m, x, budget=0.5)
            assert type(out) is torch.Tensor and type(m.last) is torch.Tensor
            assert torch.equal(out, ref(x)) and torch.equal(m.last, ref.last)


class _IntArg(nn.Module):
    """A region that takes a length as a plain int (as HF's ``max_length_q``) and uses it."""

    def __init__(self, branch):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.branch = branch

    def forward(self, x, n):
        if self.branch:
            h = self.lin(x)
            if n > 10:  # a branch on the int: a guard of the symbolic pass
                h = F.gelu(h) * h
            return h.sigmoid() * h.exp() * n
        h = self.lin(x[:, :n])
        return (h.sigmoid() * h.exp()).reshape(x.shape[0], n * 16)


@pytest.mark.parametrize("branch", [False, True], ids=["slice", "branch"])
def test_int_argument_is_a_size(branch):
    torch.manual_seed(0)
    m = _IntArg(branch)
    ns = [5, 9, 12, 30, 7, 15, 3] if branch else [5, 9, 3, 12, 7, 17]
    for seed, n in enumerate(ns):
        x = torch.randn(2, 20, 16, requires_grad=True)  # only n changes
        outs = []
        for fn in (lambda *a: gradaccel.checkpoint(m, *a, budget=0.3), m):
            torch.manual_seed(seed)
            out = fn(x, n)
            outs.append((out, *torch.autograd.grad(out.square().sum(), [x, *m.parameters()])))
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b), n
    (structure,) = STATE.shapes[m].values()
    # One trace per path (n <= 10, then n > 10), every other call sized from formulas that read n.
    assert (structure.traces, structure.sized) == ((2, len(ns) - 2) if branch else (1, len(ns) - 1))
    formulas = [t.formulas for t in structure.templates if t.formulas]
    assert formulas and all(("int", 1, None) in f.sources.values() for f in formulas)
