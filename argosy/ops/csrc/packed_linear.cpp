// bf16 linear layers with oneDNN-packed weights, called without a Python layer.
//
// argosy/models/packed_linear.py packs each weight once (mkldnn::_reorder_linear_weight, an
// opaque tensor torch.compile cannot trace) and registers it here under an integer key;
// argosy_ext::packed_linear(x, key, out_features, bias) then runs mkldnn::_linear_pointwise on
// it. The Python custom op doing the same cost ~30 us a call (121 calls a decode step).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string_view>
#include <unordered_map>

namespace {

std::mutex registry_mutex;
std::unordered_map<int64_t, at::Tensor> registry;
int64_t next_key = 0;

int64_t register_packed(const at::Tensor& packed) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.emplace(next_key, packed);
  return next_key++;
}

void release_packed(int64_t key) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(key);
}

at::Tensor packed_linear(const at::Tensor& x, int64_t key, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  at::Tensor weight;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(key);
    TORCH_CHECK(it != registry.end(), "packed_linear: no packed weight under key ", key);
    weight = it->second;
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         std::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<std::string_view>)>();
  auto out = op.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
  TORCH_CHECK(out.size(-1) == out_features, "packed_linear: weight under key ", key, " has the wrong shape");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(argosy_ext, m) {
  m.def("register_packed(Tensor packed) -> int");
  m.def("release_packed(int key) -> ()");
  m.def("packed_linear(Tensor x, int key, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(argosy_ext, CompositeExplicitAutograd, m) {
  m.impl("register_packed", &register_packed);
  m.impl("release_packed", &release_packed);
}

TORCH_LIBRARY_IMPL(argosy_ext, CPU, m) { m.impl("packed_linear", &packed_linear); }
