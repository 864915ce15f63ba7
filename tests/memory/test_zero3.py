"""gradaccel.fit under DeepSpeed ZeRO-3 (``zero3=N``): weights, gradient partition, fp32 masters and
optimizer state counted as one rank's 1/N, plus the most parameter bytes whole at once (a block,
or a module outside the blocks where larger), each named so in the table."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gradaccel.memory.fit import estimate  # noqa: E402
from gradaccel.memory.zero3 import gathered_at_once  # noqa: E402


def _config(vocab):
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256,
                                    tie_word_embeddings=False)


@pytest.mark.parametrize("vocab", [128, 4096])  # the largest gathered: a block, then the embedding and head
def test_zero3_counts_a_ranks_share_and_what_is_gathered_at_once(vocab):
    whole = estimate(_config(vocab), 64, 2, budget=0.5)
    ranks = 4
    ours = estimate(_config(vocab), 64, 2, budget=0.5, zero3=ranks)
    model = transformers.LlamaForCausalLM(_config(vocab)).to(torch.bfloat16)
    block = max(sum(p.numel() * 2 for p in layer.parameters()) for layer in model.model.layers)
    embedding = model.model.embed_tokens.weight.numel() * 2
    assert gathered_at_once(model, list(model.model.layers)) == max(block, embedding)
    trainable = sum(p.numel() for p in model.parameters())
    parts = ours.parts
    assert parts[f"weights (1/{ranks} of each, ZeRO-3)"] == math.ceil(whole.parts["weights"] / ranks)
    assert parts["weights gathered whole at once (ZeRO-3)"] == max(block, embedding)
    assert parts[f"gradient partition (fp32, 1/{ranks}, DeepSpeed's)"] == math.ceil(4 * trainable / ranks)
    assert parts[f"fp32 master weights (1/{ranks}, DeepSpeed's)"] == math.ceil(4 * trainable / ranks)
    assert parts[f"optimizer state (1/{ranks})"] == math.ceil(whole.parts["optimizer state"] / ranks)
    # The activations are a rank's own, as without sharding.
    assert parts["block activations held"] == whole.parts["block activations held"]
    assert ours.peak < whole.peak and ours.zero3 == ranks and whole.zero3 is None
    table = ours.table()
    assert f"DeepSpeed ZeRO-3 over {ranks} ranks" in table and "gathered whole at once" in table
    assert "ZeRO-3" not in whole.table()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_zero3_must_be_a_count(bad):
    with pytest.raises(ValueError, match="zero3"):
        estimate(_config(128), 64, 2, zero3=bad)


def _as_if_sharded(model):
    """``model`` as ZeRO-3 leaves it between modules' forwards: every parameter an empty placeholder
    with its whole shape in ``ds_shape``, and a module hook of DeepSpeed's on every module."""
    def gather(module, args):  # stands in for ZeRO-3's fetch: it must not run on a copy
        raise AssertionError("a DeepSpeed hook ran on the profile's copy")
    gather.__module__ = "deepspeed.runtime.zero.parameter_offload"
    for p in model.parameters():
        p.ds_shape = tuple(p.shape)
        p.data = torch.empty(0, dtype=p.dtype)
    for m in model.modules():
        m.register_forward_pre_hook(gather)
    return model


def test_memory_target_plans_a_sharded_model_at_whole_shapes():
    from gradaccel import checkpoint_blocks
    from gradaccel.memory.profile import fake_copy, fake_mode
    from gradaccel.memory.target import MemoryTarget
    from gradaccel.memory.zero3 import is_sharded, whole_shape

    cfg = _config(128)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg)
    sharded = _as_if_sharded(transformers.LlamaForCausalLM(cfg))
    assert is_sharded(sharded) and not is_sharded(plain)
    copy = fake_copy(sharded, fake_mode())
    assert [tuple(p.shape) for p in copy.parameters()] == [tuple(whole_shape(p)) for p in sharded.parameters()] == \
        [tuple(p.shape) for p in plain.parameters()]
    assert not any(h.__module__.startswith("deepspeed.") for m in copy.modules() for h in m._forward_pre_hooks.values())
    # memory=: at the first training call (the hook, called as the model would call it) the plan of the
    # sharded model predicts the same activations plus what ZeRO-3 gathers at once.
    ids = torch.randint(0, 128, (2, 32))
    chosen = []
    for model in (plain, sharded):
        checkpoint_blocks(model, memory=1 << 30)
        target = next(h for h in model._forward_pre_hooks.values() if isinstance(h, MemoryTarget))
        model.train()
        target(model, (), {"input_ids": ids, "labels": ids})
        chosen.append((target.gathered, *target.chosen.values()))
    (free, (_, plain_peak, _)), (gathered, (_, sharded_peak, _)) = chosen
    assert free == 0 and gathered == gathered_at_once(plain, list(plain.model.layers)) > 0
    assert sharded_peak == plain_peak + gathered
