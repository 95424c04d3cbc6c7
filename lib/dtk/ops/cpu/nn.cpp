// CPU neural-network ops: softmax and log-softmax, cross entropy, RMSNorm, activations, RoPE and
// embeddings. Row ops accumulate in double (f32 too). Every loop that a thread runs owns its
// outputs, and every sum runs serially in a fixed order, so results do not depend on the number
// of threads. Index inputs (targets, ids) are validated in a serial pass before the parallel loop,
// because an exception must not leave an OpenMP region.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/ops/backend.h"

namespace dtk::ops::cpu {

namespace {

constexpr int64_t kParallelMin = 1 << 15;  // elements below which a loop stays on one thread
constexpr int64_t kColBlock = 64;          // columns per task of the column-wise accumulations

template <typename F>
void visit_float(DType t, F&& f) {
  if (t == DType::f64) f(double{});
  else f(float{});
}

int64_t last_dim(const Tensor& t) { return t.ndim() == 0 ? 1 : t.dim(-1); }
int64_t rows_of(const Tensor& t) {
  const int64_t n = last_dim(t);
  return n == 0 ? 0 : t.numel() / n;
}

// max and log(sum exp(x - max)) of a row, in double.
template <typename T>
void row_max_logsum(const T* x, int64_t n, double* max_out, double* logsum_out) {
  double m = -HUGE_VAL;
  for (int64_t i = 0; i < n; ++i) m = std::fmax(m, static_cast<double>(x[i]));
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(static_cast<double>(x[i]) - m);
  *max_out = m;
  *logsum_out = std::log(s);
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

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

constexpr double kGeluK = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluC = 0.044715;

void check_targets(const char* op, const int32_t* t, int64_t n, int64_t V) {
  for (int64_t i = 0; i < n; ++i)
    if (t[i] != -1 && (t[i] < 0 || t[i] >= V))
      fail_usage(std::string(op) + ": target " + std::to_string(t[i]) + " at row " + std::to_string(i) +
                 " is outside [0, " + std::to_string(V) + ") and is not -1 (ignored)");
}

void check_ids(const char* op, const int32_t* ids, int64_t n, int64_t V) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= V)
      fail_usage(std::string(op) + ": id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                 " is outside [0, " + std::to_string(V) + ")");
}

}  // namespace

// ---------------------------------------------------------------------------- softmax

void softmax_forward(const Tensor& x, Tensor& y) {
  const int64_t n = last_dim(x), rows = rows_of(x);
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.ptr<T>();
    T* yp = y.ptr<T>();
#pragma omp parallel for if (rows * n > kParallelMin)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = xp + r * n;
      T* yr = yp + r * n;
      double m, logsum;
      row_max_logsum(xr, n, &m, &logsum);
      const double shift = m + logsum;
      for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<T>(std::exp(static_cast<double>(xr[i]) - shift));
    }
  });
}

void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const int64_t n = last_dim(y), rows = rows_of(y);
  visit_float(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* yp = y.ptr<T>();
    const T* dyp = dy.ptr<T>();
    T* dxp = dx.ptr<T>();
#pragma omp parallel for if (rows * n > kParallelMin)
    for (int64_t r = 0; r < rows; ++r) {
      const T* yr = yp + r * n;
      const T* dyr = dyp + r * n;
      T* dxr = dxp + r * n;
      double s = 0;
      for (int64_t i = 0; i < n; ++i) s += static_cast<double>(dyr[i]) * static_cast<double>(yr[i]);
      for (int64_t i = 0; i < n; ++i)
        dxr[i] = static_cast<T>(static_cast<double>(yr[i]) * (static_cast<double>(dyr[i]) - s));
    }
  });
}

void log_softmax_forward(const Tensor& x, Tensor& y) {
  const int64_t n = last_dim(x), rows = rows_of(x);
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.ptr<T>();
    T* yp = y.ptr<T>();
#pragma omp parallel for if (rows * n > kParallelMin)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = xp + r * n;
      T* yr = yp + r * n;
      double m, logsum;
      row_max_logsum(xr, n, &m, &logsum);
      for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<T>((static_cast<double>(xr[i]) - m) - logsum);
    }
  });
}

