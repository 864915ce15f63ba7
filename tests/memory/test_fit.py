"""gradaccel.fit: predicted peaks against the real peak of live tensor bytes of training steps
on CPU, the memory split across blocks, the fit itself and its command line."""

import functools
import json
import math
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gradaccel  # noqa: E402
from gradaccel.memory.fit import Planner, fit, hf_step  # noqa: E402
from gradaccel.memory.fit_cli import main  # noqa: E402
from gradaccel.memory.counter import LiveBytes, measured_peak, parse_bytes  # noqa: E402
from gradaccel.recompute.block_plan import BlockPlan, set_plan  # noqa: E402
from _models import PlainBlock  # noqa: E402

# Three tiny Llama shapes: (hidden, intermediate, layers, heads, kv heads, vocab).
SHAPES = [(32, 80, 2, 4, 2, 256), (48, 96, 3, 4, 4, 128), (64, 176, 2, 8, 2, 384)]
SEQS = (32, 96, 192)
FRACTIONS = (0.05, 0.4, 1.0)  # of a block's activation bytes, as int budgets


def _model(shape, lora=False):
    hidden, inter, layers, heads, kv, vocab = shape
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                   max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg)
    if lora:
        peft = pytest.importorskip("peft")
        lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
        model = peft.get_peft_model(model, lora_config)
    return model


def _batch(shape, mb, seq):
    ids = torch.randint(0, shape[5], (mb, seq))
    return {"input_ids": ids, "labels": ids}


def _real_peak(model, budgets, batch, accum=1):
    for block, b in zip(gradaccel.memory.fit.find_blocks(model), budgets):
        set_plan(block, BlockPlan.parse(b))
    opt = gradaccel.FusedAccumOptimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), accum)
    return measured_peak(model, opt, hf_step, batch)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_predicted_peak_within_10_percent(shape, lora):
    """3 shapes x 3 sequence lengths x 3 budgets x 2 micro-batch sizes, with and without LoRA:
    the prediction (from fake tensors) is within 10% of the real peak of live bytes."""
    if lora and shape is not SHAPES[1]:
        pytest.skip("LoRA on one shape keeps the test short; the others cover the shapes")
    gradaccel.reset_plans()
    model = _model(shape, lora)
    gradaccel.checkpoint_blocks(model, budget=1)  # as Fit.apply does; budgets are set per case
    model.train()
    opt_proto = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    planner = Planner(model, optim=opt_proto)
    worst = 0.0
    for seq in SEQS:
        for mb in (1, 2):
            prof = planner.profile(seq, mb)
            batch = _batch(shape, mb, seq)
            for frac in FRACTIONS:
                budgets = [max(1, int(frac * prof.kind_of[i].graph.activation_bytes)) for i in range(len(prof.blocks))]
                predicted = planner.estimate(seq, mb, budgets).peak
                real = _real_peak(model, budgets, batch)
                worst = max(worst, abs(predicted / real - 1))
                assert abs(predicted / real - 1) <= 0.10, (seq, mb, frac, predicted, real)
    # Not a loose pass: the model is exact up to a few bytes outside tensor storages.
    assert worst < 0.01


def test_bf16_without_masters_predicted():
    """bf16 parameters without fp32 masters: the update rounds each gradient in place in the
    window buffer (no bf16 copy of every gradient), and the prediction says so. At 8 tokens
    and a 2048 vocabulary the update is the peak; the old copy over-predicted it by 17%."""
    gradaccel.reset_plans()
    shape = (32, 80, 2, 4, 2, 2048)
    model = _model(shape).to(torch.bfloat16)
    gradaccel.checkpoint_blocks(model, budget=1)
    model.train()
    planner = Planner(model, optim=torch.optim.AdamW(model.parameters()))
    prof = planner.profile(8, 1)
    budgets = [max(1, int(0.05 * prof.kind_of[i].graph.activation_bytes)) for i in range(len(prof.blocks))]
    est = planner.estimate(8, 1, budgets)
    real = _real_peak(model, budgets, _batch(shape, 1, 8))
    assert est.phase == "optimizer step"
    assert abs(est.peak / real - 1) < 0.001, (est.peak, real)


