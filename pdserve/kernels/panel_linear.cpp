// Float32 linear layer on weights packed in column panels: y = x W^T, for any number of rows.
//
// A decode step at batch 8-32 multiplies 8-32 rows of x by every weight matrix. Each weight is read
// from memory once per step (the model is far larger than the caches) and used for as many
// multiply-adds as there are rows, so the step needs both the memory stream and the FMA units busy
// at once. On a Zen 5 class core oneDNN's packed GEMM at 20 rows ran the bench preset's 48 linears
// in 20-21 ms: about the sum of streaming their 302 MB (7.5 ms at 40 GB/s) and computing at its
// large-M rate (13 ms), as if the two took turns. This kernel overlaps them:
//
//   * The weight [N, K] is stored as panels of 16 output features, [ceil(N / 16)][K][16]
//     (``pdserve_f32_pack_panels``), so the whole matrix is one sequential stream and one 64-byte
//     line holds the 16 features' weights at one k.
//   * A block of up to MAX_ROWS rows keeps one 16-lane accumulator per row in registers;
//     each weight line is loaded once and multiplied by every row of the block, broadcasting x's
//     value at that k (an FMA with an embedded broadcast on AVX-512). x's rows are first copied to
//     [K][rows] per block, so those broadcasts read one sequential line, not rows a stride apart.
//   * Every weight line is prefetched PREFETCH_FLOATS ahead, far enough for DRAM's latency at the
//     rate the FMAs consume lines. Where x's block is small (at most an eighth of the core's L1D, read
//     once: a row or two) the lines go into L1, half of L1D ahead; otherwise into L2, PREFETCH_FLOATS
//     ahead, whence L1's own prefetcher takes them, so that they do not evict x's block, which every
//     FMA's broadcast reads. On a 2-core Zen 4 EPYC (32 KiB L1D) the first rule (all into L1, 32 KiB
//     ahead) ran the bench preset's 48 linears at 8 rows in 20.5-25.7 ms, into L2 in 13.3-15.7 (16 rows
//     26-35 -> 23-27 ms, 32 rows 51-60 -> 48-55, 2 rows 14.1-16.9 -> 13.7-15.5); at one row into L1 16
//     KiB ahead was the fastest (13.4-15.7 ms, 32 KiB ahead 13.4-16.7, L2 14.6-16.1) (runs of `python
//     benchmarks/bench_linear_formats.py --rows 1 2 4 8 16 32 --core 1`, each variant in turn).
//
// Measured on that core (bench preset's 48 linears, weights cold, one thread): 20 rows in 13.6-14.3 ms
// against oneDNN's 20.9-21.7 ms; 8 rows 10.7 against 13.5; 32 rows 25.0 against 30.2; at 512 rows
// (a prompt chunk) 5-25% behind it. (On the Zen 4 EPYC a prefill worker's 64-row prompts ran 11% faster
// than on oneDNN and 256-2,048 rows within 1.5%: a prefill worker times both at load.) Blocking K (x and
// the panel slice in L1, partial sums through out) made that worse: 150-161 GFLOPS at 288-512 rows against
// 180-208.
//
// From 192 rows on AVX-512, two panels at a time (block2, 12 rows a block): each broadcast of x feeds two FMAs.
// One block with x resident ran at 250-258 GFLOPS against block<28>'s 230-241 (the FMA peak measured on the
// same Zen 5 core is ~269), and the bench preset's 48 linears took 5-8% less time at 192-1,024 rows (512: 331-336
// against 358-365 ms; 128 rows level, so not below 192). Blocking M so that x's rows stay in L2 was slower
// (217-222 GFLOPS against 229).
//
// Each output sums its products in increasing k, one lane per output feature and one FMA per product,
// whatever the number of rows, the block a row falls in or the thread: a row's outputs never depend
// on the batch (batch-invariant by construction, as decode_linear.cpp).
//
// Built by pdserve/kernels/__init__.py with the system C++ compiler, loaded with ctypes; plain
// C ABI, no torch headers.
//
// Layouts (all contiguous, row-major):
//   pdserve_f32_pack_panels:  panels [ceil(N / 16), K, 16] from weight [N, K]; features past N are 0.
//   pdserve_f32_panel_linear: out [M, N], x [M, K], panels as packed. Any M, N, K >= 1.

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>
#include <unistd.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int LANES = 16;
#ifdef __AVX512F__
constexpr int MAX_ROWS = 28;  // accumulators + the weight vector + broadcasts: 32 zmm registers
constexpr int MAX_ROWS2 = 12;  // block2: 2 x 12 accumulators, 2 weight vectors, a broadcast
constexpr int64_t TWO_PANEL_MIN_ROWS = 192;  // block2 from here (measured: level at 128 rows, behind below)
constexpr int64_t PREFETCH_FLOATS = 8192;  // 32 KiB ahead: DRAM latency at ~10 cycles a line
#else
constexpr int MAX_ROWS = 6;  // AVX2: an accumulator is two of 16 ymm registers
constexpr int MAX_ROWS2 = 3;
constexpr int64_t TWO_PANEL_MIN_ROWS = INT64_MAX;  // block2 not measured faster with 16 registers: never
constexpr int64_t PREFETCH_FLOATS = 4096;
#endif

typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof(v)); return v; }

// acc + w * s, one rounding (a fused multiply-add) wherever the CPU has one.
inline v16 fma16(v16 acc, v16 w, float s) {
#if defined(__AVX512F__)
  __m512 a, b;
  std::memcpy(&a, &acc, sizeof(a)); std::memcpy(&b, &w, sizeof(b));
  a = _mm512_fmadd_ps(b, _mm512_set1_ps(s), a);
  std::memcpy(&acc, &a, sizeof(a));
  return acc;
#elif defined(__FMA__)
  __m256 lo, hi, wlo, whi;
  std::memcpy(&lo, &acc, 32); std::memcpy(&hi, reinterpret_cast<const char*>(&acc) + 32, 32);
  std::memcpy(&wlo, &w, 32); std::memcpy(&whi, reinterpret_cast<const char*>(&w) + 32, 32);
  const __m256 sv = _mm256_set1_ps(s);
  lo = _mm256_fmadd_ps(wlo, sv, lo); hi = _mm256_fmadd_ps(whi, sv, hi);
  std::memcpy(&acc, &lo, 32); std::memcpy(reinterpret_cast<char*>(&acc) + 32, &hi, 32);
  return acc;
#else
  for (int i = 0; i < LANES; ++i) acc[i] = __builtin_fmaf(w[i], s, acc[i]);
  return acc;
#endif
}

// out[m0 .. m0 + R, the 16 features of panels p .. p + P - 1] = x block (xt [K][R]) times those panels. At
// decode row counts one panel at a time (P = 1): the weights stay one sequential stream (two or four panels
// side by side, for more independent accumulators at few rows, measured slower at 1-12 rows: 8-14 ms
// against 7.5-9).
// into_l1: prefetch the weight lines into L1 (prefetcht0), else into L2 (prefetcht1).
// `ahead`: floats between a weight line and the one prefetched.
// P = 2 (panels p and p + 1 side by side) is for blocks of many rows: each broadcast of x then feeds two
// FMAs, so a k step loads 2 weight lines and R values of x for 2R FMAs where block<1, 28> loads 1 line and
// 28 values for 28 (x's block no longer fits L1D at prompt row counts, and its loads are what run short).
// Each output's sum is the same for any P: increasing k, one FMA per product.
template <int P, int R, bool into_l1>
void block(float* out, const float* xt, const float* panels, int64_t p, int64_t m0, int64_t N, int64_t K,
           int64_t ahead) {
  v16 acc[P][R];
#pragma GCC unroll 32
  for (int q = 0; q < P; ++q)
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) acc[q][r] = v16{};
  const float* w = panels + p * K * LANES;
  for (int64_t k = 0; k < K; ++k) {
    v16 wv[P];
#pragma GCC unroll 2
    for (int q = 0; q < P; ++q) {
      wv[q] = load16(w + q * K * LANES + k * LANES);
      __builtin_prefetch(w + q * K * LANES + k * LANES + ahead, 0, into_l1 ? 3 : 2);
    }
    const float* xk = xt + k * R;
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int q = 0; q < P; ++q) acc[q][r] = fma16(acc[q][r], wv[q], xk[r]);
  }
  for (int q = 0; q < P; ++q) {
    const int64_t n = (p + q) * LANES;
    const int64_t cols = N - n < LANES ? N - n : LANES;
    for (int r = 0; r < R; ++r) std::memcpy(out + (m0 + r) * N + n, &acc[q][r], cols * sizeof(float));
  }
}

