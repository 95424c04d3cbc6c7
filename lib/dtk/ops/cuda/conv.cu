// CUDA ops of convolutional networks (ops.h, "convolutional nets"): im2col and its adjoint
// col2im, max pooling forward and backward, and the batch-norm reductions and elementwise passes.
// Deterministic by construction, no atomics: col2im and the pooling backward gather their terms
// (one thread per output element, adding in the documented order, the same as the CPU backend's),
// and the batch-norm sums are fixed-tree block reductions in double, one block per channel, with a
// block size that depends only on the sizes.
#include "dtk/ops/cuda/common.cuh"

namespace dtk::ops::cuda {
using namespace kern;

namespace {

constexpr int kThreads = 256;

// The window and image sizes a kernel needs, passed by value (ops::Window's methods are host-only).
// C is the channels of one image (im2col / col2im) or N C planes (pooling).
struct Geom {
  int64_t C, H, W, P, Q;
  int64_t kh, kw, sh, sw, ph, pw;
};

Geom geom(int64_t C, int64_t H, int64_t W, const Window& g) {
  return {C, H, W, g.out_h(H), g.out_w(W), g.kh, g.kw, g.stride_h, g.stride_w, g.pad_h, g.pad_w};
}

// The outputs o (of n_out) whose windows cover input position pos along one dimension, i.e.
// o stride - pad + k = pos for some kernel offset k in [0, kernel): the range [lo, hi).
__device__ __forceinline__ void covering(int64_t pos, int64_t kernel, int64_t stride, int64_t pad, int64_t n_out,
                                         int64_t& lo, int64_t& hi) {
  const int64_t first = pos + pad - kernel + 1;  // o stride >= first
  lo = first <= 0 ? 0 : (first + stride - 1) / stride;
  const int64_t last = (pos + pad) / stride + 1;  // pos + pad >= 0: o stride <= pos + pad
  hi = last < n_out ? last : n_out;
}

// ------------------------------------------------------------------------------- im2col / col2im
// cols [C kh kw, P Q]: one thread per element. Element (row (c, i, j), column (p, q)) copies
// x[c, p sh - ph + i, q sw - pw + j], or 0 when that position is in the padding.
template <typename T>
__global__ void im2col_kernel(const T* x, T* cols, Geom g) {
  const int64_t PQ = g.P * g.Q, n = g.C * g.kh * g.kw * PQ;
  for (int64_t e = global_tid(); e < n; e += grid_stride()) {
    const int64_t row = e / PQ, col = e - row * PQ;
    const int64_t p = col / g.Q, q = col - p * g.Q;
    const int64_t c = row / (g.kh * g.kw), i = row / g.kw % g.kh, j = row % g.kw;
    const int64_t h = p * g.sh - g.ph + i, w = q * g.sw - g.pw + j;
    cols[e] = (h >= 0 && h < g.H && w >= 0 && w < g.W) ? x[(c * g.H + h) * g.W + w] : T(0);
  }
}

// dx [C, H, W]: one thread per element (c, h, w). It sums, over the rows (c, i, j) of its channel
// in increasing order, the one column (p, q) each lands in, if any: p sh - ph + i = h and
// q sw - pw + j = w. That is row-major order of cols, and exactly the CPU backend's sum.
template <typename T>
__global__ void col2im_kernel(const T* cols, T* dx, Geom g) {
  const int64_t PQ = g.P * g.Q, n = g.C * g.H * g.W;
  for (int64_t e = global_tid(); e < n; e += grid_stride()) {
    const int64_t c = e / (g.H * g.W), hw = e - c * g.H * g.W;
    const int64_t h = hw / g.W, w = hw - h * g.W;
    T s = 0;
    for (int64_t i = 0; i < g.kh; ++i) {
      const int64_t hp = h + g.ph - i;  // = p sh
      if (hp < 0 || hp % g.sh != 0 || hp / g.sh >= g.P) continue;
      const int64_t p = hp / g.sh;
      for (int64_t j = 0; j < g.kw; ++j) {
        const int64_t wq = w + g.pw - j;  // = q sw
        if (wq < 0 || wq % g.sw != 0 || wq / g.sw >= g.Q) continue;
        const int64_t row = (c * g.kh + i) * g.kw + j;
        s += cols[row * PQ + p * g.Q + wq / g.sw];
      }
    }
    dx[e] = s;
  }
}

// ------------------------------------------------------------------------------- max pooling
// y, argmax [N C, P, Q]: one thread per output. Scans the window row-major (i, then j), skipping
// positions outside the image; the first in-image value starts the scan, and a value replaces
// the current winner when strictly greater, or when it is a NaN and the winner is not (so the
// first NaN wins and stays). argmax is the winner's h W + w within its plane. A window with no
// in-image position (only possible for an empty image) gives 0 and -1, as on the CPU.
template <typename T>
__global__ void maxpool_forward_kernel(const T* x, T* y, int32_t* argmax, Geom g) {
  const int64_t PQ = g.P * g.Q, n = g.C * PQ;
  for (int64_t e = global_tid(); e < n; e += grid_stride()) {
    const int64_t nc = e / PQ, pq = e - nc * PQ;
    const int64_t p = pq / g.Q, q = pq - p * g.Q;
    const T* xc = x + nc * g.H * g.W;
    int64_t best = -1;
    T v = 0;
    for (int64_t i = 0; i < g.kh; ++i) {
      const int64_t h = p * g.sh - g.ph + i;
      if (h < 0 || h >= g.H) continue;
      for (int64_t j = 0; j < g.kw; ++j) {
        const int64_t w = q * g.sw - g.pw + j;
        if (w < 0 || w >= g.W) continue;
        const T u = xc[h * g.W + w];
        if (best < 0 || u > v || (d_isnan(u) && !d_isnan(v))) {
          best = h * g.W + w;
          v = u;
        }
      }
    }
    y[e] = v;
    argmax[e] = static_cast<int32_t>(best);
  }
}

// dx [N C, H, W]: one thread per input element (plane nc, h, w). It loops over the outputs
// (p, q) whose windows cover it, in row-major order, adding dy where argmax names it.
template <typename T>
__global__ void maxpool_backward_kernel(const int32_t* argmax, const T* dy, T* dx, Geom g) {
  const int64_t HW = g.H * g.W, n = g.C * HW;
  for (int64_t e = global_tid(); e < n; e += grid_stride()) {
    const int64_t nc = e / HW, hw = e - nc * HW;
    const int64_t h = hw / g.W, w = hw - h * g.W;
    int64_t p0, p1, q0, q1;
    covering(h, g.kh, g.sh, g.ph, g.P, p0, p1);
    covering(w, g.kw, g.sw, g.pw, g.Q, q0, q1);
    const int32_t* ac = argmax + nc * g.P * g.Q;
    const T* dyc = dy + nc * g.P * g.Q;
    T s = 0;
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t q = q0; q < q1; ++q)
        if (ac[p * g.Q + q] == hw) s += dyc[p * g.Q + q];
    dx[e] = s;
  }
}

// ------------------------------------------------------------------------------- batch norm
// x [N, C, L] (the dims after C flattened into L). Channel c's elements are N runs of L
// contiguous values, run n starting at (n C + c) L.

// The block's per-thread partial sums a and b of channel c, reduced in a fixed tree, into
// sums[0][c] and sums[1][c].
__device__ void store_channel_sums(double a, double b, double* sums, int64_t c, int64_t C, double* scratch) {
  a = block_reduce(a, SumOp{}, 0.0, scratch);
  b = block_reduce(b, SumOp{}, 0.0, scratch);
  if (threadIdx.x == 0) {
    sums[c] = a;
    sums[C + c] = b;
  }
}

// sums f64 [2, C]: one block per channel (blockIdx.x = c). Thread t accumulates, in double,
// elements k = t, t + blockDim, ... of the channel's N L (k = n L + l), then two fixed-tree block
// reductions give sums[0][c] = sum x and sums[1][c] = sum x^2.
template <typename T>
__global__ void batchnorm_reduce_kernel(const T* x, double* sums, int64_t N, int64_t C, int64_t L) {
  __shared__ double scratch[32];
  const int64_t c = blockIdx.x, NL = N * L;
  double a = 0, b = 0;
  for (int64_t k = threadIdx.x; k < NL; k += blockDim.x) {
    const int64_t n = k / L, l = k - n * L;
    const double v = static_cast<double>(x[(n * C + c) * L + l]);
    a += v;
    b += v * v;
  }
  store_channel_sums(a, b, sums, c, C, scratch);
}

// The same layout: sums[0][c] = sum dy, sums[1][c] = sum dy (x - mean[c]) invstd[c], in double.
template <typename T>
__global__ void batchnorm_backward_reduce_kernel(const T* dy, const T* x, const T* mean, const T* invstd,
                                                 double* sums, int64_t N, int64_t C, int64_t L) {
  __shared__ double scratch[32];
  const int64_t c = blockIdx.x, NL = N * L;
  const double m = static_cast<double>(mean[c]), r = static_cast<double>(invstd[c]);
  double a = 0, b = 0;
  for (int64_t k = threadIdx.x; k < NL; k += blockDim.x) {
    const int64_t n = k / L, i = (n * C + c) * L + (k - n * L);
    const double d = static_cast<double>(dy[i]);
    a += d;
    b += d * ((static_cast<double>(x[i]) - m) * r);
  }
  store_channel_sums(a, b, sums, c, C, scratch);
}

// y = (x - mean[c]) (invstd[c] gamma[c]) + beta[c]: one thread per element, channel (e / L) % C.
// Each thread reads its x before writing its y, so y may be x.
template <typename T>
__global__ void batchnorm_forward_kernel(const T* x, const T* mean, const T* invstd, const T* gamma, const T* beta,
                                         T* y, int64_t n, int64_t C, int64_t L) {
  for (int64_t e = global_tid(); e < n; e += grid_stride()) {
    const int64_t c = e / L % C;
    y[e] = (x[e] - mean[c]) * (invstd[c] * gamma[c]) + beta[c];
  }
}

// dx = gamma[c] invstd[c] (dy - sums[0][c] / count - (x - mean[c]) invstd[c] sums[1][c] / count):
// one thread per element; the two means are taken in double and rounded to T, as on the CPU.
template <typename T>
__global__ void batchnorm_backward_kernel(const T* dy, const T* x, const T* mean, const T* invstd, const T* gamma,
                                          const double* sums, double count, T* dx, int64_t n, int64_t C, int64_t L) {
  for (int64_t e = global_tid(); e < n; e += grid_stride()) {
    const int64_t c = e / L % C;
    const T r = invstd[c];
    const T mean_dy = static_cast<T>(sums[c] / count), mean_dyx = static_cast<T>(sums[C + c] / count);
    dx[e] = (gamma[c] * r) * (dy[e] - mean_dy - (x[e] - mean[c]) * r * mean_dyx);
  }
}

}  // namespace