def test_fitted_plan_never_exceeds_target():
    gradaccel.reset_plans()
    shape = SHAPES[2]
    model = _model(shape)
    planner = Planner(model, optim=torch.optim.AdamW(model.parameters()))
    least = planner.fit(192, 4, 1 << 40, slack=0, micro_batches=[1]).parts
    static = least["weights"] + least["window buffer (fp32 grads)"] + least["optimizer state"]
    chosen = []
    for extra in (2.0, 4.0, 8.0):  # targets between "micro-batch 1, nothing kept" and everything
        memory = int(static * 1.15 + extra * 1e6)
        result = planner.fit(192, 4, memory, slack=0)
        if not result.fits:
            continue
        chosen.append((result.micro_batch, result.kept))
        model2 = _model(shape)
        model2.train()
        model2, opt = result.apply(model2, torch.optim.AdamW(model2.parameters()))
        real = measured_peak(model2, opt, hf_step, _batch(shape, result.micro_batch, 192))
        assert real <= memory, (memory, real, result.table())
        assert abs(result.peak / real - 1) <= 0.10
    assert len(chosen) >= 2 and len(set(chosen)) >= 2, chosen  # the targets led to different plans


def test_fit_computes_the_loss_in_chunks_where_logits_dominate():
    """A vocabulary 128x the hidden size: the loss's logits set the floor. The fit finds the
    loss in chunks (no whole logits made) where the plain loss cannot fit, applies it in
    one call, and the real step stays under the target, within 10% of the prediction, with
    stock gradients."""
    from gradaccel.memory.fit import _least

    gradaccel.reset_plans()
    shape, seq = (32, 80, 2, 4, 2, 4096), 128
    planner = Planner(_model(shape), optim=torch.optim.AdamW(_model(shape).parameters()))
    plain, chunked = (_least(planner, seq, 1, False, c).peak for c in (False, True))
    static = planner.static.total
    assert chunked - static < 0.85 * (plain - static), (chunked, plain, static)
    memory = (plain + chunked) // 2
    result = planner.fit(seq, 1, memory, slack=0)
    assert result.fits and result.chunked_loss and "loss in chunks" in result.table()
    model, ref = _model(shape).train(), _model(shape).train()
    model, opt = result.apply(model, torch.optim.AdamW(model.parameters()))
    batch = _batch(shape, 1, seq)
    real = measured_peak(model, opt, hf_step, batch)
    assert real <= memory and abs(result.peak / real - 1) <= 0.10, (memory, real, result.peak)
    # Same loss and gradients as the stock loss, on a model that has not stepped.
    fresh = _model(shape).train()
    model, _ = result.apply(fresh, torch.optim.SGD(fresh.parameters()))
    loss, ref_loss = hf_step(model, batch), hf_step(ref, batch)
    torch.testing.assert_close(loss, ref_loss)
    grads = torch.autograd.grad(loss, [p for p in model.parameters()])
    for g, q in zip(grads, torch.autograd.grad(ref_loss, list(ref.parameters()))):
        torch.testing.assert_close(g, q, rtol=1e-4, atol=1e-6)


