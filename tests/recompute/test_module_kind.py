"""One notion of a module's kind (gradaccel/recompute/structure.py ``module_kind``): the layers
of a model share size formulas in gradaccel.checkpoint and one trace in the memory planner's
profile (gradaccel/memory/profile.py), both keyed by it."""

import torch

from gradaccel.memory.profile import Profile
from gradaccel.recompute.structure import module_kind
from tests._models import hf_llama


def _llama(inter=64):
    return hf_llama(hidden=32, inter=inter, layers=3, vocab=64, seq=16)


def test_layers_of_one_llama_are_one_kind_and_another_shape_is_another():
    model = _llama()
    a, b, c = model.model.layers
    assert a.self_attn.layer_idx != b.self_attn.layer_idx  # layer indices differ, and do not count
    assert module_kind(a) == module_kind(b) == module_kind(c)
    assert hash(module_kind(a)) == hash(module_kind(b))
    wider = _llama(inter=96).model.layers[0]  # another MLP width: other parameter shapes
    assert module_kind(wider) != module_kind(a)


def test_what_a_kind_ignores_and_what_it_does_not():
    a, b, _ = _llama().model.layers
    # gradaccel's own plan settings and values equal to the class default are no difference.
    b._gradaccel_budget = 1234
    b.gradient_checkpointing = type(b).gradient_checkpointing  # set on the instance, as the class has it
    assert "gradient_checkpointing" in vars(b)
    assert module_kind(a) == module_kind(b)
    # A setting the code reads, a frozen parameter, another dtype: another kind.
    b.self_attn.scaling = 0.5
    assert module_kind(a) != module_kind(b)
    c = _llama().model.layers[1]
    c.mlp.up_proj.weight.requires_grad_(False)
    assert module_kind(a) != module_kind(c)
    d = _llama().model.layers[1].to(torch.float64)
    assert module_kind(a) != module_kind(d)


def test_the_profile_traces_one_block_per_kind():
    model = _llama()
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))

    def step(m, batch):
        return m(**batch[1]).loss

    prof = Profile(model, step, ((), {"input_ids": ids, "labels": ids, "use_cache": False}), grad_hooks=False,
                   skeleton=False)
    assert [k.blocks for k in prof.kinds] == [[0, 1, 2]]
    assert prof.kinds[0].key == module_kind(prof.blocks[0])
