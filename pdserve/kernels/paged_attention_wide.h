// The 16-lane (AVX-512) path of paged_attention.cpp: scores and value sums of the query heads that
// share one KV head, over a block's rows of a float32 or bfloat16 cache whose widths are multiples of 16.
//
// Half the FMA instructions of the 8-lane path, each key and value row loaded once for all the query
// heads that share it, and every score's 16 partial sums folded to 8 in registers before the fixed
// tree of hsum / hsum8 (a score has the same bits whichever loop computed it; each output lane still
// sums its value rows in order). On a Zen 5 core the 8-lane path read the bench preset's KV at
// 10-11 GB/s, from DRAM or from L3 alike: its instructions, not memory, bounded it.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "vec8.h"

namespace pdserve_kernels {

// The element types the 16-lane path reads (float32, bfloat16 stored as uint16).
template <typename T>
constexpr bool kWideType = std::is_same<T, float>::value || std::is_same<T, uint16_t>::value;

// Whether rows of type T with these widths take the 16-lane path (an AVX-512 build, widths multiples of 16).
template <typename T>
inline bool wide_path(int64_t head_dim, int64_t v_dim) {
#ifdef __AVX512F__
  return kWideType<T> && head_dim % 16 == 0 && v_dim % 16 == 0;
#else
  (void)head_dim; (void)v_dim;
  return false;
#endif
}

// Software prefetches spread over a loop: each next() prefetches one more 64-byte line of `rows` rows
// (row_bytes each, row_stride apart) into L1. The 16-lane path calls it once per cache line it reads, so
// the next block arrives at the rate this one is used. Prefetching a block's share in one burst of 64
// lines (as NextBlock::slice does) left the memory system idle between bursts: on a Zen 5 core a sum over
// random 16 KiB chunks read 22.5 GB/s with one prefetch per line read and 14.5 GB/s with each chunk's
// prefetches in one burst at its start (18.5 in four bursts).
struct LinePrefetch {
  const char* row = nullptr;  // the current row (null: nothing left)
  const char* end = nullptr;  // one past the last row
  int64_t row_stride = 0, row_bytes = 0, b = 0;
  inline void next() {
    if (row == nullptr) return;
    __builtin_prefetch(row + b, 0, 3);
    if ((b += 64) >= row_bytes) {
      b = 0;
      row += row_stride;
      if (row == end) row = nullptr;
    }
  }
};

#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof(v)); return v; }
inline v16 load16(const uint16_t* p) {  // 16 bfloat16 -> 16 float32
  v16u16 h; std::memcpy(&h, p, sizeof(h));
  const v16u32 w = __builtin_convertvector(h, v16u32) << 16;
  v16 v; std::memcpy(&v, &w, sizeof(v)); return v;
}
inline v8 fold(v16 a) {  // lanes i and i + 8 added: 16 partial sums -> 8, in registers
  const __m512 w = (__m512)a;  // (a memcpy of each half went through the stack: a store-forwarding stall)
  return (v8)_mm256_add_ps(_mm512_castps512_ps256(w), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1)));
}

// scores[r * s_stride + t] = scale * <q_r, k_t> for the R query rows q_r (head_dim apart) of one KV head
// and the `run` key rows starting at krow: each key vector is loaded once for all R rows (R * 8
// accumulators in registers), and every score's lanes add in one tree (fold, then hsum / hsum8).
template <int R, typename T>
inline void rows_scores16(const float* q, const T* krow, int64_t slot_stride, int64_t run, int64_t head_dim,
                          float scale, float* scores, int64_t s_stride, LinePrefetch& pf) {
  constexpr int kLine = 64 / sizeof(T);  // elements of one cache line
  int64_t t = 0;
  for (; t + 8 <= run; t += 8) {
    v16 a[R][8] = {};
    for (int64_t d = 0; d < head_dim; d += 16)
      for (int i = 0; i < 8; ++i) {
        if (d % kLine == 0) pf.next();
        const v16 kv = load16(krow + (t + i) * slot_stride + d);
        for (int r = 0; r < R; ++r) a[r][i] += load16(q + r * head_dim + d) * kv;
      }
    for (int r = 0; r < R; ++r) {
      v8 f[8];
      for (int i = 0; i < 8; ++i) f[i] = fold(a[r][i]);
      store8(scores + r * s_stride + t, hsum8(f) * scale);
    }
  }
  for (; t < run; ++t) {
    const T* k0 = krow + t * slot_stride;
    v16 a[R] = {};
    for (int64_t d = 0; d < head_dim; d += 16) {
      if (d % kLine == 0) pf.next();
      const v16 kv = load16(k0 + d);
      for (int r = 0; r < R; ++r) a[r] += load16(q + r * head_dim + d) * kv;
    }
    for (int r = 0; r < R; ++r) scores[r * s_stride + t] = hsum(fold(a[r])) * scale;
  }
}

