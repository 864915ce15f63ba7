"""The fine-tuning stacks people run, each with gradaccel.hf.enable against its stock run: TRL's
SFTTrainer (default SFTConfig, and with peft_config), QLoRA (4-bit nf4 base, peft's
prepare_model_for_kbit_training, LoRA, paged 8-bit AdamW), a plain accelerate loop; and LoRA
with FusedAccumOptimizer over bitsandbytes' 8-bit optimizers. Tiny random models, text made here."""

import copy
import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")
accelerate = pytest.importorskip("accelerate")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

import gradaccel  # noqa: E402
from gradaccel.recompute.checkpoint import plan_rows, reset_plans  # noqa: E402

A, MICRO, WINDOWS, VOCAB = 4, 2, 3, 64


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {"[PAD]": 0, "[EOS]": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[PAD]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]")


@pytest.fixture(scope="module")
def texts():
    """Texts of 3 to 11 words: windows of unequal token counts."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 12, (A * MICRO * WINDOWS,), generator=gen).tolist()
    return [" ".join(f"w{i}" for i in torch.randint(0, VOCAB - 2, (n,), generator=gen).tolist()) for n in lengths]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama saved locally (hidden 64: bitsandbytes' 4-bit blocks are 64 wide)."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def logged(trainer):
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def assert_engaged(trainer):
    """gradaccel ran: its optimizer under accelerate's wrapper, its checkpoint on every layer."""
    opt = trainer.optimizer.optimizer
    assert isinstance(opt, gradaccel.FusedAccumOptimizer) and opt.last_grad_norm is not None
    assert all(p.grad is None for p in trainer.model.parameters())
    rows = plan_rows()
    assert rows and {r["region"] for r in rows} == {"LlamaDecoderLayer.forward"}


def assert_same_training(ref, ours, exact):
    la, lb = logged(ref), logged(ours)
    assert len(la) == WINDOWS
    assert [x[0] for x in lb] == [x[0] for x in la]  # the loss is the forward's: bit for bit
    # grad_norm: one pass over the flat buffer against torch's per-tensor norms: ulp-level.
    assert [x[1] for x in lb] == pytest.approx([x[1] for x in la], rel=1e-6)
    for (name, p), q in zip(ref.model.named_parameters(), ours.model.parameters()):
        if exact:
            assert torch.equal(p, q), name
        else:
            # Clipping scales by a coefficient from that ulp-different norm: 1e-6 relative, and
            # Adam turns an entry whose gradient is rounding noise into ~lr steps (1e-4 lr).
            torch.testing.assert_close(q.float(), p.float(), rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


def sft(model_dir, tokenizer, texts, out, use_gradaccel, peft_config=None, fuse_wgrad=False, **kw):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    args = trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=A,
                         max_steps=WINDOWS, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=0,
                         data_seed=0, disable_tqdm=True, learning_rate=1e-2, **kw)
    assert args.gradient_checkpointing  # SFTConfig's default, kept
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": texts}),
                             processing_class=tokenizer, peft_config=peft_config)
    if use_gradaccel:
        reset_plans()
        gradaccel.hf.enable(trainer, budget=0.5, fuse_wgrad=fuse_wgrad)
    trainer.train()
    return trainer


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_trainer_fuse_wgrad(model_dir, tokenizer, texts, tmp_path, lora):
    """hf.enable(fuse_wgrad=True): the Linear and Embedding weight gradients of the model the
    Trainer prepares go straight into the fp32 window; training equals stock's to fp32
    accumulation order (the window sums each micro-batch's GEMM into fp32, stock adds .grad)."""
    peft_config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM") if lora else None
    # fp32 (SFTConfig would autocast to bf16 on this CPU, where the fused GEMM's dx and stock's
    # bf16 one round differently: compared with fp64 in tests/accumulate/test_fuse_wgrad.py).
    kw = dict(peft_config=peft_config, max_grad_norm=0.0, bf16=False)
    ref = sft(model_dir, tokenizer, texts, tmp_path / "stock", False, **kw)
    ours = sft(model_dir, tokenizer, texts, tmp_path / "ga", True, fuse_wgrad=True, **kw)
    assert_engaged(ours)
    layers = ours.optimizer.optimizer.fused_layers
    if lora:  # peft's adapters are nn.Linear; the frozen base weights make no gradient to route
        assert layers and all("lora_" in name for name in layers), layers
    else:
        assert any(name.endswith("lm_head") for name in layers) and any("embed_tokens" in n for n in layers), layers
    la, lb = logged(ref), logged(ours)
    assert [x[0] for x in lb] == pytest.approx([x[0] for x in la], rel=1e-5)
    for (name, p), q in zip(ref.model.named_parameters(), ours.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_sft_trainer_default_config(model_dir, tokenizer, texts, tmp_path):
    ref = sft(model_dir, tokenizer, texts, tmp_path / "stock", False, max_grad_norm=0.0)
    ours = sft(model_dir, tokenizer, texts, tmp_path / "ga", True, max_grad_norm=0.0)
    assert_engaged(ours)
    assert_same_training(ref, ours, exact=True)


def test_sft_trainer_with_peft_config(model_dir, tokenizer, texts, tmp_path):
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    ref = sft(model_dir, tokenizer, texts, tmp_path / "stock", False, peft_config=lora)
    ours = sft(model_dir, tokenizer, texts, tmp_path / "ga", True, peft_config=lora)
    assert_engaged(ours)
    assert_same_training(ref, ours, exact=False)  # SFTConfig clips at 1.0


def test_sft_trainer_prebuilt_optimizer_before_peft_raises(model_dir, tokenizer, texts, tmp_path):
    # The optimizer holds the base weights, which peft then freezes; the adapters are not in it.
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=MICRO, max_steps=1, use_cpu=True,
                         report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": texts}),
                             processing_class=tokenizer, optimizers=(opt, None),
                             peft_config=peft.LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    gradaccel.hf.enable(trainer)
    with pytest.raises(ValueError, match="lora_A.*not in the optimizer|not in the optimizer"):
        trainer.train()


def qlora(model_dir, tokenizer, texts, out, use_gradaccel):
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, device_map="cpu")
    model = peft.prepare_model_for_kbit_training(model)  # its defaults: HF checkpointing turned on
    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"],
                                                       task_type="CAUSAL_LM"))
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=A, max_steps=WINDOWS,
        use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=0, data_seed=0, disable_tqdm=True,
        learning_rate=1e-2, optim="paged_adamw_8bit", gradient_checkpointing=True, bf16=True)
    ds = datasets.Dataset.from_dict(dict(tokenizer(texts)))
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, data_collator=collator)
    return train_quietly(trainer, use_gradaccel)


