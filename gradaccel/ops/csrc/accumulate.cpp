// Gradient accumulation into fp32 buffers: CPU kernels, Meta (shape-only) kernels, and the one
// TORCH_LIBRARY block that declares every gradaccel op. Other files add ops with
// TORCH_LIBRARY_FRAGMENT(gradaccel, m). The CUDA kernels of these ops are Triton, registered
// from Python (gradaccel/ops/accumulate.py).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include "axpy.h"
#include "spans.h"
#include "fold_plan.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

namespace gradaccel {
namespace {

// Elements per parallel task. Fixed (not per thread) so that finalize's partial sums, and
// hence its result, do not depend on the number of threads.
constexpr int64_t kChunk = 1 << 16;

// --- argument checks ---------------------------------------------------------------------------
// The one definition of what each op accepts, for the CPU, Meta and (through the _check_* ops)
// Triton paths alike. TORCH_CHECK_VALUE raises Python's ValueError; refusals about memory
// overlap stay RuntimeError, as torch's own in-place ops raise them. gradaccel/ops/accumulate.py adds only
// what the schema hides from C++: an argument that is not a tensor at all (TypeError).

std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

void check_buffer(const char* op, const char* name, const at::Tensor& buf) {
  TORCH_CHECK_VALUE(buf.scalar_type() == at::kFloat, "gradaccel.", op, ": ", name, " must be float32 ",
                    "(the fp32 accumulation buffer), got ", dtype_name(buf.scalar_type()));
}

void check_grad(const at::Tensor& grad, const std::string& what) {
  const auto dt = grad.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "gradaccel.", what,
                    " must be float32, bfloat16 or float16, got ", dtype_name(dt),
                    " (integer and other dtypes carry no gradient to accumulate)");
  TORCH_CHECK_VALUE(grad.layout() == at::kStrided, "gradaccel.", what,
                    " must be a dense (strided) tensor, got layout ", grad.layout());
}

void check_pair(const at::Tensor& acc, const at::Tensor& grad) {
  check_buffer("scale_accumulate_", "acc", acc);
  check_grad(grad, "scale_accumulate_: grad");
  TORCH_CHECK_VALUE(acc.device() == grad.device(), "gradaccel.scale_accumulate_: acc is on ",
                    acc.device(), " but grad is on ", grad.device(), "; move one of them");
  TORCH_CHECK_VALUE(acc.sym_sizes() == grad.sym_sizes(), "gradaccel.scale_accumulate_: grad has shape ",
                    grad.sym_sizes(), " but acc has shape ", acc.sym_sizes(), "; they must match");
}

// acc is written while grad is read: no element of acc may be written twice (an expanded view),
// and grad may be acc itself but no other view of acc's memory. Conservative: grads that
// interleave with acc without touching it are refused too, on every path alike.
void check_pair_memory(const at::Tensor& acc, const at::Tensor& grad) {
  TORCH_CHECK(at::has_internal_overlap(acc) != at::MemOverlap::Yes, "gradaccel.scale_accumulate_: ",
              "acc has overlapping elements (an expanded view); accumulate into a tensor that owns its memory");
  const bool same = acc.const_data_ptr() == grad.const_data_ptr() && acc.strides() == grad.strides() &&
                    acc.scalar_type() == grad.scalar_type();
  TORCH_CHECK(same || !spans_intersect(acc, grad), "gradaccel.scale_accumulate_: grad partially ",
              "overlaps acc (some elements refer to a single memory location); pass a grad that does ",
              "not alias acc");
}

// Any strides: TensorIterator coalesces dims, splits work across threads, and hands us
// 2-D loops whose inner stride is usually the element size.
void scale_accumulate_strided(const at::Tensor& acc, const at::Tensor& grad, float s) {
  auto iter = at::TensorIteratorConfig()
                  .add_output(acc)
                  .add_const_input(acc)
                  .add_const_input(grad)
                  .check_all_same_dtype(false)
                  .resize_outputs(false)
                  .build();
  const auto dtype = grad.scalar_type();
  iter.for_each([&](char** data, const int64_t* strides, int64_t n0, int64_t n1) {
    for (int64_t j = 0; j < n1; ++j) {
      char* out = data[0] + j * strides[3];
      const char* in = data[1] + j * strides[4];
      const char* g = data[2] + j * strides[5];
      const int64_t gsize = c10::elementSize(dtype);
      if (strides[0] == 4 && strides[1] == 4 && strides[2] == gsize && out == in) {
        axpy_dispatch(reinterpret_cast<float*>(out), g, dtype, s, n0);
        continue;
      }
      for (int64_t i = 0; i < n0; ++i) {
        float gv;
        const char* gp = g + i * strides[2];
        switch (dtype) {
          case at::kFloat: gv = *reinterpret_cast<const float*>(gp); break;
          case at::kBFloat16: gv = load_float(*reinterpret_cast<const c10::BFloat16*>(gp)); break;
          default: gv = load_float(*reinterpret_cast<const c10::Half*>(gp)); break;
        }
        *reinterpret_cast<float*>(out + i * strides[0]) =
            *reinterpret_cast<const float*>(in + i * strides[1]) + gv * s;
      }
    }
  }, kChunk);
}

void scale_accumulate_cpu(const at::Tensor& acc, const at::Tensor& grad, double scale) {
  check_pair(acc, grad);
  check_pair_memory(acc, grad);
  const int64_t n = acc.numel();
  if (n == 0) return;
  const float s = static_cast<float>(scale);
  if (acc.is_contiguous() && grad.is_contiguous()) {
    float* a = acc.data_ptr<float>();
    const char* g = static_cast<const char*>(grad.const_data_ptr());
    const auto dtype = grad.scalar_type();
    const int64_t gsize = grad.element_size();
    at::parallel_for(0, n, kChunk, [&](int64_t begin, int64_t end) {
      axpy_dispatch(a + begin, g + begin * gsize, dtype, s, end - begin);
    });
    return;
  }
  scale_accumulate_strided(acc, grad, s);
}

void check_fold(const at::Tensor& flat, at::TensorList grads, at::IntArrayRef offsets) {
  check_buffer("fold_", "flat", flat);
  TORCH_CHECK_VALUE(flat.dim() == 1 && flat.is_contiguous(), "gradaccel.fold_: flat must be a 1-D ",
                    "contiguous buffer, got shape ", flat.sym_sizes(), flat.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK_VALUE(grads.size() == offsets.size(), "gradaccel.fold_: got ", grads.size(), " grads but ",
                    offsets.size(), " offsets; pass one offset per grad");
  for (size_t i = 0; i < grads.size(); ++i) {
    check_grad(grads[i], "fold_: grads[" + std::to_string(i) + "]");
    TORCH_CHECK_VALUE(grads[i].device() == flat.device(), "gradaccel.fold_: grads[", i, "] is on ",
                      grads[i].device(), " but flat is on ", flat.device());
  }
}

// Slices must be in bounds and disjoint, and no grad may live in flat: the fold writes the
// slices in parallel while it reads the grads.
void check_fold_layout(const at::Tensor& flat, at::TensorList grads, at::IntArrayRef offsets) {
  for (size_t i = 0; i < grads.size(); ++i) {
    TORCH_CHECK(!spans_intersect(flat, grads[i]), "gradaccel.fold_: grads[", i,
                "] shares memory with flat; fold a gradient that does not alias the buffer (clone it)");
  }
  const int64_t total = flat.numel();
  std::vector<size_t> order(grads.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
  int64_t end_prev = 0;
  for (size_t i : order) {
    const int64_t n = grads[i].numel();
    if (n == 0) continue;
    TORCH_CHECK_VALUE(offsets[i] >= 0 && offsets[i] <= total - n, "gradaccel.fold_: grads[", i,
                      "] (", n, " elements) at offset ", offsets[i], " does not fit in flat (", total,
                      " elements)");
    TORCH_CHECK_VALUE(offsets[i] >= end_prev, "gradaccel.fold_: the slice of grads[", i, "] at offset ",
                      offsets[i], " overlaps another grad's slice (ending at ", end_prev,
                      "); slices must be disjoint");
    end_prev = offsets[i] + n;
  }
}

void fold_cpu(const at::Tensor& flat, at::TensorList grads, at::IntArrayRef offsets, double scale) {
  check_fold(flat, grads, offsets);
  check_fold_layout(flat, grads, offsets);
  const float s = static_cast<float>(scale);
  float* base = flat.data_ptr<float>();
  struct Chunk {
    float* acc;
    const char* grad;
    at::ScalarType dtype;
    int64_t n;
  };
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    const int64_t n = g.numel();
    if (n == 0) continue;
    if (!g.is_contiguous()) {
      scale_accumulate_strided(flat.narrow(0, offsets[i], n).view(g.sizes()), g, s);
      continue;
    }
    const char* gp = static_cast<const char*>(g.const_data_ptr());
    const int64_t gsize = g.element_size();
    for (int64_t start = 0; start < n; start += kChunk) {
      chunks.push_back({base + offsets[i] + start, gp + start * gsize, g.scalar_type(),
                        std::min(kChunk, n - start)});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      axpy_dispatch(chunks[c].acc, chunks[c].grad, chunks[c].dtype, s, chunks[c].n);
    }
  });
}

// The launch plan of the Triton fold, in the layout of fold_plan.h, written into `plan` (int64,
// CPU, fold_plan::capacity slots). Built here rather than in Python because a plan reads four
// attributes of every grad: ~20 ns each in C++ and ~150 ns each in Python, which for a
// 150-tensor model would rival the GPU time of the fold.
void build_fold_plan(const at::Tensor& flat, at::TensorList grads, at::IntArrayRef offsets,
                     int64_t block, const at::Tensor& plan) {
  namespace fp = fold_plan;
  check_fold(flat, grads, offsets);
  check_fold_layout(flat, grads, offsets);
  TORCH_CHECK(plan.device().is_cpu() && plan.scalar_type() == at::kLong && plan.dim() == 1 &&
                  plan.is_contiguous(), "gradaccel._fold_plan: plan must be a 1-D contiguous int64 CPU tensor");
  TORCH_CHECK(block > 0, "gradaccel._fold_plan: block must be positive, got ", block);
  const int64_t n = static_cast<int64_t>(grads.size());
  int64_t rows = 0, blocks = 0, strided = 0;
  bool aligned = reinterpret_cast<uintptr_t>(flat.const_data_ptr()) % 16 == 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t numel = grads[i].numel();
    if (numel == 0) continue;
    if (grads[i].is_contiguous()) {
      ++rows;
      blocks += (numel + block - 1) / block;
    } else {
      ++strided;
    }
  }
  const int64_t t0 = fp::kHeaderLen + strided, m0 = t0 + fp::kRowWidth * rows, used = m0 + (blocks + 1) / 2;
  TORCH_CHECK(used <= plan.numel(), "gradaccel._fold_plan: plan has ", plan.numel(),
              " slots, the fold needs ", used);
  int64_t* p = plan.data_ptr<int64_t>();
  int32_t* block_map = reinterpret_cast<int32_t*>(p + m0);
  int64_t k = 0, row = 0, first_block = 0;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& g = grads[i];
    const int64_t numel = g.numel();
    if (numel == 0) continue;
    if (!g.is_contiguous()) {
      p[fp::kHeaderLen + k++] = i;
      continue;
    }
    const auto addr = reinterpret_cast<uintptr_t>(g.const_data_ptr());
    aligned = aligned && addr % 16 == 0 && offsets[i] % 4 == 0;
    int64_t* r = p + t0 + fp::kRowWidth * row;
    r[fp::kAddress] = static_cast<int64_t>(addr);
    r[fp::kNumel] = numel;
    r[fp::kOffset] = offsets[i];
    r[fp::kFirstBlock] = first_block;
    r[fp::kDtype] = fp::dtype_code(g.scalar_type());
    const int64_t nb = (numel + block - 1) / block;
    std::fill(block_map + first_block, block_map + first_block + nb, static_cast<int32_t>(row));
    first_block += nb;
    ++row;
  }
  if (blocks % 2) block_map[blocks] = 0;
  p[fp::kRows] = rows;
  p[fp::kBlocks] = blocks;
  p[fp::kAligned] = aligned ? 1 : 0;
  p[fp::kStrided] = strided;
  p[fp::kTableStart] = t0;
  p[fp::kMapStart] = m0;
  p[fp::kEnd] = used;
}

