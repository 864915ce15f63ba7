"""A fit you can trust (#36): every kind of plan holds its predicted peak as the allocator counts
it (kernels' own scratch included), the same inputs give the same plan whatever the machine's
load, the fit says why it chose its plan, apply() refuses a model or optimizer the plan was not
made for, and on a CPU device host memory is no saving."""

import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gradaccel  # noqa: E402
from gradaccel.memory.counter import measured_peak  # noqa: E402
from gradaccel.memory.fit import Planner, _evaluate, _least, hf_step  # noqa: E402
from gradaccel.memory.fit_choice import NOISE, prefer  # noqa: E402
from gradaccel.memory.parts import is_nested, slices_of  # noqa: E402
from gradaccel.memory.profile import KEEP_ALL  # noqa: E402


def _llama(hidden, inter, layers, heads, kv, vocab, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                   max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).to(dtype).train()


def _batch(vocab, mb, seq):
    ids = torch.randint(0, vocab, (mb, seq))
    return {"input_ids": ids, "labels": ids}


def _allocated(plan, model_fn, vocab, optimizer=torch.optim.AdamW):
    """The applied plan's peak over a training window, as the allocator counts it."""
    gradaccel.reset_plans()
    model = model_fn()
    model, opt = plan.apply(model, optimizer(model.parameters()))
    return measured_peak(model, opt, hf_step, _batch(vocab, plan.micro_batch, plan.seq), by="allocator")


# -- 1. every plan holds its prediction ---------------------------------------------------------
ISSUE = (192, 512, 3, 4, 2, 1536)  # the issue's model: 3-layer Llama, fp32, hidden 192, vocabulary 1536


def test_the_issues_plan_with_the_loss_in_chunks_stays_under_its_target():
    """Batch 8 x 256 tokens, AdamW, target 0.6 of no checkpointing's predicted peak, slack 0,
    micro-batch 8: the loss in chunks was predicted at 93.8 MiB and allocated 102.9 MiB, 9% over
    the 94.1 MiB target (aten's logsumexp makes a chunk-sized temporary inside its kernel, which
    no dispatch-level count sees). Now it allocates what was predicted."""
    planner = Planner(_llama(*ISSUE), optim=torch.optim.AdamW(_llama(*ISSUE).parameters()))
    prof = planner.profile(256, 8)
    full = _evaluate(planner, 256, 8, 8, [prof.uncheckpointed(prof.kind_of[i]) for i in range(3)]).peak
    memory = int(0.6 * full)
    result = planner.fit(256, 8, memory, slack=0, micro_batches=[8])
    assert result.fits and result.chunked_loss, result.table()
    real = _allocated(result, lambda: _llama(*ISSUE), ISSUE[5])
    assert real <= memory and abs(real / result.peak - 1) <= 0.01, (real, result.peak, memory)


SMALL = (64, 176, 3, 4, 2, 384)
SEQ, MB = 128, 2


@pytest.fixture(scope="module")
def small():
    planner = Planner(_llama(*SMALL), optim=torch.optim.AdamW(_llama(*SMALL).parameters()), device="cuda")
    return planner


