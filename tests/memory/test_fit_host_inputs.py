"""The fit's pricing of block inputs on the host (checkpoint_blocks(inputs_on_host=True)): the
device peak it predicts against the measured one (live bytes on CPU), the host bytes against the
store's, and the fit choosing it where only then a plan fits, as what apply() installs."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gradaccel  # noqa: E402
from gradaccel.memory.counter import measured_peak  # noqa: E402
from gradaccel.memory.fit import Planner, hf_step  # noqa: E402
from gradaccel.recompute.offload_frame import store_for  # noqa: E402
from gradaccel.recompute.block_plan import plan_of  # noqa: E402

HIDDEN, LAYERS, VOCAB, SEQ = 256, 6, 64, 96  # a block input: 96 x 256 x 4 = 96 KiB (fp32)


def _model(norms_only=False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=SEQ, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg)
    if norms_only:  # adapter-like: few gradients, so activations set the peak
        for name, p in model.named_parameters():
            p.requires_grad_("norm" in name)
    return model


def _batch():
    ids = torch.randint(0, VOCAB, (1, SEQ))
    return {"input_ids": ids, "labels": ids}


def _measured(inputs_on_host):
    gradaccel.reset_plans()
    # budget=1: the keep-nothing plan of gradaccel.checkpoint, the one estimate(..., 1) prices
    model = gradaccel.checkpoint_blocks(_model().train(), budget=1, inputs_on_host=inputs_on_host)
    opt = gradaccel.FusedAccumOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3, momentum=0.9), 1)
    store = store_for(None)
    before = store.stats()["bytes_offloaded"]
    peak = measured_peak(model, opt, hf_step, _batch())  # two steps
    return peak, (store.stats()["bytes_offloaded"] - before) // 2


def test_predicted_against_measured():
    planner = Planner(_model(), optim="sgd")
    kept = planner.estimate(SEQ, 1, 1)
    parked = planner.estimate(SEQ, 1, 1, inputs_on_host=True)
    one = SEQ * HIDDEN * 4
    assert parked.inputs_on_host and not kept.inputs_on_host
    assert parked.host["block inputs (inputs_on_host)"] == LAYERS * one
    assert parked.time >= kept.time  # the copies' exposed time, never negative
    real_kept, _ = _measured(False)
    real_parked, host = _measured(True)
    assert host == LAYERS * one  # what the store received per step: every block's input
    for predicted, real in ((kept.peak, real_kept), (parked.peak, real_parked)):
        assert abs(predicted / real - 1) <= 0.10, (predicted, real)
    # The device saving, predicted and measured alike: most of the inputs.
    assert kept.peak - parked.peak >= (LAYERS - 3) * one
    assert real_kept - real_parked >= (LAYERS - 3) * one


def test_fit_chooses_inputs_on_host_where_only_that_fits():
    # Planned as for an accelerator: on a CPU device the host is the device, and the fit offers no
    # host plans (tests/memory/test_fit_trust.py); the CPU stands in for one here.
    planner = Planner(_model(), optim="sgd", device="cuda")
    from gradaccel.memory.fit import _least

    least_kept = _least(planner, SEQ, 1, False, False).peak
    least_parked = _least(planner, SEQ, 1, False, False, host=True).peak
    assert least_parked < least_kept
    memory = (least_kept + least_parked) // 2
    result = planner.fit(SEQ, 1, memory, slack=0)
    assert result.fits and result.inputs_on_host and result.peak <= memory
    assert result.host["block inputs (inputs_on_host)"] == LAYERS * SEQ * HIDDEN * 4
    assert "inputs on host" in result.summary() and "block inputs" in result.table()
    gradaccel.reset_plans()
    model = _model().train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3, momentum=0.9)
    model, opt = result.apply(model, opt)
    assert all(layer._gradient_checkpointing_func.inputs_on_host for layer in model.model.layers)
    real = measured_peak(model, opt, hf_step, _batch())
    assert real <= memory * 1.05, (real, memory)


def test_memory_target_parks_inputs_where_only_that_fits():
    import warnings

    from gradaccel.memory import target
    from gradaccel.memory.target import MemoryTarget

    def target_of(model):
        return next(h for h in model._forward_pre_hooks.values() if isinstance(h, MemoryTarget))

    batch = _batch()
    # The least peak the step reaches with its blocks' inputs on the device, as memory= counts it
    # (above weights and optimizer state): a target no plan meets, planned keeping the inputs.
    gradaccel.reset_plans()
    probe = gradaccel.checkpoint_blocks(_model(True).train(), memory=1)
    calls = []
    probe.register_forward_pre_hook(lambda m, a, k: calls.append((a, k)), with_kwargs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # memory=1: below the least, as meant
        hf_step(probe, batch)
        target._busy.on = True  # as in the hook: the profiles' fake models do not plan themselves
        try:
            _, (_, kept, _), _, _, _ = target_of(probe)._plan(probe, *calls[0], True, False)
        finally:
            target._busy.on = False
    # Two block inputs under it: the blocks (sliced, nested or parts) do not reach it keeping
    # their inputs; parked, they do.
    memory = kept - 2 * SEQ * HIDDEN * 4
    gradaccel.reset_plans()
    ref = gradaccel.checkpoint_blocks(_model(True).train())
    model = gradaccel.checkpoint_blocks(_model(True).train(), memory=memory)
    hf_step(ref, batch).backward()
    first = gradaccel.memory.LiveBytes()
    with warnings.catch_warnings(), first:
        warnings.simplefilter("error", UserWarning)  # no "below the least" warning: it fits
        hf_step(model, batch).backward()  # the first step plans (on fake tensors), and traces each block
    model.zero_grad()
    assert first.peak <= memory * 1.05, (first.peak, memory)  # before the first out-of-memory error
    live = gradaccel.memory.LiveBytes()
    with live:
        hf_step(model, batch).backward()
    chosen = target_of(model)
    assert list(chosen.hosts.values()) == [True] and "host" in next(iter(chosen.chosen.values()))[0]
    assert all(plan_of(layer).parked for layer in model.model.layers)
    assert live.peak <= memory * 1.05, (live.peak, memory)
    for p, q in zip(ref.parameters(), model.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7)