using BlockFn = void (*)(float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t);

// block_table<P, into_l1>(rows 0 .. n - 1)[R] = block<P, R, into_l1> for R = 1 .. n (index 0 unused).
template <int P, bool into_l1, int... Rs>
constexpr std::array<BlockFn, sizeof...(Rs) + 1> block_table(std::integer_sequence<int, Rs...>) {
  return {nullptr, &block<P, Rs + 1, into_l1>...};
}

template <bool into_l1>
constexpr auto kBlocks = block_table<1, into_l1>(std::make_integer_sequence<int, MAX_ROWS>{});
constexpr auto kBlocks2 = block_table<2, false>(std::make_integer_sequence<int, MAX_ROWS2>{});

// This core's L1 data cache in bytes (48 KiB where the system does not say).
int64_t l1d_bytes() {
  static const int64_t bytes = [] {
    const long b = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return b > 0 ? static_cast<int64_t>(b) : int64_t{48} << 10;
  }();
  return bytes;
}

}  // namespace

extern "C" int pdserve_f32_pack_panels(float* panels, const float* weight, int64_t N, int64_t K) {
  if (N < 1 || K < 1) return 1;
  const int64_t num_panels = (N + LANES - 1) / LANES;
  for (int64_t p = 0; p < num_panels; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int j = 0; j < LANES; ++j) {
        const int64_t n = p * LANES + j;
        panels[(p * K + k) * LANES + j] = n < N ? weight[n * K + k] : 0.0f;
      }
  return 0;
}

extern "C" int pdserve_f32_panel_linear(float* out, const float* x, const float* panels, int64_t M, int64_t N,
                                        int64_t K, int num_threads) {
  if (M < 0 || N < 1 || K < 1 || num_threads < 1) return 1;
  if (M == 0) return 0;
  // Blocks of at most MAX_ROWS rows (MAX_ROWS2 for two panels at a time), as even as possible (20 rows: one
  // block; 40: two of 20).
  const int64_t num_panels = (N + LANES - 1) / LANES;
  const bool two_panels = M >= TWO_PANEL_MIN_ROWS && num_panels >= 2;
  const int64_t max_rows = two_panels ? MAX_ROWS2 : MAX_ROWS;
  const int64_t num_blocks = (M + max_rows - 1) / max_rows;
  const int64_t block_rows = (M + num_blocks - 1) / num_blocks;
  thread_local std::vector<float> scratch;  // x's blocks, each [K][rows]
  if (scratch.size() < static_cast<size_t>(M * K)) scratch.resize(M * K);
  float* xt = scratch.data();
  for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
    const int64_t rows = M - m0 < block_rows ? M - m0 : block_rows;
    for (int64_t i = 0; i < rows; ++i) {
      const float* src = x + (m0 + i) * K;
      float* dst = xt + m0 * K + i;
      for (int64_t k = 0; k < K; ++k) dst[k * rows] = src[k];
    }
  }
  // The weight lines are prefetched into L1 only where x's block (K * block_rows floats) is small (above).
  const int64_t l1d_floats = l1d_bytes() / static_cast<int64_t>(sizeof(float));
  const bool into_l1 = !two_panels && K * block_rows <= l1d_floats / 8;
  const int64_t ahead = into_l1 ? l1d_floats / 2 : PREFETCH_FLOATS;
  const auto& blocks = into_l1 ? kBlocks<true> : kBlocks<false>;
  // Threads split the panels (pairs of panels); each is read from memory by the first row block, from L2 by
  // the rest. An odd last panel of a two-panel split goes alone.
  const int64_t step = two_panels ? 2 : 1;
  const int64_t num_units = (num_panels + step - 1) / step;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t u = 0; u < num_units; ++u) {
    const int64_t p = u * step;
    const bool pair = two_panels && p + 1 < num_panels;
    for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
      const int rows = static_cast<int>(M - m0 < block_rows ? M - m0 : block_rows);
      const BlockFn fn = pair ? kBlocks2[rows] : blocks[rows];
      fn(out, xt + m0 * K, panels, p, m0, N, K, ahead);
    }
  }
  return 0;
}
