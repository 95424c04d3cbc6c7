// CPU ops of convolutional networks: im2col and its adjoint, max pooling, and the batch-norm
// reductions and elementwise passes (ops.h, "convolutional nets"). Every output element is
// written by one thread, and every sum runs in a fixed order (col2im and the pooling backward
// gather their terms instead of scattering them), so results do not depend on the number of
// threads. Batch-norm sums accumulate in double, per channel in (n, l) order.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "dtk/ops/backend.h"
#include "dtk/ops/cpu/internal.h"

namespace dtk::ops::cpu {

namespace {

// The outputs o (of `n_out`) whose windows cover input position `pos` along one dimension:
// o stride - pad + k = pos for some kernel offset k in [0, kernel): [lo, hi).
inline void covering(int64_t pos, int64_t kernel, int64_t stride, int64_t pad, int64_t n_out, int64_t& lo,
                     int64_t& hi) {
  const int64_t first = pos + pad - kernel + 1;  // o stride >= first
  lo = first <= 0 ? 0 : (first + stride - 1) / stride;
  hi = std::min(n_out, (pos + pad) / stride + 1);
}

template <typename T>
void im2col_t(const Tensor& x, const Window& g, Tensor& cols) {
  const int64_t C = x.dim(0), H = x.dim(1), W = x.dim(2), P = g.out_h(H), Q = g.out_w(W);
  const T* xp = x.ptr<T>();
  T* cp = cols.ptr<T>();
  const int64_t rows = C * g.kh * g.kw;
#pragma omp parallel for schedule(static) if (rows * P * Q >= kParallelMin)
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t c = row / (g.kh * g.kw), i = row / g.kw % g.kh, j = row % g.kw;
    T* out = cp + row * P * Q;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t h = p * g.stride_h - g.pad_h + i;
      for (int64_t q = 0; q < Q; ++q) {
        const int64_t w = q * g.stride_w - g.pad_w + j;
        out[p * Q + q] = (h >= 0 && h < H && w >= 0 && w < W) ? xp[(c * H + h) * W + w] : T(0);
      }
    }
  }
}

// dx[c, h, w] = the sum over kernel offsets (i, j) (row-major: the order of cols' rows) of
// cols[(c, i, j), (p, q)] where p stride_h - pad_h + i = h and q stride_w - pad_w + j = w.
template <typename T>
void col2im_t(const Tensor& cols, const Window& g, Tensor& dx) {
  const int64_t C = dx.dim(0), H = dx.dim(1), W = dx.dim(2), P = g.out_h(H), Q = g.out_w(W);
  const T* cp = cols.ptr<T>();
  T* dp = dx.ptr<T>();
#pragma omp parallel for schedule(static) if (C * H * W * g.kh * g.kw >= kParallelMin)
  for (int64_t ch = 0; ch < C * H; ++ch) {
    const int64_t c = ch / H, h = ch % H;
    for (int64_t w = 0; w < W; ++w) {
      T s = 0;
      for (int64_t i = 0; i < g.kh; ++i) {
        const int64_t ph = h + g.pad_h - i;
        if (ph < 0 || ph % g.stride_h != 0 || ph / g.stride_h >= P) continue;
        const int64_t p = ph / g.stride_h;
        for (int64_t j = 0; j < g.kw; ++j) {
          const int64_t qw = w + g.pad_w - j;
          if (qw < 0 || qw % g.stride_w != 0 || qw / g.stride_w >= Q) continue;
          s += cp[((c * g.kh + i) * g.kw + j) * P * Q + p * Q + qw / g.stride_w];
        }
      }
      dp[(c * H + h) * W + w] = s;
    }
  }
}

template <typename T>
void maxpool_forward_t(const Tensor& x, const Window& g, Tensor& y, Tensor& argmax) {
  const int64_t NC = x.dim(0) * x.dim(1), H = x.dim(2), W = x.dim(3), P = g.out_h(H), Q = g.out_w(W);
  const T* xp = x.ptr<T>();
  T* yp = y.ptr<T>();
  int32_t* ap = argmax.ptr<int32_t>();
#pragma omp parallel for schedule(static) if (NC * P * Q * g.kh * g.kw >= kParallelMin)
  for (int64_t nc = 0; nc < NC; ++nc) {
    const T* xc = xp + nc * H * W;
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q) {
        int64_t best = -1;
        T v = 0;
        for (int64_t i = 0; i < g.kh; ++i) {
          const int64_t h = p * g.stride_h - g.pad_h + i;
          if (h < 0 || h >= H) continue;
          for (int64_t j = 0; j < g.kw; ++j) {
            const int64_t w = q * g.stride_w - g.pad_w + j;
            if (w < 0 || w >= W) continue;
            const T u = xc[h * W + w];
            if (best < 0 || u > v || (std::isnan(u) && !std::isnan(v))) {
              best = h * W + w;
              v = u;
            }
          }
        }
        yp[(nc * P + p) * Q + q] = v;
        ap[(nc * P + p) * Q + q] = static_cast<int32_t>(best);
      }
  }
}

