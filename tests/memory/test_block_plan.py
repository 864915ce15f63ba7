"""One typed plan per block (gradaccel/recompute/block_plan.py): its settings parse and write back,
bad ones are refused, and a checkpointed block holds its plan as one attribute, nothing else."""

import pickle

import pytest
import torch
import torch.nn as nn

import gradaccel
from gradaccel.recompute.block_plan import ATTR, PAIR, PAIRED, BlockPlan, Mode, plan_of, set_plan

# Attributes the plan replaced: none may be left on a block.
GONE = ("_gradaccel_budget", "_gradaccel_fine", "_gradaccel_inputs_on_host", "_gradaccel_sliced", "_gradaccel_pair",
        "_gradaccel_paired", "_gradaccel_offload", "_gradaccel_cost", "_gradaccel_policy", "_gradaccel_tiles")


@pytest.mark.parametrize("setting, mode, slices", [
    (0, Mode.BUDGET, 0), (4096, Mode.BUDGET, 0), (0.5, Mode.BUDGET, 0), (1.0, Mode.BUDGET, 0),
    (None, Mode.NONE, 0), ("parts", Mode.PARTS, 1), ("tiles:8", Mode.TILES, 8), ("tiles:1", Mode.TILES, 1),
    ("nested:4", Mode.NESTED, 4), ("sliced:16", Mode.SLICED, 16), (("offload", 100), Mode.BUDGET, 0)])
def test_every_setting_round_trips(setting, mode, slices):
    plan = BlockPlan.parse(setting)
    assert (plan.mode, plan.slices) == (mode, slices)
    assert plan.to_setting() == setting and BlockPlan.parse(plan.to_setting()) == plan
    assert BlockPlan.parse(plan) is plan
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_json_and_profile_forms():
    assert BlockPlan.parse(["offload", 7]) == BlockPlan.parse(("offload", 7)) == BlockPlan(Mode.BUDGET, 7, offload=True)
    assert BlockPlan.parse("all") == BlockPlan.parse(None)  # the profile's no-checkpoint plan
    assert BlockPlan.parse("nested:2").budget == 0  # keep nothing around the parts
    assert str(BlockPlan.parse("tiles:4")) == "tiles:4" and str(BlockPlan.parse(12)) == "12"


@pytest.mark.parametrize("bad", [-1, 1.5, float("nan"), True, "tiles", "tiles:0", "tiles:x", "tiles:-2", "nested:01",
                                 "slice:4", "Parts", ("offload",), ("offload", -3), ("host", 4), {"budget": 1}, object()])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="block's plan must be"):
        BlockPlan.parse(bad)


def test_bad_fields_are_refused():
    with pytest.raises(ValueError, match="parking"):
        BlockPlan(parking="disk")
    with pytest.raises(ValueError, match="pair"):
        BlockPlan(parking=PAIR)  # a pair's first names the next block
    with pytest.raises(TypeError, match="mode"):
        BlockPlan("parts")
    with pytest.raises(TypeError, match="BlockPlan"):
        set_plan(nn.Linear(2, 2), "parts")


def test_parts_helpers_ask_the_parser():
    from gradaccel.memory.parts import is_nested, is_parts, is_sliced, nested, sliced, slices_of, tiles

    assert (tiles(3), nested(2), sliced(5)) == ("tiles:3", "nested:2", "sliced:5")
    assert [slices_of(s) for s in ("parts", "tiles:3", "nested:2", "sliced:5", 9, None, "all", ("offload", 9))] == \
        [1, 3, 2, 5, 0, 0, 0, 0]
    assert [is_parts(s) for s in ("parts", "tiles:3", "nested:2", "sliced:5", 9)] == [True, True, False, False, False]
    assert is_nested("nested:2") and is_sliced("sliced:5") and not is_sliced(object())


def test_set_plan_keeps_an_equal_plan_and_takes_one_away():
    block = nn.Linear(2, 2)
    first = BlockPlan.parse(64)
    set_plan(block, first)
    set_plan(block, BlockPlan.parse(64))
    assert plan_of(block) is first  # the same object: torch.compile's guards see no change
    set_plan(block, None)
    assert plan_of(block) is None and ATTR not in vars(block)


