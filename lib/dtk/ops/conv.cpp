// Public ops of convolutional networks (ops.h, "convolutional nets"): argument checks, then the
// backend of the tensors' device; the convolution itself is im2col and gemm here, once for both
// backends.
#include <string>

#include "dtk/ops/backend.h"
#include "dtk/ops/check.h"

namespace dtk::ops {

namespace {

void check_window(const char* op, const Window& g) {
  if (g.kh < 1 || g.kw < 1 || g.stride_h < 1 || g.stride_w < 1 || g.pad_h < 0 || g.pad_w < 0)
    fail_usage("{}: kernel and stride must be at least 1 and padding at least 0, got kernel {}x{}, stride {}x{}, "
               "padding {}x{}",
               op, g.kh, g.kw, g.stride_h, g.stride_w, g.pad_h, g.pad_w);
  if (g.pad_h >= g.kh || g.pad_w >= g.kw)
    fail_usage("{}: padding {}x{} must be less than the kernel {}x{}", op, g.pad_h, g.pad_w, g.kh, g.kw);
}

// An image tensor [.., H, W] whose window fits: P, Q >= 1.
void check_fits(const char* op, const Tensor& x, const Window& g, const char* name) {
  const int64_t H = x.dim(-2), W = x.dim(-1);
  if (H + 2 * g.pad_h < g.kh || W + 2 * g.pad_w < g.kw)
    fail_usage("{}: the {}x{} window with padding {}x{} does not fit {} {}", op, g.kh, g.kw, g.pad_h, g.pad_w, name,
               x.str());
}

void check_images(const char* op, const Tensor& x, int64_t ndim, const char* name) {
  detail::check_float(op, x, name);
  if (x.ndim() != ndim)
    fail_usage(std::string(op) + ": " + name + " must be " + (ndim == 3 ? "[C, H, W]" : "[N, C, H, W]") + ", got " +
               x.str());
}

// cols of one image [C, H, W] under window g.
Shape cols_shape(int64_t C, int64_t H, int64_t W, const Window& g) { return {C * g.kh * g.kw, g.out_h(H) * g.out_w(W)}; }

void check_stats(const char* op, const Tensor& x, const Tensor& t, const char* name) {
  detail::check_kind(op, x, t, name);
  detail::check_shape(op, t, {x.dim(1)}, name);
}

void check_sums(const char* op, const Tensor& x, const Tensor& sums) {
  detail::check_type(op, sums, DType::f64, "sums");
  detail::check_on(op, x, sums, "sums");
  detail::check_shape(op, sums, {2, x.dim(1)}, "sums");
}

void check_bn_input(const char* op, const Tensor& x, const char* name) {
  detail::check_float(op, x, name);
  if (x.ndim() < 2) fail_usage(std::string(op) + ": " + name + " must be [N, C, ...], got " + x.str());
}

}  // namespace

void im2col(const Tensor& x, const Window& win, Tensor& cols) {
  check_window("im2col", win);
  check_images("im2col", x, 3, "x");
  check_fits("im2col", x, win, "x");
  detail::check_kind("im2col", x, cols, "cols");
  detail::check_shape("im2col", cols, cols_shape(x.dim(0), x.dim(1), x.dim(2), win), "cols");
  DTK_DISPATCH(x, im2col(x, win, cols));
}

void col2im(const Tensor& cols, const Window& win, Tensor& dx) {
  check_window("col2im", win);
  check_images("col2im", dx, 3, "dx");
  check_fits("col2im", dx, win, "dx");
  detail::check_kind("col2im", dx, cols, "cols");
  detail::check_shape("col2im", cols, cols_shape(dx.dim(0), dx.dim(1), dx.dim(2), win), "cols");
  DTK_DISPATCH(dx, col2im(cols, win, dx));
}

namespace {

// x [N, C, H, W], w [K, C, kh, kw] matching the window, y [N, K, P, Q], cols [C kh kw, P Q].
void check_conv(const char* op, const Tensor& x, const Tensor& w, const Window& g, const Tensor& cols,
                const Tensor& y, const char* yname) {
  check_window(op, g);
  check_images(op, x, 4, "x");
  check_fits(op, x, g, "x");
  detail::check_kind(op, x, w, "w");
  if (w.ndim() != 4 || w.dim(1) != x.dim(1) || w.dim(2) != g.kh || w.dim(3) != g.kw)
    fail_usage("{}: w must be [K, {}, {}, {}], got {}", op, x.dim(1), g.kh, g.kw, w.str());
  detail::check_kind(op, x, y, yname);
  detail::check_shape(op, y, {x.dim(0), w.dim(0), g.out_h(x.dim(2)), g.out_w(x.dim(3))}, yname);
  detail::check_kind(op, x, cols, "cols");
  detail::check_shape(op, cols, cols_shape(x.dim(1), x.dim(2), x.dim(3), g), "cols");
}

}  // namespace

void conv2d_forward(const Tensor& x, const Tensor& w, const Window& win, Tensor& cols, Tensor& y, Math math) {
  check_conv("conv2d_forward", x, w, win, cols, y, "y");
  const int64_t K = w.dim(0), PQ = cols.dim(1);
  const Tensor wm = w.reshape({K, cols.dim(0)});
  for (int64_t n = 0; n < x.dim(0); ++n) {
    DTK_DISPATCH(x, im2col(x.select(n), win, cols));
    Tensor yn = y.select(n).reshape({K, PQ});
    gemm(false, false, 1.0, wm, cols, 0.0, yn, math);  // y[n] = W cols
  }
}

void conv2d_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Window& win, Tensor& cols,
                     Tensor& dcols, Tensor& dw, Tensor* dx, Math math) {
  check_conv("conv2d_backward", x, w, win, cols, dy, "dy");
  detail::check_like("conv2d_backward", cols, dcols, "dcols");
  detail::check_shape("conv2d_backward", dcols, cols.shape(), "dcols");
  detail::check_like("conv2d_backward", w, dw, "dw");
  detail::check_shape("conv2d_backward", dw, w.shape(), "dw");
  if (dx) {
    detail::check_like("conv2d_backward", x, *dx, "dx");
    detail::check_shape("conv2d_backward", *dx, x.shape(), "dx");
  }
  const int64_t K = w.dim(0), PQ = cols.dim(1);
  const Tensor wm = w.reshape({K, cols.dim(0)});
  Tensor dwm = dw.reshape({K, cols.dim(0)});
  for (int64_t n = 0; n < x.dim(0); ++n) {
    const Tensor dyn = dy.select(n).reshape({K, PQ});
    DTK_DISPATCH(x, im2col(x.select(n), win, cols));
    gemm(false, true, 1.0, dyn, cols, 1.0, dwm, math);  // dW += dy[n] cols^T
    if (dx) {
      gemm(true, false, 1.0, wm, dyn, 0.0, dcols, math);  // dcols = W^T dy[n]
      Tensor dxn = dx->select(n);
      DTK_DISPATCH(x, col2im(dcols, win, dxn));
    }
  }
}

