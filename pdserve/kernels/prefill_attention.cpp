// Causal attention for prefill rows on the CPU: a prompt's query rows over its keys, in tiles, with
// the online softmax of FlashAttention (Dao et al., NeurIPS 2022; Milakov & Gimelshein's online
// normalizer), so the [rows, keys] score matrix never exists whole.
//
// K and V of each KV head are first packed for the tiles (pack_head): K transposed tile by tile, so a
// key tile's K is one contiguous [head_dim, kKeyBlock] block in which kLanes keys are one vector, and
// V's rows back to back. One work item is a block of kRowBlock query rows of the query heads that share
// one KV head (grouped-query attention; at most kMaxItemHeads of them), so each K/V tile is read once
// for all of them. It walks the key tiles its rows may see, front to back:
//   1. scores S = (scale * Q) K^T, four rows by kScoreVecs vectors of keys in registers;
//   2. keys past a row's causal limit are masked, the row's running maximum and sum are updated and
//      its accumulator rescaled (the online softmax), P = exp(S - max) with our vectorized exp;
//   3. the accumulator takes P V: four rows by kValueVecs vectors of values in registers, one V row
//      read per key.
// In both products each K or V vector is loaded once into a register for the four rows (in_register) and
// the P V tile's width is a constant (value_tile_n): GCC had folded the loads into every FMA and kept P V's
// vectors on the stack. On a Zen 4 EPYC core (bench preset's 12 query / 4 KV heads of 64, one thread) that
// took a chunk of 256 rows over 2,048 keys from 29.6 to 19.5 ms, 1,024 fresh rows from 31.3 to 22.4, 2,048
// from 120 to 88 (51-54 -> 72-77 GFLOPS); built for AVX2 on the same core, 10-20% faster. Same bits.
// A row's result depends on its own query and the keys it sees alone (the key tiles always start
// at key 0, whatever row block, head group or thread computes it), so the output does not change with
// the number of rows, sequences or threads.
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
// Built by pdserve/kernels/__init__.py with the system C++ compiler and loaded with ctypes.

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

// The vector the kernel computes in: 16 floats (one zmm register) where the build has AVX-512, else 8
// (one ymm register of AVX2; -march=native on any other CPU compiles 8-lane vector extensions to what it
// has). The register tiles below are sized for each, so neither spills: AVX-512 has 32 vector registers,
// AVX2 16. The first build used the 16-lane tiles on AVX2 too (GCC splits each into two ymm registers,
// 32 accumulators for 16 registers): on a 2-core AVX2 EPYC it ran 6-9x slower than torch's SDPA
// (bench preset's 12 query / 4 KV heads of 64, one thread: 43 ms against 7.1 at 288 rows, 481 against 64
// at 1,024). With these AVX2 tiles, measured the same way: 3.9 / 4.9 ms at 288 rows, 13.1 / 14.4 at 512,
// 42 / 41 at 1,024, 198 / 161 at 2,048 (noisy machine; medians). Past ~1,000 keys SDPA's GEMM blocks
// win, so which path a prompt takes is measured per machine and per length when the engine loads
// (pdserve/engine/layers/kernel_choice.py).
#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kScoreVecs = 4;  // score tile: 4 rows x 64 keys = 16 accumulators (of 32 registers)
constexpr int kValueVecs = 4;  // P V tile: 4 rows x 64 values = 16 accumulators
constexpr int64_t kKeyBlock = 64;  // keys per tile (a multiple of kScoreVecs * kLanes)
#else
constexpr int kLanes = 8;
constexpr int kScoreVecs = 3;  // score tile: 4 rows x 24 keys = 12 accumulators, 3 K loads, 1 broadcast
constexpr int kValueVecs = 2;  // P V tile: 4 rows x 16 values = 8 accumulators (three vectors measured slower)
constexpr int64_t kKeyBlock = 48;  // keys per tile: two score tiles (64 keys with 4 x 16 measured 10-15% slower)
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vfi32 __attribute__((vector_size(4 * kLanes)));

