// 8-lane float32 vectors, their fixed-order lane sums and a vectorized exp shared by the native
// kernels (paged_attention.cpp, int8_linear.cpp, prefill_attention.cpp).
// GCC vector extensions, so -march=native compiles them to AVX2 (or wider) instructions; where a
// conversion has no good generic form, AVX2 intrinsics do it, with a scalar fallback.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pdserve_kernels {

typedef float v8 __attribute__((vector_size(32)));

// x in every lane of a V (v8, or a wider float vector): one vbroadcastss. (Not ``V{} + x``: without
// -ffast-math that is a real scalar add of 0.0 before the broadcast, since 0 + -0 is +0; in the prompt
// attention kernel's inner loops it cost a dependent vaddss per broadcast, ~20% of the kernel's cycles.)
template <typename V = v8>
inline V splat(float x) {
  V v;
#ifdef __AVX512F__
  if constexpr (sizeof(V) == 64) {
    const __m512 b = _mm512_set1_ps(x);
    std::memcpy(&v, &b, sizeof(v));
    return v;
  }
#endif
#ifdef __AVX__
  if constexpr (sizeof(V) == 32) {
    const __m256 b = _mm256_set1_ps(x);
    std::memcpy(&v, &b, sizeof(v));
    return v;
  }
#endif
  for (unsigned i = 0; i < sizeof(V) / sizeof(float); ++i) v[i] = x;  // (GCC builds it lane by lane)
  return v;
}

inline v8 load8(const float* p) { v8 v; std::memcpy(&v, p, sizeof(v)); return v; }

inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }  // memcpy: unaligned-safe, one vmovups
// a * b + c lane by lane, rounded once where the CPU has FMA (an explicit instruction: GCC contracts
// ``a * b + c`` into an FMA in some loops and not in others, and a kernel whose tiles differ in that
// gives a row other bits among other rows), else a multiply and an add.
template <typename V>
inline V fmadd(V a, V b, V c) {
#ifdef __AVX512F__
  if constexpr (sizeof(V) == 64) {
    __m512 x, y, z;
    std::memcpy(&x, &a, 64); std::memcpy(&y, &b, 64); std::memcpy(&z, &c, 64);
    z = _mm512_fmadd_ps(x, y, z);
    std::memcpy(&c, &z, 64);
    return c;
  }
#endif
#ifdef __FMA__
  if constexpr (sizeof(V) == 32) {
    __m256 x, y, z;
    std::memcpy(&x, &a, 32); std::memcpy(&y, &b, 32); std::memcpy(&z, &c, 32);
    z = _mm256_fmadd_ps(x, y, z);
    std::memcpy(&c, &z, 32);
    return c;
  }
#endif
  return a * b + c;
}

// The lanes of v added in one fixed tree; hsum8 adds eight vectors' lanes in the same tree, so a
// score has the same bits whichever path computed it.
inline float hsum(v8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

// {hsum(a[0]), ..., hsum(a[7])} with 7 vector adds instead of 8 scalar trees (the transposing
// horizontal add of 8x8 reductions).
inline v8 hsum8(const v8 (&a)[8]) {
#ifdef __AVX2__
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a[0], (__m256)a[1]), _mm256_hadd_ps((__m256)a[2], (__m256)a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a[4], (__m256)a[5]), _mm256_hadd_ps((__m256)a[6], (__m256)a[7]));
  // u0 = {a0[0..3], a1[0..3], a2[0..3], a3[0..3] | the same over lanes 4..7}, u1 likewise for a4..a7
  return (v8)(_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
#else
  v8 r;
  for (int i = 0; i < 8; ++i) r[i] = hsum(a[i]);
  return r;
#endif
}

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

// exp(x) lane by lane for a float vector type V (8 or 16 lanes) and its int32 twin VI: x = n*ln2 + r
// with |r| <= ln2/2, a degree-6 polynomial for exp(r), and 2^n put straight into the exponent bits.
// Relative error about 2e-7 (float32 rounding); inputs below -87 (or -inf) give 0, as softmax wants
// for scores far under the maximum.
template <typename V, typename VI>
inline V vexp(V x) {
  const V lo = V{} - 87.0f, hi = V{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const V n = __builtin_convertvector(
      __builtin_convertvector(x * 1.44269504088896341f + (V{} + 0.5f) - (x < 0 ? V{} + 1.0f : V{}), VI), V);
  V r = x - n * 0.693359375f;  // ln2 in two parts, so n*ln2 is exact
  r = r + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  V y = p * scale;
  return x <= lo ? V{} : y;
}

}  // namespace pdserve_kernels