void maxpool2d_forward(const Tensor& x, const Window& win, Tensor& y, Tensor& argmax) {
  check_window("maxpool2d_forward", win);
  check_images("maxpool2d_forward", x, 4, "x");
  check_fits("maxpool2d_forward", x, win, "x");
  if (x.dim(2) * x.dim(3) > INT32_MAX) fail_usage("maxpool2d_forward: images beyond 2^31 - 1 pixels, got " + x.str());
  const Shape out{x.dim(0), x.dim(1), win.out_h(x.dim(2)), win.out_w(x.dim(3))};
  detail::check_kind("maxpool2d_forward", x, y, "y");
  detail::check_shape("maxpool2d_forward", y, out, "y");
  detail::check_type("maxpool2d_forward", argmax, DType::i32, "argmax");
  detail::check_on("maxpool2d_forward", x, argmax, "argmax");
  detail::check_shape("maxpool2d_forward", argmax, out, "argmax");
  DTK_DISPATCH(x, maxpool2d_forward(x, win, y, argmax));
}

void maxpool2d_backward(const Tensor& argmax, const Tensor& dy, const Window& win, Tensor& dx) {
  check_window("maxpool2d_backward", win);
  check_images("maxpool2d_backward", dx, 4, "dx");
  check_fits("maxpool2d_backward", dx, win, "dx");
  const Shape out{dx.dim(0), dx.dim(1), win.out_h(dx.dim(2)), win.out_w(dx.dim(3))};
  detail::check_kind("maxpool2d_backward", dx, dy, "dy");
  detail::check_shape("maxpool2d_backward", dy, out, "dy");
  detail::check_type("maxpool2d_backward", argmax, DType::i32, "argmax");
  detail::check_on("maxpool2d_backward", dx, argmax, "argmax");
  detail::check_shape("maxpool2d_backward", argmax, out, "argmax");
  DTK_DISPATCH(dx, maxpool2d_backward(argmax, dy, win, dx));
}

void batchnorm_reduce(const Tensor& x, Tensor& sums) {
  check_bn_input("batchnorm_reduce", x, "x");
  check_sums("batchnorm_reduce", x, sums);
  DTK_DISPATCH(x, batchnorm_reduce(x, sums));
}

void batchnorm_forward(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& gamma,
                       const Tensor& beta, Tensor& y) {
  const char* op = "batchnorm_forward";
  check_bn_input(op, x, "x");
  check_stats(op, x, mean, "mean");
  check_stats(op, x, invstd, "invstd");
  check_stats(op, x, gamma, "gamma");
  check_stats(op, x, beta, "beta");
  detail::check_like(op, x, y, "y");
  DTK_DISPATCH(x, batchnorm_forward(x, mean, invstd, gamma, beta, y));
}

void batchnorm_backward_reduce(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                               Tensor& sums) {
  const char* op = "batchnorm_backward_reduce";
  check_bn_input(op, x, "x");
  detail::check_like(op, x, dy, "dy");
  check_stats(op, x, mean, "mean");
  check_stats(op, x, invstd, "invstd");
  check_sums(op, x, sums);
  DTK_DISPATCH(x, batchnorm_backward_reduce(dy, x, mean, invstd, sums));
}

void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                        const Tensor& gamma, const Tensor& sums, double count, Tensor& dx) {
  const char* op = "batchnorm_backward";
  check_bn_input(op, x, "x");
  detail::check_like(op, x, dy, "dy");
  check_stats(op, x, mean, "mean");
  check_stats(op, x, invstd, "invstd");
  check_stats(op, x, gamma, "gamma");
  check_sums(op, x, sums);
  detail::check_like(op, x, dx, "dx");
  if (!(count >= 1)) fail_usage("batchnorm_backward: count must be at least 1, got {}", count);
  DTK_DISPATCH(x, batchnorm_backward(dy, x, mean, invstd, gamma, sums, count, dx));
}

}  // namespace dtk::ops