constexpr int64_t kRowBlock = 16;  // query rows per work item (a multiple of 4)
constexpr int64_t kMaxItemHeads = 4;  // query heads of one KV group a work item takes together
constexpr int64_t kScoreKeys = kScoreVecs * kLanes;  // keys one score tile covers
constexpr int64_t kValueWidth = kValueVecs * kLanes;  // values one P V tile covers
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline vf loadv(const float* p) { vf v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf splat(float x) { return pdserve_kernels::splat<vf>(x); }

// x, kept in a register (where one holds a vf: AVX, AVX-512), so a vector that several FMAs multiply is loaded
// once. Left to itself GCC folds the load into each FMA as a memory operand, reloading it for every row of the
// tile: 16 FMAs took 20 loads, more than a Zen 4 core, which loads one 64-byte vector a cycle, can feed.
inline vf in_register(vf x) {
#ifdef __AVX__
  asm("" : "+v"(x));  // an empty asm that "changes" x: its value must be in a vector register here
#endif
  return x;
}

// A vector's largest lane and its lanes' sum: AVX-512's reduction sequences where the CPU has them (a
// row's softmax takes both once per tile; 7-8% of the kernel's time against a lane-by-lane loop at
// 128-1024 keys), else lane by lane. The sum's order is fixed either way: a row's result still depends on
// its own query and keys alone.
inline float reduce_max(vf x) {
#ifdef __AVX512F__
  __m512 v;
  std::memcpy(&v, &x, sizeof(v));
  return _mm512_reduce_max_ps(v);
#else
  float m = x[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, x[i]);
  return m;
#endif
}

inline float reduce_add(vf x) {
#ifdef __AVX512F__
  __m512 v;
  std::memcpy(&v, &x, sizeof(v));
  return _mm512_reduce_add_ps(v);
#else
  float total = 0.f;
  for (int i = 0; i < kLanes; ++i) total += x[i];
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

// K and V of KV head g, packed for the tiles that read them: K transposed tile by tile,
// kt[(t / kKeyBlock) * head_dim * kKeyBlock + d * kKeyBlock + t % kKeyBlock] = k[t, g, d], so one key
// tile is one contiguous 16 KiB (head_dim 64) read front to back; V's rows back to back,
// vp[t * v_dim + j] = v[t, g, j]. Keys past num_k are 0 (never seen). A transpose of the whole [d, keys]
// had each score tile read head_dim rows a whole prompt apart: past ~1,500 keys (K and V of a head over
// an AVX2 EPYC's 1 MiB L2) those were head_dim streams no prefetcher follows, and the kernel fell to
// 0.6x SDPA's speed at 2,048 keys.
void pack_head(const Args& a, int64_t g, int64_t keys_pad, float* kt, float* vp) {
  for (int64_t t = 0; t < keys_pad; ++t) {
    const float* row = a.k + t * a.k_row + g * a.k_head;
    float* tile = kt + (t / kKeyBlock) * a.head_dim * kKeyBlock + t % kKeyBlock;
    for (int64_t d = 0; d < a.head_dim; ++d) tile[d * kKeyBlock] = t < a.num_k ? row[d] : 0.f;
    float* vrow = vp + t * a.v_dim;
    if (t < a.num_k)
      std::memcpy(vrow, a.v + t * a.v_row + g * a.v_head, sizeof(float) * a.v_dim);
    else
      std::fill(vrow, vrow + a.v_dim, 0.f);
  }
}

// P V for four rows: acc[i * v_row + j] += sum over t < keys of p[i * kKeyBlock + t] * v[t * v_row + j] for i < 4,
// j < NV vectors, the accumulators in registers. NV is a constant so that the loops unroll: with the count known
// only at run time GCC kept the value vectors on the stack, reloading them for every FMA.
template <int NV>
inline void value_tile_n(const float* p, const float* v, int64_t v_row, int64_t keys, float* acc) {
  vf c[4][NV];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < NV; ++j) c[i][j] = loadv(acc + i * v_row + j * kLanes);
  for (int64_t t = 0; t < keys; ++t) {
    const float* vr = v + t * v_row;
    vf vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = in_register(loadv(vr + j * kLanes));
    for (int i = 0; i < 4; ++i) {
      const vf pt = splat(p[i * kKeyBlock + t]);
      for (int j = 0; j < NV; ++j) c[i][j] += pt * vv[j];
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < NV; ++j) storev(acc + i * v_row + j * kLanes, c[i][j]);
}

// value_tile_n for nv (1 .. kValueVecs) vectors of values, the last tile of a row narrower where v_dim is.
inline void value_tile(int64_t nv, const float* p, const float* v, int64_t v_row, int64_t keys, float* acc) {
  if (nv == kValueVecs) value_tile_n<kValueVecs>(p, v, v_row, keys, acc);
  else if (nv == 1) value_tile_n<1>(p, v, v_row, keys, acc);
  else if (nv == 2) value_tile_n<2>(p, v, v_row, keys, acc);
  else value_tile_n<3>(p, v, v_row, keys, acc);
}

// Rows [r0, r0 + rows) of query heads h0 .. h0 + nh - 1, which share one KV head (grouped-query
// attention): each key tile's K and V are read once for all of them. Head j's rows are "virtual rows"
// j * kRowBlock .. j * kRowBlock + rows of the tile buffers; a head's rows past `rows` are padding.
void attend_rows(const Args& a, int64_t h0, int64_t nh, int64_t r0, int64_t rows, const float* kt, const float* vp) {
  const int64_t D = a.head_dim, V = a.v_dim;
  const int64_t offset = a.num_k - a.num_q;  // keys before the first query row
  const int64_t vrows = nh * kRowBlock;
  const int64_t padded_rows = (rows + 3) / 4 * 4;  // per head: whole groups of four rows
  thread_local std::vector<float> buffers;
  buffers.assign(vrows * (D + kKeyBlock + V + 2), 0.f);
  float* qs = buffers.data();            // [vrows, D] scaled queries; padding rows stay 0
  float* s = qs + vrows * D;             // [vrows, kKeyBlock] this tile's scores, then its probabilities
  float* acc = s + vrows * kKeyBlock;    // [vrows, V] running P V
  float* m = acc + vrows * V;            // [vrows] running max
  float* l = m + vrows;                  // [vrows] running sum
  std::fill(m, m + vrows, kNegInf);
  for (int64_t j = 0; j < nh; ++j)
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = a.q + (r0 + r) * a.q_row + (h0 + j) * a.q_head;
      for (int64_t d = 0; d < D; ++d) qs[(j * kRowBlock + r) * D + d] = src[d] * a.scale;
    }
  const int64_t last_key = offset + r0 + rows - 1;  // the last key any row here sees
  for (int64_t kb = 0; kb <= last_key; kb += kKeyBlock) {
    // 1. scores, four rows by kScoreKeys keys at a time (64 with AVX-512, 16 with AVX2)
    const float* ktile = kt + kb * D;  // this key tile's K, [D][kKeyBlock]
    for (int64_t r = 0; r < vrows; r += 4) {
      if (r % kRowBlock >= padded_rows) continue;  // a head's padding rows
      for (int64_t k0 = 0; k0 < kKeyBlock; k0 += kScoreKeys) {
        vf c[4][kScoreVecs] = {};
        for (int64_t d = 0; d < D; ++d) {
          const float* kd = ktile + d * kKeyBlock + k0;
          vf kv[kScoreVecs];
          for (int j = 0; j < kScoreVecs; ++j) kv[j] = in_register(loadv(kd + j * kLanes));
          for (int i = 0; i < 4; ++i) {
            const vf qv = splat(qs[(r + i) * D + d]);
            for (int j = 0; j < kScoreVecs; ++j) c[i][j] += qv * kv[j];
          }
        }
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < kScoreVecs; ++j) storev(s + (r + i) * kKeyBlock + k0 + j * kLanes, c[i][j]);
      }
    }
    // 2. causal mask and online softmax, row by row
    int64_t tile_keys = 0;  // keys of this tile that some row sees
    for (int64_t i = 0; i < vrows; ++i) {
      const int64_t r = i % kRowBlock;
      float* sr = s + i * kKeyBlock;
      const int64_t visible = r < rows ? std::min<int64_t>(kKeyBlock, offset + r0 + r - kb + 1) : 0;  // may be <= 0
      if (visible <= 0) {
        std::fill(sr, sr + kKeyBlock, 0.f);
        continue;
      }
      tile_keys = std::max(tile_keys, visible);
      for (int64_t t = visible; t < kKeyBlock; ++t) sr[t] = kNegInf;
      vf mv = loadv(sr);
      for (int64_t j = kLanes; j < kKeyBlock; j += kLanes) {
        const vf x = loadv(sr + j);
        mv = x > mv ? x : mv;
      }
      const float mx = reduce_max(mv);
      const float m_new = std::max(m[i], mx);
      const float correction = m[i] == kNegInf ? 0.f : std::exp(m[i] - m_new);
      vf sum = {};
      const vf shift = splat(m_new);
      for (int64_t j = 0; j < kKeyBlock; j += kLanes) {
        const vf p = pdserve_kernels::vexp<vf, vfi32>(loadv(sr + j) - shift);
        storev(sr + j, p);
        sum += p;
      }
      const float total = reduce_add(sum);
      l[i] = l[i] * correction + total;
      m[i] = m_new;
      if (correction != 1.f) {
        float* ar = acc + i * V;
        for (int64_t j = 0; j < V; ++j) ar[j] *= correction;
      }
    }
    // 3. acc += P V, four rows by kValueWidth values at a time (64 with AVX-512, 16 with AVX2)
    const float* vtile = vp + kb * V;
    for (int64_t r = 0; r < vrows; r += 4) {
      if (r % kRowBlock >= padded_rows) continue;
      for (int64_t j0 = 0; j0 < V; j0 += kValueWidth)
        value_tile(std::min<int64_t>(kValueVecs, (V - j0) / kLanes), s + r * kKeyBlock, vtile + j0, V, tile_keys,
                   acc + r * V + j0);
    }
  }
  for (int64_t j = 0; j < nh; ++j)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = j * kRowBlock + r;
      float* dst = a.out + (r0 + r) * a.out_row + (h0 + j) * a.out_head;
      const float inv = 1.f / l[i];
      for (int64_t x = 0; x < V; ++x) dst[x] = acc[i * V + x] * inv;
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
  std::vector<float> kt(num_kv_heads * head_dim * keys_pad), vp(num_kv_heads * v_dim * keys_pad);
  const int64_t row_blocks = (num_q + kRowBlock - 1) / kRowBlock;
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head
  // A work item: one row block of up to kMaxItemHeads query heads of one KV group (all of them when the
  // group is that small), so each K/V tile is read once for all of them.
  const int64_t item_heads = std::min<int64_t>(group, kMaxItemHeads);
  const int64_t subgroups = (group + item_heads - 1) / item_heads;
  const int64_t per_block = num_kv_heads * subgroups;
  const int64_t items = row_blocks * per_block;
#pragma omp parallel num_threads(std::max(1, num_threads))
  {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < num_kv_heads; ++g)
      pack_head(a, g, keys_pad, kt.data() + g * head_dim * keys_pad, vp.data() + g * v_dim * keys_pad);
    // the last row blocks see the most keys: hand them out first
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = row_blocks - 1 - item / per_block, g = item % per_block / subgroups;
      const int64_t h0 = g * group + item % subgroups * item_heads;
      const int64_t r0 = b * kRowBlock;
      attend_rows(a, h0, std::min(item_heads, (g + 1) * group - h0), r0, std::min(kRowBlock, num_q - r0),
                  kt.data() + g * head_dim * keys_pad, vp.data() + g * v_dim * keys_pad);
    }
  }
  return 0;
}
