// Causal attention for prefill rows on the CPU: a prompt's query rows over its keys, in tiles, with
// the online softmax of FlashAttention (Dao et al., NeurIPS 2022; Milakov & Gimelshein's online
// normalizer), so the [rows, keys] score matrix never exists whole.
//
// One work item is (query head, block of kRowBlock query rows). It walks the key blocks the block's
// rows may see, front to back, kKeyBlock keys at a time:
//   1. scores S = (scale * Q) K^T for kRowBlock x kKeyBlock, four rows by 64 keys in registers; K is
//      read from a transposed copy [head_dim, keys] made once per KV head, so 16 keys are one vector;
//   2. keys past a row's causal limit are masked, the row's running maximum and sum are updated and
//      its accumulator rescaled (the online softmax), P = exp(S - max) with our vectorized exp;
//   3. the accumulator takes P V: four rows by 64 values in registers, one V row read per key.
// The query heads that share a KV head (grouped-query attention) read the same transposed K.
// A row's result depends on its own query and the keys it sees alone (the key blocks always start
// at key 0, whatever row block or thread computes it), so the output does not change with the
// number of rows, sequences or threads.
//
// Layouts (float32; strides in elements; a head's values are contiguous):
//   q:   row j, head h at q + j * q_row + h * q_head, head_dim values      (j < num_q, h < num_heads)
//   k:   key t, KV head g at k + t * k_row + g * k_head, head_dim values   (t < num_k, g < num_kv_heads)
//   v:   key t, KV head g at v + t * v_row + g * v_head, v_dim values
//   out: row j, head h at out + j * out_row + h * out_head, v_dim values
// Query row j sits at position num_k - num_q + j and attends to keys 0 .. num_k - num_q + j: a fresh
// prompt has num_q == num_k (plain causal); a chunk after cached rows has num_q < num_k. Query head h
// reads KV head h / (num_heads / num_kv_heads).
//
// Returns 0, or 1 when head_dim or v_dim is not a multiple of 16, num_heads is not a multiple of
// num_kv_heads, or num_q > num_k (the caller then uses another path).
//
// Built by pdserve/engine/kernels/__init__.py with the system C++ compiler and loaded with ctypes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "vec8.h"

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i32 __attribute__((vector_size(64)));

constexpr int64_t kRowBlock = 16;  // query rows per work item (a multiple of 4)
constexpr int64_t kKeyBlock = 64;  // keys per tile: four 16-lane vectors
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
inline v16 splat(float x) { return v16{} + x; }

// A vector's largest lane and its lanes' sum: AVX-512's reduction sequences where the CPU has them (a
// row's softmax takes both once per tile; 7-8% of the kernel's time against a lane-by-lane loop at
// 128-1024 keys), else lane by lane. The sum's order is fixed either way: a row's result still depends on
// its own query and keys alone.
inline float reduce_max(v16 x) {
#ifdef __AVX512F__
  __m512 v;
  std::memcpy(&v, &x, sizeof(v));
  return _mm512_reduce_max_ps(v);
#else
  float m = x[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, x[i]);
  return m;
#endif
}

inline float reduce_add(v16 x) {
#ifdef __AVX512F__
  __m512 v;
  std::memcpy(&v, &x, sizeof(v));
  return _mm512_reduce_add_ps(v);
#else
  float total = 0.f;
  for (int i = 0; i < 16; ++i) total += x[i];
  return total;
#endif
}

struct Args {
  float* out;
  const float* q;
  const float* k;
  const float* v;
  int64_t num_q, num_k, num_heads, num_kv_heads, head_dim, v_dim;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, out_row, out_head;
  float scale;
};

// K of KV head g, transposed: kt[d * ld + t] = k[t, g, d] for t < keys_pad; keys past num_k are 0 (never seen).
void transpose_keys(const Args& a, int64_t g, int64_t keys_pad, int64_t ld, float* kt) {
  for (int64_t t = 0; t < keys_pad; ++t) {
    const float* row = a.k + t * a.k_row + g * a.k_head;
    for (int64_t d = 0; d < a.head_dim; ++d) kt[d * ld + t] = t < a.num_k ? row[d] : 0.f;
  }
}

