"""A block's parts: its direct children (attention, MLP, norms) run as keep-nothing checkpoints
of their own, and in "tiles" mode a token-wise child (an MLP) a chunk of tokens at a time.

Below the per-block floor, backward's working set is what counts: a block run as parts rebuilds
one part at a time, not the whole block while every gradient made so far is alive. The
``memory=`` target (gradaccel/memory/target.py) and the fit choose these as per-block plans.
"""

import functools

import torch
import torch.nn as nn
import torch.utils.checkpoint as _tc

__all__ = ["has_parts", "has_tiles", "install_parts", "set_parts"]

TILE_CHUNKS = 4  # token chunks of a token-wise part in "tiles" mode


# -- parts: a block's children as their own checkpoints -----------------------------------------
def _part_forward(module, *args, **kwargs):
    forward = type(module).forward.__get__(module)
    if not (module.__dict__.get("_gradaccel_part") and module.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    tiles = module.__dict__.get("_gradaccel_tiles", 1)
    if tiles > 1 and len(args) == 1 and not kwargs and torch.is_tensor(args[0]) and args[0].dim() >= 2:
        # A token-wise part (an MLP): each chunk of tokens is its own checkpoint, so backward
        # rebuilds a chunk's intermediates at a time. Outputs are the same rows, concatenated.
        return torch.cat([_tc.checkpoint(forward, x, use_reentrant=False)
                          for x in args[0].chunk(tiles, dim=-2)], dim=-2)
    return _tc.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _token_wise(module: nn.Module) -> bool:
    """An MLP made of linear layers and parameterless activations: each token's output depends
    on that token alone, so it can run a chunk of tokens at a time."""
    return type(module).__name__.endswith("MLP") and all(
        isinstance(m, nn.Linear) or not any(True for _ in m.parameters(recurse=False))
        for m in module.modules())


def _parts_of(block: nn.Module) -> list:
    return [c for c in block.children() if any(True for _ in c.parameters())]


def has_parts(block: nn.Module) -> bool:
    """Whether ``block`` can run as its parts (two children or more with parameters); if so,
    readies them (:func:`install_parts`)."""
    if len(_parts_of(block)) < 2:
        return False
    install_parts(block)
    return True


def has_tiles(block: nn.Module) -> bool:
    """Whether ``block`` has parts and a token-wise one among them (tiles mode changes it)."""
    return has_parts(block) and any(_token_wise(c) for c in _parts_of(block))


def install_parts(block: nn.Module) -> None:
    """Lets ``block``'s children run as their own checkpoints (off until :func:`set_parts`)."""
    for child in _parts_of(block):
        if "_gradaccel_part" not in child.__dict__:
            child._gradaccel_part = False
            child.forward = functools.partial(_part_forward, child)


def set_parts(block: nn.Module, on: bool, tiles: bool = False) -> None:
    """``on``: ``block`` runs uncheckpointed and its children as keep-nothing checkpoints;
    ``tiles``: its token-wise children (MLPs) a chunk of tokens at a time."""
    block._gradaccel_fine = on
    for child in _parts_of(block):
        if "_gradaccel_part" in child.__dict__:
            child._gradaccel_part = on
            child._gradaccel_tiles = TILE_CHUNKS if on and tiles and _token_wise(child) else 1
