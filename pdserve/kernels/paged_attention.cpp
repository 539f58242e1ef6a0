// Paged attention on the CPU: every query reads its sequence's K/V straight from the paged
// cache through the block table. Nothing is gathered, nothing is zero-filled, and slots past a
// sequence's length are never read.
//
// The algorithm is PagedAttention (Kwon et al., SOSP'23). For each query token, a work item
// (a sequence, or a sequence's share of KV heads when there are fewer sequences than threads)
// walks the sequence's blocks front to back: first the scores of every key it may see
// (causal, optionally a sliding window) for all its query heads, then a softmax in float32
// (vectorized exp of our own), then the weighted sum of the value rows. A block's slots are
// adjacent in memory, so each block is one contiguous read, and the next block is prefetched
// while this one is used (walk_blocks). Query heads sharing a KV head reuse each K/V row from L1.
// Vectors are GCC vector extensions: 8 floats here, and with AVX-512 a float32 or bfloat16 cache
// takes the 16-lane path of paged_attention_wide.h.
//
// Built by pdserve/kernels/__init__.py with the system C++ compiler and loaded with
// ctypes; plain C ABI, no torch headers (it compiles in about a second).
//
// Layouts (all contiguous, row-major):
//   query:         [num_tokens, num_heads, head_dim] float32 (head_dim a multiple of 8)
//   out:           [num_tokens, num_heads, v_dim] float32 (v_dim a multiple of 8, <= head_dim)
//   kv_cache:      [kv_slots, num_blocks, block_size, num_kv_heads, row_len], element type kv_dtype
//                  (0 = float32, 1 = bfloat16: row_len = head_dim elements; 2 = int8, 3 = fp8 e4m3,
//                  4 = fp8 e5m2: row_len = head_dim + 4 bytes, head_dim quantized values followed by the
//                  row's float32 scale, see pdserve/common/kv_quant.py). kv_slots 2: index 0 is K, 1 is
//                  V (v_dim = head_dim). kv_slots 1, a latent cache (MLA): the one row is the key, and
//                  its first v_dim values are the value (a quantized row's one scale serves both).
//   block_tables:  [num_seqs, max_blocks_per_seq] int64
//   seq_lens:      [num_seqs] int64, context length after this step (cached + new tokens)
//   query_start_loc: [num_seqs + 1] int64, cumulative new-token counts
//   skip:          [num_seqs] uint8 or null; rows of a sequence with skip[s] != 0 are not written
// Query token j of sequence s sits at position seq_lens[s] - q_len_s + j and attends to keys
// at positions k <= that position (and > position - sliding_window when sliding_window > 0).
//
// Quantized rows are dequantized as they are read: load8 widens 8 quantized values to float32
// (int8: a convert; fp8: the sign, exponent and mantissa bits moved into a float32 and one
// multiply by a power of two that re-biases the exponent, exact, subnormals included), and the
// row's scale multiplies once per row, not per element: into the score after the dot product for
// K, into the softmax weight p[t] for V. The float32 and bfloat16 paths are unchanged by this.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "kv_rows.h"
#include "paged_attention_wide.h"
#include "vec8.h"

