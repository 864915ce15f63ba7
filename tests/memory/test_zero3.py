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
    assert gathered_at_once(model) == max(block, embedding)
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