// Rows [r0, r0 + rows) of query head h.
void attend_rows(const Args& a, int64_t h, int64_t r0, int64_t rows, const float* kt, int64_t ld) {
  const int64_t D = a.head_dim, V = a.v_dim;
  const int64_t g = h / (a.num_heads / a.num_kv_heads);
  const int64_t offset = a.num_k - a.num_q;  // keys before the first query row
  alignas(64) float qs[kRowBlock * 512];      // scaled queries; rows past `rows` stay 0
  alignas(64) float s[kRowBlock * kKeyBlock];  // this tile's scores, then its probabilities
  std::vector<float> acc(kRowBlock * V, 0.f);
  float m[kRowBlock], l[kRowBlock];
  std::fill(m, m + kRowBlock, kNegInf);
  std::fill(l, l + kRowBlock, 0.f);
  std::memset(qs, 0, sizeof(float) * kRowBlock * D);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = a.q + (r0 + r) * a.q_row + h * a.q_head;
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = src[d] * a.scale;
  }
  const int64_t padded_rows = (rows + 3) / 4 * 4;
  const int64_t last_key = offset + r0 + rows - 1;  // the last key any row here sees
  for (int64_t kb = 0; kb <= last_key; kb += kKeyBlock) {
    // 1. scores, four rows by 64 keys at a time
    for (int64_t r = 0; r < padded_rows; r += 4) {
      v16 c[4][4] = {};
      const float* kcol = kt + kb;
      for (int64_t d = 0; d < D; ++d) {
        const float* kd = kcol + d * ld;
        const v16 k0 = load16(kd), k1 = load16(kd + 16), k2 = load16(kd + 32), k3 = load16(kd + 48);
        for (int i = 0; i < 4; ++i) {
          const v16 qv = splat(qs[(r + i) * D + d]);
          c[i][0] += qv * k0; c[i][1] += qv * k1; c[i][2] += qv * k2; c[i][3] += qv * k3;
        }
      }
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) store16(s + (r + i) * kKeyBlock + j * 16, c[i][j]);
    }
    // 2. causal mask and online softmax, row by row
    int64_t tile_keys = 0;  // keys of this tile that some row sees
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * kKeyBlock;
      const int64_t visible = std::min<int64_t>(kKeyBlock, offset + r0 + r - kb + 1);  // may be <= 0
      if (visible <= 0) {
        std::fill(sr, sr + kKeyBlock, 0.f);
        continue;
      }
      tile_keys = std::max(tile_keys, visible);
      for (int64_t t = visible; t < kKeyBlock; ++t) sr[t] = kNegInf;
      v16 mv = load16(sr);
      for (int64_t j = 16; j < kKeyBlock; j += 16) {
        const v16 x = load16(sr + j);
        mv = x > mv ? x : mv;
      }
      const float mx = reduce_max(mv);
      const float m_new = std::max(m[r], mx);
      const float correction = m[r] == kNegInf ? 0.f : std::exp(m[r] - m_new);
      v16 sum = {};
      const v16 shift = splat(m_new);
      for (int64_t j = 0; j < kKeyBlock; j += 16) {
        const v16 p = pdserve_kernels::vexp<v16, v16i32>(load16(sr + j) - shift);
        store16(sr + j, p);
        sum += p;
      }
      const float total = reduce_add(sum);
      l[r] = l[r] * correction + total;
      m[r] = m_new;
      if (correction != 1.f) {
        float* ar = acc.data() + r * V;
        for (int64_t j = 0; j < V; ++j) ar[j] *= correction;
      }
    }
    for (int64_t r = rows; r < padded_rows; ++r) std::fill(s + r * kKeyBlock, s + (r + 1) * kKeyBlock, 0.f);
    // 3. acc += P V, four rows by 64 values at a time
    const float* vbase = a.v + kb * a.v_row + g * a.v_head;
    for (int64_t r = 0; r < padded_rows; r += 4) {
      for (int64_t j0 = 0; j0 < V; j0 += 64) {
        const int64_t nv = std::min<int64_t>(4, (V - j0) / 16);
        v16 c[4][4] = {};
        for (int i = 0; i < 4; ++i)
          for (int64_t j = 0; j < nv; ++j) c[i][j] = load16(acc.data() + (r + i) * V + j0 + j * 16);
        for (int64_t t = 0; t < tile_keys; ++t) {
          const float* vr = vbase + t * a.v_row + j0;
          v16 vv[4];
          for (int64_t j = 0; j < nv; ++j) vv[j] = load16(vr + j * 16);
          for (int i = 0; i < 4; ++i) {
            const v16 p = splat(s[(r + i) * kKeyBlock + t]);
            for (int64_t j = 0; j < nv; ++j) c[i][j] += p * vv[j];
          }
        }
        for (int i = 0; i < 4; ++i)
          for (int64_t j = 0; j < nv; ++j) store16(acc.data() + (r + i) * V + j0 + j * 16, c[i][j]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = a.out + (r0 + r) * a.out_row + h * a.out_head;
    const float inv = 1.f / l[r];
    for (int64_t j = 0; j < V; ++j) dst[j] = acc[r * V + j] * inv;
  }
}

}  // namespace

