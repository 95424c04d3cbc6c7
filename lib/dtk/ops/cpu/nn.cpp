// CPU neural-network ops: softmax and log-softmax, cross entropy, RMSNorm, activations, RoPE and
// embeddings. f32 rows are computed in f32 by vectorised kernels (common.h: exp_f32, one clone
// per instruction set); f64 (the gradient checks) in double with libm. Every loop that a thread
// runs owns its outputs, and every sum runs in a fixed order within its row, so results do not
// depend on the number of threads. Index inputs (targets, ids) are validated in a serial pass
// before the parallel loop, because an exception must not leave an OpenMP region.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/ops/backend.h"
#include "dtk/ops/cpu/internal.h"

namespace dtk::ops::cpu {

namespace {

constexpr int64_t kColBlock = 64;  // columns per task of the column-wise accumulations

// ---- row kernels, written once in T. The f32 overloads are DTK_SIMD_CLONES: each clone inlines
// the template and vectorises it for its instruction set; the f64 overloads are plain.

// max of the row and log(sum exp(x - max))
template <typename T>
inline void max_logsum_t(const T* x, int64_t n, T& max_out, T& logsum_out) {
  T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += vexp(x[i] - m);
  max_out = m;
  logsum_out = std::log(s);
}

// y = exp(x - max) * (scale / sum), one exp per element; returns the log-sum-exp
template <typename T>
inline T softmax_row_t(const T* x, T* y, int64_t n, T scale) {
  T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  T l = 0;
#pragma omp simd reduction(+ : l)
  for (int64_t i = 0; i < n; ++i) {
    y[i] = vexp(x[i] - m);
    l += y[i];
  }
  const T k = scale / l;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= k;
  return m + std::log(l);
}

// y = exp(x - lse) * scale: a softmax row from its log-sum-exp, one pass (y may be x)
template <typename T>
inline void exp_shift_row_t(const T* x, T* y, int64_t n, T lse, T scale) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = vexp(x[i] - lse) * scale;
}

// x = a + b (b null: x is a, not written), then y = x rstd w; returns rstd
template <typename T>
inline T rmsnorm_row_t(const T* a, const T* b, const T* w, T eps, T* x, T* y, int64_t n) {
  T ss = 0;
  if (b) {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) {
      const T v = a[i] + b[i];
      x[i] = v;
      ss += v * v;
    }
    a = x;
  } else {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += a[i] * a[i];
  }
  const T rs = T(1) / std::sqrt(ss / static_cast<T>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] * rs * w[i];
  return rs;
}

// dx = rs w dy - x rs^3 / n sum(dy w x), or dx += that (accumulate)
template <typename T>
inline void rmsnorm_grad_row_t(const T* x, const T* w, T rs, const T* dy, T* dx, int64_t n, bool accumulate) {
  T dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < n; ++i) dot += dy[i] * w[i] * x[i];
  const T k = rs * rs * rs * dot / static_cast<T>(n);
  if (accumulate) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dx[i] += rs * dy[i] * w[i] - x[i] * k;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dx[i] = rs * dy[i] * w[i] - x[i] * k;
  }
}

template <typename T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + vexp(-x));
}

// y = silu(a) * b (b null: silu(a))
template <typename T>
inline void swiglu_t(const T* a, const T* b, T* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] * sigmoid(a[i]) * (b ? b[i] : T(1));
}

// da = dy b silu'(a), db = dy silu(a) (b null: da = dy silu'(a)); reads before writing (aliasing)
template <typename T>
inline void swiglu_grad_t(const T* a, const T* b, const T* dy, T* da, T* db, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const T av = a[i], bv = b ? b[i] : T(1), g = dy[i];
    const T s = sigmoid(av);
    da[i] = g * bv * (s + av * s * (T(1) - s));
    if (db) db[i] = g * av * s;
  }
}

