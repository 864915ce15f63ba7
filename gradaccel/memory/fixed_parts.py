"""What a fit is made of besides the profile: the model (a preset or config built on fake
tensors, LoRA adapters as peft makes them) and the fixed parts of a training step (weights,
window buffer, optimizer state and masters, and the update's working set). See gradaccel/memory/fit.py.
"""

import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import math
import os
import re
import warnings
from unittest import mock

import torch
import torch.nn as nn

from gradaccel.accumulate.flat import NARROW_HEAD
from gradaccel.memory.presets import PRESETS
from gradaccel.memory.profile import fake_mode, find_blocks
from gradaccel.memory.counter import LiveBytes, format_bytes, optimizer_state_bytes, storage_bytes

OPTIMS = ("adamw", "adamw8bit", "paged_adamw8bit", "sgd")
# peft's "all-linear" on these families: Llama, Mistral, Qwen2.5, Gemma 2 (separate projections) and Phi-3 (fused).
_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"]


# -- models ------------------------------------------------------------------------------------
def hf_step(model, batch):
    """A causal LM's training forward: ``model(input_ids, labels).loss``, without a KV cache
    (checkpointed layers drop it in training anyway), sequences not packed (:func:`unpacked`)."""
    with unpacked():
        return model(**batch, use_cache=False).loss


def unpacked():
    """A context in which transformers takes sequences as not packed: under fake tensors it
    cannot read that from the positions, and would build a dense (T x T) mask that the real
    run does not make. A no-op without transformers."""
    try:
        import transformers.masking_utils as masking
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(masking, "find_packed_sequence_indices"):
        return contextlib.nullcontext()
    return mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None)


def load_config(spec):
    """A transformers config from a preset name (``PRESETS``), a config.json path (or its
    folder), a Hugging Face hub id such as ``"Qwen/Qwen2.5-7B"`` (its config.json only, fetched
    through huggingface_hub and cached as it caches), or a config object (returned as is)."""
    from transformers import AutoConfig

    if not isinstance(spec, (str, os.PathLike)):
        return spec
    if str(spec) in PRESETS:
        fields = dict(PRESETS[str(spec)])
    else:
        path = os.path.join(spec, "config.json") if os.path.isdir(spec) else str(spec)
        if not os.path.isfile(path):
            if _looks_like_path(str(spec)):
                raise ValueError(f"model {str(spec)!r}: file not found")
            if not _HUB_ID.fullmatch(str(spec)):
                raise ValueError(f"model must be a preset ({', '.join(PRESETS)}), a config.json path or a "
                                 f"Hugging Face hub id (owner/name), got {spec!r}")
            path = _hub_config(str(spec))
        with open(path) as f:
            fields = json.load(f)
    return AutoConfig.for_model(**fields)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _looks_like_path(spec: str) -> bool:
    """A file the user meant (``./x/config.json``, ``/data/m``, ``~/m``, ``m/config.json``), not a
    hub id: hub ids are ``owner/name``, never relative to a folder and never a ``.json`` file."""
    return spec.startswith((".", "/", "~", os.sep)) or spec.endswith(".json") or spec.count("/") > 1


