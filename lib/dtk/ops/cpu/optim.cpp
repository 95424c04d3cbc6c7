// CPU fused optimizer updates: one pass over param, grad and state, in the element type (the
// same order of operations as the CUDA kernels). Bias corrections are computed once in double.
#include <cmath>
#include <cstdint>

#include "dtk/ops/backend.h"
#include "dtk/ops/cpu/internal.h"

namespace dtk::ops::cpu {

namespace {


}  // namespace

void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, double lr, double momentum,
              double weight_decay, bool nesterov) {
  visit_float(param.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = param.ptr<T>();
    const T* g = grad.ptr<T>();
    T* buf = (momentum != 0 && momentum_buf.defined()) ? momentum_buf.ptr<T>() : nullptr;
    const T lr_t = static_cast<T>(lr), mom = static_cast<T>(momentum), wd = static_cast<T>(weight_decay);
    const int64_t n = param.numel();
#pragma omp parallel for if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) {
      T d = g[i] + wd * p[i];
      if (buf) {
        const T b = mom * buf[i] + d;
        buf[i] = b;
        d = nesterov ? d + mom * b : b;
      }
      p[i] -= lr_t * d;
    }
  });
}

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  visit_float(param.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = param.ptr<T>();
    const T* g = grad.ptr<T>();
    T* mp = m.ptr<T>();
    T* vp = v.ptr<T>();
    const T lr_t = static_cast<T>(lr), b1 = static_cast<T>(beta1), b2 = static_cast<T>(beta2);
    const T eps_t = static_cast<T>(eps), lr_wd = static_cast<T>(lr * weight_decay);
    const T inv_bc1 = static_cast<T>(1.0 / bc1), inv_bc2 = static_cast<T>(1.0 / bc2);
    const int64_t n = param.numel();
#pragma omp parallel for if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) {
      const T gi = g[i];
      T pi = p[i];
      pi -= lr_wd * pi;  // decoupled weight decay before the Adam update, as PyTorch's AdamW
      const T mi = b1 * mp[i] + (T(1) - b1) * gi;
      const T vi = b2 * vp[i] + (T(1) - b2) * gi * gi;
      mp[i] = mi;
      vp[i] = vi;
      pi -= lr_t * (mi * inv_bc1) / (std::sqrt(vi * inv_bc2) + eps_t);
      p[i] = pi;
    }
  });
}

void clip_scale(Tensor& x, const Tensor& norm, double max_norm) {
  const double n = *norm.ptr<double>();
  if (!std::isfinite(n) || !(n > max_norm)) return;
  const double c = max_norm / n;
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = x.ptr<T>();
    const T ct = static_cast<T>(c);
    const int64_t k = x.numel();
#pragma omp parallel for if (k > kParallelMin)
    for (int64_t i = 0; i < k; ++i) p[i] *= ct;
  });
}

}  // namespace dtk::ops::cpu