DTK_SIMD_CLONES void max_logsum(const float* x, int64_t n, float& m, float& ls) { max_logsum_t(x, n, m, ls); }
DTK_SIMD_CLONES void exp_shift_row(const float* x, float* y, int64_t n, float lse, float scale) {
  exp_shift_row_t(x, y, n, lse, scale);
}
void exp_shift_row(const double* x, double* y, int64_t n, double lse, double scale) {
  exp_shift_row_t(x, y, n, lse, scale);
}
void max_logsum(const double* x, int64_t n, double& m, double& ls) { max_logsum_t(x, n, m, ls); }
DTK_SIMD_CLONES float rmsnorm_row(const float* a, const float* b, const float* w, float eps, float* x, float* y,
                                   int64_t n) {
  return rmsnorm_row_t(a, b, w, eps, x, y, n);
}
double rmsnorm_row(const double* a, const double* b, const double* w, double eps, double* x, double* y, int64_t n) {
  return rmsnorm_row_t(a, b, w, eps, x, y, n);
}
DTK_SIMD_CLONES void rmsnorm_grad_row(const float* x, const float* w, float rs, const float* dy, float* dx, int64_t n,
                                      bool accumulate) {
  rmsnorm_grad_row_t(x, w, rs, dy, dx, n, accumulate);
}
void rmsnorm_grad_row(const double* x, const double* w, double rs, const double* dy, double* dx, int64_t n,
                      bool accumulate) {
  rmsnorm_grad_row_t(x, w, rs, dy, dx, n, accumulate);
}
DTK_SIMD_CLONES void swiglu(const float* a, const float* b, float* y, int64_t n) { swiglu_t(a, b, y, n); }
void swiglu(const double* a, const double* b, double* y, int64_t n) { swiglu_t(a, b, y, n); }
DTK_SIMD_CLONES void swiglu_grad(const float* a, const float* b, const float* dy, float* da, float* db, int64_t n) {
  swiglu_grad_t(a, b, dy, da, db, n);
}
void swiglu_grad(const double* a, const double* b, const double* dy, double* da, double* db, int64_t n) {
  swiglu_grad_t(a, b, dy, da, db, n);
}

// An elementwise op over n elements in chunks, the chunks in parallel when n is large.
constexpr int64_t kChunk = 4096;
template <typename F>
void chunked(int64_t n, F&& f) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for if (n > kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) f(c * kChunk, std::min(kChunk, n - c * kChunk));
}

// f(r) for each row r of a [rows, n] op, the rows in parallel when the op is large.
template <typename F>
void for_rows(int64_t rows, int64_t n, F&& f) {
#pragma omp parallel for if (rows * n > kParallelMin)
  for (int64_t r = 0; r < rows; ++r) f(r);
}

int64_t last_dim(const Tensor& t) { return t.ndim() == 0 ? 1 : t.dim(-1); }
int64_t rows_of(const Tensor& t) {
  const int64_t n = last_dim(t);
  return n == 0 ? 0 : t.numel() / n;
}

template <typename T, typename F>
void map1(const Tensor& a, Tensor& out, F f) {
  const T* x = a.ptr<T>();
  T* y = out.ptr<T>();
  const int64_t n = out.numel();
#pragma omp parallel for if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] = f(x[i]);
}

template <typename T, typename F>
void map2(const Tensor& a, const Tensor& b, Tensor& out, F f) {
  const T* x = a.ptr<T>();
  const T* z = b.ptr<T>();
  T* y = out.ptr<T>();
  const int64_t n = out.numel();
#pragma omp parallel for if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] = f(x[i], z[i]);
}

constexpr double kGeluK = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluC = 0.044715;

void check_targets(const char* op, const int32_t* t, int64_t n, int64_t V) {
  for (int64_t i = 0; i < n; ++i)
    if (t[i] != -1 && (t[i] < 0 || t[i] >= V))
      fail_usage("{}: target {} at row {} is outside [0, {}) and is not -1 (ignored)", op, t[i], i, V);
}

void check_ids(const char* op, const int32_t* ids, int64_t n, int64_t V) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= V)
      fail_usage("{}: id {} at position {} is outside [0, {})", op, ids[i], i, V);
}

}  // namespace

DTK_SIMD_CLONES float softmax_row(const float* x, float* y, int64_t n, float scale) {
  return softmax_row_t(x, y, n, scale);
}
double softmax_row(const double* x, double* y, int64_t n, double scale) { return softmax_row_t(x, y, n, scale); }

// ---------------------------------------------------------------------------- softmax

void softmax_forward(const Tensor& x, Tensor& y) {
  const int64_t n = last_dim(x), rows = rows_of(x);
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.ptr<T>();
    T* yp = y.ptr<T>();
    for_rows(rows, n, [&](int64_t r) {
      softmax_row(xp + r * n, yp + r * n, n, T(1));
    });
  });
}

void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const int64_t n = last_dim(y), rows = rows_of(y);
  visit_float(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* yp = y.ptr<T>();
    const T* dyp = dy.ptr<T>();
    T* dxp = dx.ptr<T>();
    for_rows(rows, n, [&](int64_t r) {
      const T* yr = yp + r * n;
      const T* dyr = dyp + r * n;
      T* dxr = dxp + r * n;
      double s = 0;
      for (int64_t i = 0; i < n; ++i) s += static_cast<double>(dyr[i]) * static_cast<double>(yr[i]);
      for (int64_t i = 0; i < n; ++i)
        dxr[i] = static_cast<T>(static_cast<double>(yr[i]) * (static_cast<double>(dyr[i]) - s));
    });
  });
}

