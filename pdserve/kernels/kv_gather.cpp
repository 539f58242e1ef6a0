// KV transfer's own work on the sending and receiving cores, in one pass over the bytes.
//
// pdserve_kv_checksum: the two word sums of pdserve.kvtransfer.checksum over a byte range.
// pdserve_kv_gather_checksum: a layer's blocks gathered out of the paged cache into a contiguous
//   staging buffer (the bytes that go on the wire) and those sums over the staged bytes, each block
//   summed right after it is written, while it is still in L1.
//
// The checksum (see checksum.py) reads the bytes as little-endian uint64 words in rows of 32 words
// (256 bytes, the last row zero-padded), with r_k the sum of row k's words and R rows in all:
//     words = sum_k r_k                 s2 = sum_k (R - k) * r_k          (all modulo 2^64)
// s2 is the sum of the prefix sums P_j = r_0 + ... + r_j, so one pass keeps two vector
// accumulators, A += row (lane-wise) and B += A, and adds up their lanes at the end: no row sum is
// ever reduced across lanes, and no weight is multiplied. Unsigned wrap-around is the modulo.
#include <cstdint>
#include <cstring>

namespace {

// One vector register of words: 8 on AVX-512, 4 on AVX2 (and the SSE floor, where GCC splits it in two).
// A 64-byte vector on AVX2 made GCC keep the accumulators in memory (12 GB/s on data in L2, not 60).
#if defined(__AVX512F__)
typedef uint64_t vword __attribute__((vector_size(64)));
#else
typedef uint64_t vword __attribute__((vector_size(32)));
#endif
constexpr int64_t kLanes = sizeof(vword) / 8;

constexpr int64_t kRowWords = 32;
constexpr int64_t kRowBytes = 8 * kRowWords;
constexpr int64_t kRowVectors = kRowWords / kLanes;  // 4 (AVX-512) or 8 (AVX2)

inline vword load(const unsigned char* p) { vword v; std::memcpy(&v, p, sizeof(v)); return v; }

// A row's words folded into one vector (lane-wise): a tree of adds, no carried dependency.
inline vword row_sum(const unsigned char* p) {
  vword v[kRowVectors];
  for (int64_t i = 0; i < kRowVectors; ++i) v[i] = load(p + i * sizeof(vword));
  for (int64_t w = kRowVectors / 2; w >= 1; w /= 2) {
    for (int64_t i = 0; i < w; ++i) v[i] += v[i + w];
  }
  return v[0];
}

struct Sums {
  vword a{}, b{};  // lane-wise running sum of rows, and running sum of those

  // Whole rows at p (n of them). Local copies of a and b, so they live in registers in the loop;
  // two rows a turn: a' = a + r0 + r1, b' = b + (a + r0) + a' (one carried add each per two rows).
  void rows(const unsigned char* p, int64_t n) {
    vword ra = a, rb = b;
    int64_t k = 0;
    for (; k + 2 <= n; k += 2, p += 2 * kRowBytes) {
      const vword a1 = ra + row_sum(p);
      ra = a1 + row_sum(p + kRowBytes);
      rb += a1 + ra;
    }
    if (k < n) {
      ra += row_sum(p);
      rb += ra;
    }
    a = ra;
    b = rb;
  }

  // A last row of fewer than 256 bytes, zero-padded.
  void tail(const unsigned char* p, int64_t num_bytes) {
    if (num_bytes <= 0) return;
    unsigned char row[kRowBytes] = {};
    std::memcpy(row, p, num_bytes);
    rows(row, 1);
  }

  void result(int64_t* out) const {
    uint64_t wa = 0, wb = 0;
    for (int64_t i = 0; i < kLanes; ++i) { wa += a[i]; wb += b[i]; }
    out[0] = static_cast<int64_t>(wa);
    out[1] = static_cast<int64_t>(wb);
  }
};

}  // namespace

extern "C" {

// out[0] = words, out[1] = s2 over data[0 .. num_bytes) (any alignment). Returns 0.
int pdserve_kv_checksum(const void* data, int64_t num_bytes, int64_t* out) {
  const auto* p = static_cast<const unsigned char*>(data);
  Sums sums;
  const int64_t full = num_bytes / kRowBytes;
  sums.rows(p, full);
  sums.tail(p + full * kRowBytes, num_bytes - full * kRowBytes);
  sums.result(out);
  return 0;
}

// Gather src[slot, block_ids[j], t, 0:token_bytes] for slot < num_slots, j < num_blocks,
// t < block_size into dst (contiguous, in that order: [num_slots, num_blocks, block_size,
// token_bytes]) and put the checksum sums of dst's bytes in out (as pdserve_kv_checksum(dst)).
// Strides are in bytes; a token's token_bytes are contiguous in src (a TP piece's heads are a
// contiguous run of each token's heads). Rows that straddle two blocks are summed once complete.
// Returns 0, or 1 (nothing copied, out not set) if a block id is outside [0, num_cache_blocks).
int pdserve_kv_gather_checksum(const void* src, int64_t num_slots, int64_t slot_stride, int64_t num_cache_blocks,
                               const int64_t* block_ids, int64_t num_blocks, int64_t block_stride,
                               int64_t block_size, int64_t token_stride, int64_t token_bytes, void* dst,
                               int64_t* out) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  const int64_t block_bytes = block_size * token_bytes;
  const bool dense = token_stride == token_bytes;  // a block is one contiguous run in src
  for (int64_t j = 0; j < num_blocks; ++j) {
    if (block_ids[j] < 0 || block_ids[j] >= num_cache_blocks) return 1;
  }
  Sums sums;
  int64_t written = 0, summed = 0;  // bytes of dst written, and summed (whole rows)
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    for (int64_t j = 0; j < num_blocks; ++j) {
      const unsigned char* from = s + slot * slot_stride + block_ids[j] * block_stride;
      unsigned char* to = d + written;
      if (dense) {
        std::memcpy(to, from, block_bytes);
      } else {
        for (int64_t t = 0; t < block_size; ++t) std::memcpy(to + t * token_bytes, from + t * token_stride, token_bytes);
      }
      written += block_bytes;
      const int64_t rows = (written - summed) / kRowBytes;
      sums.rows(d + summed, rows);
      summed += rows * kRowBytes;
    }
  }
  sums.tail(d + summed, written - summed);
  sums.result(out);
  return 0;
}

}  // extern "C"