void im2col(const Tensor& x, const Window& win, Tensor& cols) {
  const Geom g = geom(x.dim(0), x.dim(1), x.dim(2), win);
  const int64_t n = cols.numel();
  if (n == 0) return;
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    im2col_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream()>>>(x.ptr<T>(), cols.ptr<T>(), g);
  });
  check_launch("im2col");
}

void col2im(const Tensor& cols, const Window& win, Tensor& dx) {
  const Geom g = geom(dx.dim(0), dx.dim(1), dx.dim(2), win);
  const int64_t n = dx.numel();
  if (n == 0) return;
  visit_float(dx.dtype(), [&](auto tag) {
    using T = decltype(tag);
    col2im_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream()>>>(cols.ptr<T>(), dx.ptr<T>(), g);
  });
  check_launch("col2im");
}

void maxpool2d_forward(const Tensor& x, const Window& win, Tensor& y, Tensor& argmax) {
  const Geom g = geom(x.dim(0) * x.dim(1), x.dim(2), x.dim(3), win);
  const int64_t n = y.numel();
  if (n == 0) return;
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    maxpool_forward_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream()>>>(x.ptr<T>(), y.ptr<T>(),
                                                                               argmax.ptr<int32_t>(), g);
  });
  check_launch("maxpool2d_forward");
}

