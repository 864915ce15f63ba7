"""gradaccel.hf.enable under Hugging Face Trainer, against Trainer's own accumulation, clipping and
checkpointing with the same optimizer and data: parameters, logged loss and grad_norm."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import gradaccel  # noqa: E402
from gradaccel.recompute.checkpoint import plan_rows, reset_plans  # noqa: E402
from bench.common import pad_collate  # noqa: E402
from test_trainer import A, MICRO, WINDOWS, _trainer, base_and_data  # noqa: E402,F401


def uneven(data, seed=1):
    """The same token ids cut to lengths 3..9: windows of unequal token counts."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 10, (len(data),), generator=gen).tolist()
    return [{"input_ids": d["input_ids"][:n], "labels": d["labels"][:n]} for d, n in zip(data, lengths)]


def run(base, data, out, gradaccel_budget=-1, resume=None, **kw):
    """Trainer's own accumulation (A micro-batches per step), checkpointing, warm-up and clipping;
    with ``gradaccel_budget`` other than -1 the same script plus gradaccel.hf.enable."""
    model = copy.deepcopy(base)
    args = dict(gradient_accumulation_steps=A, max_steps=WINDOWS, gradient_checkpointing=True, learning_rate=1e-2,
                warmup_steps=2, lr_scheduler_type="linear", logging_strategy="steps", logging_steps=1,
                save_strategy="no")
    trainer = _trainer(model, data, out, (None, None), collator=pad_collate, **{**args, **kw})
    if gradaccel_budget != -1:
        gradaccel.hf.enable(trainer, budget=gradaccel_budget)
    trainer.train(resume_from_checkpoint=resume)
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == WINDOWS  # (a resumed run keeps the history saved with the checkpoint)
    return model, trainer, logs


def assert_engaged(trainer, model):
    """gradaccel really ran: its optimizer folded the gradients, its checkpoint planned the layers."""
    opt = trainer.optimizer.optimizer  # accelerate's wrapper around ours
    assert isinstance(opt, gradaccel.FusedAccumOptimizer) and opt.normalize == "sum"
    assert opt.last_grad_norm is not None and opt.grad_buffer.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())
    layers = model.transformer.h
    assert all(isinstance(b._gradient_checkpointing_func, gradaccel.recompute.blocks._HFCheckpoint) for b in layers)
    rows = plan_rows()  # one per layer and input shape
    assert len(rows) >= len(layers) and {r["region"] for r in rows} == {"GPT2Block.forward"}