// A scale on the CPU is accepted for a buffer on any device (the Triton path copies it over).
void check_finalize(const at::Tensor& flat, const at::Tensor& scale) {
  check_buffer("finalize_", "flat", flat);
  TORCH_CHECK_VALUE(flat.is_contiguous(), "gradaccel.finalize_: flat must be contiguous (the flat ",
                    "accumulation buffer)");
  TORCH_CHECK_VALUE(scale.dim() == 0 && at::isFloatingType(scale.scalar_type()), "gradaccel.finalize_: ",
                    "scale must be a 0-d floating-point tensor, got shape ", scale.sym_sizes(),
                    " and dtype ", dtype_name(scale.scalar_type()));
  TORCH_CHECK_VALUE(scale.device() == flat.device() || scale.device().is_cpu(), "gradaccel.finalize_: ",
                    "scale is on ", scale.device(), " but flat is on ", flat.device());
}

std::tuple<at::Tensor, at::Tensor> finalize_cpu(const at::Tensor& flat, const at::Tensor& scale) {
  check_finalize(flat, scale);
  // As float32, like the CUDA kernel: a double scale past float's range is inf there too.
  const float s = static_cast<float>(scale.item<double>());
  const int64_t n = flat.numel();
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  std::vector<double> sq(nchunks, 0.0);
  std::vector<uint32_t> bad(nchunks, 0);
  float* a = flat.data_ptr<float>();
  at::parallel_for(0, nchunks, 1, [&](int64_t begin, int64_t end) {
    constexpr int kLanes = 8;  // independent sums: a single fp64 sum is latency-bound
    for (int64_t c = begin; c < end; ++c) {
      float* x = a + c * kChunk;
      const int64_t len = std::min(kChunk, n - c * kChunk);
      double lanes[kLanes] = {};
      uint32_t any = 0;
      int64_t i = 0;
      for (; i + kLanes <= len; i += kLanes) {
        for (int j = 0; j < kLanes; ++j) {
          const float v = x[i + j] * s;
          x[i + j] = v;
          lanes[j] += static_cast<double>(v) * static_cast<double>(v);
          uint32_t bits;
          std::memcpy(&bits, &v, sizeof(bits));
          any |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);  // exponent all ones
        }
      }
      for (; i < len; ++i) {
        const float v = x[i] * s;
        x[i] = v;
        lanes[0] += static_cast<double>(v) * static_cast<double>(v);
        any |= static_cast<uint32_t>(!std::isfinite(v));
      }
      double total = 0.0;
      for (double l : lanes) total += l;
      sq[c] = total;
      bad[c] = any;
    }
  });
  double total = 0.0;
  uint32_t any = 0;
  for (int64_t c = 0; c < nchunks; ++c) {
    total += sq[c];
    any |= bad[c];
  }
  // fp64 out: squares of finite fp32 values overflow fp32 once the norm passes 1.8e19.
  return {at::scalar_tensor(total, flat.options().dtype(at::kDouble)),
          at::scalar_tensor(any != 0, flat.options().dtype(at::kBool))};
}

