// Public reductions (ops.h): argument checks, then the backend of the tensor's device.
#include <string>

#include "dtk/ops/backend.h"
#include "dtk/ops/check.h"

namespace dtk::ops {

namespace {

const char* kind_name(Reduce kind) {
  switch (kind) {
    case Reduce::sum: return "sum";
    case Reduce::mean: return "mean";
    case Reduce::max: return "max";
    case Reduce::min: return "min";
    case Reduce::norm2: return "norm2";
    case Reduce::absmax: return "absmax";
  }
  return "?";
}

}  // namespace

void reduce(Reduce kind, Axis axis, const Tensor& a, Tensor& out) {
  detail::check_float("reduce", a, "a");
  detail::check_defined("reduce", out, "out");
  if (out.dtype() != a.dtype() || out.device() != a.device())
    fail_usage("reduce: out " + out.str() + " must have the dtype and device of a " + a.str());
  int64_t want = 1, count = a.numel();  // outputs, and elements reduced into each
  if (axis != Axis::all) {
    if (a.ndim() != 2) fail_usage("reduce: rows and cols reductions need a 2-D tensor, got " + a.str());
    want = axis == Axis::rows ? a.dim(0) : a.dim(1);
    count = axis == Axis::rows ? a.dim(1) : a.dim(0);
  }
  if (out.numel() != want)
    fail_usage("reduce: out must have {} element(s), got {}", want, out.str());
  const bool needs_elements = kind == Reduce::max || kind == Reduce::min || kind == Reduce::absmax;
  if (needs_elements && count == 0 && want > 0)
    fail_usage(std::string("reduce: ") + kind_name(kind) + " of an empty tensor is undefined (" + a.str() + ")");
  DTK_DISPATCH(a, reduce(kind, axis, a, out));
}

double reduce_all(Reduce kind, const Tensor& a) {
  detail::check_float("reduce_all", a, "a");
  Tensor out = Tensor::empty({1}, a.dtype(), a.device());
  reduce(kind, Axis::all, a, out);
  return out.item();
}

int64_t count_nonfinite(const Tensor& a) {
  detail::check_defined("count_nonfinite", a, "a");
  if (!dtype_is_float(a.dtype())) fail_usage("count_nonfinite: a must be a float tensor, got " + a.str());
  return DTK_DISPATCH(a, count_nonfinite(a));
}

// The backends have no dot of their own: the products go to a temporary of a's size, then the
// deterministic, double-accumulated sum.
double dot(const Tensor& a, const Tensor& b) {
  detail::check_float("dot", a, "a");
  detail::check_like("dot", a, b, "b");
  Tensor prod = Tensor::empty({a.numel()}, a.dtype(), a.device());
  DTK_DISPATCH(a, mul(a, b, prod));
  return reduce_all(Reduce::sum, prod);
}

}  // namespace dtk::ops
