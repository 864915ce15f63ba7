"""Weight gradients added straight onto fp32 buffers, with no weight-sized gradient in between.

- :func:`wgrad_accumulate_`: ``acc += scale * dyᵀ @ x`` (the weight gradient of ``nn.Linear``).
- :func:`embedding_accumulate_`: ``acc[ids] += scale * dy``, repeats summed (of ``nn.Embedding``).
- :func:`fused_linear`: ``F.linear`` whose backward adds the weight's gradient onto a buffer a
  callable gives, instead of making it (what ``fuse_wgrad`` routes ``nn.Linear`` layers through).

Registered ops, ``torch.ops.gradaccel.<name>``, declared with their C++ CPU and Meta kernels in
gradaccel/ops/csrc/wgrad.cpp (which holds every argument check). On CUDA: a Triton GEMM with an
accumulate epilogue for bf16/fp16 (gradaccel/ops/triton/wgrad.py) and cuBLAS ``addmm_`` with
``beta=1`` for fp32 (one kernel, writing onto ``acc``: what stock PyTorch runs for an fp32
weight gradient, so it honours ``torch.backends.cuda.matmul.allow_tf32`` as stock does); the
embedding through a Triton kernel.
"""

from typing import Callable

import torch

from gradaccel.ops import accumulate as _acc
from gradaccel.ops import extension as _ext

_wgrad_op = _embedding_op = _check_wgrad_op = _check_embedding_op = None
_cuda_lib = None
_compiling = torch.compiler.is_compiling
_kernels = None


def _load_ops() -> None:
    global _wgrad_op, _embedding_op, _check_wgrad_op, _check_embedding_op, _cuda_lib
    _ext.load()
    lib = torch.ops.gradaccel
    _wgrad_op = lib.wgrad_accumulate_.default
    _embedding_op = lib.embedding_accumulate_.default
    _check_wgrad_op = lib._check_wgrad_accumulate.default
    _check_embedding_op = lib._check_embedding_accumulate.default
    if torch.cuda.is_available() and _cuda_lib is None:
        cuda = torch.library.Library("gradaccel", "IMPL")
        cuda.impl("wgrad_accumulate_", _wgrad_accumulate_cuda, "CUDA")
        cuda.impl("embedding_accumulate_", _embedding_accumulate_cuda, "CUDA")
        _cuda_lib = cuda  # the registrations live as long as this object


def _triton():
    global _kernels
    if _kernels is None:
        try:
            from gradaccel.ops.triton import wgrad as kernels
        except ImportError as exc:  # a CUDA machine without Triton: the CPU ops still work
            kernels = _acc._MissingTriton(exc)
        _kernels = kernels
    return _kernels


# The CUDA kernels of the ops. Plain functions of the op's schema, so that tests also run them
# on CPU tensors through the Triton interpreter.
def _wgrad_accumulate_triton(acc: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, scale: float) -> None:
    if _check_wgrad_op is None:
        _load_ops()
    _check_wgrad_op(acc, x, dy)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    _triton().wgrad_accumulate(acc, x2, dy2, float(torch.tensor(scale, dtype=torch.float32)))


def _wgrad_accumulate_cuda(acc: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, scale: float) -> None:
    if x.dtype == torch.float32:
        _check_wgrad_op(acc, x, dy)
        s = float(torch.tensor(scale, dtype=torch.float32))
        acc.addmm_(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]), beta=1.0, alpha=s)
        return
    _wgrad_accumulate_triton(acc, x, dy, scale)


def _embedding_accumulate_triton(acc: torch.Tensor, ids: torch.Tensor, dy: torch.Tensor, scale: float,
                                 padding_idx: int = -1) -> None:
    if _check_embedding_op is None:
        _load_ops()
    _check_embedding_op(acc, ids, dy)
    _triton().embedding_accumulate(acc, ids.reshape(-1).long(), dy.reshape(-1, dy.shape[-1]),
                                   float(torch.tensor(scale, dtype=torch.float32)), int(padding_idx))


_embedding_accumulate_cuda = _embedding_accumulate_triton