def train_quietly(trainer, use_gradaccel):
    """``trainer.train()``, under ``hf.enable(budget=0.5)`` if asked, without bitsandbytes' notice
    that paged optimizers fall back to unpaged on CPU."""
    if use_gradaccel:
        reset_plans()
        gradaccel.hf.enable(trainer, budget=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer


def test_qlora_matches_stock(model_dir, tokenizer, texts, tmp_path):
    ref = qlora(model_dir, tokenizer, texts, tmp_path / "stock", False)
    ours = qlora(model_dir, tokenizer, texts, tmp_path / "ga", True)
    assert_engaged(ours)
    inner = ours.optimizer.optimizer.optimizer  # accelerate's wrapper > gradaccel's > bitsandbytes' paged 8-bit AdamW
    assert isinstance(inner, bnb.optim.AdamW) and inner.args.optim_bits == 8 and inner.is_paged
    assert_same_training(ref, ours, exact=False)  # max_grad_norm=1.0 by default


def lm_batches(model_dir, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (MICRO, 9), generator=gen) for _ in range(A * WINDOWS)]


def accelerate_loop(model_dir, use_gradaccel):
    """The accelerate recipe: accumulate(), backward(), clip_grad_norm_() at the window's end."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model.activation_checkpointing_enable()
    # accelerate's state is process-wide: a Trainer run earlier leaves its dataloader state behind.
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=A, cpu=True)
    if use_gradaccel:
        reset_plans()
        gradaccel.hf.enable(accelerator, budget=0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    model.train()
    norms, window_losses, micro_losses = [], [], []
    for ids in lm_batches(model_dir):
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            micro_losses.append(loss.detach())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients and use_gradaccel:
            window_losses.append(opt.optimizer.window_loss)
    return model, opt, norms, window_losses, micro_losses


def test_accelerate_loop_matches_stock(model_dir):
    ref, _, ref_norms, _, _ = accelerate_loop(model_dir, False)
    model, opt, norms, window_losses, micro = accelerate_loop(model_dir, True)
    assert isinstance(opt.optimizer, gradaccel.FusedAccumOptimizer)
    assert plan_rows() and all(p.grad is None for p in model.parameters())
    assert len(norms) == WINDOWS and norms == pytest.approx(ref_norms, rel=1e-6)
    assert min(norms) > 0.5  # clipped every window
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # The window's loss: what the window's gradient is the gradient of, the mean of its
    # micro-batch losses (equal sizes: the big batch's loss).
    expect = [torch.stack(micro[k * A:(k + 1) * A]).mean().item() for k in range(WINDOWS)]
    assert window_losses == pytest.approx(expect, rel=1e-6)


@pytest.mark.parametrize("make", [
    lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-2),
    lambda ps: bnb.optim.PagedAdamW8bit(ps, lr=1e-2),
    pytest.param("torchao", id="torchao-AdamW8bit"),
], ids=["bnb-AdamW8bit", "bnb-PagedAdamW8bit", "torchao-AdamW8bit"])
def test_lora_fused_over_8bit_optimizers_matches_stock_accumulation(model_dir, make):
    if make == "torchao":
        torchao_optim = pytest.importorskip("torchao.optim", reason="torchao is not installed")
        make = lambda ps: torchao_optim.AdamW8bit(ps, lr=1e-2)  # noqa: E731
    models = []
    for fused in (False, True):
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                         task_type="CAUSAL_LM"))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = gradaccel.FusedAccumOptimizer(make(params), A) if fused else make(params)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # paged optimizers fall back to unpaged on CPU
            for k, ids in enumerate(lm_batches(model_dir)):
                loss = model(input_ids=ids, labels=ids).loss
                if fused:  # the stock loop with the mean over the window done by the optimizer
                    loss.backward()
                    assert opt.step() == (k % A == A - 1)
                    opt.zero_grad()
                else:  # stock accumulation: loss / A, step every A micro-batches
                    (loss / A).backward()
                    if k % A == A - 1:
                        opt.step()
                        opt.zero_grad()
        models.append(model)
    # A = 4: dividing by 4 before or after the sum is exact, so the update is the same, bit for bit.
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p, q), name
    # And it trained: LoRA's B matrices start at zero.
    assert all(p.abs().sum() > 0 for n, p in models[1].named_parameters() if "lora_B" in n)


def test_qlora_block_prices_4bit_gemms(model_dir, monkeypatch):
    """gemm_4bit has no formula in torch's FLOP registry: gradaccel's own table prices it
    2·M·N·K (so its regions are sized at new lengths like any other), never 0, and the plan is
    not the one made when it was priced at 0 (replayed as if free)."""
    from gradaccel.recompute import trace as _trace
    from gradaccel.recompute.state import STATE

    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, device_map="cpu")
    model = peft.prepare_model_for_kbit_training(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    gradaccel.checkpoint_blocks(model, budget=0.5)  # takes over what prepare_model_for_kbit_training turned on
    model.train()
    ids = torch.randint(2, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))

    def plan():
        reset_plans()
        model(input_ids=ids, labels=ids).loss.backward()
        return plan_rows()

    priced = plan()
    gemm = "bitsandbytes.gemm_4bit.default"
    assert priced and all(gemm not in r["priced_ops"] for r in priced)
    # Flattened, a gemm's arguments are A, B, then shapeB's (out_features, in_features).
    gemms = [op for ref in STATE.in_order if ref() is not None for op in ref().graph.ops if str(op.func) == gemm]
    assert len(gemms) == 7 * 2  # q, k, v, o, gate, up, down in each of 2 layers
    assert all(op.flops == 2 * math.prod(op.leaves[0].size) * op.leaves[2] > 0 for op in gemms)
    real = _trace._flops  # priced at 0, as before: the plan is another one
    monkeypatch.setattr(_trace, "_flops", lambda f, *a: (0, "formula") if "gemm_4bit" in str(f) else real(f, *a))
    free = plan()
    # (What is kept is the bf16->fp32 copy of gemm_4bit's output, which is how its cost shows.)
    assert [(r["kept_ops"], r["replayed_ops"]) for r in priced] != [(r["kept_ops"], r["replayed_ops"]) for r in free]