namespace {

using pdserve_kernels::hsum;
using pdserve_kernels::hsum8;
using pdserve_kernels::Packed;
using pdserve_kernels::QE4M3;
using pdserve_kernels::QE5M2;
using pdserve_kernels::QInt8;
using pdserve_kernels::row_scale;
using pdserve_kernels::kWideType;
using pdserve_kernels::load8;
using pdserve_kernels::store8;
using pdserve_kernels::v8;
using pdserve_kernels::wide_path;
#ifdef __AVX512F__
using pdserve_kernels::head_scores16;
using pdserve_kernels::head_values16;
#endif
typedef int32_t v8i32 __attribute__((vector_size(32)));

inline v8 exp8(v8 x) { return pdserve_kernels::vexp<v8, v8i32>(x); }

// scores[t] = scale * <q, k_t> for the `run` rows starting at krow (rows slot_stride apart).
// Four keys at a time: one load of each q vector feeds four independent FMA chains.
template <typename T>
inline void block_scores(const float* q, const T* krow, int64_t slot_stride, int64_t run, int64_t head_dim,
                         float scale, float* scores) {
  int64_t t = 0;
  for (; t + 8 <= run; t += 8) {  // eight keys at a time, their lane sums transposed into one vector
    v8 a[8] = {};
    for (int64_t d = 0; d < head_dim; d += 8) {
      const v8 qv = load8(q + d);
      for (int i = 0; i < 8; ++i) a[i] += qv * load8(krow + (t + i) * slot_stride + d);
    }
    v8 factor = v8{} + scale;
    if constexpr (Packed<T>::value)
      for (int i = 0; i < 8; ++i) factor[i] = scale * row_scale(krow + (t + i) * slot_stride, head_dim);
    store8(scores + t, hsum8(a) * factor);
  }
  for (; t + 4 <= run; t += 4) {
    const T* k0 = krow + t * slot_stride;
    const T* k1 = k0 + slot_stride;
    const T* k2 = k1 + slot_stride;
    const T* k3 = k2 + slot_stride;
    v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t d = 0; d < head_dim; d += 8) {
      v8 qv = load8(q + d);
      a0 += qv * load8(k0 + d);
      a1 += qv * load8(k1 + d);
      a2 += qv * load8(k2 + d);
      a3 += qv * load8(k3 + d);
    }
    if constexpr (Packed<T>::value) {
      scores[t] = hsum(a0) * (scale * row_scale(k0, head_dim));
      scores[t + 1] = hsum(a1) * (scale * row_scale(k1, head_dim));
      scores[t + 2] = hsum(a2) * (scale * row_scale(k2, head_dim));
      scores[t + 3] = hsum(a3) * (scale * row_scale(k3, head_dim));
    } else {
      scores[t] = hsum(a0) * scale;
      scores[t + 1] = hsum(a1) * scale;
      scores[t + 2] = hsum(a2) * scale;
      scores[t + 3] = hsum(a3) * scale;
    }
  }
  for (; t < run; ++t) {
    const T* k0 = krow + t * slot_stride;
    v8 a0 = {};
    for (int64_t d = 0; d < head_dim; d += 8) a0 += load8(q + d) * load8(k0 + d);
    if constexpr (Packed<T>::value) scores[t] = hsum(a0) * (scale * row_scale(k0, head_dim));
    else scores[t] = hsum(a0) * scale;
  }
}

// x <- softmax(x) in place, in float32, 8 at a time. A finite `sink` is one more logit in the
// denominator with no value row (an attention sink, as gpt-oss learns one per head); -inf: none.
inline void softmax(float* x, int64_t n, float sink) {
  // The maximum 8 lanes at a time (a scalar running max is one long dependency chain: it was a
  // fifth of the kernel's time at batch 32). A max is exact in any order.
  float mx = sink;
  int64_t i = 0;
  if (n >= 8) {
    v8 m8 = load8(x);
    for (i = 8; i + 8 <= n; i += 8) {
      const v8 xi = load8(x + i);
      m8 = xi > m8 ? xi : m8;
    }
    for (int l = 0; l < 8; ++l) mx = std::max(mx, m8[l]);
  }
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  v8 sum8 = {};
  float sum = std::isfinite(sink) ? std::exp(sink - mx) : 0.f;
  for (i = 0; i + 8 <= n; i += 8) {
    v8 e = exp8(load8(x + i) - mx);
    store8(x + i, e);
    sum8 += e;
  }
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = 1.f / (sum + hsum(sum8));
  for (i = 0; i + 8 <= n; i += 8) store8(x + i, load8(x + i) * inv);
  for (; i < n; ++i) x[i] *= inv;
}