def wgrad_accumulate_(acc: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``acc += scale * dyᵀ @ x`` in place, products summed in fp32, no weight-sized temporary.

    The weight gradient of ``y = x @ Wᵀ`` added onto an fp32 buffer: leading dims of ``x`` and
    ``dy`` (batch, sequence) are tokens, summed over.

    Args:
        acc: float32 ``(out, in)``, any strides, sharing no memory with ``x`` or ``dy``.
        x: ``(..., in)`` float32, bfloat16 or float16, on ``acc``'s device, any strides.
        dy: ``(..., out)``, ``x``'s dtype and leading dims.
        scale: Python number, applied as float32 to the product.

    Returns:
        ``acc``.

    Raises:
        ValueError: dtypes, shapes or devices that do not fit (the message names the argument).
        TypeError: an argument that is not a tensor.
        RuntimeError: ``acc`` overlapping itself, ``x`` or ``dy``.

    On CPU, fp32 runs one ``acc.addmm_(dy2ᵀ, x2, beta=1, alpha=scale)`` (bit-equal to it);
    bf16/fp16 widen a block of token rows at a time (each block's fp32 copy stays under a
    quarter of the weight's bf16 gradient and 4 MiB) and add its GEMM onto ``acc``.
    """
    if _wgrad_op is None:
        _load_ops()
    try:
        if acc.is_cuda and not _compiling():
            _wgrad_accumulate_cuda(acc, x, dy, float(scale))
        else:
            _wgrad_op(acc, x, dy, float(scale))
    except (RuntimeError, AttributeError):
        _acc._explain_refusal("wgrad_accumulate_", acc=acc, x=x, dy=dy)
        raise
    return acc


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 acc_of: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose weight gradient autograd never makes.

    Backward computes the input's and the bias's gradients as stock autograd does, and adds the
    weight's onto ``acc_of()`` with :func:`wgrad_accumulate_` (``acc += dyᵀ @ x``, ``x`` as
    saved: under autocast, as autocast cast it); the weight gets no gradient. ``acc_of`` is
    called once per backward, only when the weight needs a gradient, and must return a float32
    tensor of the weight's shape. A C++ autograd function (gradaccel/ops/csrc/fused_linear.cpp):
    it runs once per routed layer per micro-batch, where a Python one costs tens of µs more.
    """
    if _compiling():
        return _fused_linear_eager(x, weight, bias, acc_of)  # a graph break, made on purpose
    if _wgrad_op is None:
        _load_ops()  # backward reaches the op through the dispatcher: its CUDA kernel must be registered
    return _ext.load().fused_linear(x, weight, bias, acc_of)


# Dynamo cannot trace a pybind call with a side effect in backward; this keeps it from trying
# (and from tracing the extension's first load). Eager calls skip the wrapper: it costs µs a layer.
_fused_linear_eager = torch.compiler.disable(fused_linear)


def embedding_accumulate_(acc: torch.Tensor, ids: torch.Tensor, dy: torch.Tensor, scale: float = 1.0,
                          padding_idx: int | None = None) -> torch.Tensor:
    """``acc[ids[t]] += scale * dy[t]`` for every token ``t``, repeated ids summed, in place.

    The weight gradient of ``nn.Embedding`` added onto an fp32 buffer, reading only the rows the
    batch used: no vocabulary-sized temporary. Repeats are added in token order, on every device
    (deterministic).

    Args:
        acc: float32 ``(vocab, dim)``.
        ids: int64/int32 tensor of any shape, values in ``[0, vocab)`` (checked on CPU; on CUDA
            the embedding's forward has checked them).
        dy: ``ids.shape + (dim,)``, float32/bfloat16/float16, on ``acc``'s device.
        scale: Python number, applied as float32.
        padding_idx: rows with this id get nothing, as ``nn.Embedding(padding_idx=...)``; None: no
            such row.

    Returns:
        ``acc``.

    Raises:
        ValueError: dtypes, shapes or devices that do not fit. IndexError: an id out of range (CPU).
        TypeError: an argument that is not a tensor.
    """
    if _embedding_op is None:
        _load_ops()
    pad = -1 if padding_idx is None else int(padding_idx)
    try:
        if acc.is_cuda and not _compiling():
            _embedding_accumulate_cuda(acc, ids, dy, float(scale), pad)
        else:
            _embedding_op(acc, ids, dy, float(scale), pad)
    except (RuntimeError, AttributeError):
        _acc._explain_refusal("embedding_accumulate_", acc=acc, ids=ids, dy=dy)
        raise
    return acc
