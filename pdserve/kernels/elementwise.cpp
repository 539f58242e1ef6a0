// The elementwise layers of a decoder block, one pass over memory each, for eager (prefill) forwards
// on the CPU: RMSNorm (Zhang & Sennrich, 2019), SwiGLU's silu(gate) * up (Shazeer, 2020) and rotary
// embedding's rotate-half form (Su et al., RoFormer; GPT-NeoX's layout). In torch each is four to ten
// operators, each reading and writing a whole tensor; here a row is read once and written once.
// A compiled forward (torch.compile) fuses these itself and does not call this library.
//
// Every function takes float32 rows with a row stride in elements (values inside a row contiguous)
// and splits the rows over `num_threads` OpenMP threads. Each row is computed alone, in a fixed
// order, so the results do not depend on the number of rows or threads. All return 0.
//
// Built by pdserve/kernels/__init__.py with the system C++ compiler and loaded with ctypes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec8.h"

namespace {

// One vector: 16 floats with AVX-512, else 8 (AVX2). A 16-lane vector on AVX2 is two registers, and its
// float <-> int32 conversions in the vectorized exp went through scalar code: SwiGLU ran 2.7x slower than
// torch's operators on an AVX2 EPYC (2.56 against 0.96 ms for 256 rows of 2 x 2,048).
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vfi32 __attribute__((vector_size(4 * kLanes)));

inline vf loadv(const float* p) { vf v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// Threads worth starting for `elements` values (a thread's start costs about as much as 32K values).
inline int threads_for(int64_t elements, int num_threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, elements / 32768)));
}

}  // namespace

// out[r, j] = silu(x[r, j]) * x[r, d + j] for j < d: x [rows, 2d] holds [gate | up], out [rows, d].
extern "C" int pdserve_silu_and_mul(float* out, const float* x, int64_t rows, int64_t d, int64_t x_row,
                                    int64_t out_row, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * d, num_threads))
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = x + r * x_row;
    const float* up = gate + d;
    float* o = out + r * out_row;
    int64_t j = 0;
    for (; j + kLanes <= d; j += kLanes) {
      const vf g = loadv(gate + j);
      const vf e = pdserve_kernels::vexp<vf, vfi32>(-g);
      storev(o + j, g / (1.0f + e) * loadv(up + j));
    }
    for (; j < d; ++j) o[j] = gate[j] / (1.0f + std::exp(-gate[j])) * up[j];
  }
  return 0;
}

// out[r] = weight * x[r] / sqrt(mean(x[r]^2) + eps): x, out [rows, hidden], weight [hidden].
extern "C" int pdserve_rms_norm(float* out, const float* x, const float* weight, int64_t rows, int64_t hidden,
                                int64_t x_row, int64_t out_row, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * hidden, num_threads))
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * x_row;
    float* o = out + r * out_row;
    vf acc = {};
    int64_t j = 0;
    for (; j + kLanes <= hidden; j += kLanes) {
      const vf v = loadv(xr + j);
      acc += v * v;
    }
    float sum = 0.f;
    for (int i = 0; i < kLanes; ++i) sum += acc[i];
    for (; j < hidden; ++j) sum += xr[j] * xr[j];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    j = 0;
    for (; j + kLanes <= hidden; j += kLanes) storev(o + j, loadv(weight + j) * (loadv(xr + j) * inv));
    for (; j < hidden; ++j) o[j] = weight[j] * (xr[j] * inv);
  }
  return 0;
}

// Rotary embedding, rotate-half layout: for token n, head h of x [tokens, heads, head_dim] (token stride
// x_row, head stride x_head) and i < rot / 2, with a = x[i], b = x[i + rot / 2]:
// out[i] = a cos - b sin, out[i + rot / 2] = b cos + a sin, cos / sin [tokens, rot / 2] (row stride cs_row).
// Values past `rot` (partial rotary) are copied. out [tokens, heads, head_dim] is contiguous.
extern "C" int pdserve_rope_rotate_half(float* out, const float* x, const float* cos, const float* sin,
                                        int64_t tokens, int64_t heads, int64_t head_dim, int64_t rot, int64_t x_row,
                                        int64_t x_head, int64_t cs_row, int num_threads) {
  const int64_t half = rot / 2;
#pragma omp parallel for schedule(static) num_threads(threads_for(tokens * heads * head_dim, num_threads))
  for (int64_t n = 0; n < tokens; ++n) {
    const float* c = cos + n * cs_row;
    const float* s = sin + n * cs_row;
    for (int64_t h = 0; h < heads; ++h) {
      const float* lo = x + n * x_row + h * x_head;
      const float* hi = lo + half;
      float* olo = out + (n * heads + h) * head_dim;
      float* ohi = olo + half;
      int64_t i = 0;
      for (; i + kLanes <= half; i += kLanes) {
        const vf a = loadv(lo + i), b = loadv(hi + i), cv = loadv(c + i), sv = loadv(s + i);
        storev(olo + i, a * cv - b * sv);
        storev(ohi + i, b * cv + a * sv);
      }
      for (; i < half; ++i) {
        const float a = lo[i], b = hi[i];
        olo[i] = a * c[i] - b * s[i];
        ohi[i] = b * c[i] + a * s[i];
      }
      if (rot < head_dim) std::memcpy(olo + rot, lo + rot, sizeof(float) * (head_dim - rot));
    }
  }
  return 0;
}
