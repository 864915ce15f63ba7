"""memory= and fit's applied plan across sequence lengths (gradaccel/memory/lengths.py): the profile at
a length that was not run is predicted exactly, every length gets its own plan within the
target, gradients are those without checkpointing, and no fake-tensor profile runs per length."""

import copy
import warnings

import pytest
import torch

import gradaccel
from gradaccel.memory.split import least_recompute
from gradaccel.memory.lengths import LengthProfile, profile_lengths
from gradaccel.memory.profile import KEEP_ALL, Profile, profile_runs
from gradaccel.memory.target import MemoryTarget, _step
from gradaccel.memory.counter import LiveBytes, measured_peak
from gradaccel.recompute.block_plan import plan_of
from _models import PlainBlock

transformers = pytest.importorskip("transformers")


def _llama(layers=2):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=80, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                   max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).train()


class _GPT(torch.nn.Module):
    """Not a Hugging Face model (no loss in chunks): token ids in, logits out."""

    def __init__(self, vocab=64, width=32, heads=4, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(PlainBlock(width, heads, materialised=True) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_predicted_profile_equals_the_profile_at_that_length():
    """Fitted at four lengths, the profile at another equals a fake-tensor run there: the
    step's phases, each candidate plan (the planner's own plan at that length for its bytes)
    with its block peaks, and so the peak of any split, to the byte."""
    model = _llama(layers=2)

    def make(t):
        ids = torch.zeros(1, t, dtype=torch.long)
        return Profile(model, _step, ((), {"input_ids": ids, "labels": ids, "use_cache": False}), grad_hooks=False,
                       trajectories=True)

    lp = LengthProfile(make, profile_lengths(64))
    assert lp.failed is None and len(lp.lengths) == 4
    t = 41
    assert t not in lp.lengths and lp.covers(t)
    pred, real = lp.at(t), make(t)
    assert pred.phases == real.phases and pred.pre == real.pre and pred.held == real.held
    for kp, kr in zip(pred.kinds, real.kinds):
        assert len(kp.frontier) >= 4
        for p in kp.frontier:  # equality, not a tolerance: bytes, FLOPs and costs are integers
            q = kr.plan_at(p.budget)
            assert (p.kept, p.cost, p.flops, p.replay_bytes, p.plan.keep) == (q.kept, q.cost, q.flops, q.replay_bytes,
                                                                             q.plan.keep)
            assert (pred.block_forward_peak(kp, p), pred.block_peak(kp, p)) == \
                   (real.block_forward_peak(kr, q), real.block_peak(kr, q))
        assert pred.block_peak(kp, KEEP_ALL) == real.block_peak(kr, KEEP_ALL)
    full = real.predict([real.kind_of[i].frontier[-1] for i in range(len(real.blocks))])["peak"]
    for frac in (0.8, 0.95):
        memory = int(frac * full)
        a = least_recompute(pred, [pred.options(pred.kind_of[i]) for i in range(len(pred.blocks))], memory)
        b = least_recompute(real, [real.options(real.kind_of[i]) for i in range(len(real.blocks))], memory)
        assert a is not None and b is not None
        same = [real.kind_of[i].plan_at(p.budget) if isinstance(p.budget, int) else
                next(o for o in real.options(real.kind_of[i]) if o.plan == p.plan) for i, p in enumerate(a)]
        assert pred.predict(a)["peak"] == real.predict(same)["peak"] <= memory
    assert lp.block_runs == 0  # nothing run for the prediction


def _train_peak(model, ids):
    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        model(ids).float().sum().backward()
    return live.peak


def test_memory_holds_at_every_length_without_profiling_each():
    """memory= on a model trained at many lengths: the first length is profiled alone, the
    second profiles a range ahead of both (up to 256: the next power of two past twice the
    longer), then no fake-tensor profile runs for a length inside it; each length's measured
    peak is under the target and its gradients are those without checkpointing. A length past
    the range is profiled once, the range grows ahead of it, and lengths up to there are
    covered from then on."""
    gradaccel.reset_plans()
    ref, model = _GPT(), _GPT()
    ids = {t: torch.randint(0, 64, (1, t), generator=torch.Generator().manual_seed(t))
           for t in (16, 37, 101, 127, 128, 150, 160)}
    memory = int(0.97 * _train_peak(ref, ids[160]))
    gradaccel.checkpoint_blocks(model, memory=memory)
    target = next(h for h in model._forward_pre_hooks.values() if isinstance(h, MemoryTarget))
    before = profile_runs()
    _train_peak(model, ids[128])
    assert profile_runs() - before == 1  # one length so far: profiled alone (fixed-length data needs no more)
    model(ids[16])
    runs = profile_runs()
    assert runs - before == 5  # a second length: the range, 8, 68, 98, 128 (profile_lengths)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="gradaccel")  # none of ours: the target fits at each length
        for t in (16, 37, 101, 127, 128, 160, 150):
            model(ids[t])  # plans this length
            assert profile_runs() == runs, t  # 160 and 150 too: inside the range, ahead of the data
            peak = _train_peak(model, ids[t])
            ref_peak = _train_peak(ref, ids[t])
            assert peak <= memory, (t, peak, memory)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
            (mode, predicted, _), = [v for k, v in target.chosen.items() if k == (((1, t), torch.int64),)]
            assert predicted <= memory and (ref_peak <= memory or predicted < ref_peak)
    assert _train_peak(ref, ids[16]) <= memory < _train_peak(ref, ids[160])  # some lengths need no checkpoint
    (lp,) = target.lengths.values()
    assert lp.lengths == [8, 132, 194, 256]
    with warnings.catch_warnings():
        # The target is below what these lengths can take: each is then profiled itself, and
        # said so (tested elsewhere). What is checked here is how far the range grows.
        warnings.simplefilter("ignore")
        model(torch.randint(0, 64, (1, 300)))  # past the range: it grows ahead of it, to 1024
        assert lp.lengths == [8, 132, 194, 256, 1024] and lp.failed is None
        model(torch.randint(0, 64, (1, 700)))
        assert lp.lengths == [8, 132, 194, 256, 1024]


def test_fit_applies_a_plan_per_length_up_to_seq():
    """fit(seq=128)'s applied plan at shorter lengths: re-planned per length for the same
    target, with no fake-tensor profile once applied; under the target at each, stock gradients,
    and at a short length the plan keeps more than the fitted byte budgets would say."""
    from gradaccel.memory.fit import Planner, hf_step

    gradaccel.reset_plans()
    shape_model = _llama(layers=3)
    planner = Planner(shape_model, optim=torch.optim.SGD(shape_model.parameters(), lr=0.1), loss_fn=hf_step)
    least = planner.estimate(128, 1, 1).peak
    most = planner.estimate(128, 1, 1.0).peak
    memory = (least + most) // 2
    result = planner.fit(128, 1, memory, slack=0)
    assert result.fits and not result.chunked_loss
    model, ref = _llama(layers=3), _llama(layers=3)
    model, opt = result.apply(model, torch.optim.SGD(model.parameters(), lr=0.0))
    runs = profile_runs()
    hook = next(h for h in model._forward_pre_hooks.values() if type(h).__name__ == "FittedLengths")
    for t in (9, 70, 128):
        ids = torch.randint(0, 96, (1, t), generator=torch.Generator().manual_seed(t))
        batch = {"input_ids": ids, "labels": ids}
        real = measured_peak(model, opt, hf_step, batch)
        assert real <= memory, (t, real, memory)
        loss, ref_loss = hf_step(model, batch), hf_step(ref, batch)
        torch.testing.assert_close(loss, ref_loss)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        for g, q in zip(grads, torch.autograd.grad(ref_loss, list(ref.parameters()))):
            torch.testing.assert_close(g, q, rtol=1e-4, atol=1e-6)
    assert profile_runs() == runs and not hook.profiled
    assert hook.plans[128] == result.budgets  # the fitted length: the fitted plan, unchanged
    assert hook.plans[9] != result.budgets


def test_memory_budgets_per_length_do_not_retrace_the_blocks():
    # memory= sets each block a byte budget per length; the budget is a plan input, not a trace
    # input, so a block is traced once and every other length (and budget) is sized, not traced.
    from gradaccel.recompute.state import STATE

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).train()
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 128, (1, 128))
    with LiveBytes() as live:
        ref(input_ids=ids, labels=ids).loss.backward()
    ref.zero_grad()
    gradaccel.checkpoint_blocks(model, memory=int(0.6 * live.peak))
    budgets = set()
    for t in (128, 100, 90, 77, 120, 64):
        x = ids[:, :t]
        ref(input_ids=x, labels=x).loss.backward()
        model(input_ids=x, labels=x).loss.backward()
        for (name, p), q in zip(ref.named_parameters(), model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
        ref.zero_grad(), model.zero_grad()
        budgets.add(tuple(plan_of(layer).to_setting() for layer in model.model.layers))
    assert len(budgets) >= 3  # the plans really changed with the length
    traces = [s.traces for layer in model.model.layers for s in STATE.shapes.get(layer, {}).values()]
    assert sum(traces) <= len(model.model.layers), traces


def test_memory_with_seq_profiles_the_stated_range_at_the_first_call():
    """checkpoint_blocks(memory=..., seq=160): the first call, at 16 tokens, profiles the range up
    to 160 (four fake-tensor runs); no length up to seq is profiled again, each stays under the
    target, and a length past seq is profiled once with a warning."""
    gradaccel.reset_plans()
    ref, model = _GPT(), _GPT()
    ids = {t: torch.randint(0, 64, (1, t), generator=torch.Generator().manual_seed(t)) for t in (16, 101, 160, 170)}
    memory = int(0.97 * _train_peak(ref, ids[160]))
    gradaccel.checkpoint_blocks(model, memory=memory, seq=160)
    before = profile_runs()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="gradaccel")
        for t in (16, 101, 160):
            model(ids[t])  # plans this length (LiveBytes would count the first call's fake tensors)
            assert profile_runs() == before + 4, t  # 8, 84, 122, 160: all at the first call
            assert _train_peak(model, ids[t]) <= memory, t
    with pytest.warns(UserWarning, match="longer than seq=160"):
        _train_peak(model, ids[170])
    assert profile_runs() == before + 5
    # A copy of the model plans for itself: its target keeps the settings, not the profiles
    # (fake copies of the model, which each profile run would otherwise copy again).
    twin = copy.deepcopy(model)
    hook = next(h for h in twin._forward_pre_hooks.values() if isinstance(h, MemoryTarget))
    assert (hook.memory, hook.seq, hook.lengths, hook.seen) == (memory, 160, {}, {})
    assert _train_peak(twin, ids[101]) > 0 and profile_runs() == before + 9


