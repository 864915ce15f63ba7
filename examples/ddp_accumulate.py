"""Data-parallel gradient accumulation: one gradient all-reduce per window, not per micro-batch.

    torchrun --nproc-per-node 2 examples/ddp_accumulate.py --accum-steps 4 --check
    torchrun --nproc-per-node 2 examples/ddp_accumulate.py --fsdp --sync window --check

Each rank runs the stock loop (backward, step, zero_grad) on its share of every window.
FusedAccumOptimizer(process_group=...) folds each micro-batch into a flat fp32 buffer and
all-reduces that buffer once at the end of the window. Do not also wrap the model in
DistributedDataParallel: DDP all-reduces every backward (FusedAccumOptimizer refuses it and says
so). Start every rank from the same weights (broadcast below). gloo on CPU, NCCL on GPUs.
--fsdp: shard the model with FSDP2 (fully_shard per block, then the root) instead: each rank
keeps its shard of the fp32 window; --sync says when FSDP2 reduce-scatters (every micro-batch,
or once per window). --check: rank 0 also trains a copy the stock way on each whole global batch.
"""

import argparse
import copy
import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from gradaccel import FusedAccumOptimizer, checkpoint_blocks


class ResidualMLP(nn.Module):
    def __init__(self, d_in, d, layers):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d)) for _ in range(layers))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h).squeeze(-1)


def global_batch(gen, rows, d_in):
    """The same batch on every rank (same generator): x and a smooth nonlinear target."""
    x = torch.randn(rows, d_in, generator=gen)
    return x, torch.sin(2 * x[:, 0]) + 0.5 * x[:, 1] * x[:, 2]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accum-steps", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (windows)")
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of replicating")
    p.add_argument("--sync", default="micro_batch", choices=["micro_batch", "window"], help="with --fsdp")
    p.add_argument("--check", action="store_true", help="compare with single-process big-batch training")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(rank)  # different on purpose: the broadcast below is what makes ranks equal
    d_in = 16
    model = ResidualMLP(d_in, args.width, args.layers).to(device)
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=0)
    reference = copy.deepcopy(model) if args.check and rank == 0 else None
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    checkpoint_blocks(model, budget=args.budget)  # before or after fully_shard: either works

    # SGD with momentum: sensitive to the gradient's scale, so --check also checks the averaging.
    make = lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9)  # noqa: E731
    if args.fsdp:  # FSDP2 reduce-scatters; the optimizer folds each rank's shard
        opt = FusedAccumOptimizer(make(model.parameters()), args.accum_steps, sync=args.sync, module=model)
    else:
        opt = FusedAccumOptimizer(make(model.parameters()), args.accum_steps, process_group=dist.group.WORLD)
    ref_opt = make(reference.parameters()) if reference is not None else None

    gen = torch.Generator().manual_seed(1234)
    per_rank = args.accum_steps * args.micro_batch
    for window in range(args.steps):
        x, y = global_batch(gen, world * per_rank, d_in)
        x, y = x.to(device), y.to(device)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)  # this rank's share of the window
        window_loss = torch.zeros((), device=device)
        for k in range(args.accum_steps):
            m = slice(mine.start + k * args.micro_batch, mine.start + (k + 1) * args.micro_batch)
            loss = F.mse_loss(model(x[m]), y[m])
            loss.backward()
            window_loss += loss.detach()
            updated = opt.step()  # True only after the last micro-batch: one all-reduce there
            opt.zero_grad()
        assert updated
        dist.all_reduce(window_loss)  # for the log only
        if reference is not None:
            F.mse_loss(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        if rank == 0:
            print(f"step {window + 1:3d}  loss {window_loss.item() / (world * args.accum_steps):.5f}", flush=True)

    params = [p.full_tensor() if args.fsdp else p for p in model.parameters()]  # every rank gathers
    if reference is not None:
        diff = max((p - q).abs().max().item() for p, q in zip(params, reference.parameters()))
        print(f"check: max |param - big-batch param| = {diff:.3e}")
        assert diff < 1e-5, "FusedAccumOptimizer diverged from single-process big-batch training"
        print("check: ok")
    # The optimizer holds the process group: free it (and any garbage cycle still holding the
    # group) first. A group that outlives destroy_process_group is destroyed at exit, which can
    # abort the process ("terminate called without an active exception"; gloo, torch 2.13).
    del opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
