"""Builds gradaccel's extension ``gradaccel._C``.

A ``CppExtension`` from ``gradaccel/ops/csrc/*.cpp``; a ``CUDAExtension`` that adds ``gradaccel/ops/csrc/cuda/*.cu`` where
torch has CUDA and ``CUDA_HOME`` is set. ``GRADACCEL_CUDA=0/1`` overrides the choice. Build with
``pip install --no-build-isolation -e .`` (``make install`` does this) so the torch already
installed is the one built against.
"""

import importlib.util
import os
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).parent
CSRC = ROOT / "gradaccel" / "ops" / "csrc"

# Two cores on CI: uncapped parallel nvcc/g++ jobs only thrash memory.
os.environ.setdefault("MAX_JOBS", str(min(4, os.cpu_count() or 1)))


def _load_source_hash():
    spec = importlib.util.spec_from_file_location("_gradaccel_source_hash", ROOT / "gradaccel" / "ops" / "source_hash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.source_hash(CSRC)


def _want_cuda() -> bool:
    forced = os.environ.get("GRADACCEL_CUDA")
    if forced is not None:
        return forced == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None


def _write_hash_header() -> Path:
    """Writes the sources' hash into a generated header that only gradaccel/ops/csrc/module.cpp includes.

    A header rather than a -D flag: a changed flag would make ninja recompile every file.
    """
    include = ROOT / "build" / "generated"
    include.mkdir(parents=True, exist_ok=True)
    text = f'#pragma once\n#define GRADACCEL_SOURCE_HASH "{_load_source_hash()}"\n'
    header = include / "gradaccel_source_hash.h"
    if not header.exists() or header.read_text() != text:
        header.write_text(text)
    return include


def _extension():
    sources = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp"))
    define = []
    include_dirs = [str(_write_hash_header())]
    # -g0: Python's flags ask for debug info, which takes a third of the compile time here.
    cxx = ["-O3", "-std=c++20", "-g0"]
    if _want_cuda():
        sources += sorted(str(p.relative_to(ROOT)) for p in (CSRC / "cuda").glob("*.cu"))
        define.append(("GRADACCEL_WITH_CUDA", "1"))
        nvcc = ["-O3", "-std=c++20", "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
        return CUDAExtension("gradaccel._C", sources, include_dirs=include_dirs, define_macros=define, extra_compile_args={"cxx": cxx, "nvcc": nvcc})
    return CppExtension("gradaccel._C", sources, include_dirs=include_dirs, define_macros=define, extra_compile_args={"cxx": cxx})


# `make install` installs the package with GRADACCEL_SKIP_EXT=1 and then builds the extension with
# `setup.py build_ext --inplace` alone: pip's editable build and build_ext use different build
# folders, so letting both compile doubled a first install (7 minutes each on 2 cores).
_SKIP_EXT = os.environ.get("GRADACCEL_SKIP_EXT") == "1"
setup(
    ext_modules=[] if _SKIP_EXT else [_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