void log_softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const int64_t n = last_dim(y), rows = rows_of(y);
  visit_float(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* yp = y.ptr<T>();
    const T* dyp = dy.ptr<T>();
    T* dxp = dx.ptr<T>();
#pragma omp parallel for if (rows * n > kParallelMin)
    for (int64_t r = 0; r < rows; ++r) {
      const T* yr = yp + r * n;
      const T* dyr = dyp + r * n;
      T* dxr = dxp + r * n;
      double s = 0;
      for (int64_t i = 0; i < n; ++i) s += static_cast<double>(dyr[i]);
      for (int64_t i = 0; i < n; ++i)
        dxr[i] = static_cast<T>(static_cast<double>(dyr[i]) - std::exp(static_cast<double>(yr[i])) * s);
    }
  });
}

// ---------------------------------------------------------------------------- cross entropy

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses) {
  const int64_t N = logits.dim(0), V = logits.dim(1);
  const int32_t* tp = targets.ptr<int32_t>();
  check_targets("cross_entropy_forward", tp, N, V);
  visit_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = logits.ptr<T>();
    T* lp = losses.ptr<T>();
#pragma omp parallel for if (N * V > kParallelMin)
    for (int64_t r = 0; r < N; ++r) {
      if (tp[r] < 0) {
        lp[r] = T(0);
        continue;
      }
      const T* xr = xp + r * V;
      double m, logsum;
      row_max_logsum(xr, V, &m, &logsum);
      lp[r] = static_cast<T>((m + logsum) - static_cast<double>(xr[tp[r]]));
    }
  });
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, double scale, Tensor& dlogits) {
  const int64_t N = logits.dim(0), V = logits.dim(1);
  const int32_t* tp = targets.ptr<int32_t>();
  check_targets("cross_entropy_backward", tp, N, V);
  visit_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = logits.ptr<T>();
    T* dp = dlogits.ptr<T>();
#pragma omp parallel for if (N * V > kParallelMin)
    for (int64_t r = 0; r < N; ++r) {
      const T* xr = xp + r * V;
      T* dr = dp + r * V;
      const int32_t t = tp[r];
      if (t < 0) {
        for (int64_t i = 0; i < V; ++i) dr[i] = T(0);
        continue;
      }
      double m, logsum;
      row_max_logsum(xr, V, &m, &logsum);
      const double shift = m + logsum;
      for (int64_t i = 0; i < V; ++i) {
        const double p = std::exp(static_cast<double>(xr[i]) - shift);
        dr[i] = static_cast<T>((p - (i == t ? 1.0 : 0.0)) * scale);
      }
    }
  });
}

// ---------------------------------------------------------------------------- rmsnorm

void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  const int64_t D = last_dim(x), rows = rows_of(x);
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.ptr<T>();
    const T* wp = w.ptr<T>();
    T* yp = y.ptr<T>();
    T* rp = rstd.ptr<T>();
#pragma omp parallel for if (rows * D > kParallelMin)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = xp + r * D;
      T* yr = yp + r * D;
      double ss = 0;
      for (int64_t i = 0; i < D; ++i) ss += static_cast<double>(xr[i]) * static_cast<double>(xr[i]);
      const double rs = 1.0 / std::sqrt(ss / static_cast<double>(D) + eps);
      for (int64_t i = 0; i < D; ++i)
        yr[i] = static_cast<T>(static_cast<double>(xr[i]) * rs * static_cast<double>(wp[i]));
      rp[r] = static_cast<T>(rs);
    }
  });
}

