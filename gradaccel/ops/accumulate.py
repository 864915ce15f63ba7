"""Fused gradient-accumulation ops (public: ``scale_accumulate_``; ``fold_`` and ``finalize_``
serve ``FusedAccumOptimizer``).

Each is a registered op, ``torch.ops.gradaccel.<name>``, with a C++ kernel for CPU tensors
(gradaccel/ops/csrc/accumulate.cpp), a Triton kernel for CUDA tensors (gradaccel/ops/triton/accumulate.py,
registered below), and a Meta kernel, so the ops trace under FakeTensor / torch.compile. Bad
arguments raise ``ValueError``/``TypeError`` naming the argument.

Every argument check lives in C++ (gradaccel/ops/csrc/accumulate.cpp), which refuses before writing anything;
the Triton kernels reach the same checks through the internal ``_check_*`` ops and
``_fold_plan`` (the Triton fold's launch plan). Python adds only what the op schema hides from
C++: an argument that is not a tensor at all. Eager CUDA calls go straight to the Triton
launchers, skipping the dispatcher's round trip through C++ and back to Python.
"""

import numbers

import torch

from gradaccel.ops import extension as _ext

# The OpOverloads, resolved once: calling `.default` skips the packet's overload lookup.
_scale_accumulate_op = _fold_op = _finalize_op = None
_check_scale_accumulate_op = _check_finalize_op = None
_cuda_lib = None
_compiling = torch.compiler.is_compiling


def _load_ops() -> None:
    """Loads the C++ extension (which defines the ops) and registers the Triton CUDA kernels."""
    global _scale_accumulate_op, _fold_op, _finalize_op
    global _check_scale_accumulate_op, _check_finalize_op
    _ext.load()
    if torch.cuda.is_available():
        _register_cuda()
    lib = torch.ops.gradaccel
    _scale_accumulate_op = lib.scale_accumulate_.default
    _fold_op = lib.fold_.default
    _finalize_op = lib.finalize_.default
    _check_scale_accumulate_op = lib._check_scale_accumulate.default
    _check_finalize_op = lib._check_finalize.default


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
            from gradaccel.ops.triton import accumulate as kernels
        except ImportError as exc:  # a CUDA machine without Triton: the CPU ops still work
            kernels = _MissingTriton(exc)
        _kernels = kernels
    return _kernels


def _scale_accumulate_triton(acc: torch.Tensor, grad: torch.Tensor, scale: float) -> None:
    if _check_scale_accumulate_op is None:
        _load_ops()
    _check_scale_accumulate_op(acc, grad)
    _triton().scale_accumulate(acc, grad, scale)


def _fold_triton(flat: torch.Tensor, grads: list, offsets: list, scale: float) -> None:
    # Its C++ plan builder validates (dtypes, devices, bounds, overlaps) before any launch.
    _triton().fold(flat, grads, offsets, scale)


def _finalize_triton(flat: torch.Tensor, scale: torch.Tensor):
    if _check_finalize_op is None:
        _load_ops()
    _check_finalize_op(flat, scale)
    if scale.device != flat.device:  # a CPU scale (checked above)
        scale = scale.to(flat.device, non_blocking=True)
    return _triton().finalize(flat, scale.to(dtype=torch.float32))


class _MissingTriton:
    """Stands in for the Triton launchers where Triton cannot be imported."""

    def __init__(self, exc: ImportError):
        self.exc = exc

    def __getattr__(self, name):
        raise RuntimeError(f"gradaccel's CUDA kernels are written in Triton, which failed to import "
                           f"({self.exc}); install it with `pip install triton`") from self.exc


def _explain_refusal(op: str, **args) -> None:
    """Names an argument that never reached the C++ checks, after the op refused it: one that is
    not a tensor (the schema's RuntimeError names only the C++ type) raises TypeError; a sparse
    one (the dispatcher finds no sparse kernel) raises ValueError. Otherwise returns."""
    for name, value in args.items():
        items = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
        for i, v in items:
            where = name if i is None else f"{name}[{i}]"
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"{op}: {where} must be a torch.Tensor, got {type(v).__name__}")
            if v.layout is not torch.strided:
                raise ValueError(f"{op}: {where} must be a dense (strided) tensor, got layout {v.layout}")


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
    if _scale_accumulate_op is None:
        _load_ops()
    try:
        if acc.is_cuda and not _compiling():
            _scale_accumulate_triton(acc, grad, float(scale))
        else:
            _scale_accumulate_op(acc, grad, float(scale))
    except (RuntimeError, AttributeError):
        _explain_refusal("scale_accumulate_", acc=acc, grad=grad)
        raise
    return acc


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
    except (RuntimeError, AttributeError):
        _explain_refusal("fold_", flat=flat, grads=list(grads))
        raise
    return flat


def _scale_tensor(flat, scale) -> torch.Tensor:
    """finalize_'s ``scale`` as a tensor (a Python number becomes a float32 one on flat's device)."""
    _explain_refusal("finalize_", flat=flat)
    if isinstance(scale, torch.Tensor):
        return scale
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"finalize_: scale must be a 0-d tensor or a number, got {type(scale).__name__}")
    return torch.tensor(float(scale), dtype=torch.float32, device=flat.device)


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
    scale = _scale_tensor(flat, scale)
    if _finalize_op is None:
        _load_ops()
    if flat.is_cuda and not _compiling():
        return _finalize_triton(flat, scale)
    return _finalize_op(flat, scale)