// acc += sum_t p[t] * v_t[:v_dim] over `run` rows (v_dim a multiple of 8); a quantized row's scale
// (after its head_dim values) multiplies p[t].
template <typename T>
inline void block_values(const float* p, const T* vrow, int64_t slot_stride, int64_t run, int64_t v_dim,
                         int64_t head_dim, float* acc) {
  int64_t d0 = 0;
  // 64 columns at a time: eight independent FMA chains keep both FMA ports busy (four chains
  // left half of them idle waiting on the previous FMA). Each lane still sums over t in order.
  for (; d0 + 64 <= v_dim; d0 += 64) {
    v8 a[8];
    for (int i = 0; i < 8; ++i) a[i] = load8(acc + d0 + i * 8);
    for (int64_t t = 0; t < run; ++t) {
      const T* v = vrow + t * slot_stride + d0;
      const v8 pt = v8{} + (Packed<T>::value ? p[t] * row_scale(vrow + t * slot_stride, head_dim) : p[t]);
      for (int i = 0; i < 8; ++i) a[i] += pt * load8(v + i * 8);
    }
    for (int i = 0; i < 8; ++i) store8(acc + d0 + i * 8, a[i]);
  }
  for (; d0 < v_dim; d0 += 32) {  // what is left: 4 vectors of accumulators in registers
    const int64_t w = std::min<int64_t>(32, v_dim - d0);
    v8 a[4];
    for (int i = 0; i < 4; ++i) a[i] = (i * 8 < w) ? load8(acc + d0 + i * 8) : v8{};
    for (int64_t t = 0; t < run; ++t) {
      const T* v = vrow + t * slot_stride + d0;
      const v8 pt = v8{} + (Packed<T>::value ? p[t] * row_scale(vrow + t * slot_stride, head_dim) : p[t]);
      for (int i = 0; i < 4; ++i)
        if (i * 8 < w) a[i] += pt * load8(v + i * 8);
    }
    for (int i = 0; i < 4; ++i)
      if (i * 8 < w) store8(acc + d0 + i * 8, a[i]);
  }
}

// The next block of a walk (walk_blocks), prefetched into L1 (prefetcht0) while the current block is
// computed on: the 16-lane path takes it a KV head's share at a time, each share one line per line
// of K or V the head's work reads (``lines``, LinePrefetch), so fetches and FMAs interleave. (Bench
// preset, KV on 2 MiB pages as the engine allocates it, one Zen 5 core: all at once 14.6-14.9 ms at
// batch 32, each share in one burst 13.2-13.8, no prefetch 18.6-20.6; two or three blocks ahead gained
// nothing. Later, at contexts of 321, shares in bursts 19.1-20.0 ms against 16.6-16.9 spread over the
// loads, and 36.6-38.8 against 33.8-34.8 at batch 64: python benchmarks/bench_paged_attention.py
// --cases 32:321 64:321.) The 8-lane path prefetches the
// whole share first (into L1 rather than L2: 10% faster at batch 32 on that core; a non-temporal
// prefetch measured 15% slower than L2 on a Zen 4 core). Only the rows the work item reads are
// fetched: its KV heads' part of each token (a block holds every KV head's rows). Fetching the whole
// block for each of the four head groups of a lone sequence made the prefetches 40% of the kernel's
// cycles on a Zen 3 core (a decode step's attention at batch 1: 46 us a layer at 166 tokens).
struct NextBlock {
  const char* base;  // the item's part of the next block's first token (null at the end of the walk)
  int64_t rows;       // tokens in the block
  int64_t row_stride;  // bytes from one token's rows to the next's
  int64_t row_bytes;   // bytes of the item's rows in one token
  pdserve_kernels::LinePrefetch lines(int64_t i, int64_t parts) const {  // slice i's lines, one next() each
    pdserve_kernels::LinePrefetch pf;
    const int64_t t0 = rows * i / parts, t1 = rows * (i + 1) / parts;
    if (base != nullptr && t1 > t0)
      pf = {base + t0 * row_stride, base + t1 * row_stride, row_stride, row_bytes, 0};
    return pf;
  }
  void slice(int64_t i, int64_t parts) const {  // prefetch slice i of `parts` (tokens)
    if (base == nullptr) return;
    for (int64_t t = rows * i / parts, end = rows * (i + 1) / parts; t < end; ++t) {
      const char* row = base + t * row_stride;
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
    }
  }
};