@pytest.mark.parametrize("kwargs, match", [({"seq": 128}, "with memory="),
                                           ({"memory": "1GiB", "seq": 0}, "seq must be an int"),
                                           ({"memory": "1GiB", "seq": 12.5}, "seq must be an int")])
def test_memory_seq_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gradaccel.checkpoint_blocks(_GPT(), **kwargs)


def test_profile_does_not_depend_on_the_plan_the_model_runs():
    """A profile made after a plan is applied (a fit's hook profiling a new length: blocks with
    different byte budgets, one run as its parts) groups the blocks and traces them as one made
    before: the plan is what the profile chooses, not what it measures. Found on fit's applied
    plan at padded batches of 4, which profiled every length."""
    from gradaccel.memory.lengths import _structure
    from gradaccel.memory.profile import PARTS, find_blocks
    from gradaccel.memory.target import set_plans

    model = _llama(layers=2)

    def make():
        ids = torch.zeros(1, 24, dtype=torch.long)
        return Profile(model, _step, ((), {"input_ids": ids, "labels": ids, "use_cache": False}), grad_hooks=False)

    plain = make()
    gradaccel.checkpoint_blocks(model, budget=0)
    set_plans(model, find_blocks(model), False, [PARTS, 4096])
    planned = make()
    assert [k.blocks for k in planned.kinds] == [k.blocks for k in plain.kinds] == [[0, 1]]
    assert _structure(planned.kinds[0].graph) == _structure(plain.kinds[0].graph)