def test_fit_runs_blocks_as_their_parts_below_the_checkpoint_floor():
    """Below the least that checkpoint plans reach, blocks run as their parts: the applied plan's
    real peak stays under the target and within 10% of the prediction."""
    from gradaccel.memory.split import least_peak
    from gradaccel.memory.fit import _least
    from gradaccel.memory.parts import is_parts

    gradaccel.reset_plans()
    shape, seq = (64, 176, 3, 8, 2, 128), 192
    planner = Planner(_model(shape), optim=torch.optim.AdamW(_model(shape).parameters()), loss_fn=hf_step)
    prof = planner.profile(seq, 1)
    checkpoints = gradaccel.memory.fit._evaluate(planner, seq, 1, 1, least_peak(prof, [k.frontier for k in (
        prof.kind_of[i] for i in range(len(prof.blocks)))])).peak
    lowest = _least(planner, seq, 1, False, False).peak
    assert lowest < checkpoints, (lowest, checkpoints)
    memory = (lowest + checkpoints) // 2
    result = planner.fit(seq, 1, memory, slack=0)
    assert result.fits and any(is_parts(b) for b in result.budgets), result.table()
    blocks_line = result.table().splitlines()[1]  # the mode of each block
    assert blocks_line.startswith("blocks: ") and "parts" in blocks_line, result.table()
    model = _model(shape).train()
    model, opt = result.apply(model, torch.optim.AdamW(model.parameters()))
    real = measured_peak(model, opt, hf_step, _batch(shape, 1, seq))
    assert real <= memory and abs(result.peak / real - 1) <= 0.10, (memory, real, result.peak)


def test_nothing_fits_says_what_would(monkeypatch):
    model = _model(SHAPES[0])
    result = fit(model, 96, 4, 1000, slack=0)
    assert not result.fits and result.suggestions and not result.options
    assert "DOES NOT FIT" in result.table()
    # Offload is no way under the floor of keeping nothing here: since the replay frees as it
    # goes, its working set is torch.utils.checkpoint's, and an offload plan holds that plus what
    # it fetches back. (Copy cost pinned, as measured here.) The fit says so: the least-peak plan
    # without offload is its answer at that memory, not an offload plan.
    cost = lambda device, model="flops": 40.0  # noqa: E731
    monkeypatch.setattr(sys.modules["gradaccel.recompute.region"], "offload_cost_per_byte", cost)
    monkeypatch.setattr(gradaccel.memory.step_peak, "offload_cost_per_byte", cost)
    monkeypatch.setattr(gradaccel.memory.kinds, "offload_cost_per_byte", cost)
    planner = Planner(model, loss_fn=hf_step)
    least = planner.fit(192, 1, 1000, slack=0)  # the least each way, with what would fit
    floor, offload = least.peak, planner.estimate(192, 1, 1, offload=True).peak
    assert floor <= offload
    result = planner.fit(192, 1, floor, slack=0)
    assert result.fits and not result.offload and result.peak <= floor


