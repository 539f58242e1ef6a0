// How fast one core reads KV-block-sized chunks in a random order, by how the next chunk is prefetched: the
// access pattern of a decode step's paged attention (each sequence's blocks lie anywhere in the cache), with
// no attention arithmetic, so it gives the ceiling a kernel's prefetching can reach on this machine.
//
//   g++ -O2 -std=c++17 -march=native benchmarks/bench_prefetch_pattern.cpp -o /tmp/bench_prefetch
//   taskset -c 1 /tmp/bench_prefetch
//
// A 1 GiB buffer on transparent huge pages, read as 16 KiB chunks (a float32 KV block of the bench preset: 16
// tokens x 4 KV heads x 64) in a shuffled order, 256 MiB a pass, best of 5. The chunk `ahead` places on is
// prefetched into L1 (prefetcht0): "spread", one prefetch per 64-byte line read; "burst", all of its lines at
// the current chunk's start; "slices", a quarter of them at each quarter (as a kernel that prefetches one KV
// head's share before each head's work). `work` adds that many FMAs per line read (0: a plain sum). Prints
// GB/s per variant. On a Zen 5 core (2026-12-04): spread 22.5, burst 14.5, slices 18.5 GB/s at work 0, and
// 13.9 / 7.9 / 8.8 at work 6 (docs/benchmarks.md). x86 with AVX-512 only.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main() {
  const size_t chunk = 16 << 10, total = size_t(1) << 30;
  float* buf = static_cast<float*>(aligned_alloc(2 << 20, total));
  madvise(buf, total, MADV_HUGEPAGE);
  for (size_t i = 0; i < total / 4; ++i) buf[i] = 1.0f;
  const size_t num_chunks = total / chunk, floats = chunk / 4, visit = (256u << 20) / chunk;
  std::vector<size_t> order(num_chunks);
  for (size_t i = 0; i < num_chunks; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  const char* names[] = {"spread", "burst ", "slices"};
  for (int work : {0, 6})
    for (int mode : {0, 1, 2})
      for (int ahead : {1, 2, 4}) {
        double best = 1e9;
        float sink = 0;
        for (int rep = 0; rep < 5; ++rep) {
          const size_t off = (rep * 7919) % (num_chunks - visit);
          __m512 acc[8];
          for (auto& a : acc) a = _mm512_setzero_ps();
          const __m512 q = _mm512_set1_ps(1.0001f);
          const auto t0 = std::chrono::steady_clock::now();
          for (size_t i = 0; i + 8 < visit; ++i) {
            const float* c = buf + order[off + i] * floats;
            const char* next = reinterpret_cast<const char*>(buf + order[off + i + ahead] * floats);
            if (mode == 1)
              for (size_t b = 0; b < chunk; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
            for (size_t j = 0; j < floats; j += 16) {
              if (mode == 0) {
                _mm_prefetch(next + j * 4, _MM_HINT_T0);
              } else if (mode == 2 && j % (floats / 4) == 0) {
                for (size_t b = 0; b < chunk / 4; b += 64) _mm_prefetch(next + j * 4 + b, _MM_HINT_T0);
              }
              const __m512 v = _mm512_loadu_ps(c + j);
              acc[0] = _mm512_add_ps(acc[0], v);
              for (int w = 0; w < work; ++w) acc[1 + w] = _mm512_fmadd_ps(v, q, acc[1 + w]);
            }
          }
          const auto t1 = std::chrono::steady_clock::now();
          for (auto& a : acc) sink += _mm512_reduce_add_ps(a);
          best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
        }
        std::printf("work %d, %s, %d chunk(s) ahead: %.1f GB/s (checksum %g)\n", work, names[mode], ahead,
                    (visit - 8) * chunk / best / 1e9, sink);
      }
  std::free(buf);
  return 0;
}
