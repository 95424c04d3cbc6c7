// Public fused optimizer updates (ops.h): argument checks, then the backend of the tensors' device.
#include <string>

#include "dtk/ops/backend.h"
#include "dtk/ops/check.h"

namespace dtk::ops {

void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, double lr, double momentum,
              double weight_decay, bool nesterov) {
  detail::check_float("sgd_step", param, "param");
  detail::check_like("sgd_step", param, grad, "grad");
  if (momentum != 0) {
    if (!momentum_buf.defined()) fail_usage("sgd_step: momentum is not 0, so momentum_buf must be defined");
    detail::check_like("sgd_step", param, momentum_buf, "momentum_buf");
  }
  if (nesterov && momentum == 0) fail_usage("sgd_step: nesterov needs a non-zero momentum");
  DTK_DISPATCH(param, sgd_step(param, grad, momentum_buf, lr, momentum, weight_decay, nesterov));
}

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step) {
  detail::check_float("adamw_step", param, "param");
  detail::check_like("adamw_step", param, grad, "grad");
  detail::check_like("adamw_step", param, m, "m");
  detail::check_like("adamw_step", param, v, "v");
  if (step < 1) fail_usage("adamw_step: step counts from 1, got {}", step);
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
    fail_usage("adamw_step: beta1 and beta2 must be in [0, 1)");
  DTK_DISPATCH(param, adamw_step(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step));
}

void clip_scale(Tensor& x, const Tensor& norm, double max_norm) {
  detail::check_float("clip_scale", x, "x");
  detail::check_type("clip_scale", norm, DType::f64, "norm");
  detail::check_on("clip_scale", x, norm, "norm");
  if (norm.numel() != 1) fail_usage("clip_scale: norm must have one element, got " + norm.str());
  if (!(max_norm >= 0)) fail_usage("clip_scale: max_norm must be >= 0, got {}", max_norm);
  if (max_norm == 0 || x.numel() == 0) return;
  DTK_DISPATCH(x, clip_scale(x, norm, max_norm));
}

}  // namespace dtk::ops