// Calls fn(first slot's row in `cache`, position k, run, next) for each stretch of positions
// [k_begin, k_end) that lies in one block, in order; `next` is the following block, for fn to
// prefetch while it uses this one (the next block is elsewhere in memory), and for the last block
// `after` (or nothing): the keys' walk passes the values' first block, the values' walk the next
// item's first key block, so no walk starts cold (batch 32, one Zen 5 core: 13.5 -> 12.5-13.2 ms).
// `item_offset` (elements) and `item_row` (elements) are the item's rows within a token: what `next`
// prefetches; `after` already points at the following item's rows.
template <typename T, typename Fn>
inline void walk_blocks(const T* cache, const int64_t* table, int64_t block_size, int64_t slot_stride,
                        int64_t k_begin, int64_t k_end, int64_t item_offset, int64_t item_row, Fn fn,
                        const void* after = nullptr) {
  const int64_t stride = slot_stride * static_cast<int64_t>(sizeof(T));
  const int64_t row_bytes = item_row * static_cast<int64_t>(sizeof(T));
  for (int64_t k = k_begin; k < k_end;) {
    const int64_t off = k % block_size;
    const int64_t run = std::min(block_size - off, k_end - k);
    const NextBlock next{k + run < k_end ? reinterpret_cast<const char*>(
                             cache + table[(k + run) / block_size] * block_size * slot_stride + item_offset)
                                         : static_cast<const char*>(after),
                         block_size, stride, row_bytes};
    fn(cache + (table[k / block_size] * block_size + off) * slot_stride, k, run, next);
    k += run;
  }
}

