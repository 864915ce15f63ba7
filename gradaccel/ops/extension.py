"""Loads the C++ extension on first use, and refuses a missing or stale build with a fix."""

import functools
from pathlib import Path

from gradaccel.ops.source_hash import source_hash

_CSRC = Path(__file__).resolve().parent / "csrc"
_HOW = "Build it with `make install` (or `pip install --no-build-isolation -e .`) from the repository root."


@functools.cache
def load():
    """Return the ``gradaccel._C`` module, importing it (and registering its ops) once.

    Raises:
        RuntimeError: the extension is not built, or was built from other sources than the
            ``gradaccel/ops/csrc/`` next to this package (an in-tree checkout edited since its last build).
    """
    import torch  # noqa: F401  (loads libtorch, which _C links against)

    try:
        from gradaccel import _C
    except ImportError as exc:
        raise RuntimeError(f"gradaccel's C++ extension (gradaccel._C) is not built: {exc}. {_HOW}") from exc
    if _CSRC.is_dir():
        expected = source_hash(_CSRC)
        if _C.source_hash != expected:
            raise RuntimeError(
                f"gradaccel's C++ extension is stale: built from sources {_C.source_hash}, "
                f"gradaccel/ops/csrc/ is now {expected}. {_HOW}"
            )
    return _C