template <typename T>
void maxpool_backward_t(const Tensor& argmax, const Tensor& dy, const Window& g, Tensor& dx) {
  const int64_t NC = dx.dim(0) * dx.dim(1), H = dx.dim(2), W = dx.dim(3), P = dy.dim(2), Q = dy.dim(3);
  const int32_t* ap = argmax.ptr<int32_t>();
  const T* dyp = dy.ptr<T>();
  T* dxp = dx.ptr<T>();
#pragma omp parallel for schedule(static) if (NC * H * W >= kParallelMin)
  for (int64_t nc = 0; nc < NC; ++nc)
    for (int64_t h = 0; h < H; ++h) {
      int64_t p0, p1;
      covering(h, g.kh, g.stride_h, g.pad_h, P, p0, p1);
      for (int64_t w = 0; w < W; ++w) {
        int64_t q0, q1;
        covering(w, g.kw, g.stride_w, g.pad_w, Q, q0, q1);
        T s = 0;
        for (int64_t p = p0; p < p1; ++p)
          for (int64_t q = q0; q < q1; ++q) {
            const int64_t o = (nc * P + p) * Q + q;
            if (ap[o] == h * W + w) s += dyp[o];
          }
        dxp[(nc * H + h) * W + w] = s;
      }
    }
}

// Per channel c: f(value index) over its N L elements in (n, l) order, summed in double.
template <typename F>
void channel_sums(int64_t N, int64_t C, int64_t L, double* s0, double* s1, F&& f) {
#pragma omp parallel for schedule(static) if (N * C * L >= kParallelMin)
  for (int64_t c = 0; c < C; ++c) {
    double a = 0, b = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0, i = (n * C + c) * L; l < L; ++l, ++i) f(i, c, a, b);
    s0[c] = a;
    s1[c] = b;
  }
}

}  // namespace

void im2col(const Tensor& x, const Window& win, Tensor& cols) {
  visit_float(x.dtype(), [&](auto t) { im2col_t<decltype(t)>(x, win, cols); });
}

void col2im(const Tensor& cols, const Window& win, Tensor& dx) {
  visit_float(dx.dtype(), [&](auto t) { col2im_t<decltype(t)>(cols, win, dx); });
}

void maxpool2d_forward(const Tensor& x, const Window& win, Tensor& y, Tensor& argmax) {
  visit_float(x.dtype(), [&](auto t) { maxpool_forward_t<decltype(t)>(x, win, y, argmax); });
}

void maxpool2d_backward(const Tensor& argmax, const Tensor& dy, const Window& win, Tensor& dx) {
  visit_float(dx.dtype(), [&](auto t) { maxpool_backward_t<decltype(t)>(argmax, dy, win, dx); });
}

void batchnorm_reduce(const Tensor& x, Tensor& sums) {
  const int64_t N = x.dim(0), C = x.dim(1), L = channel_size(x);
  double* s = sums.ptr<double>();
  visit_float(x.dtype(), [&](auto t) {
    const auto* xp = x.ptr<decltype(t)>();
    channel_sums(N, C, L, s, s + C, [&](int64_t i, int64_t, double& a, double& b) {
      const double v = xp[i];
      a += v;
      b += v * v;
    });
  });
}

void batchnorm_forward(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& gamma,
                       const Tensor& beta, Tensor& y) {
  const int64_t NC = x.dim(0) * x.dim(1), C = x.dim(1), L = channel_size(x);
  visit_float(x.dtype(), [&](auto t) {
    using T = decltype(t);
    const T *xp = x.ptr<T>(), *m = mean.ptr<T>(), *r = invstd.ptr<T>(), *gm = gamma.ptr<T>(), *bt = beta.ptr<T>();
    T* yp = y.ptr<T>();
#pragma omp parallel for schedule(static) if (NC * L >= kParallelMin)
    for (int64_t nc = 0; nc < NC; ++nc) {
      const int64_t c = nc % C;
      const T mc = m[c], a = r[c] * gm[c], b = bt[c];
      for (int64_t l = nc * L; l < (nc + 1) * L; ++l) yp[l] = (xp[l] - mc) * a + b;
    }
  });
}

void batchnorm_backward_reduce(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                               Tensor& sums) {
  const int64_t N = x.dim(0), C = x.dim(1), L = channel_size(x);
  double* s = sums.ptr<double>();
  visit_float(x.dtype(), [&](auto t) {
    using T = decltype(t);
    const T *xp = x.ptr<T>(), *dp = dy.ptr<T>(), *m = mean.ptr<T>(), *r = invstd.ptr<T>();
    channel_sums(N, C, L, s, s + C, [&](int64_t i, int64_t c, double& a, double& b) {
      const double d = dp[i];
      a += d;
      b += d * ((static_cast<double>(xp[i]) - m[c]) * r[c]);
    });
  });
}

void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                        const Tensor& gamma, const Tensor& sums, double count, Tensor& dx) {
  const int64_t NC = x.dim(0) * x.dim(1), C = x.dim(1), L = channel_size(x);
  const double* s = sums.ptr<double>();
  visit_float(x.dtype(), [&](auto t) {
    using T = decltype(t);
    const T *xp = x.ptr<T>(), *dp = dy.ptr<T>(), *m = mean.ptr<T>(), *r = invstd.ptr<T>(), *gm = gamma.ptr<T>();
    T* dxp = dx.ptr<T>();
#pragma omp parallel for schedule(static) if (NC * L >= kParallelMin)
    for (int64_t nc = 0; nc < NC; ++nc) {
      const int64_t c = nc % C;
      const T mc = m[c], rc = r[c], a = gm[c] * rc;
      const T mean_dy = static_cast<T>(s[c] / count), mean_dyx = static_cast<T>(s[C + c] / count);
      for (int64_t l = nc * L; l < (nc + 1) * L; ++l) dxp[l] = a * (dp[l] - mean_dy - (xp[l] - mc) * rc * mean_dyx);
    }
  });
}

}  // namespace dtk::ops::cpu
