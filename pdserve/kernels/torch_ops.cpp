// The CPU kernels of the decode step's most frequent torch.ops.pdserve operators, in C++, so that a call
// from a compiled graph goes through the dispatcher straight to the native kernel.
//
// Each operator also has a Python implementation (pdserve/engine/layers: registered for
// CompositeExplicitAutograd, which serves CPU tensors wherever no CPU kernel is registered). That one
// is a boxed call into Python, a function that checks and allocates, and a ctypes call: ~10 us a call
// with everything in cache, ~20 us in a decode step, whose weights stream through the caches between
// calls (py-spy over the bench preset at batch 1 on a Zen 4 core: the dispatch into Python alone was 6%
// of the step), and the bench preset's step makes 49 such calls. These kernels do the same checks and
// the same call with no Python in between. vLLM registers its CPU operators in C++ for the same reason.
//
// This file includes torch's headers, unlike the kernels it calls (built apart, without them, in about
// a second each, and for the ISA pdserve/kernels/__init__.py chooses). It links against libtorch and
// is built for the torch it was compiled with (the cache key holds torch's version). The kernels are
// reached through function pointers that Python binds after loading both libraries
// (pdserve_torch_ops_bind), and the panels of a handle through a table Python keeps current
// (pdserve_torch_ops_set_panels: set when a layer registers its panels, cleared when they are freed).
//
// Operators (schemas in pdserve/kernels/ops.py):
//   panel_linear_by_handle(x [M, K] float32, handle, N) -> [M, N]: panel_linear.cpp's kernel on the panels
//     [ceil(N / 16), K, 16] registered under handle.
//   decode_linear(x [M, K], weight [N, K]) -> [M, N]: decode_linear.cpp's kernel, float32 or bfloat16.
//   paged_decode_attention_f32(query [N, H, D], key, value [N, H_kv, D], kv_cache [L, 2, blocks, block_size,
//     H_kv, D], layer, slot_mapping [N], block_tables [N, W], seq_lens [N], query_start_loc [N + 1], scale,
//     sliding_window) -> [N, H, D]: paged_attention.cpp's decode kernel on a float32 cache (the new rows'
//     write and the attention in one call), every tensor float32 or int64 as the engine passes them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

namespace {

// pdserve_f32_panel_linear, pdserve_f32_linear and pdserve_bf16_linear share this signature.
using LinearFn = int (*)(void* out, const void* x, const void* weight, int64_t M, int64_t N, int64_t K,
                         int num_threads);

// pdserve_paged_decode_attention (paged_attention.cpp)
using PagedDecodeFn = int (*)(float* out, const float* query, const float* key, const float* value, float* kv_cache,
                              int64_t layer, const int64_t* slot_mapping, const int64_t* block_tables,
                              int64_t max_blocks_per_seq, const int64_t* seq_lens, const int64_t* query_start_loc,
                              int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, int64_t num_blocks, float scale, int64_t sliding_window,
                              int num_threads);

PagedDecodeFn g_paged_decode = nullptr;
LinearFn g_panel_linear = nullptr;
LinearFn g_f32_linear = nullptr;
LinearFn g_bf16_linear = nullptr;

struct Panels {
  const float* data = nullptr;  // null: no panels under this handle (never set, or freed)
  int64_t num_panels = 0;
  int64_t in_features = 0;
};

std::mutex g_panels_lock;  // writers (registration, a freed tensor's finalizer) against each other
std::vector<Panels> g_panels;

at::Tensor panel_linear_by_handle(const at::Tensor& x_in, int64_t handle, int64_t out_features) {
  TORCH_CHECK(g_panel_linear != nullptr, "the panel linear kernel is not bound (pdserve_torch_ops_bind)");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "panel_linear_by_handle takes a 2-D float32 CPU x, got ", x_in.sizes(), " ", x_in.scalar_type());
  Panels p;
  {
    std::lock_guard<std::mutex> guard(g_panels_lock);
    if (handle >= 0 && handle < static_cast<int64_t>(g_panels.size())) p = g_panels[handle];
  }
  TORCH_CHECK(p.data != nullptr, "no panels under handle ", handle, " (never registered, or freed)");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), in_features = x.size(1);
  TORCH_CHECK(in_features == p.in_features && p.num_panels * 16 >= out_features,
              "panels of ", p.num_panels, " x ", p.in_features, " do not fit x ", x.sizes(), " -> ", out_features,
              " features");
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const int rc = g_panel_linear(out.data_ptr(), x.data_ptr(), p.data, rows, out_features, in_features,
                                at::get_num_threads());
  TORCH_CHECK(rc == 0, "panel linear kernel refused x ", x.sizes(), " -> ", out_features, " features");
  return out;
}

at::Tensor decode_linear(const at::Tensor& x_in, const at::Tensor& weight_in) {
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  const LinearFn fn = bf16 ? g_bf16_linear : g_f32_linear;
  TORCH_CHECK(fn != nullptr, "the decode linear kernel is not bound (pdserve_torch_ops_bind)");
  TORCH_CHECK(x_in.dim() == 2 && weight_in.dim() == 2 && x_in.size(1) == weight_in.size(1) &&
                  weight_in.scalar_type() == x_in.scalar_type() &&
                  (bf16 || x_in.scalar_type() == at::kFloat) && x_in.device().is_cpu(),
              "decode_linear takes x [M, K] and weight [N, K], both float32 or both bfloat16 on the CPU; got ",
              x_in.sizes(), " ", x_in.scalar_type(), " and ", weight_in.sizes(), " ", weight_in.scalar_type());
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t rows = x.size(0), out_features = weight.size(0), in_features = x.size(1);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const int rc = fn(out.data_ptr(), x.data_ptr(), weight.data_ptr(), rows, out_features, in_features,
                    at::get_num_threads());
  TORCH_CHECK(rc == 0, "decode linear kernel refused K=", in_features, " for ", x.scalar_type(),
              " (a multiple of ", bf16 ? 32 : 16, " is needed)");
  return out;
}

