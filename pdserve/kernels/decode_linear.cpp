// Float32 linear layer for a few rows on the CPU: y = x W^T, streaming W from memory once.
//
// A decode step multiplies a handful of token rows by every weight matrix of the model: the
// weights are far larger than the caches, so the step is bound by how fast W is read (the
// "memory roofline" of decoding, MBU in the field's terms). MKL's sgemm is built for large M: at
// 1-16 rows it reads W at half the machine's bandwidth or less (bench preset, one core: 13.9 GB/s
// at M = 1, 7 GB/s at M = 8, against 27 GB/s a plain sum reads). This kernel is the "skinny GEMM"
// every CPU decoding engine grows (llama.cpp's vec-dot, vLLM CPU's oneDNN small-M path): each
// weight row is loaded once into registers and multiplied by every x row while it is there.
//
// Built by pdserve/kernels/__init__.py with the system C++ compiler and loaded with
// ctypes; plain C ABI, no torch headers.
//
// Layouts (all contiguous, row-major):
//   pdserve_f32_linear:  out [M, N], x [M, K], weight [N, K], all float32; K a multiple of 16.
//   pdserve_bf16_linear: the same in bfloat16 (stored as uint16), accumulated in float32 and rounded
//                        to bfloat16 (nearest even) once at the end; K a multiple of 32. With AVX-512
//                        BF16 each instruction multiplies 32 pairs (vdpbf16ps); elsewhere the values
//                        are widened to float32 (a bfloat16 is the high half of a float32).
//
// Each (m, n) has its own accumulator (16 lanes with AVX-512, 8 with AVX2) that takes k in increasing order, and the lanes are
// added in one fixed tree at the end: an output's summation order never depends on M, the tile it
// falls in or the thread computing it (batch-invariant by construction, like int8_linear.cpp).
//
// Tiling: a tile is R rows of x times C rows of W: R * C accumulators, and one side's vectors in
// registers while the other streams through one (AVX-512: W's C; AVX2: the smaller of x's R and W's C). With AVX-512 (32 zmm registers, 16-lane vectors) x's rows go through in tiles
// of 8 (3 weight rows each), then 4 (6 weight rows) and up to 3 (8 weight rows); with AVX2 (16 ymm
// registers, 8-lane vectors) in tiles of 4 (3 weight rows), then 3 (4), 2 (6) and 1 (8), so no tile
// spills (a 16-lane tile on AVX2 needs twice the registers the CPU has: the first build of this kernel
// on an AVX2 EPYC spent its time moving accumulators through the stack). Threads split the output
// features (N) in blocks of NB rows; with more rows of x than one tile holds, each tile of C weight rows
// stays in L1 while every tile of x's rows goes through it, so W is read from memory once and the read
// never pauses (taking each x tile through the whole block in turn re-read the block from L2 with
// nothing streaming meanwhile: on a Zen 3 core 8 rows took 47 ms over the bench preset's 48 linears
// against 39 now, 16 rows 70 against 64). The next tile's weight rows are prefetched into
// L2 (prefetcht1), not non-temporally: on a Zen 4 core that read W at 24 GB/s instead of 19 at one row
// and 23 instead of 15 at four (bench preset's 85 matrices, cold).

#include <cstdint>
#include <cstring>

#include "vec8.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kMaxTileRows = 8;
#else
constexpr int kLanes = 8;
constexpr int kMaxTileRows = 4;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));

inline vf loadv(const float* p) { vf v; std::memcpy(&v, p, sizeof(v)); return v; }