// y_i = x_i r w_i with r = (mean(x^2) + eps)^(-1/2), so dr/dx_j = -r^3 x_j / D and
// dx_j = r w_j dy_j - x_j r^3 / D * sum_i(dy_i w_i x_i); dw_i += sum over rows of dy_i x_i r.
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                      Tensor& dw) {
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
#pragma omp parallel for if (rows * D > kParallelMin)
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = xp + r * D;
      const T* dyr = dyp + r * D;
      T* dxr = dxp + r * D;
      const double rs = static_cast<double>(rp[r]);
      double dot = 0;
      for (int64_t i = 0; i < D; ++i)
        dot += static_cast<double>(dyr[i]) * static_cast<double>(wp[i]) * static_cast<double>(xr[i]);
      const double k = rs * rs * rs * dot / static_cast<double>(D);
      for (int64_t i = 0; i < D; ++i) {
        const double g = static_cast<double>(dyr[i]) * static_cast<double>(wp[i]);
        dxr[i] = static_cast<T>(rs * g - static_cast<double>(xr[i]) * k);
      }
    }
  });
}

// ---------------------------------------------------------------------------- activations

void silu_forward(const Tensor& x, Tensor& y) {
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map1<T>(x, y, [](T v) { return v * sigmoid(v); });
  });
}

void silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map2<T>(x, dy, dx, [](T v, T g) {
      const T s = sigmoid(v);
      return g * (s + v * s * (T(1) - s));
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
  visit_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map2<T>(a, b, y, [](T av, T bv) { return av * sigmoid(av) * bv; });
  });
}

void swiglu_backward(const Tensor& a, const Tensor& b, const Tensor& dy, Tensor& da, Tensor& db) {
  visit_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* ap = a.ptr<T>();
    const T* bp = b.ptr<T>();
    const T* gp = dy.ptr<T>();
    T* dap = da.ptr<T>();
    T* dbp = db.ptr<T>();
    const int64_t n = a.numel();
#pragma omp parallel for if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) {
      // read everything before writing: da / db may alias a / b / dy
      const T av = ap[i], bv = bp[i], g = gp[i];
      const T s = sigmoid(av);
      dap[i] = g * bv * (s + av * s * (T(1) - s));
      dbp[i] = g * av * s;
    }
  });
}

// ---------------------------------------------------------------------------- rope

void rope(const Tensor& x, double theta, int64_t pos0, bool inverse, Tensor& y) {
  const int64_t B = x.dim(0), T_ = x.dim(1), H = x.dim(2), hd = x.dim(3), half = hd / 2;
  // cos and sin of every (position, pair), in double
  std::vector<double> cs(static_cast<size_t>(T_ * half)), sn(static_cast<size_t>(T_ * half));
  for (int64_t t = 0; t < T_; ++t) {
    const double pos = static_cast<double>(pos0 + t);
    for (int64_t i = 0; i < half; ++i) {
      const double angle = pos * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
      cs[t * half + i] = std::cos(angle);
      sn[t * half + i] = inverse ? -std::sin(angle) : std::sin(angle);
    }
  }
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.ptr<T>();
    T* yp = y.ptr<T>();
#pragma omp parallel for collapse(2) if (x.numel() > kParallelMin)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T_; ++t) {
        const double* c = cs.data() + t * half;
        const double* s = sn.data() + t * half;
        for (int64_t h = 0; h < H; ++h) {
          const int64_t base = ((b * T_ + t) * H + h) * hd;
          for (int64_t i = 0; i < half; ++i) {
            const double x0 = static_cast<double>(xp[base + 2 * i]);
            const double x1 = static_cast<double>(xp[base + 2 * i + 1]);
            yp[base + 2 * i] = static_cast<T>(x0 * c[i] - x1 * s[i]);
            yp[base + 2 * i + 1] = static_cast<T>(x0 * s[i] + x1 * c[i]);
          }
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------- embedding

void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  const int64_t V = table.dim(0), D = table.dim(1), N = ids.numel();
  const int32_t* ip = ids.ptr<int32_t>();
  check_ids("embedding_forward", ip, N, V);
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
