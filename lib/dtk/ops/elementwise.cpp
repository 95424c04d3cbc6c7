// Public elementwise ops (ops.h): argument checks, then the backend of the tensors' device.
#include <string>

#include "dtk/ops/backend.h"
#include "dtk/ops/check.h"

namespace dtk::ops {

namespace {

void check_unary(const char* op, const Tensor& a, const Tensor& out) {
  detail::check_float(op, a, "a");
  detail::check_like(op, a, out, "out");
}

void check_binary(const char* op, const Tensor& a, const Tensor& b, const Tensor& out) {
  detail::check_float(op, a, "a");
  detail::check_like(op, a, b, "b");
  detail::check_like(op, a, out, "out");
}

}  // namespace

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  detail::check_float_or_bf16("add", a, "a");
  detail::check_like_mixed("add", a, b, "b");
  detail::check_like_mixed("add", a, out, "out");
  DTK_DISPATCH(a, add(a, b, out));
}

void sub(const Tensor& a, const Tensor& b, Tensor& out) {
  check_binary("sub", a, b, out);
  DTK_DISPATCH(a, sub(a, b, out));
}

void mul(const Tensor& a, const Tensor& b, Tensor& out) {
  check_binary("mul", a, b, out);
  DTK_DISPATCH(a, mul(a, b, out));
}

void div(const Tensor& a, const Tensor& b, Tensor& out) {
  check_binary("div", a, b, out);
  DTK_DISPATCH(a, div(a, b, out));
}

void add_scalar(const Tensor& a, double s, Tensor& out) {
  check_unary("add_scalar", a, out);
  DTK_DISPATCH(a, add_scalar(a, s, out));
}

void scale(const Tensor& a, double s, Tensor& out) {
  check_unary("scale", a, out);
  DTK_DISPATCH(a, scale(a, s, out));
}

void axpy(double alpha, const Tensor& x, Tensor& y) {
  detail::check_float("axpy", x, "x");
  detail::check_like("axpy", x, y, "y");
  DTK_DISPATCH(x, axpy(alpha, x, y));
}

void lerp(const Tensor& a, const Tensor& b, double w, Tensor& out) {
  check_binary("lerp", a, b, out);
  DTK_DISPATCH(a, lerp(a, b, w, out));
}

void sqrt(const Tensor& a, Tensor& out) {
  check_unary("sqrt", a, out);
  DTK_DISPATCH(a, sqrt(a, out));
}

void rsqrt(const Tensor& a, Tensor& out) {
  check_unary("rsqrt", a, out);
  DTK_DISPATCH(a, rsqrt(a, out));
}

void pow(const Tensor& a, double p, Tensor& out) {
  check_unary("pow", a, out);
  DTK_DISPATCH(a, pow(a, p, out));
}

void sign(const Tensor& a, Tensor& out) {
  check_unary("sign", a, out);
  DTK_DISPATCH(a, sign(a, out));
}

void abs(const Tensor& a, Tensor& out) {
  check_unary("abs", a, out);
  DTK_DISPATCH(a, abs(a, out));
}

void clamp(const Tensor& a, double lo, double hi, Tensor& out) {
  check_unary("clamp", a, out);
  if (!(lo <= hi)) fail_usage("clamp: lo ({}) must not exceed hi ({})", lo, hi);
  DTK_DISPATCH(a, clamp(a, lo, hi, out));
}

void where(const Tensor& cond_u8, const Tensor& a, const Tensor& b, Tensor& out) {
  check_binary("where", a, b, out);
  detail::check_type("where", cond_u8, DType::u8, "cond");
  detail::check_on("where", a, cond_u8, "cond");
  if (cond_u8.numel() != a.numel())
    fail_usage("where: cond " + cond_u8.str() + " must have as many elements as a " + a.str());
  DTK_DISPATCH(a, where(cond_u8, a, b, out));
}

}  // namespace dtk::ops
