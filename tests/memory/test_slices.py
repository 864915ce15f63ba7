"""Blocks a slice of the sequence at a time (gradaccel/memory/parts.py): gradients against stock
PyTorch, the measured peak against the slice count, which norms join their consumer, and the
split's tie rule (gradaccel/memory/split.py)."""

import copy

import pytest
import torch
import torch.nn as nn

import gradaccel

from gradaccel.memory import LiveBytes
from gradaccel.memory.parts import check_structure, is_parts, set_parts, slice_counts, slices_of, structure_notes, tiles
from gradaccel.memory.profile import Profile, find_blocks
from gradaccel.memory.split import least_peak, least_recompute
from gradaccel.memory.target import _step, set_plans

transformers = pytest.importorskip("transformers")

# Weight gradients sum over the slices in another order than one matmul over all tokens: fp32,
# relative to the largest gradient.
TOL = 1e-5


def _llama(hidden=64, inter=176, layers=2, vocab=128):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                   max_position_embeddings=1024)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()


def _lora(model):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, cfg)


def _block_call(model, ids):
    """The first block's (args, kwargs) in a forward of ``ids``."""
    seen = {}
    block = find_blocks(model)[0]
    h = block.register_forward_pre_hook(lambda m, a, k: seen.update(a=a, k=k), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    h.remove()
    return block, seen["a"], seen["k"]


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_slice_counts():
    assert slice_counts(8192) == [2, 4, 8]
    assert slice_counts(65536) == [8, 16, 32, 64]  # slices of 8K down to 1K tokens
    assert slice_counts(1000) == [4] and slice_counts(2) == []
    assert [slices_of(s) for s in ("parts", tiles(8), "nested:4", 4096, None, "all")] == [1, 8, 4, 0, 0, 0]
    assert [is_parts(s) for s in ("parts", tiles(8), "nested:4", 4096)] == [True, True, False, False]


def test_llama_norms_join_their_consumer():
    model = _llama()
    joins, notes = check_structure(*_block_call(model, torch.randint(0, 128, (1, 32))))
    assert joins == [("input_layernorm", "self_attn", "hidden_states"), ("post_attention_layernorm", "mlp", 0)]
    assert notes == []
    assert "post_attention_layernorm runs inside mlp's checkpoint and slices" in structure_notes(find_blocks(model)[0])


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "peft-lora"])
@pytest.mark.parametrize("setting", ["parts", "tiles:2", "tiles:3", "tiles:8", "nested:1", "nested:3"])
def test_sliced_block_gradients_match_stock(lora, setting):
    """A sliced block (an odd length: uneven slices) gives stock PyTorch's gradients, fp32."""
    model = _llama()
    model = _lora(model) if lora else model
    ids = torch.randint(0, 128, (1, 67), generator=torch.Generator().manual_seed(1))
    ref = _grads(copy.deepcopy(model), ids)
    check_structure(*_block_call(model, ids))
    gradaccel.checkpoint_blocks(model, budget=0)  # a nested plan is this checkpoint around the parts
    blocks = find_blocks(model)
    set_plans(model, blocks, False, [setting] * len(blocks))
    got = _grads(model, ids)
    assert got.keys() == ref.keys() and len(ref) > 0
    worst = max(g.abs().max().item() for g in ref.values())
    err = max((got[n] - ref[n]).abs().max().item() for n in ref) / worst
    assert err <= TOL, (setting, err)