def _hub_config(repo_id: str) -> str:
    """The local path of ``repo_id``'s config.json from the hub (or huggingface_hub's cache)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:
        raise ValueError(f"model {repo_id!r} is not a preset or a file, and huggingface_hub is not installed "
                         "to fetch its config.json") from e
    # Offline, huggingface_hub retries for half a minute before it looks in its cache: ask the
    # cache alone where the hub does not answer at once.
    local = bool(os.environ.get("HF_HUB_OFFLINE")) or not _reachable(
        os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        return hf_hub_download(repo_id, "config.json", local_files_only=local)
    except Exception as e:  # noqa: BLE001 (offline, unknown repo, gated model: one answer, its reason)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "the Hugging Face hub is not reachable and it is not in the local cache" if local else \
            f"{type(e).__name__}: {reason}"
        raise ValueError(f"model {repo_id!r}: could not fetch its config.json ({where}); give a preset or a "
                         "config.json path") from None


def _reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether ``url``'s host accepts a connection within ``timeout`` seconds."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


def fake_model(config, dtype=torch.bfloat16, layers=None, lora=None, load_in_4bit=False):
    """The causal LM of ``config`` on fake tensors (nothing allocated), ``layers`` blocks deep
    if given, with LoRA adapters of rank ``lora`` on every linear layer of the blocks (as peft
    runs them over 4-bit layers where ``load_in_4bit``)."""
    from transformers import AutoModelForCausalLM

    config = config.__class__.from_dict(config.to_dict())
    if layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    with fake_mode():
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except ValueError:  # an architecture without SDPA support (Gemma 2)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
        if lora:
            model.requires_grad_(False)
            for block in find_blocks(model):
                for name, m in list(block.named_modules()):
                    for child, sub in list(m.named_children()):
                        if isinstance(sub, nn.Linear) and child in _LORA_TARGETS:
                            setattr(m, child, LoRALinear(sub, lora, quantized=load_in_4bit))
            model.enable_input_require_grads()  # as checkpoint_blocks does for a model with adapters
    return model


class LoRALinear(nn.Module):
    """A frozen linear layer plus a rank-``r`` adapter, computed op for op as peft 0.21's LoRA
    layers compute it (adapters in fp32, as ``get_peft_model`` leaves them; no dropout), so that
    a model built here makes the tensors a peft model makes, at the same dtypes (peft itself
    cannot be applied to fake tensors: moving its adapters swaps tensors). Measured against real
    peft layers, with and without bf16 autocast, in tests/memory/test_lora_bytes.py:

    - over ``nn.Linear`` (``lora.Linear``): the input cast to the adapters' fp32, and the sum
      made in fp32 at the full output width, ``(base(x) + B(A(x.float())) * s).to(bf16)``;
    - over bitsandbytes ``Linear4bit`` (``quantized``, ``lora.bnb.Linear4bit``): the base's
      output cloned, the adapter's output cast back before the sum,
      ``base(x).clone() + (B(A(x.float())) * s).to(bf16)``. peft skips the casts where
      ``torch.is_autocast_enabled()`` (CUDA autocast), and so does this layer.
    """

    def __init__(self, base: nn.Linear, r: int, quantized: bool = False):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False, dtype=torch.float32)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, dtype=torch.float32)
        self.scaling = 2.0
        self.quantized = quantized

    def forward(self, x):
        # Written as peft writes it, local names included: the cast input ``x`` stays alive until
        # the layer returns, which sets the forward's peak where nothing is saved (a checkpoint).
        result = self.base_layer(x)
        if self.quantized:
            result = result.clone()  # peft: "for 4bit, we need to defensively clone here"
            convert = not torch.is_autocast_enabled()
            if convert:
                expected = result.dtype
                x = x.to(self.lora_A.weight.dtype)
            output = self.lora_B(self.lora_A(x)) * self.scaling
            if convert:
                output = output.to(expected)
            return result + output
        expected = result.dtype
        x = x.to(self.lora_A.weight.dtype)
        result = result + self.lora_B(self.lora_A(x)) * self.scaling
        return result.to(expected)


def _period(config) -> int:
    types = getattr(config, "layer_types", None) or []
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return p
    return 1


# -- the fixed parts of a step -----------------------------------------------------------------
@dataclasses.dataclass
class Static:
    weights: int
    buffer: int  # FusedAccumOptimizer's fp32 window buffer
    state: int  # the inner optimizer's state on the device
    masters: int
    step: int  # working set of the update at the end of a window
    trainable: int  # parameters
    paged: int = 0  # optimizer state in bitsandbytes' paged (unified) memory: host when short
    gathered: int = 0  # ZeRO-3: one block's parameters whole (gradaccel/memory/zero3.py)
    ranks: int = 0  # ZeRO-3: the ranks the rest is sharded over (0: one process holds it all)

    @property
    def total(self) -> int:
        return self.weights + self.buffer + self.state + self.masters + self.gathered


# -- weights: real storage, 4-bit included ---------------------------------------------------
def _quant_state_tensors(qs) -> list:
    """The tensors of a bitsandbytes ``QuantState`` (and its nested state for the absmax)."""
    out = [t for t in (qs.absmax, qs.code, qs.offset) if isinstance(t, torch.Tensor)]
    if getattr(qs, "state2", None) is not None:
        out += _quant_state_tensors(qs.state2)
    return out


def nf4_bytes(shape: tuple, dtype: torch.dtype) -> int:
    """Bytes a weight of ``shape`` (any ``dtype``) takes as QLoRA stores it: bitsandbytes'
    ``quantize_4bit`` layout (nf4, blocks of 64, double quantisation, uint8 storage): 4 bits a
    weight, a uint8 absmax per block of 64, an fp32 absmax per 256 of those, a 16- and a
    256-entry fp32 code book and an fp32 offset. By formula, so that sizing never imports
    bitsandbytes (seconds, and notices on stderr); tests/memory/test_fit_cli.py checks it against
    bitsandbytes' own ``quantize_4bit`` on fake tensors, to the byte."""
    numel = math.prod(shape)
    blocks = -(-numel // 64)
    return -(-numel // 2) + blocks + 4 * -(-blocks // 256) + 4 * (16 + 256 + 1)


def weight_bytes(model, load_in_4bit=False) -> int:
    """Bytes of ``model``'s parameters and buffers at their storage size: a bitsandbytes
    ``Params4bit`` as its packed weight plus its ``QuantState``'s tensors (measured, shared ones
    once); with ``load_in_4bit``, the frozen linear weights of the blocks as :func:`nf4_bytes`."""
    params = list({id(p): p for p in model.parameters()}.values())
    tensors = params + list(model.buffers())
    tensors += [t for p in params if getattr(p, "quant_state", None) is not None
                for t in _quant_state_tensors(p.quant_state)]
    weights = storage_bytes(tensors)
    if load_in_4bit:
        for block in find_blocks(model):
            for m in block.modules():
                w = getattr(m, "weight", None)
                if isinstance(m, nn.Linear) and not w.requires_grad and getattr(w, "quant_state", None) is None:
                    weights += nf4_bytes(tuple(w.shape), w.dtype) - w.numel() * w.element_size()
    return weights


def static_parts(model, optim="adamw", master_weights=False, load_in_4bit=False) -> Static:
    """Weights, window buffer, optimizer state and masters, and the update's working set.

    Args:
        optim: "adamw" (torch's fused AdamW), "adamw8bit" / "paged_adamw8bit" (bitsandbytes),
            "sgd" (momentum), or an optimizer on ``model``'s parameters (a
            ``FusedAccumOptimizer`` or the inner one): its state tensors are counted if it has
            any, else a step of its class on fake tensors makes them.
    """
    params = list({id(p): p for p in model.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]
    weights = weight_bytes(model, load_in_4bit)
    numel = sum(p.numel() for p in trainable)
    masters = sum(4 * p.numel() for p in trainable if p.dtype != torch.float32) if master_weights else 0
    # Without masters a bf16 gradient is rounded in place in the buffer, through a temporary of at
    # most NARROW_HEAD elements that is freed before the inner step runs (gradaccel/accumulate/flat.py).
    rounding = max((min(p.numel(), NARROW_HEAD) * p.element_size() for p in trainable
                    if p.dtype != torch.float32 and not master_weights), default=0)
    state, step, paged = _optimizer_state(trainable, optim, master_weights)
    if isinstance(optim, torch.optim.Optimizer) and optimizer_state_bytes(optim):
        state = optimizer_state_bytes(optim) - paged
    buffer = getattr(optim, "grad_buffer", None)
    buffer = buffer.nbytes if buffer is not None else 4 * numel
    return Static(weights, buffer, state, masters, max(step, rounding), numel, paged)


def _bnb_class(name):
    # Sizing needs bitsandbytes' optimizer classes, not its kernels: its import's notices about
    # them (a CPU kernel from a hub package it could not load, or whose publisher it could not
    # check offline: the `kernels` package's logger) are not the user's to read.
    quiet = [logging.getLogger(n) for n in ("bitsandbytes", "kernels")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ValueError(f"optim={name!r} needs bitsandbytes (pip install bitsandbytes)") from e
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return bnb.optim.PagedAdamW8bit if name == "paged_adamw8bit" else bnb.optim.AdamW8bit


def _is_bnb(cls) -> bool:
    return any(c.__module__.startswith("bitsandbytes.") and c.__name__ == "Optimizer8bit" for c in cls.__mro__)


# bitsandbytes puts a state tensor in paged memory on CUDA from this many values up
# (Optimizer8bit.get_state_buffer); on CPU it falls back to ordinary tensors.
_BNB_PAGED_MIN = 10**5


def _optimizer_state(trainable, optim, master_weights) -> tuple:
    """(device state bytes, update working set, paged state bytes): the real optimizer class
    stepped once on fake tensors of the trainable parameters' shapes, its state measured."""
    args = None
    if isinstance(optim, torch.optim.Optimizer):
        inner = getattr(optim, "optimizer", optim)
        cls = type(inner)
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in inner.defaults.items() if k in accepted}
        args = getattr(inner, "args", None)  # bitsandbytes' settings (min_8bit_size, optim_bits)
    elif optim in ("adamw8bit", "paged_adamw8bit"):
        cls, defaults = _bnb_class(optim), {}
    elif optim == "adamw":
        cls, defaults = torch.optim.AdamW, {"fused": True}
    elif optim == "sgd":
        cls, defaults = torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}
    else:
        raise ValueError(f"optim must be one of {OPTIMS} or a torch.optim.Optimizer, got {optim!r}")
    bnb = _is_bnb(cls)
    mode = fake_mode()
    with mode:
        ps = []
        for p in trainable:
            dtype = torch.float32 if master_weights else p.dtype
            q = nn.Parameter(torch.empty(tuple(p.shape), dtype=dtype))
            q.grad = torch.zeros_like(q)
            ps.append(q)
    # bitsandbytes builds its 8-bit code books with .tolist() in __init__: made outside the
    # fake mode (2 KiB, real), shared by every parameter's state as in a real run.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        opt = cls(ps, **defaults) if bnb else None
        if args is not None and bnb:
            opt.args = copy.copy(args)
        with mode:
            opt = opt or cls(ps, **defaults)
            live = LiveBytes()
            with live:
                opt.step()
            state = optimizer_state_bytes(opt)
    paged = 0
    if bnb and getattr(opt, "is_paged", False):
        paged = storage_bytes(s[k] for p, s in opt.state.items() if p.numel() >= _BNB_PAGED_MIN
                              for k in ("state1", "state2") if k in s)
    return state - paged, max(0, live.peak - state), paged


# -- advice when nothing fits ------------------------------------------------------------------
def _suggest(setup, worst, usable, lora, load_in_4bit, offload=None) -> list:
    """What would fit, from the parts of the smallest configuration (micro-batch 1, nothing kept);
    ``offload``: the plan of micro-batch 1 that offloads most (its figures are reported)."""
    st, out = setup.static, []
    act = worst.peak - st.total
    need = worst.peak - usable
    frozen_weights = st.weights
    if not load_in_4bit:
        w4 = int(frozen_weights * 0.28)  # bf16 -> nf4 with double quantisation, about
        out.append(("4-bit weights (--load-in-4bit) with LoRA", w4 + act < usable))
    if not lora:
        out.append(("LoRA (--lora 16): optimizer state and buffer for adapters only",
                    st.weights + act + st.step // 100 < usable))
    out.append(("a sequence half as long (activations about halve)", st.total + act // 2 < usable))
    for n in (2, 4, 8, 16, 32):
        if st.total // n + act < usable:
            out.append((f"FSDP2 over {n} GPUs (weights, buffer and state sharded)", True))
            break
    lines = [name for name, ok in out if ok] or [f"nothing listed: short by {format_bytes(need)}"]
    if offload is not None and offload.peak < worst.peak:  # advice only where it lowers the peak
        # Offload moves what blocks would keep or replay to host; their backward brings it back,
        # so it lowers the floor only by what the recompute's working set exceeds it.
        host = sum(offload.host.values())
        how = "block inputs on host (checkpoint_blocks(..., inputs_on_host=True))" if offload.inputs_on_host else \
            "offload (checkpoint(..., offload=True))"
        what = (f"{how}: device peak {format_bytes(offload.peak)} at micro-batch 1 "
                f"(least without it: {format_bytes(worst.peak)}), {format_bytes(host)} on host")
        # Where it fits, the fit returns that plan itself: here it is short.
        lines.append(what + f" (short by {format_bytes(offload.peak - usable)})")
    return lines
