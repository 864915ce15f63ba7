"""The script this project started from, at every length: TRL's SFTTrainer, a 4-bit (nf4,
double-quant) Llama with grouped-query attention, peft's ``prepare_model_for_kbit_training``
defaults, LoRA on q/k/v/o (with and without LoRA dropout), batch 1 (every step its own length),
bf16 autocast (SGD, so that the weights compare to a bf16 ulp; the bench runs paged 8-bit AdamW); and with ``padding_free=True``. Each against its stock run,
and selective from the first step at each length: each layer traced once, every later length
sized from formulas (bitsandbytes' gemm_4bit is an op outside aten: priced by gradaccel's FLOP
table, and run under the autocast it ran under)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")
datasets = pytest.importorskip("datasets")

from test_hf_stack import VOCAB, model_dir, tokenizer, train_quietly  # noqa: E402,F401 (same Llama, tokenizer)
from gradaccel.recompute.checkpoint import plan_rows  # noqa: E402

A, WINDOWS = 4, 3  # batch 1: A * WINDOWS micro-batches, each its own length


@pytest.fixture(scope="module")
def texts():
    """Texts of 2 to 40 words, no two of one length: a new length at every step."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randperm(39, generator=gen)[:A * WINDOWS].add(2).tolist()
    return [" ".join(f"w{i}" for i in torch.randint(0, VOCAB - 2, (n,), generator=gen).tolist()) for n in lengths]


def qlora_sft(model_dir, tokenizer, texts, out, ours, dropout, optim="sgd", **kw):
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, device_map="cpu")
    model = peft.prepare_model_for_kbit_training(model)  # its defaults: HF checkpointing turned on
    args = trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=1, gradient_accumulation_steps=A,
                         max_steps=WINDOWS, use_cpu=True, bf16=True, report_to=[], logging_steps=1, save_strategy="no",
                         seed=0, data_seed=0, disable_tqdm=True, learning_rate=1e-2, optim=optim, **kw)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, task_type="CAUSAL_LM",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    torch.manual_seed(0)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": texts}),
                             processing_class=tokenizer, peft_config=lora)
    return train_quietly(trainer, ours)


@pytest.mark.parametrize("dropout,kw", [(0.05, {}), (0.0, {}), (0.05, dict(padding_free=True, max_length=None))],
                         ids=["lora-dropout", "no-dropout", "padding-free"])
def test_qlora_sft_every_length_is_sized_and_equals_stock(model_dir, tokenizer, texts, tmp_path, dropout, kw):
    ref = qlora_sft(model_dir, tokenizer, texts, tmp_path / "stock", False, dropout, **kw)
    ours = qlora_sft(model_dir, tokenizer, texts, tmp_path / "ga", True, dropout, **kw)
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    # The first window's loss is the forward's before any update: bit for bit (the checkpointed
    # forward and its replay compute as stock does). The adapters are bf16 here: stock sums the
    # window's gradient in bf16 .grad, gradaccel in fp32 and rounds once, so the gradients
    # differ by a bf16 ulp or two (stock's rounding), and so do the weights and later losses.
    assert losses(ours)[0] == losses(ref)[0] and len(losses(ref)) == WINDOWS
    assert losses(ours) == pytest.approx(losses(ref), rel=1e-4)
    for (name, p), q in zip(ref.model.named_parameters(), ours.model.parameters()):
        ulps = 2.0 ** -7 if p.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(q.float(), p.float(), rtol=2 * ulps, atol=1e-4, msg=lambda m: f"{name}: {m}")
    rows = [r for r in plan_rows() if r["region"] == "LlamaDecoderLayer.forward"]
    assert len({r["signature"].split(")")[0] for r in rows}) == A * WINDOWS  # every step its own length
    # Per layer: one trace, then every other length from formulas.
    assert {(r["lengths"]["traced"], r["lengths"]["sized"], r["lengths"]["not_sized"]) for r in rows} == \
        {(1, A * WINDOWS - 1, "")}
    # Within budget at each length. Selective, not torch.utils.checkpoint: a plan keeps something
    # wherever its budget leaves room beside the generator state that LoRA dropout's replay needs.
    assert all(r["kept_bytes"] <= r["budget_bytes"] for r in rows), rows
    assert all(r["kept_bytes"] > 0 for r in rows if r["budget_bytes"] > 8192), rows
    assert all(r["made"] == "sized" for r in rows if r["signature"] != rows[0]["signature"])
