// acc[i] += float(g[i]) * s over fp32/bf16/fp16 g: the one inner loop of every CPU kernel that
// adds a gradient into an fp32 buffer (accumulate.cpp's folds, wgrad.cpp's embedding rows).
#pragma once

#include <ATen/ATen.h>

#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace gradaccel {

inline float load_float(float x) { return x; }
// bf16 is the top half of an fp32: a shift the compiler vectorises.
inline float load_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float load_float(c10::Half x) { return static_cast<float>(x); }

// acc[i] += float(g[i]) * s, written as a product then a sum (no FMA contraction in ISO C++),
// so the result is bit-identical to PyTorch's `acc + g.float() * s`.
template <typename T>
void axpy(float* __restrict acc, const T* __restrict g, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += load_float(g[i]) * s;
}

#if defined(__x86_64__) && defined(__GNUC__)
// The extension is built for baseline x86-64 (SSE2), where fp16 -> fp32 is a scalar bit routine
// and loops are 128 bits wide: 2.5x slower than PyTorch's AVX2 kernels for fp16 grads. These
// AVX2/F16C loops are picked at run time where the CPU has them. Still no FMA: same rounding.
#define GRADACCEL_AVX2 __attribute__((target("avx2,f16c")))

GRADACCEL_AVX2 inline __m256 load8_avx2(const float* g) { return _mm256_loadu_ps(g); }
GRADACCEL_AVX2 inline __m256 load8_avx2(const c10::BFloat16* g) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
GRADACCEL_AVX2 inline __m256 load8_avx2(const c10::Half* g) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
}

template <typename T>
GRADACCEL_AVX2 void axpy_avx2(float* __restrict acc, const T* __restrict g, float s, int64_t n) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 p0 = _mm256_mul_ps(load8_avx2(g + i), vs);
    const __m256 p1 = _mm256_mul_ps(load8_avx2(g + i + 8), vs);
    _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), p0));
    _mm256_storeu_ps(acc + i + 8, _mm256_add_ps(_mm256_loadu_ps(acc + i + 8), p1));
  }
  for (; i < n; ++i) acc[i] += load_float(g[i]) * s;
}

inline const bool kHaveAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
constexpr bool kHaveAvx2 = false;
template <typename T>
void axpy_avx2(float* acc, const T* g, float s, int64_t n) { axpy(acc, g, s, n); }
#endif

template <typename T>
void axpy_best(float* acc, const T* g, float s, int64_t n) {
  if (kHaveAvx2) return axpy_avx2(acc, g, s, n);
  axpy(acc, g, s, n);
}

inline void axpy_dispatch(float* acc, const void* g, at::ScalarType dtype, float s, int64_t n) {
  switch (dtype) {
    case at::kFloat: return axpy_best(acc, static_cast<const float*>(g), s, n);
    case at::kBFloat16: return axpy_best(acc, static_cast<const c10::BFloat16*>(g), s, n);
    case at::kHalf: return axpy_best(acc, static_cast<const c10::Half*>(g), s, n);
    default: TORCH_CHECK(false, "gradaccel: unsupported grad dtype ", dtype);
  }
}

}  // namespace gradaccel
