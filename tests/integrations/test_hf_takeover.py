"""Nothing replaces gradaccel silently: Hugging Face checkpointing turned on before or after
checkpoint_blocks (by peft, Trainer, TRL or the user) runs gradaccel's checkpoint, once."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gradaccel  # noqa: E402
from gradaccel import checkpoint_blocks
from gradaccel.recompute.blocks import _HFCheckpoint  # noqa: E402
from test_hf import VOCAB, SEQ, assert_same_step, make_pair  # noqa: E402


def mlp_calls_per_step(model, ids):
    """How often each layer's MLP runs in one forward+backward: 1 without checkpointing, 2 with
    one recompute, 3 if two checkpoints were nested. (Budget 0.0: gradaccel recomputes by running
    the layer again, as torch does; under a plan it replays ops, which module hooks do not see.)"""
    model.train()
    calls = []
    for layer in model.model.layers:
        forward = layer.mlp.forward
        layer.mlp.forward = lambda *a, forward=forward, **k: (calls.append(1), forward(*a, **k))[1]
    model(input_ids=ids, labels=ids).loss.backward()
    for layer in model.model.layers:
        del layer.mlp.forward
    return len(calls) // len(model.model.layers)


def assert_ours(model, budget):
    for layer in model.model.layers:
        assert layer.gradient_checkpointing is True
        func = layer._gradient_checkpointing_func
        assert isinstance(func, _HFCheckpoint) and func.budget == budget


def test_hf_checkpointing_already_on_is_taken_over():
    # As peft's prepare_model_for_kbit_training leaves it: HF's torch checkpoint, reentrant.
    ref, model = make_pair("llama", "eager")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    checkpoint_blocks(model, budget=0.0)  # no raise
    assert_ours(model, 0.0)
    ids = torch.randint(1, VOCAB, (2, SEQ))
    assert mlp_calls_per_step(model, ids) == 2
    model.zero_grad()
    assert_same_step(ref, model, ids)


def test_later_enable_installs_gradaccel_and_never_nests():
    ref, model = make_pair("llama", "eager")
    checkpoint_blocks(model, budget=0.0)
    model.activation_checkpointing_enable()  # e.g. Trainer(gradient_checkpointing=True), SFTConfig's default
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_ours(model, 0.0)
    ids = torch.randint(1, VOCAB, (2, SEQ))
    assert mlp_calls_per_step(model, ids) == 2
    model.zero_grad()
    assert_same_step(ref, model, ids)
    model.activation_checkpointing_disable()  # turning it off still works
    assert not model.is_activation_checkpointing
    assert mlp_calls_per_step(model, ids) == 1


def test_a_foreign_checkpoint_function_is_replaced_with_a_warning():
    _, model = make_pair("llama", "eager")
    checkpoint_blocks(model, budget=0.5)
    with pytest.warns(UserWarning, match="gradaccel's checkpoint"):
        model.activation_checkpointing_enable(offload=True)
    assert_ours(model, 0.5)


def test_second_call_says_gradaccel_is_on_and_set_budget_changes_it():
    _, model = make_pair("llama", "eager")
    checkpoint_blocks(model, budget=0.5)
    with pytest.raises(RuntimeError, match="gradaccel is already on.*budget=0.5"):
        checkpoint_blocks(model, budget=0.25)
    assert gradaccel.recompute.blocks.set_budget(model, 0.25) == 1
    assert_ours(model, 0.25)
    model.activation_checkpointing_enable()
    assert_ours(model, 0.25)


def test_release_gives_hf_its_hook_back():
    _, model = make_pair("llama", "eager")
    checkpoint_blocks(model, budget=0.5)
    gradaccel.recompute.blocks.release(model)
    assert not model.is_activation_checkpointing
    model.activation_checkpointing_enable()
    assert not isinstance(model.model.layers[0]._gradient_checkpointing_func, _HFCheckpoint)


def test_step_after_no_backward_warns():
    lin = torch.nn.Linear(4, 4)
    opt = gradaccel.FusedAccumOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), 2)
    before = lin.weight.detach().clone()
    with pytest.warns(UserWarning, match="no gradient at all"):
        assert opt.step() is False and opt.step() is False
    assert torch.equal(lin.weight, before)
    lin(torch.ones(1, 4)).sum().backward()  # with a backward: no warning, an update
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lin(torch.ones(1, 4)).sum().backward()
        assert opt.step() is True


def test_enable_refuses_what_would_bypass_gradaccel(tmp_path):
    pytest.importorskip("accelerate")
    ref, model = make_pair("gpt2", "eager")
    opt = gradaccel.FusedAccumOptimizer(torch.optim.AdamW(model.parameters()), 4)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=model, args=args, optimizers=(opt, None))
    with pytest.raises(TypeError, match="already a FusedAccumOptimizer"):
        gradaccel.hf.enable(trainer)
    with pytest.raises(TypeError, match="Trainer or an accelerate.Accelerator"):
        gradaccel.hf.enable(model)
    trainer = transformers.Trainer(model=ref, args=args)
    with pytest.warns(UserWarning, match="no effect, gradient checkpointing is off"):
        gradaccel.hf.enable(trainer, budget=0.5)
    assert not ref.is_activation_checkpointing
    ref.activation_checkpointing_enable()  # turned on later: gradaccel's, at the budget given
    assert all(isinstance(b._gradient_checkpointing_func, _HFCheckpoint) and b._gradient_checkpointing_func.budget == 0.5
               for b in ref.transformer.h)


def test_enable_after_a_first_train_still_wraps_the_optimizer(tmp_path):
    # Trainer keeps the optimizer it prepared in a first train(): the second must not bypass gradaccel.
    pytest.importorskip("accelerate")
    _, model = make_pair("gpt2", "eager")
    data = [{"input_ids": t, "labels": t} for t in torch.randint(1, VOCAB, (8, SEQ))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1,
                                          per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    gradaccel.hf.enable(trainer)
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert isinstance(opt, gradaccel.FusedAccumOptimizer) and opt.last_grad_norm is not None
