// Whether two tensors' memory may overlap: shared by every op that writes one tensor while it
// reads others (accumulate.cpp, wgrad.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

namespace gradaccel {

// True if the memory spans of `a` and `b` (first to last element) intersect. Conservative for
// strided tensors that interleave without touching, which is all a caller needs to avoid.
inline bool spans_intersect(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.has_storage() || !b.has_storage()) return false;
  if (!a.storage().is_alias_of(b.storage())) return false;
  auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    return std::pair<uintptr_t, uintptr_t>(begin, begin + (last + 1) * t.element_size());
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

}  // namespace gradaccel
