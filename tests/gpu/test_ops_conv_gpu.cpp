// CUDA ops of convolutional networks (im2col, col2im, conv2d, max pooling, batch norm) against
// the CPU backend on the same inputs. Each comparison prints one line
// "gpu-check: <op> <dtype> max_rel_err=<x> tol=<y> PASS|FAIL" for scripts/gpu-check's log; the
// ops that only copy or compare values (im2col, max pooling forward) must match bit for bit and
// print tol=0. Skipped without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "dtk/core/device.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/ops.h"
#include "../common/gpu_check.h"

namespace dtk {
namespace {

using namespace gpu_test;

// The elements where x and y differ (a NaN equals a NaN), or every element when the sizes differ.
size_t mismatches(const Vec& x, const Vec& y) {
  if (x.size() != y.size()) return std::max(x.size(), y.size());
  size_t n = 0;
  for (size_t i = 0; i < x.size(); ++i)
    if (!(x[i] == y[i] || (std::isnan(x[i]) && std::isnan(y[i])))) ++n;
  return n;
}

// A bit-exact comparison's line: the worst relative error among the finite elements, tol=0.
void report_exact(const std::string& op, const std::string& dtype, size_t bad, double err) {
  std::printf("gpu-check: %s %s max_rel_err=%.3g tol=0 %s\n", op.c_str(), dtype.c_str(), err, bad ? "FAIL" : "PASS");
  std::fflush(stdout);
  EXPECT_EQ(bad, 0u) << op << " " << dtype << ": " << bad << " elements differ from the CPU's";
}

// NaNs (equal on both sides) replaced by 0, so max_rel_err measures the rest.
Vec finite(Vec v) {
  for (double& x : v)
    if (std::isnan(x)) x = 0;
  return v;
}


Tensor make(const Vec& v, const Shape& s, DType t, Device d = Device::cpu()) { return Tensor::from_doubles(v, s, t, d); }

// Sums taken in the same order as the CPU's (col2im, pooling backward): expected bit-equal.
double gather_tol(DType t) { return t == DType::f64 ? 1e-12 : 1e-6; }
// The batch-norm ops (double accumulation, elementwise passes the GPU may fuse into FMAs).
double bn_tol(DType t) { return t == DType::f64 ? 1e-12 : 1e-5; }

struct ConvCase {
  int64_t N, C, H, W, K;
  ops::Window g;  // kh, kw, stride_h, stride_w, pad_h, pad_w
};
// 3x3 pad 1 (ResNet's), 3x3 stride 2 pad 1 with C = 1, a non-square kernel with unequal strides
// and padding, 1x1 (stride 1 and the stride-2 shortcut), a kernel of 4 with padding 3 (windows
// mostly in the padding), a larger image, and a kernel as large as the image.
const ConvCase kConvCases[] = {{2, 3, 9, 9, 4, {3, 3, 1, 1, 1, 1}},  {1, 1, 8, 7, 2, {3, 3, 2, 2, 1, 1}},
                               {3, 2, 7, 10, 3, {2, 3, 1, 2, 1, 1}}, {2, 5, 6, 6, 4, {1, 1, 1, 1, 0, 0}},
                               {2, 3, 7, 6, 2, {1, 1, 2, 2, 0, 0}},  {1, 2, 11, 5, 3, {5, 3, 2, 1, 2, 1}},
                               {1, 2, 5, 5, 3, {4, 4, 3, 3, 3, 3}},  {2, 8, 32, 31, 16, {3, 3, 1, 1, 1, 1}},
                               {1, 1, 3, 3, 1, {3, 3, 1, 1, 0, 0}}};

Shape cols_shape(const ConvCase& c) { return {c.C * c.g.kh * c.g.kw, c.g.out_h(c.H) * c.g.out_w(c.W)}; }

TEST(ConvGpu, Im2colMatchesCpuExactly) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 1;
  for (DType t : kFloatTypes) {
    size_t bad = 0;
    double worst = 0;
    for (const ConvCase& c : kConvCases) {
      const Shape xs{c.C, c.H, c.W}, cs = cols_shape(c);
      Tensor x = make(random_values(size_t(shape_numel(xs)), seed++), xs, t);
      Tensor cols = Tensor::empty(cs, t), colsg = Tensor::empty(cs, t, kGpu);
      ops::im2col(x, c.g, cols);
      ops::im2col(x.to(kGpu), c.g, colsg);
      const Vec g = colsg.to_doubles(), r = cols.to_doubles();
      bad += mismatches(g, r);
      worst = std::max(worst, max_rel_err(g, r));
    }
    report_exact("im2col", std::string(dtype_name(t)), bad, worst);
  }
}

TEST(ConvGpu, Col2imMatchesCpu) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 100;
  for (DType t : kFloatTypes) {
    double worst = 0;
    for (const ConvCase& c : kConvCases) {
      const Shape xs{c.C, c.H, c.W}, cs = cols_shape(c);
      Tensor cols = make(random_values(size_t(shape_numel(cs)), seed++), cs, t);
      // dx starts as garbage on both: col2im overwrites it.
      Tensor dx = make(Vec(size_t(shape_numel(xs)), 7.0), xs, t), dxg = dx.to(kGpu);
      ops::col2im(cols, c.g, dx);
      ops::col2im(cols.to(kGpu), c.g, dxg);
      worst = std::max(worst, max_rel_err(dxg.to_doubles(), dx.to_doubles()));
    }
    report("col2im", std::string(dtype_name(t)), worst, gather_tol(t));
  }
}

