"""Hugging Face Trainer driving checkpoint_blocks and FusedAccumOptimizer, against Trainer's own
gradient accumulation: the same parameters, bit for bit, including across a save and resume in
the middle of a window."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import gradaccel  # noqa: E402

A, WINDOWS, MICRO = 4, 3, 2  # accumulation steps, optimizer updates, sequences per micro-batch


@pytest.fixture(scope="module")
def base_and_data():
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(3, 64, (A * WINDOWS * MICRO, 9), generator=torch.Generator().manual_seed(0))
    return base, [{"input_ids": t, "labels": t} for t in ids]


def _trainer(model, data, out, optimizers, collator=None, **kw):
    """A Trainer on CPU with this file's settings; ``kw`` adds to or overrides TrainingArguments."""
    args = dict(output_dir=str(out), per_device_train_batch_size=MICRO, use_cpu=True, report_to=[],
                logging_strategy="no", seed=0, data_seed=0, dataloader_drop_last=True, disable_tqdm=True)
    args = transformers.TrainingArguments(**{**args, **kw})
    return transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=optimizers,
                                data_collator=collator)


def _stock(base, data, out):
    """Trainer's own accumulation: A micro-batches per optimizer step, a warm-up schedule."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = transformers.get_linear_schedule_with_warmup(opt, 2, WINDOWS)
    _trainer(model, data, out, (opt, sched), gradient_accumulation_steps=A, max_steps=WINDOWS,
             max_grad_norm=0.0, save_strategy="no").train()
    return model


def _fused(base, per_window=True):
    """gradaccel does the accumulation: Trainer sees one optimizer step per micro-batch."""
    model = gradaccel.checkpoint_blocks(copy.deepcopy(base), budget=0.5)
    opt = gradaccel.FusedAccumOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), A)
    sched = transformers.get_linear_schedule_with_warmup(opt, 2, WINDOWS)  # in windows
    return model, opt, opt.per_window(sched) if per_window else sched


def _fused_args(**kw):
    # Trainer's clipping off (the optimizer frees .grad; it would clip nothing), no accumulation.
    return dict(gradient_accumulation_steps=1, max_steps=A * WINDOWS, max_grad_norm=0.0, **kw)


def _assert_same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max().item():.3e}"


def test_trainer_with_fused_accumulation_equals_trainer_accumulation(base_and_data, tmp_path):
    base, data = base_and_data
    ref = _stock(base, data, tmp_path / "stock")
    model, opt, sched = _fused(base)
    _trainer(model, data, tmp_path / "fused", (opt, sched), save_strategy="no", **_fused_args()).train()
    _assert_same_params(ref, model)
    assert sched.get_last_lr() == [0.0] and sched.scheduler.last_epoch == WINDOWS


def test_without_per_window_the_schedule_runs_per_micro_batch(base_and_data, tmp_path):
    # What per_window is for: stepped after every micro-batch, the warm-up ends A times too early.
    base, data = base_and_data
    ref = _stock(base, data, tmp_path / "stock")
    model, opt, sched = _fused(base, per_window=False)
    _trainer(model, data, tmp_path / "fused", (opt, sched), save_strategy="no", **_fused_args()).train()
    assert any(not torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))


def test_resume_in_the_middle_of_a_window(base_and_data, tmp_path):
    base, data = base_and_data
    ref = _stock(base, data, tmp_path / "stock")
    # Saved after 6 micro-batches, when window 2 holds 2 of its 4.
    model, opt, sched = _fused(base)
    _trainer(model, data, tmp_path / "run", (opt, sched), save_strategy="steps", save_steps=6,
             **_fused_args()).train()
    ckpt = tmp_path / "run" / "checkpoint-6"
    assert ckpt.is_dir()  # (the run went on to the end; the checkpoint is what counts)
    model, opt, sched = _fused(base)
    _trainer(model, data, tmp_path / "resumed", (opt, sched), save_strategy="no",
             **_fused_args()).train(resume_from_checkpoint=str(ckpt))
    assert opt.micro_step == 0 and sched.scheduler.last_epoch == WINDOWS
    _assert_same_params(ref, model)