void log_softmax_forward(const Tensor& x, Tensor& y) {
  const int64_t n = last_dim(x), rows = rows_of(x);
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.ptr<T>();
    T* yp = y.ptr<T>();
    for_rows(rows, n, [&](int64_t r) {
      const T* xr = xp + r * n;
      T* yr = yp + r * n;
      T m, logsum;
      max_logsum(xr, n, m, logsum);
      for (int64_t i = 0; i < n; ++i) yr[i] = (xr[i] - m) - logsum;
    });
  });
}

void log_softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const int64_t n = last_dim(y), rows = rows_of(y);
  visit_float(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* yp = y.ptr<T>();
    const T* dyp = dy.ptr<T>();
    T* dxp = dx.ptr<T>();
    for_rows(rows, n, [&](int64_t r) {
      const T* yr = yp + r * n;
      const T* dyr = dyp + r * n;
      T* dxr = dxp + r * n;
      double s = 0;
      for (int64_t i = 0; i < n; ++i) s += static_cast<double>(dyr[i]);
      for (int64_t i = 0; i < n; ++i)
        dxr[i] = static_cast<T>(static_cast<double>(dyr[i]) - std::exp(static_cast<double>(yr[i])) * s);
    });
  });
}

// ---------------------------------------------------------------------------- cross entropy

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor& lse) {
  if (any_bf16({&logits})) {
    F32Copies f;
    cross_entropy_forward(f.in(logits), targets, losses, lse);
    return;
  }
  const int64_t N = logits.dim(0), V = logits.dim(1);
  const int32_t* tp = targets.ptr<int32_t>();
  check_targets("cross_entropy_forward", tp, N, V);
  visit_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = logits.ptr<T>();
    T* lp = losses.ptr<T>();
    T* sp = lse.ptr<T>();
    for_rows(N, V, [&](int64_t r) {
      if (tp[r] < 0) {
        lp[r] = sp[r] = T(0);
        return;
      }
      const T* xr = xp + r * V;
      T m, logsum;
      max_logsum(xr, V, m, logsum);
      sp[r] = m + logsum;
      lp[r] = (m + logsum) - xr[tp[r]];
    });
  });
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, double scale,
                            Tensor& dlogits) {
  if (any_bf16({&logits, &dlogits})) {
    F32Copies f;
    Tensor d = f.out(dlogits);
    cross_entropy_backward(f.in(logits), targets, lse, scale, d);
    return f.done();
  }
  const int64_t N = logits.dim(0), V = logits.dim(1);
  const int32_t* tp = targets.ptr<int32_t>();
  check_targets("cross_entropy_backward", tp, N, V);
  visit_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = logits.ptr<T>();
    const T* sp = lse.ptr<T>();
    T* dp = dlogits.ptr<T>();
    for_rows(N, V, [&](int64_t r) {
      const T* xr = xp + r * V;
      T* dr = dp + r * V;
      const int32_t t = tp[r];
      if (t < 0) {
        for (int64_t i = 0; i < V; ++i) dr[i] = T(0);
        return;
      }
      exp_shift_row(xr, dr, V, sp[r], static_cast<T>(scale));  // (softmax - onehot) * scale
      dr[t] -= static_cast<T>(scale);
    });
  });
}

// ---------------------------------------------------------------------------- rmsnorm

// y = rmsnorm(x) over rows, x = a + b first when b is given.
void rmsnorm_forward(const Tensor& a, const Tensor* b, const Tensor& w, double eps, Tensor& x, Tensor& y,
                     Tensor& rstd) {
  if (any_bf16({b, &w, &y})) {
    F32Copies f;
    const Tensor bf = b ? f.in(*b) : Tensor();
    Tensor yf = f.out(y);
    rmsnorm_forward(a, b ? &bf : nullptr, f.in(w), eps, x, yf, rstd);
    return f.done();
  }
  const int64_t D = last_dim(a), rows = rows_of(a);
  visit_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* ap = a.ptr<T>();
    const T* bp = b ? b->ptr<T>() : nullptr;
    const T* wp = w.ptr<T>();
    T* xp = x.ptr<T>();
    T* yp = y.ptr<T>();
    T* rp = rstd.ptr<T>();
    for_rows(rows, D, [&](int64_t r) {
      rp[r] = rmsnorm_row(ap + r * D, bp ? bp + r * D : nullptr, wp, static_cast<T>(eps), xp + r * D, yp + r * D, D);
    });
  });
}