def test_length_profiles_of_one_model_share_the_kinds_they_predict():
    """Two length profiles of one model's step (as memory='s step with the model's loss and with
    the loss in chunks) share a dict: a kind predicted at a length by one is the other's, planned
    once, and equals the kind a profile of its own predicts. Another model's kinds are its own."""
    model = _llama(layers=2)

    def make(t, m=model):
        ids = torch.zeros(1, t, dtype=torch.long)
        return Profile(m, _step, ((), {"input_ids": ids, "labels": ids, "use_cache": False}), grad_hooks=False,
                       trajectories=True)

    shared = {}
    a, b = LengthProfile(make, profile_lengths(64), shared), LengthProfile(make, profile_lengths(64), shared)
    alone = LengthProfile(make, profile_lengths(64))
    deeper = _llama(layers=3)
    other = LengthProfile(lambda t: make(t, deeper), profile_lengths(64), shared)
    ka, kb, kc = a.at(41).kinds[0], b.at(41).kinds[0], alone.at(41).kinds[0]
    assert ka is kb and ka is not kc
    assert [(p.kept, p.cost, p.plan.keep) for p in ka.frontier] == [(p.kept, p.cost, p.plan.keep) for p in kc.frontier]
    assert all(k is not ka for k in other.at(41).kinds)


