"""Fused gradient-accumulation ops (public: ``scale_accumulate_``).

PLACEHOLDER: plain-PyTorch versions of the final API, so that code built on these ops can be
written now. The kernels issue replaces the bodies with the registered C++ (CPU) / Triton
(CUDA) ops; the signatures and semantics below are the contract.
"""

import torch


def scale_accumulate_(acc: torch.Tensor, grad: torch.Tensor, scale: float) -> torch.Tensor:
    """``acc += grad.float() * scale`` in place; returns ``acc`` (fp32; grad fp32/bf16/fp16, same shape)."""
    acc.add_(grad.float() * scale)
    return acc


def fold_(flat: torch.Tensor, grads: list[torch.Tensor], offsets: list[int], scale: float) -> torch.Tensor:
    """For each i: ``flat[offsets[i]:offsets[i]+grads[i].numel()] += grads[i].flatten().float() * scale``."""
    for g, off in zip(grads, offsets):
        flat[off : off + g.numel()].add_(g.reshape(-1).float() * scale)
    return flat


def finalize_(flat: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat *= scale`` (0-d tensor) in one pass; returns (sum of squares of the result as 0-d
    fp32, 0-d bool: any non-finite value in the result)."""
    flat.mul_(scale)
    return flat.double().square().sum().float(), ~torch.isfinite(flat).all()
