"""The extension's build on first use (gradaccel/ops/extension.py): its cache key, one build for
many processes, one copy loaded per process, and the CUDA runtime found at run time."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gradaccel.ops import extension

CSRC = Path(extension.__file__).resolve().parent / "csrc"


def test_the_loaded_module_is_the_cached_build_and_registers_the_ops():
    module = extension.load()
    assert extension.load() is module
    assert Path(module.__file__).parent == extension.build_dir()
    assert extension.is_built()
    assert sys.modules[extension.NAME] is module
    assert module.with_cuda == bool(torch.version.cuda)
    assert torch.ops.gradaccel.fold_.default is not None


def test_the_cache_key_names_python_torch_device_and_sources(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADACCEL_EXTENSIONS_DIR", str(tmp_path))
    here = extension.build_dir()
    assert here.parent == tmp_path
    version = torch.__version__.split("+")[0]
    assert here.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}-torch{version}-")
    assert ("-cu" if torch.version.cuda else "-cpu-") in here.name
    monkeypatch.setattr(torch, "__version__", "2.99.0+cu130")  # another torch than this one
    assert extension.build_dir() != here  # two torch versions never share (or overwrite) a build
    monkeypatch.undo()
    monkeypatch.setenv("GRADACCEL_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(extension, "source_hash", lambda csrc: "edited")
    assert extension.build_dir() != here  # nor two versions of the sources


def test_the_cache_root_follows_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("GRADACCEL_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extension.build_dir().parent == tmp_path / "gradaccel"


# A child process that "builds" through load()'s own locking, with the compile replaced by a
# sleep that counts itself, so the test takes seconds, not the build's minutes.
_CHILD = textwrap.dedent("""
    import sys, time
    from gradaccel.ops import extension

    def fake_build(folder):
        with open(sys.argv[1], "a") as log:
            log.write("build\\n")
        time.sleep(1.5)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / extension._DONE).write_text("x")
        return "built"

    extension._build = fake_build
    extension._import = lambda folder: "imported"
    print(extension.load())
""")


def test_ranks_starting_at_once_build_once(tmp_path):
    env = dict(os.environ, GRADACCEL_EXTENSIONS_DIR=str(tmp_path / "cache"))
    log = tmp_path / "builds.log"
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(log)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert log.read_text().count("build") == 1
    assert sorted(out.strip() for out, _ in outs) == ["built", "imported", "imported"]
    waited = [err for _, err in outs if "waiting for another process" in err]
    assert len(waited) <= 2 and all("gradaccel:" in err for err in waited)


# The activation store's CUDA side looks the CUDA runtime up at run time (store_cuda.cpp): it
# needs no CUDA header to compile, and no GPU to show that it finds the runtime and calls it.
_MAIN = textwrap.dedent("""
    #include <cstdio>
    #include "store.h"
    int main() {
      void* p = nullptr;
      int err = gradaccel::store_cuda::host_alloc(&p, 4096);
      std::printf("%d|%s\\n", err, gradaccel::store_cuda::error_string(err));
      if (err == 0) gradaccel::store_cuda::host_free(p);
      return 0;
    }
""")


def _cudart_major():
    for major in (13, 12):
        try:
            import ctypes

            ctypes.CDLL(f"libcudart.so.{major}")
            return major
        except OSError:
            continue
    return None


def _run_store_cuda(tmp_path, major):
    (tmp_path / "main.cpp").write_text(_MAIN)
    exe = tmp_path / f"store_cuda_{major}"
    subprocess.run([os.environ.get("CXX", "g++"), "-std=c++20", "-Wall", "-Werror", "-DGRADACCEL_WITH_CUDA=1",
                    f"-DGRADACCEL_CUDA_MAJOR={major}", f"-I{CSRC}", str(tmp_path / "main.cpp"),
                    str(CSRC / "store_cuda.cpp"), "-ldl", "-o", str(exe)], check=True)
    code, _, message = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.strip().partition("|")
    return int(code), message


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
def test_store_cuda_names_a_missing_runtime(tmp_path):
    code, message = _run_store_cuda(tmp_path, 99)
    assert code == -1
    assert "libcudart.so.99" in message


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None or _cudart_major() is None,
                    reason="needs a C++ compiler and a CUDA runtime library (a CUDA toolkit or torch's CUDA wheel)")
def test_store_cuda_finds_and_calls_the_runtime(tmp_path):
    code, message = _run_store_cuda(tmp_path, _cudart_major())
    # 0 with a GPU; without one the runtime's own error (no device, or no driver), never ours (-1).
    assert code != -1, message
    assert message
