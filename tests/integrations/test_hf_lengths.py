"""gradaccel.hf.enable on data whose length changes every step, as fine-tuning data does: TRL's
SFTTrainer with its default collator (each batch padded to its longest text) and with
``padding_free=True`` (one row of all tokens), and Trainer with a padding collator. Each against
its stock run, and selective from the first step at each length: one trace per layer kind, and
every length after it planned without tracing."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

import gradaccel  # noqa: E402
from test_hf_stack import model_dir, tokenizer  # noqa: E402,F401 (the same tiny Llama and word-level tokenizer)
from gradaccel.recompute.checkpoint import plan_rows, reset_plans  # noqa: E402
from gradaccel.recompute.state import STATE  # noqa: E402

A, MICRO, WINDOWS, VOCAB = 2, 2, 4, 64  # VOCAB: test_hf_stack's


@pytest.fixture(scope="module")
def texts():
    """Texts of 2 to 40 words, skewed short as instruction data is: a new length most steps."""
    gen = torch.Generator().manual_seed(1)
    lengths = (torch.rand(A * MICRO * WINDOWS, generator=gen) ** 2 * 38 + 2).long().tolist()
    return [" ".join(f"w{i}" for i in torch.randint(0, VOCAB - 2, (n,), generator=gen).tolist()) for n in lengths]


def _args(cls, out, **kw):
    return cls(output_dir=str(out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=A,
               max_steps=WINDOWS, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=0,
               data_seed=0, disable_tqdm=True, learning_rate=1e-2, max_grad_norm=0.0,
               gradient_checkpointing=True, **kw)


def _train(trainer, ours):
    if ours:
        reset_plans()
        gradaccel.hf.enable(trainer, budget=0.5)
    trainer.train()
    return trainer


def _check(ref, ours):
    """Equal to stock, bit for bit (no clipping), and selective at every length it saw."""
    la = [h["loss"] for h in ref.state.log_history if "loss" in h]
    assert [h["loss"] for h in ours.state.log_history if "loss" in h] == la and len(la) == WINDOWS
    for (name, p), q in zip(ref.model.named_parameters(), ours.model.parameters()):
        assert torch.equal(p, q), name
    rows = [r for r in plan_rows() if r["region"] == "LlamaDecoderLayer.forward"]
    shapes = {r["signature"].split(")")[0] for r in rows}
    assert len(shapes) >= 4, shapes  # the data really changed length
    traced = sum(s.traces for per_owner in STATE.shapes.values() for s in per_owner.values())
    assert traced <= 2, f"{traced} traces for {len(shapes)} lengths"  # one per layer at most
    # Every length keeps something (budget 0.5), and recomputes less than keeping nothing would.
    assert all(0 < r["kept_bytes"] <= r["budget_bytes"] for r in rows), rows


def _sft(model_dir, tokenizer, texts, out, ours, **kw):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = trl.SFTTrainer(model=model, args=_args(trl.SFTConfig, out, **kw),
                             train_dataset=datasets.Dataset.from_dict({"text": texts}), processing_class=tokenizer)
    return _train(trainer, ours)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding_free"])
def test_sft_trainer_lengths(model_dir, tokenizer, texts, tmp_path, padding_free):
    # TRL refuses padding_free without packing unless max_length=None (it would not truncate);
    # the texts are far shorter than its default max_length, so nothing changes but the check.
    kw = dict(padding_free=True, max_length=None) if padding_free else {}
    ref = _sft(model_dir, tokenizer, texts, tmp_path / "stock", False, **kw)
    ours = _sft(model_dir, tokenizer, texts, tmp_path / "ga", True, **kw)
    _check(ref, ours)



def test_trainer_with_a_padding_collator(model_dir, tokenizer, texts, tmp_path):
    # DataCollatorForLanguageModeling(mlm=False) pads as DataCollatorWithPadding does and adds
    # the labels a causal LM's loss needs (pads ignored).
    data = datasets.Dataset.from_dict({"text": texts}).map(lambda b: tokenizer(b["text"]), batched=True,
                                                               remove_columns=["text"])
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)

    def run(out, ours):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        trainer = transformers.Trainer(model=model, args=_args(transformers.TrainingArguments, out),
                                       train_dataset=data, data_collator=collator)
        return _train(trainer, ours)

    _check(run(tmp_path / "stock", False), run(tmp_path / "ga", True))
