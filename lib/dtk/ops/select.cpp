// Public selection ops (ops.h): top-k by magnitude, random-k indices, gather and scatter-add.
#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "dtk/core/philox.h"
#include "dtk/ops/backend.h"
#include "dtk/ops/check.h"

namespace dtk::ops {

void topk_abs(const Tensor& x, int64_t k, Tensor& values, Tensor& indices) {
  detail::check_float("topk_abs", x, "x");
  if (k < 0 || k > x.numel())
    fail_usage("topk_abs: k = {} must be in [0, {}] for {}", k, x.numel(), x.str());
  detail::check_defined("topk_abs", values, "values");
  if (values.dtype() != x.dtype() || values.device() != x.device() || values.numel() != k)
    fail_usage("topk_abs: values must be {} with {} elements on {}, got {}", dtype_name(x.dtype()), k,
               x.device().str(), values.str());
  detail::check_type("topk_abs", indices, DType::i64, "indices");
  detail::check_on("topk_abs", x, indices, "indices");
  if (indices.numel() != k)
    fail_usage("topk_abs: indices must have {} elements, got {}", k, indices.str());
  DTK_DISPATCH(x, topk_abs(x, k, values, indices));
}

// A partial Fisher-Yates shuffle of [0, n) driven by Philox: step i swaps position i with
// i + floor(u_i (n - i)), u_i = philox::uniform(seed, offset + i). The first k positions are a
// uniformly random k-subset. Computed on the host (integer steps and one exact-rounded product
// each), so every rank and device gets the same indices. Untouched positions hold their own
// index, so a sparse map of the swapped ones is enough when k is small against n.
Tensor randomk_indices(int64_t n, int64_t k, uint64_t seed, uint64_t offset, Device d) {
  if (n < 0 || k < 0 || k > n)
    fail_usage("randomk_indices: need 0 <= k <= n, got k = {}, n = {}", k, n);
  std::vector<int64_t> picked(static_cast<size_t>(k));
  auto draw = [&](int64_t i) {
    const int64_t m = n - i;
    int64_t j = static_cast<int64_t>(philox::uniform(seed, offset + static_cast<uint64_t>(i)) * static_cast<double>(m));
    if (j >= m) j = m - 1;  // the product can round up to m when m is huge
    return i + j;
  };
  if (k * 4 >= n) {
    std::vector<int64_t> perm(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) perm[i] = i;
    for (int64_t i = 0; i < k; ++i) std::swap(perm[i], perm[draw(i)]);
    std::copy(perm.begin(), perm.begin() + k, picked.begin());
  } else {
    std::unordered_map<int64_t, int64_t> moved;  // position -> value, where it differs from the position
    moved.reserve(static_cast<size_t>(2 * k));
    auto at = [&](int64_t pos) {
      const auto it = moved.find(pos);
      return it == moved.end() ? pos : it->second;
    };
    for (int64_t i = 0; i < k; ++i) {
      const int64_t j = draw(i);
      const int64_t vi = at(i), vj = at(j);
      moved[i] = vj;
      moved[j] = vi;
      picked[i] = vj;
    }
  }
  std::sort(picked.begin(), picked.end());
  return Tensor::from_host(picked.data(), {k}, DType::i64, d);
}

void gather(const Tensor& x, const Tensor& indices, Tensor& out) {
  detail::check_float("gather", x, "x");
  detail::check_type("gather", indices, DType::i64, "indices");
  detail::check_on("gather", x, indices, "indices");
  detail::check_defined("gather", out, "out");
  if (out.dtype() != x.dtype() || out.device() != x.device() || out.numel() != indices.numel())
    fail_usage("gather: out must have the dtype and device of x {} and {} elements, got {}", x.str(), indices.numel(),
               out.str());
  DTK_DISPATCH(x, gather(x, indices, out));
}

void scatter_add(const Tensor& indices, const Tensor& values, Tensor& out) {
  detail::check_float("scatter_add", out, "out");
  detail::check_type("scatter_add", indices, DType::i64, "indices");
  detail::check_on("scatter_add", out, indices, "indices");
  detail::check_defined("scatter_add", values, "values");
  if (values.dtype() != out.dtype() || values.device() != out.device() || values.numel() != indices.numel())
    fail_usage("scatter_add: values must have the dtype and device of out {} and {} elements, got {}", out.str(),
               indices.numel(), values.str());
  DTK_DISPATCH(out, scatter_add(indices, values, out));
}

}  // namespace dtk::ops