// The scores of `rows` query rows that share one KV head, three at a time (24 accumulators).
template <typename T>
inline void head_scores16(const float* q, const T* krow, int64_t slot_stride, int64_t run, int64_t head_dim,
                          float scale, int64_t rows, float* scores, int64_t s_stride, LinePrefetch& pf) {
  int64_t r = 0;
  for (; r + 3 <= rows; r += 3)
    rows_scores16<3>(q + r * head_dim, krow, slot_stride, run, head_dim, scale, scores + r * s_stride, s_stride, pf);
  switch (rows - r) {
    case 1: rows_scores16<1>(q + r * head_dim, krow, slot_stride, run, head_dim, scale, scores + r * s_stride, s_stride, pf); break;
    case 2: rows_scores16<2>(q + r * head_dim, krow, slot_stride, run, head_dim, scale, scores + r * s_stride, s_stride, pf); break;
  }
}

// acc[r] += sum_t p[r * p_stride + t] * v_t[d0 .. d0 + 16 W] for the R query rows of one KV head: each
// value row is loaded once for all of them, and R * W accumulators stay in registers.
template <int R, int W, typename T>
inline void values_chunk(const float* p, int64_t p_stride, const T* vrow, int64_t slot_stride, int64_t run,
                         int64_t d0, int64_t v_dim, float* acc, LinePrefetch& pf) {
  constexpr int kLine = 64 / sizeof(T);  // elements of one cache line
  v16 a[R][W];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < W; ++i) a[r][i] = load16(acc + r * v_dim + d0 + i * 16);
  for (int64_t t = 0; t < run; ++t) {
    const T* v = vrow + t * slot_stride + d0;
    v16 vv[W];
    for (int i = 0; i < W; ++i) {
      if ((d0 + i * 16) % kLine == 0) pf.next();
      vv[i] = load16(v + i * 16);
    }
    for (int r = 0; r < R; ++r) {
      const v16 pt = v16{} + p[r * p_stride + t];
      for (int i = 0; i < W; ++i) a[r][i] += pt * vv[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < W; ++i) std::memcpy(acc + r * v_dim + d0 + i * 16, &a[r][i], sizeof(v16));
}

template <int R, typename T>
inline void block_values16(const float* p, int64_t p_stride, const T* vrow, int64_t slot_stride, int64_t run,
                           int64_t v_dim, float* acc, LinePrefetch& pf) {
  int64_t d0 = 0;
  for (; d0 + 64 <= v_dim; d0 += 64) values_chunk<R, 4>(p, p_stride, vrow, slot_stride, run, d0, v_dim, acc, pf);
  switch ((v_dim - d0) / 16) {
    case 1: values_chunk<R, 1>(p, p_stride, vrow, slot_stride, run, d0, v_dim, acc, pf); break;
    case 2: values_chunk<R, 2>(p, p_stride, vrow, slot_stride, run, d0, v_dim, acc, pf); break;
    case 3: values_chunk<R, 3>(p, p_stride, vrow, slot_stride, run, d0, v_dim, acc, pf); break;
  }
}

// The value sums of `rows` query rows that share one KV head, four at a time.
template <typename T>
inline void head_values16(const float* p, int64_t p_stride, const T* vrow, int64_t slot_stride, int64_t run,
                          int64_t v_dim, int64_t rows, float* acc, LinePrefetch& pf) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    block_values16<4>(p + r * p_stride, p_stride, vrow, slot_stride, run, v_dim, acc + r * v_dim, pf);
  switch (rows - r) {
    case 1: block_values16<1>(p + r * p_stride, p_stride, vrow, slot_stride, run, v_dim, acc + r * v_dim, pf); break;
    case 2: block_values16<2>(p + r * p_stride, p_stride, vrow, slot_stride, run, v_dim, acc + r * v_dim, pf); break;
    case 3: block_values16<3>(p + r * p_stride, p_stride, vrow, slot_stride, run, v_dim, acc + r * v_dim, pf); break;
  }
}
#endif  // __AVX512F__

}  // namespace pdserve_kernels
