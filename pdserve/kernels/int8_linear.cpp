// Weight-only int8 linear layer on the CPU: y = x W^T with W held as int8 values and float32
// scales, widened to float32 in registers as it is read. Nothing is dequantized into memory, so
// a decode step reads one byte per weight instead of four (weight-only "W8A16" quantization, as
// in LLM.int8() without its outlier path, Dettmers et al. 2022, and vLLM's / Marlin's W8A16 GEMMs
// on GPUs).
//
// Built by pdserve/kernels/__init__.py with the system C++ compiler and loaded with
// ctypes; plain C ABI, no torch headers.
//
// Layouts (all contiguous, row-major):
//   out:    [M, N] float32
//   x:      [M, K] float32 (the activations: M tokens)
//   weight: [N, K] int8
//   scale:  [N, K / group_size] float32 (one scale per output row when group_size == K)
// K and group_size must be multiples of 8, and group_size must divide K.
//
// out[m, n] = sum over groups g of scale[n, g] * (sum over k in g of x[m, k] * weight[n, k]).
// Each (m, n) has its own 8-lane accumulator that takes k in increasing order (lane j sums the
// k = j mod 8), and the lanes are added in one fixed tree at the end: the summation order of an
// output never depends on M, on the tile it falls in, or on the thread computing it. The kernel is
// therefore batch-invariant by construction (a token's projection has the same bits whatever else
// is in the batch), which MKL's sgemm is not without padding (pdserve/engine/layers/base.py).
//
// Tiling: a tile is MR rows of x times NR rows of W. Per 8 values of k it widens NR weight vectors
// once and loads each of the MR x vectors once, for MR * NR multiply-adds; NR rows of W (NR * K
// bytes) stay in L1 while every row tile of x passes over them, so W is read from memory once per
// call. Threads split the output features (N) in blocks of NR.

#include <algorithm>
#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec8.h"

namespace {

using pdserve_kernels::load8;
using pdserve_kernels::v8;
using pdserve_kernels::widen_i8_to_float;

constexpr int MR = 4;  // rows of x per tile
constexpr int NR = 3;  // rows of W (output features) per tile: MR * NR accumulators + NR weights + 1 x fit in 16 AVX2 registers

// The lanes of v added in one fixed order.
inline float hsum(v8 v) {
  const float a = (v[0] + v[4]) + (v[2] + v[6]);
  const float b = (v[1] + v[5]) + (v[3] + v[7]);
  return a + b;
}

// acc[r][c] += x[m0 + r, k0:k1] * w[n0 + c, k0:k1], lane-wise (8 k at a time, k increasing).
template <int R, int C>
inline void dot_block(v8 (&acc)[R][C], const float* x, const int8_t* w, int64_t m0, int64_t n0, int64_t K,
                      int64_t k0, int64_t k1) {
  for (int64_t k = k0; k < k1; k += 8) {
    v8 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = widen_i8_to_float(w + (n0 + c) * K + k);
    for (int r = 0; r < R; ++r) {
      const v8 xv = load8(x + (m0 + r) * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] += xv * wv[c];
    }
  }
}

// One tile: rows m0 .. m0 + R of x against output features n0 .. n0 + C of W (R <= MR, C <= NR,
// compile-time so the accumulators live in registers). One scale per row: it multiplies the
// finished dot product. Grouped scales: each group's partial sums are scaled into a running total.
template <int R, int C>
void tile(float* out, const float* x, const int8_t* w, const float* scale, int64_t m0, int64_t n0,
          int64_t N, int64_t K, int64_t group_size) {
  const int64_t num_groups = K / group_size;
  v8 total[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) total[r][c] = v8{};
  if (num_groups == 1) {
    dot_block<R, C>(total, x, w, m0, n0, K, 0, K);
  } else {
    for (int64_t g = 0; g < num_groups; ++g) {
      v8 acc[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = v8{};
      dot_block<R, C>(acc, x, w, m0, n0, K, g * group_size, (g + 1) * group_size);
      for (int c = 0; c < C; ++c) {
        const float s = scale[(n0 + c) * num_groups + g];
        for (int r = 0; r < R; ++r) total[r][c] += acc[r][c] * s;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const float dot = hsum(total[r][c]);
      out[(m0 + r) * N + n0 + c] = num_groups == 1 ? dot * scale[n0 + c] : dot;
    }
}

// All row tiles of x against output features n0 .. n0 + C.
template <int C>
void column_block(float* out, const float* x, const int8_t* w, const float* scale, int64_t M, int64_t n0,
                  int64_t N, int64_t K, int64_t group_size) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<MR, C>(out, x, w, scale, m, n0, N, K, group_size);
  switch (M - m) {
    case 3: tile<3, C>(out, x, w, scale, m, n0, N, K, group_size); break;
    case 2: tile<2, C>(out, x, w, scale, m, n0, N, K, group_size); break;
    case 1: tile<1, C>(out, x, w, scale, m, n0, N, K, group_size); break;
    default: break;
  }
}

static_assert(MR == 4 && NR == 3, "the remainder switches above and below are written for these tile sizes");

// One or two rows of x (a decode step of one or two sequences): a tile of R rows has only R * C
// accumulators, too few independent multiply-add chains to hide their latency at C = NR, so these
// take wider column blocks (8 and 6 output features: 8 and 12 accumulators).
template <int R>
constexpr int narrow_cols() { return R == 1 ? 8 : 6; }

template <int R>
void narrow(float* out, const float* x, const int8_t* w, const float* scale, int64_t N, int64_t K,
            int64_t group_size, int num_threads) {
  constexpr int C = narrow_cols<R>();
  const int64_t num_blocks = (N + C - 1) / C;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n0 = b * C;
    if (n0 + C <= N) {
      tile<R, C>(out, x, w, scale, 0, n0, N, K, group_size);
    } else {
      for (int64_t n = n0; n < N; ++n) tile<R, 1>(out, x, w, scale, 0, n, N, K, group_size);
    }
  }
}

}  // namespace

extern "C" {

// out = x W^T (see the layouts above). Returns 0, or -1 when K or group_size is not a multiple
// of 8 or group_size does not divide K (the caller then computes it another way).
int pdserve_int8_linear(float* out, const float* x, const int8_t* weight, const float* scale, int64_t M,
                        int64_t N, int64_t K, int64_t group_size, int num_threads) {
  if (K <= 0 || group_size <= 0 || K % 8 || group_size % 8 || K % group_size) return -1;
  if (num_threads < 1) num_threads = 1;
  if (M == 1) { narrow<1>(out, x, weight, scale, N, K, group_size, num_threads); return 0; }
  if (M == 2) { narrow<2>(out, x, weight, scale, N, K, group_size, num_threads); return 0; }
  const int64_t num_blocks = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n0 = b * NR;
    switch (std::min<int64_t>(NR, N - n0)) {
      case 3: column_block<3>(out, x, weight, scale, M, n0, N, K, group_size); break;
      case 2: column_block<2>(out, x, weight, scale, M, n0, N, K, group_size); break;
      default: column_block<1>(out, x, weight, scale, M, n0, N, K, group_size); break;
    }
  }
  return 0;
}

}  // extern "C"