template <typename T>
void attend(float* out, const float* query, const T* kv_cache, const int64_t* block_tables,
            int64_t max_blocks_per_seq, const int64_t* seq_lens, const int64_t* query_start_loc,
            const uint8_t* skip, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t v_dim, int64_t kv_slots, int64_t block_size, int64_t num_blocks, float scale,
            int64_t sliding_window, const float* sinks, int num_threads) {
  const int64_t rep = num_heads / num_kv_heads;
  const int64_t token_stride = num_heads * head_dim;
  const int64_t out_stride = num_heads * v_dim;
  const int64_t row_len = Packed<T>::value ? head_dim + 4 : head_dim;  // elements of one (slot, KV head) row
  const int64_t slot_stride = num_kv_heads * row_len;
  const T* k_cache = kv_cache;
  // A latent cache (kv_slots 1) reads its values from the key rows.
  const T* v_cache = kv_slots == 2 ? kv_cache + num_blocks * block_size * slot_stride : kv_cache;
  // Work items: (sequence, group of KV heads). A sequence's heads stay together (its blocks are
  // read front to back, all heads at once: one contiguous read a block) unless there are too few
  // sequences to share out among several threads. (One thread took a lone sequence head by head too:
  // four strided passes over its blocks, 297 us a layer at 166 tokens with the KV out of cache on a
  // Zen 3 core, the decode step's case at batch 1, where the weights stream through the cache.)
  const int64_t head_groups = num_threads == 1 || num_seqs >= 2 * num_threads ? 1 : num_kv_heads;
  const int64_t heads_per_item = num_kv_heads / head_groups;
  const int64_t num_items = num_seqs * head_groups;
  [[maybe_unused]] const bool wide = wide_path<T>(head_dim, v_dim);

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores;  // [heads_per_item * rep, n]
    std::vector<float> acc;     // [heads_per_item * rep, v_dim]
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t s = item / head_groups;
      const int64_t h0 = (item % head_groups) * heads_per_item;
      if (skip != nullptr && skip[s]) continue;
      const int64_t q_begin = query_start_loc[s];
      const int64_t q_len = query_start_loc[s + 1] - q_begin;
      const int64_t ctx = seq_lens[s];
      const int64_t* table = block_tables + s * max_blocks_per_seq;
      const int64_t rows = heads_per_item * rep;  // query heads of this item
      for (int64_t j = 0; j < q_len; ++j) {
        const int64_t pos = ctx - q_len + j;
        const int64_t k_begin = sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0;
        const int64_t k_end = pos + 1;
        const int64_t n = k_end - k_begin;
        const float* q = query + (q_begin + j) * token_stride + h0 * rep * head_dim;  // [rows, head_dim]
        float* o = out + (q_begin + j) * out_stride + h0 * rep * v_dim;  // [rows, v_dim]
        if (n <= 0) { std::fill(o, o + rows * v_dim, 0.f); continue; }
        scores.resize(rows * n);
        const int64_t item_offset = h0 * row_len, item_row = heads_per_item * row_len;
        const T* v_first = v_cache + table[k_begin / block_size] * block_size * slot_stride + item_offset;
        walk_blocks(k_cache, table, block_size, slot_stride, k_begin, k_end, item_offset, item_row, [&](const T* base, int64_t k, int64_t run, const NextBlock& next) {
#ifdef __AVX512F__
          if constexpr (kWideType<T>) if (wide) {
            for (int64_t hh = 0; hh < heads_per_item; ++hh) {
              pdserve_kernels::LinePrefetch pf = next.lines(hh, heads_per_item);
              head_scores16(q + hh * rep * head_dim, base + (h0 + hh) * row_len, slot_stride, run, head_dim, scale, rep,
                            scores.data() + hh * rep * n + (k - k_begin), n, pf);
              while (pf.row != nullptr) pf.next();  // a short block read fewer lines than the slice holds
            }
            return;
          }
#endif
          next.slice(0, 1);
          for (int64_t hh = 0; hh < heads_per_item; ++hh)
            for (int64_t r = 0; r < rep; ++r) {
              const int64_t row = hh * rep + r;
              block_scores(q + row * head_dim, base + (h0 + hh) * row_len, slot_stride, run, head_dim, scale,
                           scores.data() + row * n + (k - k_begin));
            }
        }, v_first);
        for (int64_t row = 0; row < rows; ++row)
          softmax(scores.data() + row * n, n, sinks != nullptr ? sinks[h0 * rep + row] : -INFINITY);
        acc.assign(rows * v_dim, 0.f);
        // After the last value block, this thread's next item's first key block (one thread: it is next).
        const T* k_after = nullptr;
        if (num_threads == 1 && j + 1 == q_len && item + 1 < num_items && sliding_window <= 0) {
          const int64_t s_next = (item + 1) / head_groups;
          if (skip == nullptr || !skip[s_next])
            k_after = k_cache + block_tables[s_next * max_blocks_per_seq] * block_size * slot_stride +
                      ((item + 1) % head_groups) * heads_per_item * row_len;
        }
        walk_blocks(v_cache, table, block_size, slot_stride, k_begin, k_end, item_offset, item_row, [&](const T* base, int64_t k, int64_t run, const NextBlock& next) {
#ifdef __AVX512F__
          if constexpr (kWideType<T>) if (wide) {
            for (int64_t hh = 0; hh < heads_per_item; ++hh) {
              pdserve_kernels::LinePrefetch pf = next.lines(hh, heads_per_item);
              head_values16(scores.data() + hh * rep * n + (k - k_begin), n, base + (h0 + hh) * row_len, slot_stride,
                            run, v_dim, rep, acc.data() + hh * rep * v_dim, pf);
              while (pf.row != nullptr) pf.next();
            }
            return;
          }
#endif
          next.slice(0, 1);
          for (int64_t hh = 0; hh < heads_per_item; ++hh)
            for (int64_t r = 0; r < rep; ++r) {
              const int64_t row = hh * rep + r;
              block_values(scores.data() + row * n + (k - k_begin), base + (h0 + hh) * row_len, slot_stride, run,
                           v_dim, head_dim, acc.data() + row * v_dim);
            }
        }, k_after);
        std::memcpy(o, acc.data(), sizeof(float) * rows * v_dim);
      }
    }
  }
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 for an unsupported kv_dtype, 2 for bad head counts, 3 for a head_dim
// or v_dim that is not a multiple of 8, 4 for kv_slots other than 1 or 2, 5 for v_dim != head_dim
// with two slots or v_dim > head_dim. sinks: [num_heads] float32 attention-sink logits, or null.
int pdserve_paged_attention(float* out, const float* query, const void* kv_cache, int kv_dtype,
                            const int64_t* block_tables, int64_t max_blocks_per_seq, const int64_t* seq_lens,
                            const int64_t* query_start_loc, const uint8_t* skip, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t v_dim,
                            int64_t kv_slots, int64_t block_size, int64_t num_blocks, float scale,
                            int64_t sliding_window, const float* sinks, int num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 2;
  if (head_dim % 8 != 0 || v_dim % 8 != 0 || v_dim <= 0) return 3;
  if (kv_slots != 1 && kv_slots != 2) return 4;
  if (v_dim > head_dim || (kv_slots == 2 && v_dim != head_dim)) return 5;
  if (num_threads < 1) num_threads = 1;
  // One instantiation of attend per element type; kv_dtype picks it.
  auto run = [&](const auto* cache) {
    attend(out, query, cache, block_tables, max_blocks_per_seq, seq_lens, query_start_loc, skip, num_seqs,
           num_heads, num_kv_heads, head_dim, v_dim, kv_slots, block_size, num_blocks, scale, sliding_window, sinks,
           num_threads);
    return 0;
  };
  switch (kv_dtype) {
    case 0: return run(static_cast<const float*>(kv_cache));
    case 1: return run(static_cast<const uint16_t*>(kv_cache));
    case 2: return run(static_cast<const QInt8*>(kv_cache));
    case 3: return run(static_cast<const QE4M3*>(kv_cache));
    case 4: return run(static_cast<const QE5M2*>(kv_cache));
  }
  return 1;
}