void maxpool2d_backward(const Tensor& argmax, const Tensor& dy, const Window& win, Tensor& dx) {
  const Geom g = geom(dx.dim(0) * dx.dim(1), dx.dim(2), dx.dim(3), win);
  const int64_t n = dx.numel();
  if (n == 0) return;
  visit_float(dx.dtype(), [&](auto tag) {
    using T = decltype(tag);
    maxpool_backward_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream()>>>(argmax.ptr<int32_t>(),
                                                                                dy.ptr<T>(), dx.ptr<T>(), g);
  });
  check_launch("maxpool2d_backward");
}

void batchnorm_reduce(const Tensor& x, Tensor& sums) {
  const int64_t N = x.dim(0), C = x.dim(1), L = channel_size(x);
  if (C == 0) return;
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    batchnorm_reduce_kernel<T><<<static_cast<unsigned>(C), threads_for_row(N * L), 0, stream()>>>(
        x.ptr<T>(), sums.ptr<double>(), N, C, L);
  });
  check_launch("batchnorm_reduce");
}

void batchnorm_forward(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& gamma,
                       const Tensor& beta, Tensor& y) {
  const int64_t n = x.numel(), C = x.dim(1), L = channel_size(x);
  if (n == 0) return;
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    batchnorm_forward_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream()>>>(
        x.ptr<T>(), mean.ptr<T>(), invstd.ptr<T>(), gamma.ptr<T>(), beta.ptr<T>(), y.ptr<T>(), n, C, L);
  });
  check_launch("batchnorm_forward");
}

void batchnorm_backward_reduce(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                               Tensor& sums) {
  const int64_t N = x.dim(0), C = x.dim(1), L = channel_size(x);
  if (C == 0) return;
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    batchnorm_backward_reduce_kernel<T><<<static_cast<unsigned>(C), threads_for_row(N * L), 0, stream()>>>(
        dy.ptr<T>(), x.ptr<T>(), mean.ptr<T>(), invstd.ptr<T>(), sums.ptr<double>(), N, C, L);
  });
  check_launch("batchnorm_backward_reduce");
}

void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                        const Tensor& gamma, const Tensor& sums, double count, Tensor& dx) {
  const int64_t n = x.numel(), C = x.dim(1), L = channel_size(x);
  if (n == 0) return;
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    batchnorm_backward_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream()>>>(
        dy.ptr<T>(), x.ptr<T>(), mean.ptr<T>(), invstd.ptr<T>(), gamma.ptr<T>(), sums.ptr<double>(), count,
        dx.ptr<T>(), n, C, L);
  });
  check_launch("batchnorm_backward");
}

}  // namespace dtk::ops::cuda