def test_memory_runs_blocks_uncheckpointed_where_that_fits_without_planning_them():
    """Where the step fits with every block uncheckpointed, memory= chooses that (nothing is
    recomputed, so no plan recomputes less) without making a predicted kind's frontier (a
    planner call per candidate plan); where it does not fit, the split over the frontiers
    decides, as before."""
    gradaccel.reset_plans()
    ref, model = _GPT(), _GPT()
    ids = {t: torch.randint(0, 64, (1, t), generator=torch.Generator().manual_seed(t)) for t in (24, 101, 160)}
    memory = int(0.97 * _train_peak(ref, ids[160]))
    assert _train_peak(ref, ids[24]) <= memory
    gradaccel.checkpoint_blocks(model, memory=memory, seq=160)
    target = next(h for h in model._forward_pre_hooks.values() if isinstance(h, MemoryTarget))
    model(ids[24])
    assert target.seen[(((1, 24), torch.int64),)] == (False, [None, None])
    (lp,) = target.lengths.values()
    assert all("frontier" not in k.__dict__ for k in lp.at(24).kinds)  # never made at 24 tokens
    model(ids[160])
    head, settings = target.seen[(((1, 160), torch.int64),)]
    assert any(s is not None for s in settings)  # 160 tokens need a checkpoint: planned over the frontiers
    assert _train_peak(model, ids[160]) <= memory


def test_memory_with_seq_traces_the_blocks_at_the_first_call():
    """With seq, the first call traces each block's region and finds its size formulas, even at a
    length that needs no checkpoint (that one call keeps everything): a length that needs one
    later is sized, not traced and passed over symbolically in the middle of training."""
    from gradaccel.recompute.state import STATE

    gradaccel.reset_plans()
    ref, model = _GPT(), _GPT()
    ids = {t: torch.randint(0, 64, (1, t), generator=torch.Generator().manual_seed(t)) for t in (24, 101, 160)}
    memory = int(0.97 * _train_peak(ref, ids[160]))
    gradaccel.checkpoint_blocks(model, memory=memory, seq=160)
    target = next(h for h in model._forward_pre_hooks.values() if isinstance(h, MemoryTarget))
    structures = lambda: [s for b in model.blocks for s in STATE.shapes.get(b, {}).values()]  # noqa: E731
    model(ids[24]).sum().backward()  # the first call (LiveBytes would count its fake tensors)
    assert target.seen[(((1, 24), torch.int64),)] == (False, [None, None])  # no checkpoint needed at 24
    assert [s.traces for s in structures()] == [1, 1] and all(s.templates[0].formulas for s in structures())
    for t in (24, 160, 101):
        peak = _train_peak(model, ids[t])
        _train_peak(ref, ids[t])
        assert peak <= memory, t
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert any(s is not None for s in target.seen[(((1, 160), torch.int64),)][1])
    assert [s.traces for s in structures()] == [1, 1] and sum(s.sized for s in structures()) >= 2
