"""Hash of the C++/CUDA sources, shared by setup.py (baked into the build) and the loader.

Kept free of imports beyond the standard library so that setup.py can load it by path before
the package (and its extension) exists.
"""

import hashlib
from pathlib import Path

SUFFIXES = (".cpp", ".h", ".cu", ".cuh")


def source_files(csrc: Path) -> list[Path]:
    """Every extension source under ``csrc``, in a stable order."""
    return sorted(p for p in csrc.rglob("*") if p.suffix in SUFFIXES and p.is_file())


def source_hash(csrc: Path) -> str:
    """A short digest of the names and contents of the extension sources under ``csrc``."""
    digest = hashlib.sha256()
    for path in source_files(csrc):
        digest.update(path.relative_to(csrc).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