// The lanes of v added in one fixed order (pairs of halves, then a fixed tree over the last eight or four).
inline float hsum(vf v) {
  float s[8];
  for (int i = 0; i < 8; ++i) s[i] = kLanes == 16 ? v[i] + v[(i + 8) % kLanes] : v[i];
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

// Weight rows per tile for R rows of x: the accumulators (R * C), the held side's vectors and the
// streaming register fit the registers: 32 with AVX-512, 16 with AVX2.
template <int R>
constexpr int tile_cols() {
  return kLanes == 16 ? (R <= 2 ? 8 : (R <= 4 ? 6 : 3)) : (R == 1 ? 8 : (R == 2 ? 6 : (R == 3 ? 4 : 3)));
}

// out[m0 .. m0 + R, n0 .. n0 + C] = x[m0 .. m0 + R] . w[n0 .. n0 + C] (R, C compile-time so the
// accumulators stay in registers).
template <int R, int C>
inline void tile(float* out, const float* x, const float* w, int64_t m0, int64_t n0, int64_t N, int64_t K) {
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vf{};
  for (int64_t k = 0; k < K; k += kLanes) {
    for (int c = 0; c < C; ++c)
      if (k % 16 == 0) __builtin_prefetch(w + (n0 + c + C) * K + k, 0, 1);  // the next tile's rows, into L2
    if constexpr (kLanes == 8 && R < C) {  // AVX2: hold x's R vectors, stream the weight rows through one
      vf xv[R];
      for (int r = 0; r < R; ++r) xv[r] = loadv(x + (m0 + r) * K + k);
      for (int c = 0; c < C; ++c) {
        const vf wv = loadv(w + (n0 + c) * K + k);
        for (int r = 0; r < R; ++r) acc[r][c] = pdserve_kernels::fmadd(xv[r], wv, acc[r][c]);
      }
    } else {  // hold the C weight vectors, stream x's rows (AVX-512's every tile fits this way)
      vf wv[C];
      for (int c = 0; c < C; ++c) wv[c] = loadv(w + (n0 + c) * K + k);
      for (int r = 0; r < R; ++r) {
        const vf xv = loadv(x + (m0 + r) * K + k);
        for (int c = 0; c < C; ++c) acc[r][c] = pdserve_kernels::fmadd(xv, wv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[(m0 + r) * N + n0 + c] = hsum(acc[r][c]);
}

// ---- bfloat16 ------------------------------------------------------------------------------

inline uint16_t to_bf16(float f) {  // round to nearest even (NaN kept quiet)
  uint32_t u; std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// out[m0 .. m0 + R, n0 .. n0 + C]: 32 bfloat16 pairs per instruction into 16 float32 lanes.
template <int R, int C>
inline void tile(uint16_t* out, const uint16_t* x, const uint16_t* w, int64_t m0, int64_t n0, int64_t N,
                      int64_t K) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = (__m512bh)_mm512_loadu_si512(w + (n0 + c) * K + k);
      __builtin_prefetch(w + (n0 + c + C) * K + k, 0, 1);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + r) * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      vf v; std::memcpy(&v, &acc[r][c], sizeof(v));
      out[(m0 + r) * N + n0 + c] = to_bf16(hsum(v));
    }
}
#else
inline vf widen_bf16(const uint16_t* p) {  // kLanes bfloat16 -> kLanes float32 (a bfloat16 is a float's high half)
  typedef uint16_t u16v __attribute__((vector_size(2 * kLanes)));
  typedef uint32_t u32v __attribute__((vector_size(4 * kLanes)));
  u16v h; std::memcpy(&h, p, sizeof(h));
  const u32v b = __builtin_convertvector(h, u32v) << 16;
  vf v; std::memcpy(&v, &b, sizeof(v)); return v;
}

template <int R, int C>
inline void tile(uint16_t* out, const uint16_t* x, const uint16_t* w, int64_t m0, int64_t n0, int64_t N,
                      int64_t K) {
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vf{};
  for (int64_t k = 0; k < K; k += kLanes) {
    vf xv[R];
    for (int r = 0; r < R; ++r) xv[r] = widen_bf16(x + (m0 + r) * K + k);
    for (int c = 0; c < C; ++c) {
      const vf wv = widen_bf16(w + (n0 + c) * K + k);
      for (int r = 0; r < R; ++r) acc[r][c] = pdserve_kernels::fmadd(xv[r], wv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[(m0 + r) * N + n0 + c] = to_bf16(hsum(acc[r][c]));
}
#endif

// Rows m0 .. m0 + R of x against output features n0 .. n1 (T: float, or uint16_t holding bfloat16): C
// weight rows per tile (fewer rows of x leave registers for more weight rows), then one at a time.
template <int R, typename T>
void row_tile(T* out, const T* x, const T* w, int64_t m0, int64_t n0, int64_t n1, int64_t N, int64_t K) {
  constexpr int C = tile_cols<R>();
  int64_t n = n0;
  for (; n + C <= n1; n += C) tile<R, C>(out, x, w, m0, n, N, K);
  for (; n < n1; ++n) tile<R, 1>(out, x, w, m0, n, N, K);
}

constexpr int64_t NB = 48;  // output features per thread work item (a multiple of 6 and 8)

// Rows 0 .. M of x against the C weight rows from n (M > kMaxTileRows): every tile of x's rows meets the
// C rows while they are in L1, so W streams from memory once and without pause. (Taking each tile of x's
// rows through the whole block in turn read the block again from L2 for the second tile, with nothing
// streaming from memory meanwhile.)
template <int C, typename T>
void weight_tile(T* out, const T* x, const T* w, int64_t M, int64_t n, int64_t N, int64_t K) {
  int64_t m = 0;
  for (; m + kMaxTileRows <= M; m += kMaxTileRows) tile<kMaxTileRows, C>(out, x, w, m, n, N, K);
  for (; kMaxTileRows == 8 && m + 4 <= M; m += 4) tile<4, C>(out, x, w, m, n, N, K);
  switch (M - m) {
    case 1: tile<1, C>(out, x, w, m, n, N, K); break;
    case 2: tile<2, C>(out, x, w, m, n, N, K); break;
    case 3: tile<3, C>(out, x, w, m, n, N, K); break;
    default: break;
  }
}

// y = x W^T for every row of x: threads take blocks of NB output features. Up to kMaxTileRows rows (8
// with AVX-512, 4 with AVX2) x is one tile, as wide in weight rows as the registers allow; past that the
// block goes by tiles of C weight rows (the widest tile's C), each met by every tile of x's rows.
template <typename T>
int linear(T* out, const T* x, const T* weight, int64_t M, int64_t N, int64_t K, int64_t k_multiple,
           int num_threads) {
  if (K % k_multiple != 0 || M < 0 || N < 0) return 1;
  const int64_t num_blocks = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n0 = b * NB, n1 = n0 + NB < N ? n0 + NB : N;
    if (M > kMaxTileRows) {
      constexpr int C = tile_cols<kMaxTileRows>();
      int64_t n = n0;
      for (; n + C <= n1; n += C) weight_tile<C>(out, x, weight, M, n, N, K);
      for (; n < n1; ++n) weight_tile<1>(out, x, weight, M, n, N, K);
      continue;
    }
    int64_t m = 0;  // one tile of x's rows (AVX-512: 8, or 4 and the 1-3 left; AVX2: up to 4); none when M is 0
    for (; kMaxTileRows == 8 && m + 8 <= M; m += 8) row_tile<kMaxTileRows>(out, x, weight, m, n0, n1, N, K);
    for (; m + 4 <= M; m += 4) row_tile<4>(out, x, weight, m, n0, n1, N, K);
    switch (M - m) {
      case 1: row_tile<1>(out, x, weight, m, n0, n1, N, K); break;
      case 2: row_tile<2>(out, x, weight, m, n0, n1, N, K); break;
      case 3: row_tile<3>(out, x, weight, m, n0, n1, N, K); break;
      default: break;
    }
  }
  return 0;
}

}  // namespace

extern "C" int pdserve_f32_linear(float* out, const float* x, const float* weight, int64_t M, int64_t N,
                                  int64_t K, int num_threads) {
  return linear(out, x, weight, M, N, K, 16, num_threads);
}

extern "C" int pdserve_bf16_linear(uint16_t* out, const uint16_t* x, const uint16_t* weight, int64_t M, int64_t N,
                                   int64_t K, int num_threads) {
  return linear(out, x, weight, M, N, K, 32, num_threads);
}