// y_i = x_i r w_i with r = (mean(x^2) + eps)^(-1/2), so dr/dx_j = -r^3 x_j / D and
// dx_j = r w_j dy_j - x_j r^3 / D * sum_i(dy_i w_i x_i); dw_i += sum over rows of dy_i x_i r.
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                      Tensor& dw, bool accumulate) {
  if (any_bf16({&w, &dy})) {
    F32Copies f;
    rmsnorm_backward(x, f.in(w), rstd, f.in(dy), dx, dw, accumulate);
    return;
  }
  const int64_t D = last_dim(x), rows = rows_of(x);
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.ptr<T>();
    const T* wp = w.ptr<T>();
    const T* rp = rstd.ptr<T>();
    const T* dyp = dy.ptr<T>();
    T* dxp = dx.ptr<T>();
    T* dwp = dw.ptr<T>();
    // dw first, while dy and x are intact (dx may alias either).
    const int64_t nblocks = (D + kColBlock - 1) / kColBlock;
#pragma omp parallel for if (rows * D > kParallelMin)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t c0 = blk * kColBlock;
      const int64_t c1 = c0 + kColBlock < D ? c0 + kColBlock : D;
      double acc[kColBlock] = {};
      for (int64_t r = 0; r < rows; ++r) {
        const double rs = static_cast<double>(rp[r]);
        const T* xr = xp + r * D;
        const T* dyr = dyp + r * D;
        for (int64_t c = c0; c < c1; ++c)
          acc[c - c0] += static_cast<double>(dyr[c]) * static_cast<double>(xr[c]) * rs;
      }
      for (int64_t c = c0; c < c1; ++c) dwp[c] = static_cast<T>(static_cast<double>(dwp[c]) + acc[c - c0]);
    }
    for_rows(rows, D, [&](int64_t r) {
      rmsnorm_grad_row(xp + r * D, wp, rp[r], dyp + r * D, dxp + r * D, D, accumulate);
    });
  });
}

// ---------------------------------------------------------------------------- activations

void silu_forward(const Tensor& x, Tensor& y) {
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.ptr<T>();
    T* yp = y.ptr<T>();
    chunked(x.numel(), [&](int64_t i, int64_t n) { swiglu(xp + i, static_cast<const T*>(nullptr), yp + i, n); });
  });
}

void silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.ptr<T>();
    const T* gp = dy.ptr<T>();
    T* dxp = dx.ptr<T>();
    chunked(x.numel(), [&](int64_t i, int64_t n) {
      swiglu_grad(xp + i, static_cast<const T*>(nullptr), gp + i, dxp + i, static_cast<T*>(nullptr), n);
    });
  });
}

// GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_forward(const Tensor& x, Tensor& y) {
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map1<T>(x, y, [](T v) {
      const T k = T(kGeluK), c = T(kGeluC);
      return T(0.5) * v * (T(1) + std::tanh(k * (v + c * v * v * v)));
    });
  });
}

// sech^2 = 1 - tanh^2 (no cosh, which overflows for large |x|).
void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map2<T>(x, dy, dx, [](T v, T g) {
      const T k = T(kGeluK), c = T(kGeluC);
      const T t = std::tanh(k * (v + c * v * v * v));
      const T sech2 = T(1) - t * t;
      return g * (T(0.5) * (T(1) + t) + T(0.5) * v * sech2 * k * (T(1) + T(3) * c * v * v));
    });
  });
}

void relu_forward(const Tensor& x, Tensor& y) {
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map1<T>(x, y, [](T v) { return v > T(0) ? v : T(0); });
  });
}

void relu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map2<T>(x, dy, dx, [](T v, T g) { return v > T(0) ? g : T(0); });
  });
}

void swiglu_forward(const Tensor& a, const Tensor& b, Tensor& y) {
  if (any_bf16({&a})) {
    F32Copies f;
    Tensor yf = f.out(y);
    swiglu_forward(f.in(a), f.in(b), yf);
    return f.done();
  }
  visit_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* ap = a.ptr<T>();
    const T* bp = b.ptr<T>();
    T* yp = y.ptr<T>();
    chunked(a.numel(), [&](int64_t i, int64_t n) { swiglu(ap + i, bp + i, yp + i, n); });
  });
}