// A decode step's attention in one call, for a float32 cache of K and V: write the new token's K and V
// rows of every sequence into layer ``layer`` of the whole cache, then attend (as pdserve_paged_attention
// with kv_dtype 0, kv_slots 2, v_dim = head_dim, no skip, no sinks). The compiled decode step's
// attention op makes this one call, not two torch scatters and a call (~15 of its ~30 us at batch 1).
// key, value: [num_seqs, num_kv_heads, head_dim] contiguous; kv_cache: [num_layers, 2, num_blocks,
// block_size, num_kv_heads, head_dim]; slot_mapping: [num_seqs], each a slot of the layer (block *
// block_size + offset). Returns pdserve_paged_attention's codes, or 6 for a slot out of range (nothing
// is written then).
int pdserve_paged_decode_attention(float* out, const float* query, const float* key, const float* value,
                                   float* kv_cache, int64_t layer, const int64_t* slot_mapping,
                                   const int64_t* block_tables, int64_t max_blocks_per_seq, const int64_t* seq_lens,
                                   const int64_t* query_start_loc, int64_t num_seqs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                                   float scale, int64_t sliding_window, int num_threads) {
  const int64_t row = num_kv_heads * head_dim;  // one token's K (or V) over its KV heads
  const int64_t num_slots = num_blocks * block_size;
  for (int64_t i = 0; i < num_seqs; ++i)
    if (slot_mapping[i] < 0 || slot_mapping[i] >= num_slots) return 6;
  float* k_cache = kv_cache + layer * 2 * num_slots * row;
  float* v_cache = k_cache + num_slots * row;
  for (int64_t i = 0; i < num_seqs; ++i) {
    std::memcpy(k_cache + slot_mapping[i] * row, key + i * row, row * sizeof(float));
    std::memcpy(v_cache + slot_mapping[i] * row, value + i * row, row * sizeof(float));
  }
  return pdserve_paged_attention(out, query, k_cache, 0, block_tables, max_blocks_per_seq, seq_lens, query_start_loc,
                                 nullptr, num_seqs, num_heads, num_kv_heads, head_dim, head_dim, 2, block_size,
                                 num_blocks, scale, sliding_window, nullptr, num_threads);
}
}