TEST(ConvGpu, Conv2dForwardAndBackwardMatchCpu) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 200;
  for (DType t : kFloatTypes) {
    double worst_y = 0, worst_dw = 0, worst_dx = 0, worst_dw_only = 0;
    for (const ConvCase& c : kConvCases) {
      const ops::Window& g = c.g;
      const int64_t P = g.out_h(c.H), Q = g.out_w(c.W);
      const Shape xs{c.N, c.C, c.H, c.W}, ws{c.K, c.C, g.kh, g.kw}, ys{c.N, c.K, P, Q}, cs = cols_shape(c);
      Tensor x = make(random_values(size_t(shape_numel(xs)), seed++), xs, t);
      Tensor w = make(random_values(size_t(shape_numel(ws)), seed++), ws, t);
      Tensor dy = make(random_values(size_t(shape_numel(ys)), seed++), ys, t);
      const Vec dw0 = random_values(size_t(shape_numel(ws)), seed++);
      Tensor xg = x.to(kGpu), wg = w.to(kGpu), dyg = dy.to(kGpu);
      Tensor cols = Tensor::empty(cs, t), dcols = Tensor::empty(cs, t);
      Tensor colsg = Tensor::empty(cs, t, kGpu), dcolsg = Tensor::empty(cs, t, kGpu);

      Tensor y = Tensor::empty(ys, t), yg = Tensor::empty(ys, t, kGpu);
      ops::conv2d_forward(x, w, g, cols, y);
      ops::conv2d_forward(xg, wg, g, colsg, yg);
      worst_y = std::max(worst_y, max_rel_err(yg.to_doubles(), y.to_doubles()));

      // dw accumulates onto dw0; dx is overwritten.
      Tensor dw = make(dw0, ws, t), dwg = make(dw0, ws, t, kGpu);
      Tensor dx = Tensor::empty(xs, t), dxg = Tensor::empty(xs, t, kGpu);
      ops::conv2d_backward(x, w, dy, g, cols, dcols, dw, &dx);
      ops::conv2d_backward(xg, wg, dyg, g, colsg, dcolsg, dwg, &dxg);
      worst_dw = std::max(worst_dw, max_rel_err(dwg.to_doubles(), dw.to_doubles()));
      worst_dx = std::max(worst_dx, max_rel_err(dxg.to_doubles(), dx.to_doubles()));

      Tensor dwg2 = make(dw0, ws, t, kGpu);
      ops::conv2d_backward(xg, wg, dyg, g, colsg, dcolsg, dwg2, nullptr);
      worst_dw_only = std::max(worst_dw_only, max_rel_err(dwg2.to_doubles(), dw.to_doubles()));
    }
    const std::string dt(dtype_name(t));
    report("conv2d_forward", dt, worst_y, tol_for(t));
    report("conv2d_backward_dw", dt, worst_dw, tol_for(t));
    report("conv2d_backward_dx", dt, worst_dx, tol_for(t));
    report("conv2d_backward_dw_only", dt, worst_dw_only, tol_for(t));
  }
}

