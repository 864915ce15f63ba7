"""Fused gradient-accumulation ops (public: ``scale_accumulate_``; ``fold_`` and ``finalize_``
serve ``FusedAccumOptimizer``).

Each is a registered op, ``torch.ops.gradaccel.<name>``, with a C++ kernel for CPU tensors
(csrc/accumulate.cpp), a Triton kernel for CUDA tensors (triton_kernels/accumulate.py,
registered below), and a Meta kernel, so the ops trace under FakeTensor / torch.compile. Bad
arguments raise ``ValueError``/``TypeError`` naming the argument.

These run once per parameter per micro-batch from a backward hook, so the per-call path is
short: ``scale_accumulate_`` and ``finalize_`` check a few attributes in Python; ``fold_`` leaves
every check to C++ (which refuses before writing anything) and only re-checks in Python to name
what was refused. Eager CUDA calls go straight to the Triton launchers, skipping the
dispatcher's round trip through C++ and back to Python.
"""

import numbers

import torch

from gradaccel import _ext

_GRAD_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

# The OpOverloads, resolved once: calling `.default` skips the packet's overload lookup.
_scale_accumulate_op = _fold_op = _finalize_op = _fold_plan_op = None
_cuda_lib = None
_compiling = torch.compiler.is_compiling


def _load_ops() -> None:
    """Loads the C++ extension (which defines the ops) and registers the Triton CUDA kernels."""
    global _scale_accumulate_op, _fold_op, _finalize_op, _fold_plan_op
    _ext.load()
    if torch.cuda.is_available():
        _register_cuda()
    lib = torch.ops.gradaccel
    _scale_accumulate_op = lib.scale_accumulate_.default
    _fold_op = lib.fold_.default
    _finalize_op = lib.finalize_.default
    _fold_plan_op = lib._fold_plan.default


def _register_cuda() -> None:
    global _cuda_lib
    if _cuda_lib is not None:
        return
    lib = torch.library.Library("gradaccel", "IMPL")
    lib.impl("scale_accumulate_", _scale_accumulate_triton, "CUDA")
    lib.impl("fold_", _fold_triton, "CUDA")
    lib.impl("finalize_", _finalize_triton, "CUDA")
    _cuda_lib = lib  # the registrations live as long as this object


# The CUDA kernels of the ops. Plain functions of the op's schema, so that tests can also run
# them on CPU tensors through the Triton interpreter. Eager calls from the public functions
# below reach them directly, without the dispatcher's round trip through C++ (for a list of
# grads: boxing every tensor, then unboxing it again for this Python kernel).
_kernels = None


def _triton():
    global _kernels
    if _kernels is None:
        try:
            from gradaccel.triton_kernels import accumulate as kernels
        except ImportError as exc:  # a CUDA machine without Triton: the CPU ops still work
            kernels = _MissingTriton(exc)
        _kernels = kernels
    return _kernels


def _scale_accumulate_triton(acc: torch.Tensor, grad: torch.Tensor, scale: float) -> None:
    _check_pair(acc, grad)
    _scale_accumulate_launch(acc, grad, scale)


def _partially_overlaps(acc: torch.Tensor, grad: torch.Tensor) -> bool:
    """True if grad shares memory with acc other than element for element (as C++'s
    ``at::assert_no_partial_overlap`` refuses on the CPU path); the kernel reads one while it
    writes the other."""
    if acc.numel() == 0 or grad.numel() == 0:
        return False
    if acc.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr():
        return False
    if acc.data_ptr() == grad.data_ptr() and acc.stride() == grad.stride() and acc.dtype == grad.dtype:
        return False  # the same elements: acc += acc * scale is well defined

    def span(t):
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (g0, g1) = span(acc), span(grad)
    return a0 < g1 and g0 < a1


def _scale_accumulate_launch(acc: torch.Tensor, grad: torch.Tensor, scale: float) -> None:
    if not acc.is_contiguous() and torch._debug_has_internal_overlap(acc) == 1:
        raise RuntimeError("gradaccel.scale_accumulate_: acc has overlapping elements (an "
                           "expanded view); accumulate into a tensor that owns its memory")
    if _partially_overlaps(acc, grad):
        raise RuntimeError("gradaccel.scale_accumulate_: grad partially overlaps acc (some elements "
                           "refer to a single memory location); pass a grad that does not alias acc")
    _triton().scale_accumulate(acc, grad, scale)


