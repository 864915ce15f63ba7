// Weight gradients accumulated straight into the fp32 window buffer, with no weight-sized
// gradient tensor in between:
//   wgrad_accumulate_(acc, x, dy, scale):        acc += scale * dy^T @ x        (nn.Linear)
//   embedding_accumulate_(acc, ids, dy, scale):  acc[ids] += scale * dy, duplicates summed
// CPU kernels and Meta (shape-only) kernels here; the CUDA kernels are Triton, registered from
// Python (gradaccel/ops/wgrad.py), which reaches the same checks through the _check_* ops.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "axpy.h"
#include "spans.h"

#include <algorithm>
#include <string>

namespace gradaccel {
namespace {

std::string name_of(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

bool is_grad_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

void check_acc(const char* op, const at::Tensor& acc) {
  TORCH_CHECK_VALUE(acc.scalar_type() == at::kFloat, "gradaccel.", op, ": acc must be float32 (the fp32 ",
                    "window buffer's slice), got ", name_of(acc.scalar_type()));
  TORCH_CHECK_VALUE(acc.layout() == at::kStrided, "gradaccel.", op, ": acc must be a dense tensor");
  TORCH_CHECK_VALUE(acc.dim() == 2, "gradaccel.", op, ": acc must be 2-D (a weight's shape), got shape ",
                    acc.sym_sizes());
}

void check_input(const char* op, const char* name, const at::Tensor& t, const at::Tensor& acc) {
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "gradaccel.", op, ": ", name, " must be a dense tensor, got layout ",
                    t.layout());
  TORCH_CHECK_VALUE(t.device() == acc.device(), "gradaccel.", op, ": ", name, " is on ", t.device(),
                    " but acc is on ", acc.device(), "; move one of them");
}

// x (..., in) and dy (..., out) of one floating dtype with the same leading dims; acc (out, in).
void check_wgrad(const at::Tensor& acc, const at::Tensor& x, const at::Tensor& dy) {
  const char* op = "wgrad_accumulate_";
  check_acc(op, acc);
  check_input(op, "x", x, acc);
  check_input(op, "dy", dy, acc);
  TORCH_CHECK_VALUE(is_grad_dtype(x.scalar_type()), "gradaccel.wgrad_accumulate_: x must be float32, ",
                    "bfloat16 or float16, got ", name_of(x.scalar_type()));
  TORCH_CHECK_VALUE(x.scalar_type() == dy.scalar_type(), "gradaccel.wgrad_accumulate_: x is ",
                    name_of(x.scalar_type()), " but dy is ", name_of(dy.scalar_type()), "; they must match");
  TORCH_CHECK_VALUE(x.dim() >= 1 && dy.dim() == x.dim(), "gradaccel.wgrad_accumulate_: x and dy must have ",
                    "the same number of dims (>= 1), got shapes ", x.sym_sizes(), " and ", dy.sym_sizes());
  TORCH_CHECK_VALUE(x.sym_sizes().slice(0, x.dim() - 1) == dy.sym_sizes().slice(0, dy.dim() - 1),
                    "gradaccel.wgrad_accumulate_: x ", x.sym_sizes(), " and dy ", dy.sym_sizes(),
                    " must share their leading dims (one row of each per token)");
  TORCH_CHECK_VALUE(acc.sym_size(0) == dy.sym_size(-1) && acc.sym_size(1) == x.sym_size(-1),
                    "gradaccel.wgrad_accumulate_: acc has shape ", acc.sym_sizes(), " but dy^T @ x is (",
                    dy.sym_size(-1), ", ", x.sym_size(-1), ")");
}

// acc is written while the others are read. Conservative, as the fold's check: inputs whose
// memory span meets acc's are refused even if their elements interleave without touching.
void check_writes_apart(const char* op, const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(at::has_internal_overlap(acc) != at::MemOverlap::Yes, "gradaccel.", op, ": acc has ",
              "overlapping elements (an expanded view); accumulate into a tensor that owns its memory");
  TORCH_CHECK(!spans_intersect(acc, a) && !spans_intersect(acc, b), "gradaccel.", op, ": acc shares ",
              "memory with an input (overlap); pass inputs that do not alias the buffer");
}

void check_wgrad_memory(const at::Tensor& acc, const at::Tensor& x, const at::Tensor& dy) {
  check_writes_apart("wgrad_accumulate_", acc, x, dy);
}

// Token rows per block of the low-precision CPU path: its fp32 copies of a block of x and dy
// stay under a quarter of the weight's bf16 gradient and under 4 MiB, whatever the token count.
int64_t wgrad_rows(int64_t in, int64_t out, int64_t tokens) {
  const int64_t width = std::max<int64_t>(in + out, 1);
  const int64_t by_weight = (in * out) / (4 * width);
  const int64_t by_cap = (int64_t{1} << 20) / width;
  return std::clamp<int64_t>(std::min(by_weight, by_cap), 8, std::max<int64_t>(tokens, 8));
}

void wgrad_accumulate_cpu(const at::Tensor& acc, const at::Tensor& x, const at::Tensor& dy, double scale) {
  check_wgrad(acc, x, dy);
  check_wgrad_memory(acc, x, dy);
  const int64_t in = x.size(-1), out = dy.size(-1);
  if (acc.numel() == 0) return;
  const at::Tensor x2 = x.reshape({-1, in}), dy2 = dy.reshape({-1, out});
  const int64_t tokens = x2.size(0);
  if (tokens == 0) return;
  // As the optimizer applies scales elsewhere: the float32 value of the Python number.
  const double s = static_cast<double>(static_cast<float>(scale));
  if (x.scalar_type() == at::kFloat) {
    // One GEMM with beta=1: the BLAS writes its fp32 sums straight onto acc.
    acc.addmm_(dy2.t(), x2, 1.0, s);
    return;
  }
  // torch has no CPU mm with bf16/fp16 inputs and an fp32 output: widen a block of token rows at
  // a time (exactly: every bf16/fp16 value is an fp32 value) and add its fp32 GEMM onto acc.
  const int64_t rows = wgrad_rows(in, out, tokens);
  for (int64_t a = 0; a < tokens; a += rows) {
    const int64_t n = std::min(rows, tokens - a);
    acc.addmm_(dy2.narrow(0, a, n).to(at::kFloat).t(), x2.narrow(0, a, n).to(at::kFloat), 1.0, s);
  }
}

// ids: any shape, int32/int64; dy: ids.shape + (dim,); acc: (vocab, dim).
void check_embedding(const at::Tensor& acc, const at::Tensor& ids, const at::Tensor& dy) {
  const char* op = "embedding_accumulate_";
  check_acc(op, acc);
  check_input(op, "ids", ids, acc);
  check_input(op, "dy", dy, acc);
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
                    "gradaccel.embedding_accumulate_: ids must be int64 or int32, got ", name_of(ids.scalar_type()));
  TORCH_CHECK_VALUE(is_grad_dtype(dy.scalar_type()), "gradaccel.embedding_accumulate_: dy must be float32, ",
                    "bfloat16 or float16, got ", name_of(dy.scalar_type()));
  TORCH_CHECK_VALUE(dy.dim() == ids.dim() + 1 && dy.sym_sizes().slice(0, ids.dim()) == ids.sym_sizes() &&
                        dy.sym_size(-1) == acc.sym_size(1),
                    "gradaccel.embedding_accumulate_: dy must have shape ids.shape + (", acc.sym_size(1),
                    ",), got dy ", dy.sym_sizes(), " and ids ", ids.sym_sizes());
}

void embedding_accumulate_cpu(const at::Tensor& acc, const at::Tensor& ids, const at::Tensor& dy, double scale,
                              int64_t padding_idx) {
  check_embedding(acc, ids, dy);
  check_writes_apart("embedding_accumulate_", acc, ids, dy);
  const int64_t vocab = acc.size(0), dim = acc.size(1);
  const at::Tensor idx = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t tokens = idx.numel();
  if (tokens == 0 || dim == 0) return;
  const int64_t* id = idx.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK_INDEX(id[t] >= 0 && id[t] < vocab, "gradaccel.embedding_accumulate_: ids holds ", id[t],
                      ", out of range for ", vocab, " rows of acc");
  }
  if (acc.stride(1) != 1) {  // not how a window slice is laid out; a copy keeps the kernel simple
    at::Tensor tmp = acc.contiguous();
    embedding_accumulate_cpu(tmp, ids, dy, scale, padding_idx);
    acc.copy_(tmp);
    return;
  }
  const at::Tensor d = dy.reshape({-1, dim}).contiguous();  // token-sized, never vocabulary-sized
  const auto dtype = d.scalar_type();
  const int64_t esize = d.element_size();
  const char* g = static_cast<const char*>(d.const_data_ptr());
  float* a = acc.data_ptr<float>();
  const int64_t row_stride = acc.stride(0);
  const float s = static_cast<float>(scale);
  // Threads split the columns, never the tokens: rows with a repeated id are added by one
  // thread in token order, so the result is deterministic and free of races.
  const int64_t grain = std::max<int64_t>(64, (int64_t{1} << 16) / std::max<int64_t>(tokens, 1));
  at::parallel_for(0, dim, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t t = 0; t < tokens; ++t) {
      if (id[t] == padding_idx) continue;
      axpy_dispatch(a + id[t] * row_stride + c0, g + (t * dim + c0) * esize, dtype, s, c1 - c0);
    }
  });
}