def test_least_recompute_is_the_least_recompute_that_fits():
    """The dynamic programme over blocks against every combination of plans, on a real profile,
    by the same prediction (estimated), at bytes' resolution."""
    import itertools

    from gradaccel.memory.split import least_recompute

    prof = Planner(_model(SHAPES[1])).profile(48, 1)
    fronts = []
    for i in range(len(prof.blocks)):
        f = prof.kind_of[i].frontier
        fronts.append(f[::max(1, len(f) // 4)] + [f[-1]])
    combos = [(prof.predict(list(c), exact=False)["peak"], sum(p.cost for p in c), c)
              for c in itertools.product(*fronts)]
    floor, top = min(c[0] for c in combos), max(c[0] for c in combos)
    for memory in [floor - 1] + [floor + (top - floor) * k // 6 for k in range(7)]:
        got = least_recompute(prof, fronts, memory, units=memory, exact=False)
        fitting = [cost for peak, cost, _ in combos if peak <= memory]
        if not fitting:
            assert got is None
            continue
        assert prof.predict(got, exact=False)["peak"] <= memory
        assert math.isclose(sum(p.cost for p in got), min(fitting), rel_tol=1e-12, abs_tol=1e-9), memory
    # The last block's kept bytes are never live while another block is rebuilt (only at the
    # loss): at keep-nothing's own peak, it keeps the most, and the step recomputes less.
    got = least_recompute(prof, fronts, floor, units=floor, exact=False)
    assert got[-1].kept == max(p.kept for p in got) > 0
    assert sum(p.cost for p in got) < sum(f[0].cost for f in fronts)


def test_block_peak_does_not_depend_on_what_ran_before():
    """A block run alone makes its gradients afresh, as in a step: a run after another plan's
    must not add into the gradients that one left (memory='s profile keeps gradients, as a step
    without a fold does), which would measure them as free."""
    from _models import Block, GPTConfig

    from gradaccel.memory.profile import Profile
    from gradaccel.memory.target import _step

    torch.manual_seed(0)
    model = _Stack([Block(GPTConfig(seq_len=64, n_embd=32, n_head=4)) for _ in range(2)])
    x = torch.randn(2, 64, 32, requires_grad=True)
    peaks = []
    for stale in (False, True):
        prof = Profile(model, _step, ((x,), {}), grad_hooks=False)
        kind = prof.kind_of[1]
        for p in prof.blocks[kind.blocks[0]].parameters():
            p.grad = torch.ones_like(p) if stale else None
        peaks.append(prof.block_peak(kind, kind.frontier[-2]))  # a plan whose peak has the gradients
    assert peaks[0] == peaks[1]


def test_checkpoint_blocks_memory_splits_one_budget():
    from gradaccel.memory.target import MemoryTarget
    from gradaccel.memory.counter import LiveBytes

    gradaccel.reset_plans()
    shape = SHAPES[1]
    ref, model = _model(shape), _model(shape)
    batch = _batch(shape, 2, 64)
    model.train(), ref.train()
    with LiveBytes() as live:
        ref_loss = hf_step(ref, batch)
        ref_loss.backward()
    # memory= is the step's peak (gradaccel/memory/target.py): between the per-block floor and no
    # checkpointing, the blocks keep some of their activations.
    memory = int(0.9 * live.peak)
    gradaccel.checkpoint_blocks(model, memory=memory)
    loss = hf_step(model, batch)
    loss.backward()
    # Same maths, different kernels' order of ops in replay: compare with a tolerance.
    torch.testing.assert_close(loss, ref_loss)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    target = next(h for h in model._forward_pre_hooks.values() if isinstance(h, MemoryTarget))
    (mode, _, _), = target.chosen.values()
    assert mode == "blocks"
    rows = [r for r in gradaccel.plan_rows() if r["mode"] == "selective"]
    kept = sum(r["kept_bytes"] for r in rows[-shape[2]:])
    assert kept > 0
    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        hf_step(model, batch).backward()
    assert live.peak <= memory
    with pytest.raises(ValueError, match="memory"):
        gradaccel.checkpoint_blocks(_model(shape), memory="lots")
    with pytest.raises(ValueError, match="not both"):
        gradaccel.checkpoint_blocks(_model(shape), budget=0.5, memory="1MiB")


class _Block(torch.nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)).square())


class _Stack(torch.nn.Module):
    def __init__(self, blocks=None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks or [_Block(16, h) for h in (32, 256, 32, 256)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _run_measured(model, x):
    """(measured step peak, planner's recompute cost) of a step after the traced one."""
    from gradaccel.memory.counter import LiveBytes

    model(x).sum().backward()  # traces and plans
    for t in [x, *model.parameters()]:
        t.grad = None
    with LiveBytes() as live:
        model(x).sum().backward()
    return live.peak, sum(r.get("recompute_cost", 0.0) for r in gradaccel.plan_rows())


def test_memory_split_pays_on_blocks_that_differ():
    """Blocks with 32 and 256 hidden units alternate. memory= set to the step peak each fraction
    for every block measured: no higher measured peak, and no more recompute (the planner's cost,
    what it minimises) than the best fraction that fits; less at every fraction here (the split
    keeps a block whole where one fraction would make every block recompute something)."""
    x = torch.randn(64, 16, requires_grad=True)
    fractions = {}
    for f in (0.1, 0.3, 0.5, 0.7, 0.9):
        gradaccel.reset_plans()
        fractions[f] = _run_measured(gradaccel.checkpoint_blocks(_Stack(), budget=f), x)
    for memory in sorted({peak for peak, _ in fractions.values()}):
        gradaccel.reset_plans()
        peak, cost = _run_measured(gradaccel.checkpoint_blocks(_Stack(), memory=memory), x)
        best = min(c for p, c in fractions.values() if p <= memory)
        assert peak <= memory and cost < best, (memory, peak, cost, best)
    # Same gradients as without checkpointing.
    torch.manual_seed(0)
    ref, model = _Stack(), _Stack()
    model.load_state_dict(ref.state_dict())
    gradaccel.checkpoint_blocks(model, memory=memory)
    model(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_parse_bytes_and_live_bytes():
    assert parse_bytes("24GiB") == 24 << 30 and parse_bytes("6 GB") == 6 * 10**9 and parse_bytes(512) == 512
    for bad in ("-1GiB", "lots", -5, True, 1.5):
        with pytest.raises(ValueError, match="memory"):
            parse_bytes(bad)
    x = torch.ones(1000)
    live = LiveBytes()
    with live:
        y = x * 2  # 4000 bytes
        v = y.view(10, 100)  # a view: nothing new
        z = y + 1
        del z  # freed: the peak stays
        x.add_(1)  # in place on a tensor from before: not counted
    assert live.live == 4000 and live.peak == 8000 and v.shape == (10, 100)
    # Fake tensors count where the count began under the fake mode (a profile), not where a
    # real count has a fake run inside it (memory= planning in the first step): they take no memory.
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    real, fake = LiveBytes(), LiveBytes()
    with real:
        with mode, fake:
            w = torch.ones(1000) * 2
        u = x * 3
    assert real.peak == 4000 and fake.peak == 8000 and w.shape == u.shape


def test_cli_on_a_config_file(tmp_path, capsys):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1000)
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json_string())
    assert main(["--model", str(path), "--seq", "128", "--batch", "2", "--memory", "16MiB", "--slack", "0",
                 "--lora", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["micro_batch"] * out["accum_steps"] == 2 and out["peak"] <= 16 << 20
    assert len(out["budgets"]) == 4
    # 4 layers profiled as 2 (the first, and one standing for the rest): the same prediction
    # as profiling all 4.
    planner = Planner(str(path), lora=4)
    assert planner.layout == [0, 1, 1, 1]
    full = Planner(gradaccel.memory.fit.fake_model(gradaccel.memory.fit.load_config(str(path)), lora=4))
    assert planner.estimate(128, 1, 0.5).peak == full.estimate(128, 1, 0.5).peak


def _quantize_blocks(model):
    """The frozen linear layers of the blocks as bitsandbytes nf4 (double quantisation), as
    QLoRA loads them; quantised on CPU by ``.to("cpu")``."""
    bnb = pytest.importorskip("bitsandbytes")
    for block in gradaccel.memory.fit.find_blocks(model):
        for mod in list(block.modules()):
            for name, child in list(mod.named_children()):
                if type(child) is torch.nn.Linear and not child.weight.requires_grad:
                    q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=child.weight.dtype, quant_type="nf4", compress_statistics=True)
                    q.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True)
                    setattr(mod, name, q.to("cpu"))
    return model


def test_bitsandbytes_state_and_4bit_weights_measured():
    """bitsandbytes runs 8-bit AdamW and nf4 on CPU (paged falls back to unpaged there): the
    predicted weights and optimizer state equal a real QLoRA model's bytes, and its whole peak
    is within 15%."""
    bnb = pytest.importorskip("bitsandbytes")
    import copy

    gradaccel.reset_plans()
    shape = SHAPES[2]
    # Full fine-tuning: 8-bit state on tensors of 4096 values or more, fp32 below, shared code books.
    model = torch.nn.Sequential(torch.nn.Linear(64, 176), torch.nn.Linear(176, 64), torch.nn.LayerNorm(64))
    for optim, cls in (("adamw8bit", bnb.optim.AdamW8bit), ("paged_adamw8bit", bnb.optim.PagedAdamW8bit)):
        real_opt = cls(model.parameters())
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # paged falls back to unpaged on CPU
            real_opt.step()
        static = gradaccel.memory.fixed_parts.static_parts(model, optim)
        assert static.state == gradaccel.memory.optimizer_state_bytes(real_opt)
        assert static.paged == 0  # every tensor of these models is under bnb's paging size
        # The same from the instance, before it has state.
        assert gradaccel.memory.fixed_parts.static_parts(model, cls(model.parameters())).state == static.state
    model.zero_grad(set_to_none=True)
    # On CUDA bnb pages the state of tensors of 1e5 values or more: reported as host bytes.
    big = torch.nn.Linear(400, 300, bias=False)
    paged = gradaccel.memory.fixed_parts.static_parts(big, "paged_adamw8bit")
    assert paged.paged == 2 * 120000 and paged.state == 8 * math.ceil(120000 / 256) + 2 * 1024
    assert gradaccel.memory.fixed_parts.static_parts(big, "adamw8bit").state == paged.state + paged.paged
    optim, cls = "adamw8bit", bnb.optim.AdamW8bit
    # QLoRA: the plan is made on the model before quantisation, with load_in_4bit.
    lora = _model(shape, lora=True)
    gradaccel.checkpoint_blocks(lora, budget=1)
    lora.train()
    planner = Planner(lora, optim=optim, load_in_4bit=True)
    quantised = _quantize_blocks(copy.deepcopy(lora))
    qparams = list(quantised.parameters())
    quant_states = [p.quant_state for p in qparams if hasattr(p, "quant_state")]
    real_weights = gradaccel.memory.storage_bytes(
        qparams + list(quantised.buffers())
        + [t for qs in quant_states for t in gradaccel.memory.fixed_parts._quant_state_tensors(qs)])
    assert planner.static.weights == real_weights
    assert Planner(quantised, optim=optim).static.weights == real_weights  # an already quantised module
    with pytest.raises(ValueError, match="load_in_4bit"):
        Planner(quantised).profile(32, 1)
    prof = planner.profile(32, 2)
    budgets = [max(1, int(0.3 * prof.kind_of[i].graph.activation_bytes)) for i in range(len(prof.blocks))]
    predicted = planner.estimate(32, 2, budgets)
    for block, b in zip(gradaccel.memory.fit.find_blocks(quantised), budgets):
        set_plan(block, BlockPlan.parse(b))
    opt = gradaccel.FusedAccumOptimizer(cls([p for p in quantised.parameters() if p.requires_grad]), 1)
    real = measured_peak(quantised, opt, hf_step, _batch(shape, 2, 32))
    assert predicted.parts["optimizer state"] == gradaccel.memory.optimizer_state_bytes(opt)
    # The prediction runs bf16/fp32 linears where bnb dequantises: it adds one dequantised weight.
    # 4.4% alone (run on its own or after tests/integrations); once, in a full CI run, 10.8%: a
    # state some earlier test leaves raised the measured peak by 62 KB (not found; gc is not it).
    assert abs(predicted.peak / real - 1) <= 0.15, (predicted.peak, real)


def _checkpoint_with(model, budgets, offload):
    """The blocks through HF's checkpointing hook, each at its budget, with or without offload."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for block, b in zip(gradaccel.memory.fit.find_blocks(model), budgets):
        block._gradient_checkpointing_func = functools.partial(gradaccel.checkpoint, budget=b, offload=offload)
    return model


def test_offload_predicted_and_proposed(monkeypatch):
    """Plans with offload=True: device peak predicted against the real peak (live bytes, CPU),
    host bytes against the store's; the fit proposes the offload plan when it is faster at the
    same memory, and says what offload does when nothing fits."""
    from gradaccel.recompute.offload_frame import store_for
    from gradaccel.memory.split import least_peak

    # The copy's cost is measured per process from this machine's bandwidth, which a busy CI box
    # makes vary: pinned (for the checkpoint and the fit alike) so that offload pays here.
    cheap = lambda device, model="flops": 4.0  # noqa: E731
    monkeypatch.setattr(sys.modules["gradaccel.recompute.region"], "offload_cost_per_byte", cheap)
    monkeypatch.setattr(gradaccel.memory.step_peak, "offload_cost_per_byte", cheap)
    monkeypatch.setattr(gradaccel.memory.kinds, "offload_cost_per_byte", cheap)
    gradaccel.reset_plans()
    shape = (64, 176, 2, 8, 2, 384)
    model = _model(shape)
    planner = Planner(model, optim="sgd")
    seq, mb = 96, 2
    prof = planner.profile(seq, mb)
    batch = _batch(shape, mb, seq)
    for frac in (0.05,):  # a small budget: most of what the blocks save goes to host
        budgets = [max(1, int(frac * prof.kind_of[i].graph.activation_bytes)) for i in range(len(prof.blocks))]
        predicted = planner.estimate(seq, mb, budgets, offload=True)
        assert predicted.offload and predicted.host["activations offloaded by the blocks"] > 0
        assert predicted.time < planner.estimate(seq, mb, budgets).time  # the copies beat the recompute
        gradaccel.reset_plans()
        real_model = _checkpoint_with(_model(shape).train(), budgets, offload=True)
        store = store_for(None)
        before = store.stats()["bytes_offloaded"]
        opt = gradaccel.FusedAccumOptimizer(torch.optim.SGD(real_model.parameters(), lr=1e-3, momentum=0.9), 1)
        real = measured_peak(real_model, opt, hf_step, batch)  # 2 steps: trace, then one with offload
        assert abs(predicted.peak / real - 1) <= 0.10, (frac, predicted.peak, real)
        assert store.stats()["bytes_offloaded"] - before == predicted.host["activations offloaded by the blocks"]
    # The fit: the fastest offload plan within the same memory is an option, with its figures. It
    # pays on a deeper model (kept bytes add up over blocks, fetched ones are one block's).
    deep_config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=8,
                                           num_attention_heads=8, num_key_value_heads=2, vocab_size=384)
    deep = Planner(deep_config, optim="sgd", dtype=torch.float32)
    static = sum(deep.static.__dict__[k] for k in ("weights", "buffer", "state"))
    prof = deep.profile(seq, 2)  # the least checkpoint plans without offload can take
    checkpoints = [prof.kind_of[s].frontier for s in deep.layout]
    least = gradaccel.memory.fit._evaluate(deep, seq, 2, 2, least_peak(prof, checkpoints, deep.layout)).peak
    # Room for what offload fetches back: since the replay frees as it goes, plans without
    # offload recompute little just above the least peak, and an offload plan is faster only
    # with more room (at least + half the activations' room, none is).
    result = deep.fit(seq, 2, least + (least - static), slack=0, micro_batches=[2])
    assert result.fits and not result.offload and result.options
    off = result.options[0]
    assert off.offload and off.peak <= result.memory and off.step_cost < result.step_cost
    assert "offload=True" in result.table() and sum(off.host.values()) > 0
    # It applies in one call, as any plan: the blocks offload, within the predicted peak.
    gradaccel.reset_plans()
    torch.manual_seed(0)
    deep_model = transformers.LlamaForCausalLM(deep_config).train()
    deep_model, opt = off.apply(deep_model, torch.optim.SGD(deep_model.parameters(), lr=1e-3, momentum=0.9))
    store = store_for(None)  # reset_plans() gave the last one back
    before = store.stats()["bytes_offloaded"]
    real = measured_peak(deep_model, opt, hf_step, batch)
    assert store.stats()["bytes_offloaded"] > before
    assert abs(off.peak / real - 1) <= 0.10, (off.peak, real)
    # Nothing fits: the advice names offload with its figures where it lowers the least peak,
    # and says nothing of it where it does not (it cannot lower the floor of a keep-nothing plan).
    lowest = gradaccel.memory.fit._least(deep, seq, 2, False, False).peak  # micro-batch 1, any plan
    worse = deep.fit(seq, 2, static + (lowest - static) // 2, slack=0)
    least_off = gradaccel.memory.fit._least_either_loss(deep, seq, 2, True).peak
    advised = any(s.startswith("offload") and "on host" in s for s in worse.suggestions)
    assert not worse.fits and advised == (least_off < worse.peak), (least_off, worse.peak, worse.suggestions)


class _GPT(torch.nn.Module):
    """Not a Hugging Face model: no config, no ``.loss``; blocks found as the ModuleList."""

    def __init__(self, vocab=256, width=48, heads=4, layers=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(PlainBlock(width, heads) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _gpt_batch(micro_batch, seq):
    ids = torch.randint(0, 256, (micro_batch, seq + 1))
    return ids[:, :-1], ids[:, 1:]


def _gpt_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def test_fit_any_module_with_make_batch_and_loss_fn():
    """A GPT defined here (not Hugging Face): predicted peaks within 10% of the real ones, and a
    fitted plan applied to it stays under its target."""
    gradaccel.reset_plans()
    torch.manual_seed(0)
    model = _GPT()
    gradaccel.checkpoint_blocks(model, budget=1)
    model.train()
    planner = Planner(model, optim=torch.optim.AdamW(model.parameters()), make_batch=_gpt_batch, loss_fn=_gpt_loss)
    batch = _gpt_batch(2, 64)
    prof = planner.profile(64, 2)
    for frac in (0.05, 1.0):
        budgets = [max(1, int(frac * prof.kind_of[i].graph.activation_bytes)) for i in range(len(prof.blocks))]
        predicted = planner.estimate(64, 2, budgets).peak
        for block, b in zip(model.blocks, budgets):
            set_plan(block, BlockPlan.parse(b))
        opt = gradaccel.FusedAccumOptimizer(torch.optim.AdamW(model.parameters()), 1)
        real = measured_peak(model, opt, _gpt_loss, batch)
        assert abs(predicted / real - 1) <= 0.10, (frac, predicted, real)
        model.zero_grad(set_to_none=True)
    least = planner.estimate(64, 1, 1)
    static = least.peak - sum(v for k, v in least.parts.items() if "activations" in k or "working" in k)
    memory = static + 3 * (least.peak - static)
    result = planner.fit(64, 2, memory, slack=0)  # fit(model, ...) makes this planner
    assert result.fits and result.micro_batch * result.accum_steps == 2
    fresh = _GPT().train()
    fresh, opt = result.apply(fresh, torch.optim.AdamW(fresh.parameters()))
    real = measured_peak(fresh, opt, _gpt_loss, _gpt_batch(result.micro_batch, 64))
    assert real <= memory and abs(result.peak / real - 1) <= 0.10, (result.table(), real)
    # Clear errors: what is missing, what is wrong.
    with pytest.raises(ValueError, match="make_batch"):
        fit(_GPT(), 64, 4, memory)
    with pytest.raises(TypeError, match="make_batch"):
        fit(_GPT(), 64, 4, memory, make_batch="ids")
    with pytest.raises(ValueError, match="loss_fn"):
        fit(_GPT(), 64, 4, memory, make_batch=_gpt_batch, loss_fn=lambda m, b: m(b[0]))
    with pytest.raises(ValueError, match="no repeated blocks"):
        fit(torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256)), 64, 4, memory,
            make_batch=_gpt_batch, loss_fn=_gpt_loss)
