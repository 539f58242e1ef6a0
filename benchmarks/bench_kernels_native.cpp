// Native kernels against each other, with no Python or torch: for a machine where only a compiler is at
// hand (a lent GPU host's CPU, another ISA). Times two builds of the prompt attention kernel and of the
// few-row matmul on the bench preset's shapes, one thread, and checks that the two builds agree.
//
//   g++ -O2 -std=c++17 benchmarks/bench_kernels_native.cpp -o /tmp/bench_kernels -ldl
//   /tmp/bench_kernels OLD_prefill.so NEW_prefill.so OLD_decode.so NEW_decode.so
//
// Each .so is a kernel source built as pdserve builds it (g++ -O3 -march=native -fno-math-errno -fopenmp
// -shared -fPIC -std=c++17). Prints, per shape, the median of 7 calls of each build, in ms.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

using PrefillFn = int (*)(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          float, int);
using LinearFn = int (*)(float*, const float*, const float*, int64_t, int64_t, int64_t, int);

template <typename F>
static F symbol(const char* path, const char* name) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::fprintf(stderr, "%s\n", dlerror());
    std::exit(1);
  }
  return reinterpret_cast<F>(dlsym(lib, name));
}

template <typename Run>
static double median_ms(Run run, int reps = 7) {
  run();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto a = std::chrono::steady_clock::now();
    run();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

static std::vector<float> randn(size_t n, std::mt19937& g) {
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s OLD_prefill.so NEW_prefill.so OLD_decode.so NEW_decode.so\n", argv[0]);
    return 2;
  }
  std::mt19937 g(0);
  PrefillFn pa[2] = {symbol<PrefillFn>(argv[1], "pdserve_prefill_attention"),
                     symbol<PrefillFn>(argv[2], "pdserve_prefill_attention")};
  const int64_t H = 12, HKV = 4, D = 64;
  std::printf("prompt attention, 12 query / 4 KV heads of 64, one thread: rows keys old_ms new_ms max_diff\n");
  const int64_t shapes[][2] = {{128, 128}, {288, 288}, {512, 512}, {1024, 1024}, {2048, 2048}, {256, 1024},
                               {256, 2048}};
  for (const auto& s : shapes) {
    const int64_t nq = s[0], nk = s[1];
    auto q = randn(nq * H * D, g), k = randn(nk * HKV * D, g), v = randn(nk * HKV * D, g);
    std::vector<float> out[2] = {std::vector<float>(nq * H * D), std::vector<float>(nq * H * D)};
    double ms[2];
    for (int b = 0; b < 2; ++b)
      ms[b] = median_ms([&] {
        pa[b](out[b].data(), q.data(), k.data(), v.data(), nq, nk, H, HKV, D, D, H * D, D, HKV * D, D, HKV * D, D,
              H * D, D, 0.125f, 1);
      });
    float diff = 0;
    for (size_t i = 0; i < out[0].size(); ++i) diff = std::max(diff, std::fabs(out[0][i] - out[1][i]));
    std::printf("%lld %lld %.2f %.2f %.1e\n", (long long)nq, (long long)nk, ms[0], ms[1], diff);
  }
  LinearFn lin[2] = {symbol<LinearFn>(argv[3], "pdserve_f32_linear"), symbol<LinearFn>(argv[4], "pdserve_f32_linear")};
  // The bench preset's 12 layers: qkv [1280, 768], o [768, 768], gate_up [4096, 768], down [768, 2048]; LM head
  // [16384, 768]: 336 MiB, streamed from memory once per call set as in a decode step.
  struct M { int64_t n, k; };
  std::vector<M> mats;
  for (int l = 0; l < 12; ++l) mats.insert(mats.end(), {{1280, 768}, {768, 768}, {4096, 768}, {768, 2048}});
  mats.push_back({16384, 768});
  std::vector<std::vector<float>> ws;
  size_t bytes = 0;
  for (const auto& m : mats) {
    ws.push_back(randn(m.n * m.k, g));
    bytes += m.n * m.k * 4;
  }
  std::printf("few-row matmul, bench preset's 49 matrices (%.0f MiB), one thread: rows old_ms new_ms max_rel_diff\n",
              bytes / 1048576.0);
  for (int64_t rows : {1, 4, 8, 16, 32}) {
    auto x = randn(rows * 2048, g);
    std::vector<float> out[2] = {std::vector<float>(rows * 16384), std::vector<float>(rows * 16384)};
    double ms[2];
    float diff = 0;
    for (int b = 0; b < 2; ++b)
      ms[b] = median_ms([&] {
        for (size_t i = 0; i < mats.size(); ++i) lin[b](out[b].data(), x.data(), ws[i].data(), rows, mats[i].n, mats[i].k, 1);
      });
    for (size_t i = 0; i < out[0].size(); ++i)
      diff = std::max(diff, std::fabs(out[0][i] - out[1][i]) / (std::fabs(out[0][i]) + 1e-3f));
    std::printf("%lld %.2f %.2f %.1e\n", (long long)rows, ms[0], ms[1], diff);
  }
  return 0;
}