void swiglu_backward(const Tensor& a, const Tensor& b, const Tensor& dy, Tensor& da, Tensor& db) {
  if (any_bf16({&a})) {
    F32Copies f;
    Tensor daf = f.out(da), dbf = f.out(db);
    swiglu_backward(f.in(a), f.in(b), f.in(dy), daf, dbf);
    return f.done();
  }
  visit_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* ap = a.ptr<T>();
    const T* bp = b.ptr<T>();
    const T* gp = dy.ptr<T>();
    T* dap = da.ptr<T>();
    T* dbp = db.ptr<T>();
    chunked(a.numel(), [&](int64_t i, int64_t n) { swiglu_grad(ap + i, bp + i, gp + i, dap + i, dbp + i, n); });
  });
}

// ---------------------------------------------------------------------------- rope

namespace {

const double* cos_of(const RopeTable& t, double) { return t.cos.data(); }
const double* sin_of(const RopeTable& t, double) { return t.sin.data(); }
const float* cos_of(const RopeTable& t, float) { return t.cosf.data(); }
const float* sin_of(const RopeTable& t, float) { return t.sinf.data(); }

}  // namespace

void rope(const Tensor& x, double theta, int64_t pos0, bool inverse, Tensor& y) {
  if (any_bf16({&x})) {
    F32Copies f;
    Tensor yf = f.out(y);
    rope(f.in(x), theta, pos0, inverse, yf);
    return f.done();
  }
  const int64_t B = x.dim(0), T_ = x.dim(1), H = x.dim(2), hd = x.dim(3), half = hd / 2;
  const auto table = rope_table(T_, hd, theta, pos0);
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.ptr<T>();
    T* yp = y.ptr<T>();
    const T* cs = cos_of(*table, T{});
    const T* sn = sin_of(*table, T{});
    const T sign = inverse ? T(-1) : T(1);
#pragma omp parallel for collapse(2) if (x.numel() > kParallelMin)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T_; ++t) {
        const T* c = cs + t * half;
        const T* s = sn + t * half;
        for (int64_t h = 0; h < H; ++h) {
          const int64_t base = ((b * T_ + t) * H + h) * hd;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const T x0 = xp[base + 2 * i], x1 = xp[base + 2 * i + 1], si = sign * s[i];
            yp[base + 2 * i] = x0 * c[i] - x1 * si;
            yp[base + 2 * i + 1] = x0 * si + x1 * c[i];
          }
        }
      }
    }
  });
}

// The GPU's single launch is a saving the CPU has no use for: two passes.
void rope_qk(Tensor& q, Tensor& k, double theta, int64_t pos0, bool inverse) {
  rope(q, theta, pos0, inverse, q);
  rope(k, theta, pos0, inverse, k);
}

// ---------------------------------------------------------------------------- embedding

void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  const int64_t V = table.dim(0), D = table.dim(1), N = ids.numel();
  const int32_t* ip = ids.ptr<int32_t>();
  check_ids("embedding_forward", ip, N, V);
  if (table.dtype() != out.dtype()) {  // bf16 and f32 mixed: each row converted as it is copied
    Tensor rows = out.reshape({N, D});
    for (int64_t i = 0; i < N; ++i) {
      Tensor dst = rows.select(i);
      cast(table.select(ip[i]), dst);
    }
    return;
  }
  visit_float(table.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* tp = table.ptr<T>();
    T* op = out.ptr<T>();
#pragma omp parallel for if (N * D > kParallelMin)
    for (int64_t i = 0; i < N; ++i) {
      const T* src = tp + static_cast<int64_t>(ip[i]) * D;
      T* dst = op + i * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d];
    }
  });
}

// Repeated ids add into the same row: each task owns a block of columns and walks the ids in
// order, so there are no races and the sum order is fixed.
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  const int64_t V = dtable.dim(0), D = dtable.dim(1), N = ids.numel();
  const int32_t* ip = ids.ptr<int32_t>();
  check_ids("embedding_backward", ip, N, V);
  visit_float(dtable.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* gp = dout.ptr<T>();
    T* tp = dtable.ptr<T>();
    const int64_t nblocks = (D + kColBlock - 1) / kColBlock;
#pragma omp parallel for if (N * D > kParallelMin)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t c0 = blk * kColBlock;
      const int64_t c1 = c0 + kColBlock < D ? c0 + kColBlock : D;
      for (int64_t i = 0; i < N; ++i) {
        const T* src = gp + i * D;
        T* dst = tp + static_cast<int64_t>(ip[i]) * D;
        for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
      }
    }
  });
}

}  // namespace dtk::ops::cpu
