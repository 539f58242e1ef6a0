// The element types of a KV cache's rows, as paged_attention.cpp reads them 8 values at a time:
// bfloat16 (widened to float32), and packed quantized rows (kv_dtype 2, 3, 4: int8, fp8 e4m3, fp8 e5m2),
// one byte per value with the row's float32 scale after its head_dim bytes (pdserve/common/kv_quant.py).
#pragma once

#include <cstdint>
#include <cstring>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "vec8.h"

namespace pdserve_kernels {

typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

inline v8 load8(const uint16_t* p) {  // 8 bfloat16 -> 8 float32 (a bf16 is the high half of a float32)
  v8u16 h; std::memcpy(&h, p, sizeof(h));
  v8u32 w = __builtin_convertvector(h, v8u32) << 16;
  v8 v; std::memcpy(&v, &w, sizeof(v)); return v;
}
// Packed quantized rows (kv_dtype 2, 3, 4): one byte per value, the row's scale after head_dim bytes.
struct QInt8 { int8_t bits; };
struct QE4M3 { uint8_t bits; };
struct QE5M2 { uint8_t bits; };
template <typename T> struct Packed { static constexpr bool value = false; };
template <> struct Packed<QInt8> { static constexpr bool value = true; };
template <> struct Packed<QE4M3> { static constexpr bool value = true; };
template <> struct Packed<QE5M2> { static constexpr bool value = true; };
inline v8u32 widen_u8(const void* p) {
#ifdef __AVX2__
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
  v8u32 v; std::memcpy(&v, &w, sizeof(v)); return v;
#else
  uint8_t b[8]; std::memcpy(b, p, sizeof(b));
  v8u32 v; for (int i = 0; i < 8; ++i) v[i] = b[i];
  return v;
#endif
}

inline v8 load8(const QInt8* p) { return widen_i8_to_float(p); }  // 8 int8 -> 8 float32 (unscaled)
// 8 fp8 values with `mant` mantissa bits and exponent bias `bias` -> 8 float32: |x|'s bits shifted so
// its exponent and mantissa fields line up with float32's, then times 2^(127 - bias), which moves the
// exponent from fp8's bias to float32's (fp8 subnormals land on float32 subnormals and come out right).
template <int mant, int bias>
inline v8 fp8_to_float(const uint8_t* p) {
  const v8u32 w = widen_u8(p);
  const v8u32 bits = ((w & 0x7fu) << (23 - mant)) | ((w & 0x80u) << 24);
  v8 v; std::memcpy(&v, &bits, sizeof(v));
  return v * __builtin_ldexpf(1.0f, 127 - bias);
}
inline v8 load8(const QE4M3* p) { return fp8_to_float<3, 7>(reinterpret_cast<const uint8_t*>(p)); }
inline v8 load8(const QE5M2* p) { return fp8_to_float<2, 15>(reinterpret_cast<const uint8_t*>(p)); }

// The scale of the quantized row starting at `row` (1 for plain element types, never read).
template <typename T>
inline float row_scale(const T* row, int64_t head_dim) {
  if constexpr (Packed<T>::value) {
    float s; std::memcpy(&s, reinterpret_cast<const char*>(row) + head_dim, sizeof(s)); return s;
  } else {
    return 1.f;
  }
}

}  // namespace pdserve_kernels