// Meta: dtype/shape/device checks only, so tracing (FakeTensor, torch.compile) sees the same
// errors as eager without touching data.
void scale_accumulate_meta(const at::Tensor& acc, const at::Tensor& grad, double) {
  check_pair(acc, grad);
}
void fold_meta(const at::Tensor& flat, at::TensorList grads, at::IntArrayRef offsets, double) {
  check_fold(flat, grads, offsets);
}
void fold_plan_meta(const at::Tensor& flat, at::TensorList grads, at::IntArrayRef offsets,
                    int64_t, const at::Tensor&) {
  check_fold(flat, grads, offsets);
}
// For the Triton kernels, which Python launches directly: the same checks as the CPU kernels.
void check_scale_accumulate(const at::Tensor& acc, const at::Tensor& grad) {
  check_pair(acc, grad);
  if (!acc.is_meta()) check_pair_memory(acc, grad);
}

std::tuple<at::Tensor, at::Tensor> finalize_meta(const at::Tensor& flat, const at::Tensor& scale) {
  check_finalize(flat, scale);
  return {at::empty({}, flat.options().dtype(at::kDouble)), at::empty({}, flat.options().dtype(at::kBool))};
}

}  // namespace

TORCH_LIBRARY(gradaccel, m) {
  m.def("scale_accumulate_(Tensor(a!) acc, Tensor grad, float scale) -> ()");
  m.def("fold_(Tensor(a!) flat, Tensor[] grads, int[] offsets, float scale) -> ()");
  m.def("finalize_(Tensor(a!) flat, Tensor scale) -> (Tensor, Tensor)");
  // Internal: the Triton fold's launch plan (a CPU tensor whatever the device of flat).
  m.def("_fold_plan(Tensor flat, Tensor[] grads, int[] offsets, int block, Tensor(a!) plan) -> ()");
  // Internal: the argument checks of scale_accumulate_ and finalize_, for their Triton kernels.
  m.def("_check_scale_accumulate(Tensor acc, Tensor grad) -> ()");
  m.def("_check_finalize(Tensor flat, Tensor scale) -> ()");
}

// Any backend: the plan only reads tensor metadata and addresses.
TORCH_LIBRARY_IMPL(gradaccel, CompositeExplicitAutograd, m) {
  m.impl("_fold_plan", &build_fold_plan);
  m.impl("_check_scale_accumulate", &check_scale_accumulate);
  m.impl("_check_finalize", &check_finalize);
}

TORCH_LIBRARY_IMPL(gradaccel, CPU, m) {
  m.impl("scale_accumulate_", &scale_accumulate_cpu);
  m.impl("fold_", &fold_cpu);
  m.impl("finalize_", &finalize_cpu);
}

TORCH_LIBRARY_IMPL(gradaccel, Meta, m) {
  m.impl("scale_accumulate_", &scale_accumulate_meta);
  m.impl("fold_", &fold_meta);
  m.impl("finalize_", &finalize_meta);
  m.impl("_fold_plan", &fold_plan_meta);
}

}  // namespace gradaccel