class _Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class _Net(nn.Module):
    def __init__(self, n=4, d=16):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _plans_only(model):
    blocks = list(model.blocks) if hasattr(model, "blocks") else list(model.model.layers)
    for b in blocks:
        assert isinstance(plan_of(b), BlockPlan), b
        assert not set(GONE) & set(vars(b)), set(GONE) & set(vars(b))
    return blocks


def test_install_and_set_budget_give_one_plan():
    model = gradaccel.checkpoint_blocks(_Net(), budget=0.5, offload=False, inputs_on_host=True)
    blocks = _plans_only(model)
    assert all(plan_of(b) == BlockPlan(Mode.BUDGET, 0.5, parking="host") for b in blocks)
    gradaccel.recompute.blocks.set_budget(model, 1024)
    assert all(plan_of(b).budget == 1024 and plan_of(b).parked for b in _plans_only(model))


def test_set_plans_gives_one_plan_and_gradients_match_stock():
    from gradaccel.memory.parking import DEVICE, HOST
    from gradaccel.memory.target import set_plans

    torch.manual_seed(0)
    ref = _Net()
    model = gradaccel.checkpoint_blocks(_Net(), budget=0)
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 24, 16)
    ref(x).square().sum().backward()
    settings = [4096, None, "tiles:3", "nested:2"]
    set_plans(model, list(model.blocks), False, settings, (HOST, DEVICE, DEVICE, HOST))
    blocks = _plans_only(model)
    assert [plan_of(b).to_setting() for b in blocks] == settings
    assert [plan_of(b).parked for b in blocks] == [True, False, False, True]
    # The parts run as checkpoints where the plan says (one number each: 0 off, else their slices).
    assert [b.mlp.__dict__.get("_gradaccel_part", 0) for b in blocks] == [0, 0, 1, 1]
    model(x).square().sum().backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_pairs_name_their_next_block():
    from gradaccel.memory.parking import set_parking

    model = gradaccel.checkpoint_blocks(_Net(2), budget=0)
    blocks = list(model.blocks)
    set_parking(blocks, (PAIR, PAIRED))
    assert plan_of(blocks[0]).pair is blocks[1] and plan_of(blocks[1]).pair is None
    assert "blocks.1" not in dict(blocks[0].named_modules())  # the pair is not a child
    with pytest.raises(ValueError, match="must be 'paired'"):
        set_parking(blocks, (PAIR, PAIR))


@pytest.mark.parametrize("memory", [1 << 40, 1], ids=["roomy", "least"])
def test_fit_apply_gives_one_plan_per_block(memory):
    """After Fit.apply (a roomy target: no checkpoints; none fits: the least plan, forced) every
    block holds the plan the fit chose, as one object, and one optimizer step of the plan's
    micro-batches (the least plan: micro-batch 1 x 2 accumulation steps, blocks nested and in
    tiles) updates the weights as stock's step on the whole batch."""
    import warnings

    from gradaccel.memory.fit import fit

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    model = transformers.LlamaForCausalLM(cfg)
    model.load_state_dict(ref.state_dict())
    plan = fit(model, seq=32, batch=2, memory=memory, dtype=torch.float32, optim="sgd", micro_batches=[1, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # forced: the least plan does not fit memory=1
        model, opt = plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.1), force=True)
    blocks = _plans_only(model)
    assert [plan_of(b).to_setting() for b in blocks] == [BlockPlan.parse(b).to_setting() for b in plan.budgets]
    if memory == 1:
        assert plan.micro_batch == 1 and any(isinstance(b, str) for b in plan.budgets), plan.budgets
    # One optimizer step of the plan's micro-batches (the wrapped optimizer folds gradients away:
    # the same update is the same gradient). Every sequence has as many labels, so the mean of the
    # micro-batches' mean losses is the whole batch's.
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    ref(input_ids=ids, labels=ids).loss.backward()
    ref_opt.step()
    for part in ids.split(plan.micro_batch):
        model(input_ids=part, labels=part).loss.backward()
        opt.step()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name} {plan.budgets} {plan.chunked_loss}: {m}")