def _points(planner, kind, chunked):
    """One point per block of the plan kind ``kind``, from the profile's own candidates."""
    prof = planner.profile(SEQ, MB, chunked)
    out = []
    for i in range(len(prof.blocks)):
        k = prof.kind_of[i]
        options = prof.options(k)
        pick = {
            "keep-all": lambda: prof.uncheckpointed(k),
            "keep-nothing": lambda: k.zero,
            "keep-some": lambda: k.frontier[len(k.frontier) // 2],
            "parts": lambda: next(p for p in options if p.plan == "parts"),
            "tiles": lambda: next(p for p in options if slices_of(p.plan) > 1 and not is_nested(p.plan)),
            "nested": lambda: next(p for p in options if is_nested(p.plan)),
            "offload": lambda: k.offload_at(max(1, k.graph.activation_bytes // 20)),
            "host": lambda: k.frontier[len(k.frontier) // 2],
        }[kind]
        out.append(pick())
    return out


KINDS = ["keep-all", "keep-nothing", "keep-some", "parts", "tiles", "nested", "offload", "host"]


@pytest.mark.parametrize("chunked", [False, True], ids=["model-loss", "chunked-loss"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_plan_is_allocated_as_predicted(small, kind, chunked, monkeypatch):
    """Each kind of per-block plan, with the model's loss and in chunks, applied to a real model:
    the allocator's peak over a window (kernels' scratch included) within 5% of the prediction."""
    if kind == "offload":  # the copy's cost pinned low enough that offload pays (measured per process)
        cheap = lambda device, model="flops": 4.0  # noqa: E731
        monkeypatch.setattr(gradaccel.memory.step_peak, "offload_cost_per_byte", cheap)
        monkeypatch.setattr(sys.modules["gradaccel.recompute.region"], "offload_cost_per_byte", cheap)
    points = _points(small, kind, chunked)
    plan = _evaluate(small, SEQ, MB, MB, points, chunked_loss=chunked, host=kind == "host")
    plan.budgets = [None if b == KEEP_ALL else b for b in plan.budgets]  # keep-all: no checkpoint
    assert plan.offload == (kind == "offload") and plan.inputs_on_host == (kind == "host")
    real = _allocated(plan, lambda: _llama(*SMALL), SMALL[5])
    assert abs(real / plan.peak - 1) <= 0.05, (kind, chunked, real, plan.peak, plan.table())


# -- 2. the same plan on an idle and a loaded machine, and why ------------------------------------
def test_same_inputs_same_plan_whatever_the_measured_speeds(monkeypatch):
    """The issue's case moved between micro-batch 4 and 8 with the loss in chunks as the machine's
    load changed: fake tensors' metadata ops (prim.device) were traced and priced by their time.
    Prices are FLOPs and bytes now: a 100x slower matmul rate and copies 10x dearer give the same
    plan, and no op of a fake trace is priced by its time."""
    import gradaccel.recompute.trace as trace
    from gradaccel.recompute.plan import offload_cost_per_byte

    config = transformers.LlamaConfig(hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1536)

    def plan():
        planner = Planner(config, dtype=torch.float32)
        memory = int(0.6 * 156.8 * 2**20)
        r = planner.fit(256, 8, memory, slack=0)
        ops = [op for k in planner.profile(256, r.micro_batch, r.chunked_loss).kinds for op in k.graph.ops]
        assert all(op.priced != "measured" for op in ops) and not any("prim." in str(op.func) for op in ops)
        return r.micro_batch, r.chunked_loss, r.budgets, r.peak

    idle = plan()
    monkeypatch.setattr(trace, "_RATE", [trace._cpu_flop_rate() / 100])  # a machine 100x busier
    dear = offload_cost_per_byte(torch.device("cpu")) * 10
    monkeypatch.setattr(gradaccel.memory.step_peak, "offload_cost_per_byte", lambda device, model="flops": dear)
    assert plan() == idle


class _P:
    def __init__(self, cost, peak, mb=1, measured=0.0):
        self.step_cost, self.peak, self.micro_batch, self.measured_cost = cost, peak, mb, measured


def test_ties_within_the_noise_go_to_the_lower_peak():
    a, b = _P(100.0, 2 << 20, measured=10.0), _P(97.0, 3 << 20)  # b cheaper, within NOISE * 10 of a
    assert NOISE * 10.0 >= 3.0
    assert prefer(a, b)[0] is a and prefer(b, a)[0] is a and "lower peak" in prefer(a, b)[1]
    a.measured_cost = 0.0  # all priced from FLOPs and bytes: the cheaper one
    assert prefer(a, b)[0] is b and "less predicted time" in prefer(a, b)[1]
    c = _P(96.8, 4 << 20, mb=4)  # within 0.5% of b: the larger micro-batch
    assert prefer(b, c)[0] is c and "larger micro-batch" in prefer(b, c)[1]


def test_fit_says_why_it_chose_its_plan(small):
    least = _least(small, SEQ, 4, False, False).peak
    result = small.fit(SEQ, 4, least * 3, slack=0)
    assert result.why.startswith("chosen over micro-batch ") and f"why: {result.why}" in result.table()


# -- 3. apply() checks the model and optimizer --------------------------------------------------
def test_apply_refuses_a_model_the_plan_was_not_made_for():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=384)
    lora = Planner(config, lora=8, dtype=torch.float32).fit(64, 2, 1 << 30, slack=0)
    assert lora.made_for["LoRA rank"] == 8
    full = _llama(*SMALL)
    with pytest.raises(ValueError) as e:
        lora.apply(full, torch.optim.AdamW(full.parameters()))
    msg = str(e.value)
    assert "trainable parameters" in msg and "LoRA rank: the plan's 8, the model's none" in msg
    assert "optimizer holds" in msg and "force=True" in msg
    assert not any("_gradaccel" in k for m in full.modules() for k in vars(m))  # refused before any change
    with pytest.warns(UserWarning, match="applied anyway"):
        model, opt = lora.apply(full, torch.optim.AdamW(full.parameters()), force=True)
    assert opt.accum_steps == lora.accum_steps
    # The model it was made for, but in another dtype, or with another depth: named.
    plain = Planner(config, dtype=torch.float32).fit(64, 2, 1 << 30, slack=0)
    with pytest.raises(ValueError, match="weights' dtype: the plan's float32, the model's bfloat16"):
        bf16 = _llama(*SMALL, dtype=torch.bfloat16)
        plain.apply(bf16, torch.optim.AdamW(bf16.parameters()))
    with pytest.raises(ValueError, match="blocks: the plan's 3, the model's 2"):
        shallow = _llama(64, 176, 2, 4, 2, 384)
        plain.apply(shallow, torch.optim.AdamW(shallow.parameters()))
    right = _llama(*SMALL)
    with pytest.raises(ValueError, match="the optimizer holds"):  # only some parameters in the optimizer
        plain.apply(right, torch.optim.AdamW(list(right.parameters())[:4]))
    model, opt = plain.apply(right, torch.optim.AdamW(right.parameters()))  # the right one: no word
    # A micro-batch larger than the plan's raises at its forward; a smaller one runs.
    hf_step(model, _batch(384, plain.micro_batch // 2 or 1, 64)).backward()
    with pytest.raises(ValueError, match="micro-batch"):
        hf_step(model, _batch(384, plain.micro_batch + 1, 64))


def test_apply_refuses_a_plan_that_does_not_fit():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=384)
    short = Planner(config, dtype=torch.float32).fit(64, 2, 1 << 20, slack=0)
    assert not short.fits and "DOES NOT FIT" in short.table()
    model = _llama(*SMALL)
    with pytest.raises(ValueError, match="does not fit"):
        short.apply(model, torch.optim.AdamW(model.parameters()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        short.apply(model, torch.optim.AdamW(model.parameters()), force=True)
    assert any("does not fit" in str(w.message) for w in caught)


# -- 5. on a CPU device host memory is no saving --------------------------------------------------
def test_on_a_cpu_device_host_plans_are_no_savings():
    """Where only the inputs on the host would fit on an accelerator, a CPU model's fit says it
    does not fit, offers no plan with host memory (the host is the device), and says why."""
    def model():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=6,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
        return transformers.LlamaForCausalLM(cfg)

    accelerator = Planner(model(), optim="sgd", device="cuda")
    kept, parked = (_least(accelerator, 96, 1, False, False, host=h).peak for h in (False, True))
    memory = (kept + parked) // 2
    assert accelerator.fit(96, 1, memory, slack=0).inputs_on_host
    cpu = Planner(model(), optim="sgd")  # the model's own device
    assert cpu.on_cpu and not accelerator.on_cpu
    result = cpu.fit(96, 1, memory, slack=0)
    assert not result.fits and not result.inputs_on_host and not result.offload and not result.options
    assert any("CPU device" in n for n in result.notes) and "note: " in result.table()
    assert not any("host" in s for s in result.suggestions)
    roomy = cpu.fit(96, 1, 4 * kept, slack=0)  # fits: still no host options, and says so
    assert roomy.fits and not roomy.options and any("CPU device" in n for n in roomy.notes)


# -- 7. memory= never stalls training ----------------------------------------------------------
def _symbolic_passes() -> int:
    from gradaccel.recompute.state import STATE

    return sum(s.passes for shapes in list(STATE.shapes.values()) for s in shapes.values())


def test_memory_without_seq_plans_new_lengths_without_a_profile():
    """Issue #36's case, scaled down: memory= without seq, a target that binds at the longest
    length, four warm-up lengths, then new lengths up to the longest. No new length makes a
    fake-tensor profile or a symbolic pass (the stalls: the loss in chunks profiled mid-training,
    every candidate profiled where the predicted plans went over, a region's size formulas found
    at its first other length), and each step stays under the target."""
    from gradaccel.memory.counter import LiveBytes
    from gradaccel.memory.profile import profile_runs

    gradaccel.reset_plans()
    shape = (64, 176, 3, 4, 2, 512)
    probe = _llama(*shape)
    ids = torch.randint(0, 512, (1, 128))
    with LiveBytes() as live:
        probe(input_ids=ids, labels=ids).loss.backward()
    memory = int(0.6 * live.peak)
    model = gradaccel.checkpoint_blocks(_llama(*shape), memory=memory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "below the least" is checked below, per step
        for t in (47, 125, 25, 56):  # warm-up: the range is profiled here
            model(**_batch(512, 1, t)).loss.backward()
    runs, passes = profile_runs(), _symbolic_passes()
    for t in (128, 122, 89, 60, 33, 101, 127):
        batch = _batch(512, 1, t)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            with LiveBytes() as live:
                model(**batch).loss.backward()
        assert live.peak <= memory, (t, live.peak, memory)
        assert profile_runs() == runs and _symbolic_passes() == passes, t