bool is_index(const at::Tensor& t, int64_t dim) {
  return t.dim() == dim && t.scalar_type() == at::kLong && t.is_contiguous();
}

at::Tensor paged_decode_attention_f32(const at::Tensor& query_in, const at::Tensor& key_in,
                                      const at::Tensor& value_in, const at::Tensor& kv_cache, int64_t layer,
                                      const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                                      int64_t sliding_window) {
  TORCH_CHECK(g_paged_decode != nullptr, "the paged decode attention kernel is not bound (pdserve_torch_ops_bind)");
  TORCH_CHECK_VALUE(query_in.dim() == 3 && key_in.dim() == 3 && value_in.dim() == 3 && kv_cache.dim() == 6 &&
                        query_in.scalar_type() == at::kFloat && key_in.scalar_type() == at::kFloat &&
                        value_in.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat &&
                        kv_cache.size(1) == 2 && kv_cache.is_contiguous() && query_in.device().is_cpu(),
                    "paged_decode_attention_f32 takes float32 query [N, H, D], key and value [N, H_kv, D] and a "
                    "contiguous float32 cache [L, 2, blocks, block_size, H_kv, D]; got ", query_in.sizes(), ", ",
                    key_in.sizes(), ", ", kv_cache.sizes(), " ", kv_cache.scalar_type());
  const int64_t num_seqs = query_in.size(0), num_heads = query_in.size(1), head_dim = query_in.size(2);
  const int64_t num_blocks = kv_cache.size(2), block_size = kv_cache.size(3), num_kv_heads = kv_cache.size(4);
  TORCH_CHECK_VALUE(kv_cache.size(5) == head_dim && value_in.size(2) == head_dim && key_in.size(2) == head_dim &&
                        key_in.size(1) == num_kv_heads && value_in.size(1) == num_kv_heads &&
                        key_in.size(0) == num_seqs && value_in.size(0) == num_seqs && layer >= 0 &&
                        layer < kv_cache.size(0),
                    "K and V rows of ", kv_cache.size(5), " values over ", num_kv_heads, " heads do not fit a query ",
                    query_in.sizes(), " (key ", key_in.sizes(), ", value ", value_in.sizes(), ", layer ", layer, ")");
  TORCH_CHECK_VALUE(is_index(slot_mapping, 1) && slot_mapping.size(0) == num_seqs && is_index(block_tables, 2) &&
                        block_tables.size(0) == num_seqs && is_index(seq_lens, 1) && seq_lens.size(0) == num_seqs &&
                        is_index(query_start_loc, 1) && query_start_loc.size(0) == num_seqs + 1,
                    "the paged kernel reads the metadata as contiguous int64 tensors, one row per sequence");
  const at::Tensor query = query_in.contiguous(), key = key_in.contiguous(), value = value_in.contiguous();
  at::Tensor out = at::empty({num_seqs, num_heads, head_dim}, query.options());
  if (num_seqs == 0) return out;
  const int rc = g_paged_decode(
      out.data_ptr<float>(), query.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>(),
      kv_cache.data_ptr<float>(), layer, slot_mapping.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(),
      block_tables.size(1), seq_lens.data_ptr<int64_t>(), query_start_loc.data_ptr<int64_t>(), num_seqs, num_heads,
      num_kv_heads, head_dim, block_size, num_blocks, static_cast<float>(scale), sliding_window,
      at::get_num_threads());
  TORCH_CHECK_VALUE(rc == 0, "paged decode attention kernel rejected its inputs (code ", rc, "): ", num_heads,
                    " heads, ", num_kv_heads, " KV heads, head_dim ", head_dim, ", slots ", slot_mapping);
  return out;
}

}  // namespace

extern "C" {

// Bind the kernels by name ("panel_linear", "f32_linear", "bf16_linear", "paged_decode_attention"); returns 0, or
// 1 for another name.
int pdserve_torch_ops_bind(const char* name, void* fn) {
  const LinearFn f = reinterpret_cast<LinearFn>(fn);
  if (std::strcmp(name, "paged_decode_attention") == 0) g_paged_decode = reinterpret_cast<PagedDecodeFn>(fn);
  else if (std::strcmp(name, "panel_linear") == 0) g_panel_linear = f;
  else if (std::strcmp(name, "f32_linear") == 0) g_f32_linear = f;
  else if (std::strcmp(name, "bf16_linear") == 0) g_bf16_linear = f;
  else return 1;
  return 0;
}

// Panels under ``handle``: [num_panels, in_features, 16] float32 at ``data``, or none (data null).
int pdserve_torch_ops_set_panels(int64_t handle, const float* data, int64_t num_panels, int64_t in_features) {
  if (handle < 0) return 1;
  std::lock_guard<std::mutex> guard(g_panels_lock);
  if (static_cast<int64_t>(g_panels.size()) <= handle) g_panels.resize(handle + 1);
  g_panels[handle] = Panels{data, num_panels, in_features};
  return 0;
}
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("panel_linear_by_handle", &panel_linear_by_handle);
  m.impl("decode_linear", &decode_linear);
  m.impl("paged_decode_attention_f32", &paged_decode_attention_f32);
}
