// CUDA fused optimizer updates: one pass over param, grad and the state tensors, each element
// read once and written once (an unfused AdamW would stream the tensors five or six times).
// Scalars derived from the step (bias corrections) are computed once on the host in double.
#include "dtk/ops/cuda/common.cuh"

namespace dtk::ops::cuda {
using namespace kern;

namespace {

template <typename T>
__global__ void sgd_kernel(T* p, const T* g, T* buf, int64_t n, T lr, T momentum, T wd, bool nesterov) {
  for (int64_t i = global_tid(); i < n; i += grid_stride()) {
    T d = g[i] + wd * p[i];
    if (buf) {  // momentum != 0 (the host passes nullptr otherwise)
      const T b = momentum * buf[i] + d;
      buf[i] = b;
      d = nesterov ? d + momentum * b : b;
    }
    p[i] -= lr * d;
  }
}

template <typename T>
__global__ void adamw_kernel(T* p, const T* g, T* m, T* v, int64_t n, T lr, T beta1, T beta2, T eps, T lr_wd,
                             T inv_bc1, T inv_bc2) {
  for (int64_t i = global_tid(); i < n; i += grid_stride()) {
    const T gi = g[i];
    T pi = p[i];
    pi -= lr_wd * pi;  // decoupled weight decay, before the Adam update (as PyTorch's AdamW)
    const T mi = beta1 * m[i] + (T(1) - beta1) * gi;
    const T vi = beta2 * v[i] + (T(1) - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    pi -= lr * (mi * inv_bc1) / (d_sqrt(vi * inv_bc2) + eps);
    p[i] = pi;
  }
}

// The factor from the norm on the device (formed in double, as the CPU's), one thread per element.
template <typename T>
__global__ void clip_scale_kernel(T* x, int64_t n, const double* norm, double max_norm) {
  const double nv = *norm;
  if (!isfinite(nv) || !(nv > max_norm)) return;
  const T c = T(max_norm / nv);
  for (int64_t i = global_tid(); i < n; i += grid_stride()) x[i] *= c;
}

}  // namespace

void clip_scale(Tensor& x, const Tensor& norm, double max_norm) {
  const int64_t n = x.numel();
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    clip_scale_kernel<T><<<grid_for(n, 256), 256, 0, stream()>>>(x.ptr<T>(), n, norm.ptr<double>(), max_norm);
  });
  check_launch("clip_scale");
}

void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, double lr, double momentum,
              double weight_decay, bool nesterov) {
  const int64_t n = param.numel();
  if (n == 0) return;
  visit_float(param.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* buf = (momentum != 0 && momentum_buf.defined()) ? momentum_buf.ptr<T>() : nullptr;
    sgd_kernel<T><<<grid_for(n, 256), 256, 0, stream()>>>(param.ptr<T>(), grad.ptr<T>(), buf, n, T(lr), T(momentum),
                                                          T(weight_decay), nesterov);
  });
  check_launch("sgd_step");
}

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step) {
  const int64_t n = param.numel();
  if (n == 0) return;
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  visit_float(param.dtype(), [&](auto tag) {
    using T = decltype(tag);
    adamw_kernel<T><<<grid_for(n, 256), 256, 0, stream()>>>(param.ptr<T>(), grad.ptr<T>(), m.ptr<T>(), v.ptr<T>(), n,
                                                            T(lr), T(beta1), T(beta2), T(eps), T(lr * weight_decay),
                                                            T(1.0 / bc1), T(1.0 / bc2));
  });
  check_launch("adamw_step");
}

}  // namespace dtk::ops::cuda
