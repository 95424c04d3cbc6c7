// Public fill, cast and Philox fills (ops.h): argument checks, then the device's backend.
#include "dtk/ops/backend.h"
#include "dtk/ops/check.h"

namespace dtk::ops {

void fill(Tensor& out, double v) {
  detail::check_defined("fill", out, "out");
  DTK_DISPATCH(out, fill(out, v));
}

void cast(const Tensor& src, Tensor& dst) {
  detail::check_defined("cast", src, "src");
  detail::check_defined("cast", dst, "dst");
  detail::check_on("cast", src, dst, "dst");
  if (src.numel() != dst.numel())
    fail_usage("cast: " + src.str() + " and " + dst.str() + " differ in number of elements");
  DTK_DISPATCH(src, cast(src, dst));
}

namespace {
void check_random(const char* op, const Tensor& out) {
  detail::check_defined(op, out, "out");
  if (!dtype_is_float(out.dtype())) fail_usage(std::string(op) + ": " + out.str() + " is not a float tensor");
}
}  // namespace

void uniform_(Tensor& out, uint64_t seed, uint64_t offset, double lo, double hi) {
  check_random("uniform_", out);
  if (!(lo <= hi)) fail_usage("uniform_: lo must not exceed hi");
  DTK_DISPATCH(out, uniform_(out, seed, offset, lo, hi));
}

void normal_(Tensor& out, uint64_t seed, uint64_t offset, double mean, double std) {
  check_random("normal_", out);
  if (!(std >= 0)) fail_usage("normal_: std must be non-negative");
  DTK_DISPATCH(out, normal_(out, seed, offset, mean, std));
}

}  // namespace dtk::ops
