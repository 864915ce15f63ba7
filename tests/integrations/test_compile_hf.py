"""A compiled Hugging Face Llama under gradaccel, against the same model eager and unchanged:
checkpoint_blocks, gradaccel.hf.enable under Trainer's ``torch_compile=True``, and ``memory=``
over lengths that change every step. Gradients within 1e-5 of the largest; the graph breaks
and the graphs compiled counted by dynamo."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import gradaccel  # noqa: E402
from gradaccel import checkpoint_blocks  # noqa: E402
from gradaccel.recompute.block_plan import plan_of  # noqa: E402

VOCAB = 64


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()


def ids_of(length, seed):
    return torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def worst_grad_error(model, ref) -> float:
    """The largest gradient difference, relative to the largest gradient of each parameter."""
    return max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
               for p, q in zip(model.parameters(), ref.parameters()))


def step(model, ids):
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_checkpoint_blocks_compiles_whole(budget):
    ref = llama()
    model = checkpoint_blocks(copy.deepcopy(ref), budget=budget)
    torch._dynamo.reset()
    counters.clear()
    compiled_model = torch.compile(model, backend="aot_eager")
    for seed in range(2):
        ref.zero_grad(), model.zero_grad()
        step(ref, ids_of(16, seed)), step(compiled_model, ids_of(16, seed))
        assert worst_grad_error(model, ref) < 1e-5
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1
    # Each layer planned at its budget, while dynamo traced it.
    for layer in model.model.layers:
        assert isinstance(layer._gradaccel_compiled[("forward", float, budget, True, "flops")], gradaccel.recompute
                          .compiled.Policy)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids_of(16, 0), labels=ids_of(16, 0), use_cache=False)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_hf_enable_under_trainer_torch_compile():
    # Trainer compiles the model (torch_compile=True) and hf.enable puts gradaccel under it: one
    # window of two micro-batches, SGD at lr 1, so the update is the window's gradient.
    base = llama()
    ids = ids_of(12, 0).repeat(2, 1)
    data = [{"input_ids": t, "labels": t} for t in ids]

    def trainer(model, out, **kw):
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=2, use_cpu=True, report_to=[], logging_strategy="no",
            seed=0, data_seed=0, dataloader_drop_last=True, disable_tqdm=True, save_strategy="no", max_grad_norm=0.0,
            gradient_accumulation_steps=2, max_steps=1, **kw)
        return transformers.Trainer(model=model, args=args, train_dataset=data,
                                    optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None))

    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    trainer(ref, "stock").train()
    t = trainer(model, "gradaccel", torch_compile=True, torch_compile_backend="aot_eager",
                activation_checkpointing=True)
    gradaccel.hf.enable(t, budget=0.5)
    torch._dynamo.reset()
    counters.clear()
    t.train()
    assert type(t.model_wrapped).__name__ == "OptimizedModule"
    assert dict(counters["graph_break"]) == {}
    for (name, p0), p1, p2 in zip(base.named_parameters(), ref.parameters(), model.parameters()):
        stock, ours = (p1 - p0).detach(), (p2 - p0).detach()
        assert ((ours - stock).abs().max() / stock.abs().max()).item() < 1e-5, name


def test_memory_target_over_lengths_that_change_every_step():
    # memory= under compile: every step has its own length. The gradients are stock's, and the
    # graphs compiled are as many as stock compile makes (one static, then one dynamic): every
    # length runs the plan of the longest (seq), which holds the target at each.
    lengths = [16, 53, 41, 29, 17, 54, 42, 30]
    graphs = {}
    for name in ("stock", "gradaccel"):
        ref, model = llama(), llama()
        if name == "gradaccel":
            checkpoint_blocks(model, memory=600_000, seq=64)
        torch._dynamo.reset()
        counters.clear()
        compiled_model = torch.compile(model, backend="aot_eager")
        for seed, length in enumerate(lengths):
            ref.zero_grad(), model.zero_grad()
            step(ref, ids_of(length, seed)), step(compiled_model, ids_of(length, seed))
            assert worst_grad_error(model, ref) < 1e-5, (name, length)
        graphs[name] = counters["stats"]["unique_graphs"]
        if name == "gradaccel":  # the target's hook runs eagerly: the one break, before the first op
            assert sum(counters["graph_break"].values()) <= 2
            policies = [plan_of(layer).policy for layer in model.model.layers]
            assert any(isinstance(p, gradaccel.recompute.compiled.Policy) for p in policies), policies
    assert graphs["gradaccel"] == graphs["stock"] == 2