void wgrad_accumulate_meta(const at::Tensor& acc, const at::Tensor& x, const at::Tensor& dy, double) {
  check_wgrad(acc, x, dy);
}
void embedding_accumulate_meta(const at::Tensor& acc, const at::Tensor& ids, const at::Tensor& dy, double, int64_t) {
  check_embedding(acc, ids, dy);
}
// For the Triton kernels, which Python launches directly: the same checks as the CPU kernels.
void check_wgrad_accumulate(const at::Tensor& acc, const at::Tensor& x, const at::Tensor& dy) {
  check_wgrad(acc, x, dy);
  if (!acc.is_meta()) check_wgrad_memory(acc, x, dy);
}
void check_embedding_accumulate(const at::Tensor& acc, const at::Tensor& ids, const at::Tensor& dy) {
  check_embedding(acc, ids, dy);
  if (!acc.is_meta()) check_writes_apart("embedding_accumulate_", acc, ids, dy);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gradaccel, m) {
  m.def("wgrad_accumulate_(Tensor(a!) acc, Tensor x, Tensor dy, float scale) -> ()");
  m.def("embedding_accumulate_(Tensor(a!) acc, Tensor ids, Tensor dy, float scale, int padding_idx=-1) -> ()");
  m.def("_check_wgrad_accumulate(Tensor acc, Tensor x, Tensor dy) -> ()");
  m.def("_check_embedding_accumulate(Tensor acc, Tensor ids, Tensor dy) -> ()");
}

TORCH_LIBRARY_IMPL(gradaccel, CompositeExplicitAutograd, m) {
  m.impl("_check_wgrad_accumulate", &check_wgrad_accumulate);
  m.impl("_check_embedding_accumulate", &check_embedding_accumulate);
}

TORCH_LIBRARY_IMPL(gradaccel, CPU, m) {
  m.impl("wgrad_accumulate_", &wgrad_accumulate_cpu);
  m.impl("embedding_accumulate_", &embedding_accumulate_cpu);
}

TORCH_LIBRARY_IMPL(gradaccel, Meta, m) {
  m.impl("wgrad_accumulate_", &wgrad_accumulate_meta);
  m.impl("embedding_accumulate_", &embedding_accumulate_meta);
}

}  // namespace gradaccel