struct PoolCase {
  int64_t N, C, H, W;
  ops::Window g;
};
// torchvision's 3x3 stride 2 pad 1 (overlapping windows), 2x2 stride 2 (with an odd size that
// drops the last row), C = 1, a non-square window with unequal strides, a larger batch.
const PoolCase kPoolCases[] = {{2, 3, 9, 9, {3, 3, 2, 2, 1, 1}},    {2, 3, 8, 8, {2, 2, 2, 2, 0, 0}},
                               {1, 1, 7, 6, {3, 3, 2, 2, 1, 1}},    {3, 2, 10, 7, {2, 3, 1, 2, 1, 1}},
                               {2, 2, 9, 11, {2, 2, 2, 2, 0, 0}},   {1, 4, 3, 3, {3, 3, 1, 1, 1, 1}},
                               {8, 16, 32, 32, {3, 3, 2, 2, 1, 1}}, {1, 2, 5, 5, {1, 1, 1, 1, 0, 0}}};

// The inputs of a pooling case: 0 plain normal values, 1 rounded to halves (many ties, which go
// to the first in window order), 2 with NaNs sprinkled in (a NaN wins).
Vec pool_input(size_t n, uint64_t seed, int variant) {
  Vec v = random_values(n, seed);
  if (variant == 1)
    for (double& x : v) x = std::round(x * 2) / 2;
  if (variant == 2)
    for (size_t i = 3; i < n; i += 11) v[i] = NAN;
  return v;
}

TEST(ConvGpu, MaxPoolMatchesCpu) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 300;
  for (DType t : kFloatTypes) {
    size_t bad_y = 0, bad_arg = 0;
    double worst_y = 0, worst_dx = 0;
    for (const PoolCase& c : kPoolCases)
      for (int variant = 0; variant < 3; ++variant) {
        const ops::Window& g = c.g;
        const Shape xs{c.N, c.C, c.H, c.W}, ys{c.N, c.C, g.out_h(c.H), g.out_w(c.W)};
        Tensor x = make(pool_input(size_t(shape_numel(xs)), seed++, variant), xs, t);
        Tensor y = Tensor::empty(ys, t), arg = Tensor::empty(ys, DType::i32);
        Tensor yg = Tensor::empty(ys, t, kGpu), argg = Tensor::empty(ys, DType::i32, kGpu);
        ops::maxpool2d_forward(x, g, y, arg);
        ops::maxpool2d_forward(x.to(kGpu), g, yg, argg);
        const Vec gy = yg.to_doubles(), ry = y.to_doubles();
        bad_y += mismatches(gy, ry);
        worst_y = std::max(worst_y, max_rel_err(finite(gy), finite(ry)));
        bad_arg += mismatches(argg.to_doubles(), arg.to_doubles());

        // The same argmax on both (the CPU's), dx garbage before: overwritten.
        Tensor dy = make(random_values(size_t(shape_numel(ys)), seed++), ys, t);
        Tensor dx = make(Vec(size_t(shape_numel(xs)), 7.0), xs, t), dxg = dx.to(kGpu);
        ops::maxpool2d_backward(arg, dy, g, dx);
        ops::maxpool2d_backward(arg.to(kGpu), dy.to(kGpu), g, dxg);
        worst_dx = std::max(worst_dx, max_rel_err(dxg.to_doubles(), dx.to_doubles()));
      }
    const std::string dt(dtype_name(t));
    report_exact("maxpool2d_forward", dt, bad_y, worst_y);
    report_exact("maxpool2d_forward_argmax", dt, bad_arg, 0);
    report("maxpool2d_backward", dt, worst_dx, gather_tol(t));
  }
}

// Batch-norm shapes [N, C, ...]: 4-D images, 3-D sequences, 2-D features (L = 1), 5-D volumes,
// C = 1, and channels of many elements (several passes of a 1024-thread block).
const Shape kBnShapes[] = {{4, 3, 5, 5}, {2, 1, 7}, {8, 5}, {3, 4, 2, 3, 5}, {2, 16, 32, 32}, {16, 3, 33, 33}, {1, 1, 1}};

int64_t bn_inner(const Shape& s) {
  int64_t L = 1;
  for (size_t d = 2; d < s.size(); ++d) L *= s[d];
  return L;
}

// The worst relative error of each row of two [2, C] sums, each row against its own scale.
double sums_err(const Vec& g, const Vec& r, int64_t C) {
  const Vec g0(g.begin(), g.begin() + C), g1(g.begin() + C, g.end());
  const Vec r0(r.begin(), r.begin() + C), r1(r.begin() + C, r.end());
  return std::max(max_rel_err(g0, r0), max_rel_err(g1, r1));
}