class _SharedNormBlock(nn.Module):
    """A block that also adds its norm's output to the residual: the norm cannot join the MLP."""

    def __init__(self, d=32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = _TinyMLP(d)

    def forward(self, x):
        h = self.norm(x)
        return x + self.mlp(h) + h


class _TinyMLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_norm_used_elsewhere_is_not_joined_and_gradients_hold():
    torch.manual_seed(0)
    block = _SharedNormBlock().train()
    x = torch.randn(2, 37, 32, requires_grad=True)
    joins, notes = check_structure(block, (x,), {})
    assert joins == [] and notes == ["norm runs as its own part: its output is used outside the next part"]
    ref = copy.deepcopy(block)
    ref(x).sum().backward()
    gx, x.grad = x.grad.clone(), None
    set_parts(block, True, 4)
    block(x).sum().backward()
    torch.testing.assert_close(x.grad, gx, rtol=0, atol=1e-6)
    for p, q in zip(block.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def _block_peak(block, args, kwargs, setting):
    """Measured peak (exact bytes, LiveBytes) of ``block``'s forward and backward, and the
    bytes it holds after forward, under ``setting``."""
    set_parts(block, slices_of(setting) > 0, max(1, slices_of(setting)))
    for p in block.parameters():
        p.grad = None
    x = args[0].detach().requires_grad_()
    live = LiveBytes()
    with live:
        out = block(x, *args[1:], **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        held = live.live
        out.backward(torch.ones_like(out))
        del out
    set_parts(block, False)
    return live.peak, held


def test_tiles_peak_falls_as_slices_grow():
    """One Llama block whose MLP is wide: its measured step peak falls with each doubling of the
    slices, and joined norms hold less after forward than parts did before (4 inputs)."""
    model = _llama(hidden=64, inter=1024, layers=1)
    block, args, kwargs = _block_call(model, torch.randint(0, 128, (1, 1024)))
    check_structure(block, args, kwargs)
    peaks = [_block_peak(block, args, kwargs, s)[0] for s in ("parts", "tiles:2", "tiles:4", "tiles:8")]
    assert all(a > b for a, b in zip(peaks, peaks[1:])), peaks
    # Joined norms: the block holds its input and the attention's residual sum (2 x 1024 x 64
    # fp32), plus what attention saves, against each part's input as well without joins.
    held = _block_peak(block, args, kwargs, "parts")[1]
    from gradaccel.memory import parts as parts_mod
    saved = dict(parts_mod._STRUCTURES)
    parts_mod._STRUCTURES.clear()
    try:
        unjoined = _block_peak(block, args, kwargs, "parts")[1]
    finally:
        parts_mod._STRUCTURES.update(saved)
    assert unjoined - held == 2 * 1024 * 64 * 4, (unjoined, held)


def test_split_tie_goes_to_the_lower_peak():
    """Parts and tiles recompute the same: of equal cost, the split takes the lower peak (the
    most slices here), in least_recompute and in least_peak."""
    model = _llama(hidden=64, inter=1024, layers=2)
    ids = torch.randint(0, 128, (1, 2048))
    prof = Profile(model, _step, ((), {"input_ids": ids, "labels": ids, "use_cache": False}), grad_hooks=False)
    opts = [prof.options(prof.kind_of[i]) for i in range(len(prof.blocks))]
    sliced = {p.plan: p for p in opts[0] if is_parts(p.plan)}
    assert set(sliced) == {"parts", "tiles:2"}, sliced  # 2048 tokens: slices of 1024
    terms = prof.step_terms()
    need = {k: max(prof.need(terms, 0, p)) for k, p in sliced.items()}
    assert need["tiles:2"] < need["parts"] and sliced["tiles:2"].cost == sliced["parts"].cost
    # Both fit, at the same cost: before, the first listed (parts) won the tie.
    pair = [[sliced["parts"], sliced["tiles:2"]] for _ in opts]
    memory = prof.predict([sliced["parts"]] * len(opts))["peak"]
    got = least_recompute(prof, pair, memory, exact=False)
    assert got is not None and all(p.plan == "tiles:2" for p in got), got and [p.plan for p in got]
    lowest = least_peak(prof, [[p for p in o if is_parts(p.plan)] for o in opts])
    assert all(p.plan == "tiles:2" for p in lowest), [p.plan for p in lowest]


def test_nested_holds_the_input_alone_and_rebuilds_a_slice_at_a_time():
    """A nested plan (a keep-nothing checkpoint around the block's parts) holds after forward
    what keep-nothing holds (the block's input), less than tiles (its parts' inputs too), and
    its backward peaks below keep-nothing's whole-block rebuild (exact bytes, CPU)."""
    import torch.utils.checkpoint as tc

    model = _llama(hidden=64, inter=1024, layers=1)
    block, args, kwargs = _block_call(model, torch.randint(0, 128, (1, 1024)))
    check_structure(block, args, kwargs)

    def run(setting):
        for p in block.parameters():
            p.grad = None
        set_parts(block, slices_of(setting) > 0, max(1, slices_of(setting)))  # nested: the checkpoint below
        x = args[0].detach().requires_grad_()
        with LiveBytes() as live:
            out = tc.checkpoint(block, x, *args[1:], use_reentrant=False, **kwargs) if setting != "tiles:8" \
                else block(x, *args[1:], **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            held = live.live
            out.backward(torch.ones_like(out))
            del out
        set_parts(block, False)
        return live.peak, held, {n: p.grad.clone() for n, p in block.named_parameters()}

    whole, nested, sliced = run("keep-nothing"), run("nested:8"), run("tiles:8")
    out_bytes = 1024 * 64 * 4  # the block's output, alive after forward in each
    assert nested[1] == whole[1] == out_bytes, (nested[1], whole[1])
    assert sliced[1] > nested[1]
    assert nested[0] < whole[0], (nested[0], whole[0])
    worst = max(g.abs().max().item() for g in whole[2].values())
    assert max((nested[2][n] - g).abs().max().item() for n, g in whole[2].items()) / worst <= TOL