def assert_close_params(ref, model, exact, lr=1e-2):
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        if exact:
            assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max().item():.3e}"
        else:
            # The attention's key bias has a zero gradient in exact arithmetic (softmax ignores a
            # shift), so its float gradient is rounding noise that Adam scales up to ~lr: an ulp
            # in the clip coefficient moves it by ~1e-5 lr (seen 1.5e-5). Elsewhere 1e-6 relative.
            torch.testing.assert_close(q, p, rtol=1e-6, atol=3e-5 * lr, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("lengths", ["equal", "uneven"])
def test_trainer_matches_stock_trainer(base_and_data, tmp_path, lengths):
    base, data = base_and_data
    if lengths == "uneven":
        data = uneven(data)
    ref, _, ref_logs = run(base, data, tmp_path / "stock", max_grad_norm=0.0)
    reset_plans()
    model, trainer, logs = run(base, data, tmp_path / "ga", gradaccel_budget=0.5, max_grad_norm=0.0)
    assert_engaged(trainer, model)
    # No clipping: the window gradient is the same sum of the same micro-batch gradients (each
    # divided by the window's token count by Trainer), added in the same order: bit for bit.
    assert_close_params(ref, model, exact=True)
    assert [x[0] for x in logs] == [x[0] for x in ref_logs]
    # grad_norm: one pass over the flat buffer against torch's per-tensor norms: ulp-level.
    assert [x[1] for x in logs] == pytest.approx([x[1] for x in ref_logs], rel=1e-6)


def test_trainer_clipping_matches_stock(base_and_data, tmp_path):
    base, data = base_and_data
    data = uneven(data)
    ref, _, ref_logs = run(base, data, tmp_path / "stock", max_grad_norm=0.05)
    reset_plans()
    model, trainer, logs = run(base, data, tmp_path / "ga", gradaccel_budget=0.5, max_grad_norm=0.05)
    assert_engaged(trainer, model)
    assert all(n > 0.05 for _, n in ref_logs)  # every window is clipped
    # The clip coefficient comes from a norm summed in another order: 1e-6 relative.
    assert_close_params(ref, model, exact=False)
    assert [x[0] for x in logs] == pytest.approx([x[0] for x in ref_logs], rel=1e-6)
    assert [x[1] for x in logs] == pytest.approx([x[1] for x in ref_logs], rel=1e-6)


def test_trainer_resume_matches_stock(base_and_data, tmp_path):
    base, data = base_and_data
    data = uneven(data)
    ref, _, _ = run(base, data, tmp_path / "stock", max_grad_norm=0.0)
    reset_plans()
    run(base, data, tmp_path / "ga", gradaccel_budget=0.5, max_grad_norm=0.0, save_strategy="steps", save_steps=1)
    ckpt = tmp_path / "ga" / "checkpoint-1"
    sd = torch.load(ckpt / "optimizer.pt", weights_only=False)
    # The checkpoint holds gradaccel's optimizer state, without the buffer: Trainer saves between
    # windows, where it holds nothing (4 bytes per parameter saved for nothing otherwise).
    assert sd["gradaccel"]["micro"] == 0 and sd["gradaccel"]["flat"] is None
    model, trainer, _ = run(base, data, tmp_path / "resumed", gradaccel_budget=0.5, max_grad_norm=0.0,
                            resume=str(ckpt))
    assert_engaged(trainer, model)
    assert trainer.state.global_step == WINDOWS
    assert_close_params(ref, model, exact=True)


def test_disable_undoes_enable(base_and_data, tmp_path):
    """gradaccel.hf.disable after a trained run: the trainer's and accelerator's methods are their
    classes' again, the optimizer is unwrapped (accelerate holds the inner AdamW, at the state it
    reached), the layers checkpoint as before enable; the next train() is stock Trainer's."""
    base, data = base_and_data
    model = copy.deepcopy(base)
    trainer = _trainer(model, data, tmp_path / "ga", (None, None), collator=pad_collate, gradient_accumulation_steps=A,
                       max_steps=WINDOWS, gradient_checkpointing=True, learning_rate=1e-2, save_strategy="no")
    layers = model.transformer.h
    before = [(b.gradient_checkpointing, vars(b).get("_gradient_checkpointing_func")) for b in layers]
    acc = trainer.accelerator
    gradaccel.hf.enable(trainer, budget=0.5)
    assert {"train", "create_accelerator_and_postprocess"} <= set(vars(trainer))
    assert {"prepare", "prepare_optimizer", "clip_grad_norm_", "backward"} <= set(vars(acc))
    trainer.train()
    fused = trainer.optimizer.optimizer
    assert isinstance(fused, gradaccel.FusedAccumOptimizer)
    gradaccel.hf.disable(trainer)
    assert not {"train", "create_accelerator_and_postprocess", "_gradaccel_patches"} & set(vars(trainer))
    assert not {"prepare", "prepare_optimizer", "clip_grad_norm_", "clip_grad_value_", "backward",
                "_gradaccel"} & set(vars(acc))
    inner = trainer.optimizer.optimizer
    assert isinstance(inner, torch.optim.AdamW) and inner is fused.optimizer and inner.state
    assert [(b.gradient_checkpointing, vars(b).get("_gradient_checkpointing_func")) for b in layers] == before
    assert not any("_gradaccel_checkpoint" in vars(m) for m in model.modules())
    reset_plans()
    steps = next(iter(inner.state.values()))["step"].item()
    trainer.args.max_steps = 2 * WINDOWS
    trainer.train(resume_from_checkpoint=False)
    assert trainer.optimizer.optimizer is inner and next(iter(inner.state.values()))["step"].item() > steps
    assert all(b.gradient_checkpointing and not isinstance(b._gradient_checkpointing_func,
                                                           gradaccel.recompute.blocks._HFCheckpoint) for b in layers)
    assert not plan_rows()