def _fold_triton(flat: torch.Tensor, grads: list, offsets: list, scale: float) -> None:
    kernels = _triton()
    if _fold_plan_op is None:
        _load_ops()
    # The C++ plan builder also validates (dtypes, devices, bounds, overlaps) before any launch.
    plan = torch.empty(kernels.fold_plan_capacity(flat.numel(), len(grads)), dtype=torch.int64)
    _fold_plan_op(flat, grads, offsets, kernels.FOLD_BLOCK, plan)
    kernels.fold_planned(flat, grads, offsets, plan, scale)


def _finalize_triton(flat: torch.Tensor, scale: torch.Tensor):
    return _finalize_launch(flat, _check_finalize(flat, scale))


def _finalize_launch(flat: torch.Tensor, scale: torch.Tensor):
    return _triton().finalize(flat, scale.to(dtype=torch.float32))


class _MissingTriton:
    """Stands in for the Triton launchers where Triton cannot be imported."""

    def __init__(self, exc: ImportError):
        self.exc = exc

    def __getattr__(self, name):
        raise RuntimeError(f"gradaccel's CUDA kernels are written in Triton, which failed to import "
                           f"({self.exc}); install it with `pip install triton`") from self.exc


def _check_grad(name: str, grad) -> None:
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(grad).__name__}")
    if grad.dtype not in _GRAD_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {grad.dtype} "
                         "(integer and other dtypes carry no gradient to accumulate)")
    if grad.layout is not torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {grad.layout}")


def _check_buffer(fn: str, name: str, buf) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.float32:
        raise ValueError(f"{fn}: {name} must be float32 (the fp32 accumulation buffer), got {buf.dtype}")


def _check_pair(acc, grad) -> None:
    _check_buffer("scale_accumulate_", "acc", acc)
    _check_grad("scale_accumulate_: grad", grad)
    if acc.device != grad.device:
        raise ValueError(f"scale_accumulate_: acc is on {acc.device} but grad is on {grad.device}; "
                         "move one of them")
    if acc.shape != grad.shape:
        raise ValueError(f"scale_accumulate_: grad has shape {tuple(grad.shape)} but acc has "
                         f"shape {tuple(acc.shape)}; they must match")


def scale_accumulate_(acc: torch.Tensor, grad: torch.Tensor, scale: float) -> torch.Tensor:
    """``acc += grad.float() * scale`` in place, in fp32 arithmetic.

    Args:
        acc: float32 tensor, any shape and strides (without overlapping elements).
        grad: float32/bfloat16/float16 tensor of ``acc``'s shape, on ``acc``'s device, any strides;
            it may be ``acc`` itself, but not another view of ``acc``'s memory.
        scale: Python number, applied as float32.

    Returns:
        ``acc``.

    Raises:
        ValueError: ``acc`` not float32, ``grad`` of an integer or other dtype, shapes or devices
            that differ.
        TypeError: ``acc`` or ``grad`` not a tensor.
        RuntimeError: ``acc`` with overlapping elements, or ``grad`` partially overlapping ``acc``.
    """
    _check_pair(acc, grad)
    if _scale_accumulate_op is None:
        _load_ops()
    if acc.is_cuda and not _compiling():
        _scale_accumulate_launch(acc, grad, float(scale))
    else:
        _scale_accumulate_op(acc, grad, float(scale))
    return acc


def _explain_fold(flat, grads, offsets) -> None:
    """Raises a ValueError/TypeError naming what is wrong with fold_'s arguments, if anything.

    Run only after the op has refused them: the op's own checks (C++) are the fast path.
    """
    _check_buffer("fold_", "flat", flat)
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"fold_: flat must be a 1-D contiguous buffer, got shape {tuple(flat.shape)}"
                         f"{'' if flat.is_contiguous() else ' (non-contiguous)'}")
    grads, offsets = list(grads), list(offsets)
    if len(grads) != len(offsets):
        raise ValueError(f"fold_: got {len(grads)} grads but {len(offsets)} offsets; pass one offset per grad")
    for i, g in enumerate(grads):
        _check_grad(f"fold_: grads[{i}]", g)
        if g.device != flat.device:
            raise ValueError(f"fold_: grads[{i}] is on {g.device} but flat is on {flat.device}")
    total, end = flat.numel(), 0
    for off, n, i in sorted((int(o), g.numel(), i) for i, (g, o) in enumerate(zip(grads, offsets))):
        if n == 0:
            continue
        if off < 0 or off + n > total:
            raise ValueError(f"fold_: grads[{i}] ({n} elements) at offset {off} does not fit in "
                             f"flat ({total} elements)")
        if off < end:
            raise ValueError(f"fold_: the slice of grads[{i}] at offset {off} overlaps another "
                             f"grad's slice (ending at {end}); slices must be disjoint")
        end = off + n


