// 8-lane float32 vectors shared by the native kernels (paged_attention.cpp, int8_linear.cpp).
// GCC vector extensions, so -march=native compiles them to AVX2 (or wider) instructions; where a
// conversion has no good generic form, AVX2 intrinsics do it, with a scalar fallback.
#pragma once

#include <cstdint>
#include <cstring>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace pdserve_kernels {

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) { v8 v; std::memcpy(&v, p, sizeof(v)); return v; }

// 8 int8 -> 8 float32. GCC's __builtin_convertvector from an 8-byte vector goes through scalar
// registers (it made the int8 KV path 2.5x slower than float32); AVX2 widens in one instruction.
inline v8 widen_i8_to_float(const void* p) {
#ifdef __AVX2__
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p))));
  v8 v; std::memcpy(&v, &f, sizeof(v)); return v;
#else
  int8_t b[8]; std::memcpy(b, p, sizeof(b));
  v8 v; for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(b[i]);
  return v;
#endif
}

}  // namespace pdserve_kernels
