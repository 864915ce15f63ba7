// The Python module of gradaccel's extension (gradaccel_C, built by gradaccel/ops/extension.py).
// Tensor ops register themselves with TORCH_LIBRARY in their own files; this file only exposes
// build facts (and the non-tensor entry points) to Python.
#include <torch/extension.h>

#include "fold_plan.h"

void init_planner(pybind11::module_& m);       // planner.cpp
void init_fused_linear(pybind11::module_& m);  // fused_linear.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gradaccel C++/CUDA extension";
#ifdef GRADACCEL_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  // The Triton fold reads its launch plans through these (gradaccel/ops/triton/accumulate.py).
  m.def("fold_plan_layout", &gradaccel::fold_plan::layout,
        "The fold plan's header slots, row columns and dtype codes, by name.");
  m.def("fold_plan_capacity", &gradaccel::fold_plan::capacity, pybind11::arg("flat_numel"),
        pybind11::arg("n_grads"), pybind11::arg("block"),
        "int64 slots that the fold plan of n_grads grads into flat_numel elements may need.");
  init_planner(m);
  init_fused_linear(m);
}
