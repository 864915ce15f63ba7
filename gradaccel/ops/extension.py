"""Builds gradaccel's C++ extension on first use, once per machine, and loads it.

The package installs as plain Python (``pip install gradaccel``, from a path, a git URL, an sdist
or a wheel, with no flags), the way DeepSpeed's ops do: the C++ sources in ``gradaccel/ops/csrc``
are compiled with ninja through ``torch.utils.cpp_extension`` against the torch that imports
them, the first time they are needed, into a folder of their own in a cache:

    $GRADACCEL_EXTENSIONS_DIR, else $TORCH_EXTENSIONS_DIR/gradaccel, else ~/.cache/gradaccel
        /py311-torch2.13.0-cpu-<hash of the sources and flags>/gradaccel_C.<abi>.so

The folder's name holds everything that makes a build reusable (the Python, the torch version
with its CUDA version, the sources), so torch 2.11 and 2.13, or two checkouts of gradaccel,
never overwrite each other's build, and a stale build can never load. A file lock makes
several processes starting at once (the ranks of a torchrun) build once; the others wait.
Building ahead of time, for a Docker image or before ranks start: ``python -m gradaccel.build``.

A CUDA torch gets the same C++ build, plus the activation store's few CUDA runtime calls, which
are looked up at run time in the runtime torch loaded (gradaccel/ops/csrc/store_cuda.cpp): no
nvcc and no CUDA_HOME are needed, only a C++20 compiler.
"""

import contextlib
import functools
import hashlib
import importlib.util
import os
import sys
import sysconfig
import time
from pathlib import Path

from gradaccel.ops.source_hash import source_files, source_hash

CSRC = Path(__file__).resolve().parent / "csrc"
NAME = "gradaccel_C"
_DONE = "built"  # written into the build folder once a build has finished


def cflags() -> list[str]:
    """The compiler flags of this torch's build. ``-g0``: Python's flags ask for debug info, which
    takes a third of the compile time; ``-std=c++20``: torch 2.13's headers want it."""
    import torch

    flags = ["-O3", "-std=c++20", "-g0"]
    if torch.version.cuda:
        major = torch.version.cuda.split(".")[0]
        flags += ["-DGRADACCEL_WITH_CUDA=1", f"-DGRADACCEL_CUDA_MAJOR={major}"]
    return flags


def build_dir() -> Path:
    """The folder that holds (or will hold) the extension built for this Python, torch and sources."""
    import torch

    root = os.environ.get("GRADACCEL_EXTENSIONS_DIR")
    if not root and os.environ.get("TORCH_EXTENSIONS_DIR"):
        root = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "gradaccel")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gradaccel")
    digest = hashlib.sha256(f"{source_hash(CSRC)} {' '.join(cflags())}".encode()).hexdigest()[:16]
    kind = f"cu{torch.version.cuda}" if torch.version.cuda else "cpu"
    version = torch.__version__.split("+")[0]
    return Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}-torch{version}-{kind}-{digest}"


def is_built() -> bool:
    """Whether the extension for this torch and these sources is already in the cache."""
    return (build_dir() / _DONE).is_file()


@functools.cache
def load():
    """Return the extension module, building it first if this machine has no build of it yet.

    Importing it registers gradaccel's ops (``torch.ops.gradaccel.*``) and the activation store.
    One copy per process: this function is the only place that imports it.

    Raises:
        RuntimeError: the build failed (the message has the compiler's output).
    """
    import torch  # noqa: F401  (loads libtorch, which the extension links against)

    folder = build_dir()
    if not (folder / _DONE).is_file():
        with _lock(folder):
            if not (folder / _DONE).is_file():
                return _build(folder)
    return _import(folder)


@contextlib.contextmanager
def _lock(folder: Path):
    """Holds an exclusive lock on ``folder``'s build. ``flock`` is released by the kernel when its
    process dies, so a build killed half-way never leaves the next one waiting forever."""
    import fcntl

    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process that is building the extension in {folder}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(folder: Path):
    import torch
    from torch.utils.cpp_extension import load as jit_load

    folder.mkdir(parents=True, exist_ok=True)
    # torch's own lock file, left behind by a build that was killed; ours is held, so it is stale.
    (folder / "lock").unlink(missing_ok=True)
    kind = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    _say(f"compiling its C++ extension for torch {torch.__version__} ({kind}) into {folder}; "
         "once per torch version, a few minutes")
    start = time.perf_counter()
    sources = [str(p) for p in source_files(CSRC) if p.suffix == ".cpp"]
    with _build_env():
        try:
            module = jit_load(name=NAME, sources=sources, extra_cflags=cflags(), extra_ldflags=["-ldl"],
                              build_directory=str(folder), with_cuda=False, verbose=False)
        except (RuntimeError, OSError) as exc:
            raise RuntimeError(
                f"gradaccel: building its C++ extension in {folder} failed. It needs a C++20 compiler "
                f"(g++ >= 10 or clang >= 12) and ninja (`pip install ninja`). {exc}") from exc
    (folder / _DONE).write_text(f"{NAME}\n")
    _say(f"built the extension in {time.perf_counter() - start:.0f} s")
    return module


@contextlib.contextmanager
def _build_env():
    """ninja on the PATH even where the venv is not activated (``/path/to/venv/bin/python train.py``),
    and a bounded number of compile jobs: each takes 1-2 GB, and unbounded jobs thrash a small machine."""
    saved = {key: os.environ.get(key) for key in ("PATH", "MAX_JOBS")}
    dirs = [os.path.dirname(sys.executable)]
    with contextlib.suppress(ImportError):
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    os.environ["PATH"] = os.pathsep.join(dirs + [os.environ.get("PATH", "")])
    os.environ.setdefault("MAX_JOBS", str(min(8, os.cpu_count() or 1)))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _import(folder: Path):
    path = folder / f"{NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not path.is_file():  # torch names the library without the ABI suffix
        path = folder / f"{NAME}.so"
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[NAME] = module
    return module


def _say(message: str) -> None:
    print(f"gradaccel: {message}", file=sys.stderr, flush=True)