def fold_(flat: torch.Tensor, grads: list[torch.Tensor], offsets: list[int], scale: float) -> torch.Tensor:
    """For each i: ``flat[offsets[i]:offsets[i]+grads[i].numel()] += grads[i].flatten().float() * scale``.

    All grads are folded by one kernel launch on CUDA (whatever their dtypes) and one parallel
    loop on CPU. Arguments are validated in C++ before anything is written; the per-call cost
    does not include a Python pass over the grads.

    Args:
        flat: 1-D contiguous float32 buffer.
        grads: float32/bfloat16/float16 tensors on ``flat``'s device, any shapes and strides.
        offsets: one int per grad: where its slice of ``flat`` starts. Slices must lie inside
            ``flat`` and be disjoint, and no grad may share memory with ``flat``.
        scale: Python number, applied as float32.

    Returns:
        ``flat``.

    Raises:
        ValueError: bad dtype, device, shape, offset count, out-of-bounds or overlapping slices.
        RuntimeError: a grad that shares memory with ``flat``.
        TypeError: an argument that is not a tensor.
    """
    if _fold_op is None:
        _load_ops()
    try:
        if flat.is_cuda and not _compiling():
            _fold_triton(flat, grads, offsets, float(scale))
        else:
            _fold_op(flat, grads, offsets, float(scale))
    except (RuntimeError, TypeError, AttributeError):
        _explain_fold(flat, grads, offsets)
        raise
    return flat


def _check_finalize(flat, scale) -> torch.Tensor:
    """Checks finalize_'s arguments; returns ``scale`` as a tensor on ``flat``'s device."""
    _check_buffer("finalize_", "flat", flat)
    if not flat.is_contiguous():
        raise ValueError("finalize_: flat must be contiguous (the flat accumulation buffer)")
    if not isinstance(scale, torch.Tensor):
        if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
            raise TypeError(f"finalize_: scale must be a 0-d tensor or a number, got {type(scale).__name__}")
        scale = torch.tensor(float(scale), dtype=torch.float32, device=flat.device)
    if scale.dim() != 0 or not scale.is_floating_point():
        raise ValueError(f"finalize_: scale must be a 0-d floating-point tensor, got shape "
                         f"{tuple(scale.shape)} and dtype {scale.dtype}")
    if scale.device != flat.device:
        if scale.device.type != "cpu":
            raise ValueError(f"finalize_: scale is on {scale.device} but flat is on {flat.device}")
        if flat.device.type != "cpu":
            scale = scale.to(flat.device, non_blocking=True)
    return scale


def finalize_(flat: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat *= scale`` in one read and write, returning the squared norm and a non-finite flag.

    ``scale`` is a tensor so that a value computed on the device (1 / items seen) needs no host
    sync; it is read by the kernel and applied as float32.

    Args:
        flat: contiguous float32 tensor (the window's accumulation buffer), any shape.
        scale: 0-d floating tensor, on ``flat``'s device or the CPU (a Python number is accepted).

    Returns:
        ``(sumsq, nonfinite)``: 0-d float64 sum of squares of the scaled values (float32 would
        overflow for finite values once the norm passes 1.8e19), and 0-d bool, True if any
        scaled value is inf or NaN. Both on ``flat``'s device.

    Raises:
        ValueError: ``flat`` not float32 or not contiguous, ``scale`` not a 0-d floating tensor.
        TypeError: ``scale`` neither a tensor nor a real number.
    """
    scale = _check_finalize(flat, scale)
    if _finalize_op is None:
        _load_ops()
    if flat.is_cuda and not _compiling():
        return _finalize_launch(flat, scale)
    return _finalize_op(flat, scale)
