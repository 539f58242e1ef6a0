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

}  // namespace

extern "C" {

// Bind the kernels by name ("panel_linear", "f32_linear", "bf16_linear"); returns 0, or 1 for another name.
int pdserve_torch_ops_bind(const char* name, void* fn) {
  const LinearFn f = reinterpret_cast<LinearFn>(fn);
  if (std::strcmp(name, "panel_linear") == 0) g_panel_linear = f;
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
}