TEST(ConvGpu, BatchNormMatchesCpu) {
  SKIP_WITHOUT_GPU();
  uint64_t seed = 400;
  const double eps = 1e-5;
  for (DType t : kFloatTypes) {
    double worst_red = 0, worst_fwd = 0, worst_bred = 0, worst_bwd = 0;
    size_t bad_repeat = 0, bad_inplace = 0;
    for (const Shape& s : kBnShapes) {
      const int64_t N = s[0], C = s[1], L = bn_inner(s), M = N * L;
      // Channels off zero (mean 1.5, scale 2), so the sums do not cancel.
      Vec xv = random_values(size_t(shape_numel(s)), seed++);
      for (double& v : xv) v = 1.5 + 2 * v;
      Tensor x = make(xv, s, t), xg = x.to(kGpu);
      Tensor dy = make(random_values(size_t(shape_numel(s)), seed++), s, t), dyg = dy.to(kGpu);
      Tensor gamma = make(random_values(size_t(C), seed++), {C}, t), beta = make(random_values(size_t(C), seed++), {C}, t);
      Tensor gammag = gamma.to(kGpu), betag = beta.to(kGpu);

      // Statistics. sums starts as garbage on both: overwritten.
      Tensor sums = make(Vec(size_t(2 * C), 7.0), {2, C}, DType::f64), sumsg = sums.to(kGpu);
      ops::batchnorm_reduce(x, sums);
      ops::batchnorm_reduce(xg, sumsg);
      const Vec rs = sums.to_doubles(), gs = sumsg.to_doubles();
      worst_red = std::max(worst_red, sums_err(gs, rs, C));
      Tensor again = Tensor::empty({2, C}, DType::f64, kGpu);
      ops::batchnorm_reduce(xg, again);
      bad_repeat += mismatches(again.to_doubles(), gs);

      // mean and invstd from the CPU's sums, the same on both backends.
      Vec mean(static_cast<size_t>(C)), invstd(static_cast<size_t>(C));
      for (int64_t c = 0; c < C; ++c) {
        mean[size_t(c)] = rs[size_t(c)] / double(M);
        const double var = std::max(0.0, rs[size_t(C + c)] / double(M) - mean[size_t(c)] * mean[size_t(c)]);
        invstd[size_t(c)] = 1 / std::sqrt(var + eps);
      }
      Tensor mt = make(mean, {C}, t), it = make(invstd, {C}, t), mg = mt.to(kGpu), ig = it.to(kGpu);

      Tensor y = Tensor::empty(s, t), yg = Tensor::empty(s, t, kGpu);
      ops::batchnorm_forward(x, mt, it, gamma, beta, y);
      ops::batchnorm_forward(xg, mg, ig, gammag, betag, yg);
      const Vec gy = yg.to_doubles();
      worst_fwd = std::max(worst_fwd, max_rel_err(gy, y.to_doubles()));
      Tensor inplace = xg.clone();  // y = x: the same values as out of place
      ops::batchnorm_forward(inplace, mg, ig, gammag, betag, inplace);
      bad_inplace += mismatches(inplace.to_doubles(), gy);

      // Backward: reductions, then dx from the CPU's sums (the same on both).
      Tensor bsums = make(Vec(size_t(2 * C), 7.0), {2, C}, DType::f64), bsumsg = bsums.to(kGpu);
      ops::batchnorm_backward_reduce(dy, x, mt, it, bsums);
      ops::batchnorm_backward_reduce(dyg, xg, mg, ig, bsumsg);
      const Vec gb = bsumsg.to_doubles();
      worst_bred = std::max(worst_bred, sums_err(gb, bsums.to_doubles(), C));
      ops::batchnorm_backward_reduce(dyg, xg, mg, ig, again);
      bad_repeat += mismatches(again.to_doubles(), gb);

      Tensor dx = make(Vec(size_t(shape_numel(s)), 7.0), s, t), dxg = dx.to(kGpu);
      ops::batchnorm_backward(dy, x, mt, it, gamma, bsums, double(M), dx);
      ops::batchnorm_backward(dyg, xg, mg, ig, gammag, bsums.to(kGpu), double(M), dxg);
      worst_bwd = std::max(worst_bwd, max_rel_err(dxg.to_doubles(), dx.to_doubles()));
    }
    const std::string dt(dtype_name(t));
    report("batchnorm_reduce", dt, worst_red, bn_tol(t));
    report("batchnorm_forward", dt, worst_fwd, bn_tol(t));
    report("batchnorm_backward_reduce", dt, worst_bred, bn_tol(t));
    report("batchnorm_backward", dt, worst_bwd, bn_tol(t));
    report_exact("batchnorm_deterministic", dt, bad_repeat, 0);
    report_exact("batchnorm_forward_inplace", dt, bad_inplace, 0);
  }
}

}  // namespace
}  // namespace dtk
