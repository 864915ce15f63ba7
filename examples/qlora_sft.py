"""The common QLoRA fine-tuning script (TRL's SFTTrainer, a 4-bit base, LoRA, paged 8-bit AdamW,
gradient accumulation and checkpointing), with the one line that puts gradaccel under it.

    pip install "gradaccel[hf]"
    python examples/qlora_sft.py --steps 20 --accum-steps 8 --budget 0.5
    python examples/qlora_sft.py --steps 20 --no-gradaccel       # the same script, stock

So that it runs anywhere offline, the "pretrained" model is a small random Llama written to a
temporary folder, the tokenizer is a word-level one built on the spot, and the text is the
docstrings of a few Python modules. With your own model, only `model_id` and the data change.
"""

import argparse
import inspect
import math
import tempfile

import datasets
import peft
import tokenizers
import torch
import transformers
import trl

import gradaccel


def texts_and_tokenizer():
    words = [w for m in (math, inspect, tempfile) for w in (inspect.getdoc(m) or "").split()]
    lines = [" ".join(words[i:i + 24]) for i in range(0, len(words) - 24, 12)]
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{w: i + 3 for i, w in enumerate(sorted(set(words)))}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]")
    return lines, fast


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer updates (windows)")
    p.add_argument("--accum-steps", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--budget", type=float, default=0.5, help="gradaccel's checkpoint budget per layer")
    p.add_argument("--no-gradaccel", action="store_true", help="run the stock script")
    args = p.parse_args()

    lines, tok = texts_and_tokenizer()
    model_id = tempfile.mkdtemp()  # stands for a Hub id such as "meta-llama/Llama-3.2-1B"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1)).save_pretrained(model_id)

    # --- the usual QLoRA script --------------------------------------------------------------
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_id, quantization_config=quant, device_map="auto")
    model = peft.prepare_model_for_kbit_training(model)
    config = trl.SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
                           gradient_accumulation_steps=args.accum_steps, learning_rate=2e-3, optim="paged_adamw_8bit",
                           bf16=torch.cuda.is_available(), logging_steps=1, save_strategy="no", report_to=[],
                           max_length=64, disable_tqdm=True)
    trainer = trl.SFTTrainer(model=model, args=config, processing_class=tok,
                             train_dataset=datasets.Dataset.from_dict({"text": lines}),
                             peft_config=peft.LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    if not args.no_gradaccel:
        gradaccel.hf.enable(trainer, budget=args.budget)  # <- the one line
    trainer.train()
    # -------------------------------------------------------------------------------------------

    for h in trainer.state.log_history:
        if "loss" in h:  # the window's loss, per token, as Trainer logs it
            print(f"step {h['step']:3d}  loss {h['loss']:.4f}  grad-norm {h['grad_norm']:.3f}")
    if not args.no_gradaccel:
        print(gradaccel.plan_report())


if __name__ == "__main__":
    main()
