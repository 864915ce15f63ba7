// The Python module `gradaccel._C`. Tensor ops register themselves with TORCH_LIBRARY in their
// own files; this file only exposes build facts (and the non-tensor entry points) to Python.
#include <torch/extension.h>

#ifndef GRADACCEL_SOURCE_HASH
#define GRADACCEL_SOURCE_HASH "unknown"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gradaccel C++/CUDA extension";
  // Compared by gradaccel._ext against the sources on disk, so a stale build fails loudly.
  m.attr("source_hash") = GRADACCEL_SOURCE_HASH;
#ifdef GRADACCEL_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