extern "C" int pdserve_prefill_attention(float* out, const float* q, const float* k, const float* v,
                                         int64_t num_q, int64_t num_k, int64_t num_heads, int64_t num_kv_heads,
                                         int64_t head_dim, int64_t v_dim, int64_t q_row, int64_t q_head,
                                         int64_t k_row, int64_t k_head, int64_t v_row, int64_t v_head,
                                         int64_t out_row, int64_t out_head, float scale, int num_threads) {
  if (head_dim % 16 != 0 || v_dim % 16 != 0 || head_dim > 512 || num_kv_heads <= 0 ||
      num_heads % num_kv_heads != 0 || num_q > num_k || num_q <= 0)
    return 1;
  const Args a{out, q, k, v, num_q, num_k, num_heads, num_kv_heads, head_dim, v_dim,
               q_row, q_head, k_row, k_head, v_row, v_head, out_row, out_head, scale};
  const int64_t keys_pad = (num_k + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  // The transposed K's rows are one cache line longer than its keys: a row length that is a multiple of
  // 1 KiB (256, 512, 1024 keys) put a tile's 64 rows of K, and the transpose's writes, in the same few L1
  // sets. Measured on one Zen 5 core, bench preset's heads, fresh prompts, the two builds alternating in one
  // process (medians of 25): 256 keys 1.39 -> 1.20 ms a layer, 512 keys 5.09 -> 4.41, 1024 keys 18.7 ->
  // 16.5; 128, 288 and 384 unchanged; the same bits out.
  const int64_t ld = keys_pad + 16;
  std::vector<float> kt(num_kv_heads * head_dim * ld);
  const int64_t row_blocks = (num_q + kRowBlock - 1) / kRowBlock;
  const int64_t items = num_heads * row_blocks;
#pragma omp parallel num_threads(std::max(1, num_threads))
  {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < num_kv_heads; ++g) transpose_keys(a, g, keys_pad, ld, kt.data() + g * head_dim * ld);
    // the last row blocks see the most keys: hand them out first
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = row_blocks - 1 - item / num_heads, h = item % num_heads;
      const int64_t r0 = b * kRowBlock;
      attend_rows(a, h, r0, std::min(kRowBlock, num_q - r0), kt.data() + (h / (num_heads / num_kv_heads)) *
                  head_dim * ld, ld);
    }
  }
  return 0;
}
