// CPU causal self-attention with grouped-query heads, the straightforward O(T^2) way, in double.
// The forward saves lse (the log-sum-exp of each score row); the backward recomputes the
// probabilities P = exp(s - lse) from q and k, so it is the exact gradient of the forward.
//
// Layouts: q, out, dq [B, T, H, hd]; k, v, dk, dv [B, T, Hkv, hd]; lse [B, H, T].
// Query head h reads kv head h / (H / Hkv).
#include <cmath>
#include <cstdint>
#include <vector>

#include "dtk/ops/backend.h"

namespace dtk::ops::cpu {

namespace {

template <typename F>
void visit_float(DType t, F&& f) {
  if (t == DType::f64) f(double{});
  else f(float{});
}

struct Dims {
  int64_t B, T, H, Hkv, hd, group;
  double scale;
  int64_t q_at(int64_t b, int64_t t, int64_t h) const { return ((b * T + t) * H + h) * hd; }
  int64_t kv_at(int64_t b, int64_t t, int64_t g) const { return ((b * T + t) * Hkv + g) * hd; }
  int64_t lse_at(int64_t b, int64_t h, int64_t t) const { return (b * H + h) * T + t; }
};

Dims dims_of(const Tensor& q, const Tensor& k) {
  Dims d;
  d.B = q.dim(0);
  d.T = q.dim(1);
  d.H = q.dim(2);
  d.hd = q.dim(3);
  d.Hkv = k.dim(2);
  d.group = d.H / d.Hkv;
  d.scale = 1.0 / std::sqrt(static_cast<double>(d.hd));
  return d;
}

template <typename T>
double dot_hd(const T* a, const T* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return s;
}

template <typename T, typename L>
void forward_typed(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse) {
  const Dims d = dims_of(q, k);
  const T* qp = q.ptr<T>();
  const T* kp = k.ptr<T>();
  const T* vp = v.ptr<T>();
  T* op = out.ptr<T>();
  L* lp = lse.ptr<L>();
  const int64_t rows = d.B * d.H * d.T;
#pragma omp parallel
  {
    std::vector<double> s(static_cast<size_t>(d.T));
    std::vector<double> acc(static_cast<size_t>(d.hd));
#pragma omp for schedule(dynamic, 16)
    for (int64_t row = 0; row < rows; ++row) {
      // row = (b, h, t), t fastest: the order of lse
      const int64_t t = row % d.T, h = (row / d.T) % d.H, b = row / (d.T * d.H);
      const int64_t g = h / d.group;
      const T* qr = qp + d.q_at(b, t, h);
      double m = -HUGE_VAL;
      for (int64_t j = 0; j <= t; ++j) {
        s[j] = dot_hd(qr, kp + d.kv_at(b, j, g), d.hd) * d.scale;
        m = std::fmax(m, s[j]);
      }
      double l = 0;
      for (int64_t j = 0; j <= t; ++j) {
        s[j] = std::exp(s[j] - m);
        l += s[j];
      }
      for (int64_t c = 0; c < d.hd; ++c) acc[c] = 0;
      for (int64_t j = 0; j <= t; ++j) {
        const T* vr = vp + d.kv_at(b, j, g);
        const double p = s[j] / l;
        for (int64_t c = 0; c < d.hd; ++c) acc[c] += p * static_cast<double>(vr[c]);
      }
      T* orow = op + d.q_at(b, t, h);
      for (int64_t c = 0; c < d.hd; ++c) orow[c] = static_cast<T>(acc[c]);
      lp[d.lse_at(b, h, t)] = static_cast<L>(m + std::log(l));
    }
  }
}

// With P_tj = exp(s_tj - lse_t), dP_tj = dout_t . v_j and D_t = dout_t . out_t = sum_j P_tj dP_tj:
//   dS_tj = P_tj (dP_tj - D_t),  dq_t = scale sum_j dS_tj k_j,
//   dk_j = scale sum_{h in group, t >= j} dS_tj q_t,  dv_j = sum_{h in group, t >= j} P_tj dout_t.
// Pass 1 owns each query row (dq and D_t); pass 2 owns each key row (dk, dv), summing over the
// query heads of its group and t in a fixed order: no races, no atomics.
template <typename T, typename L>
void backward_typed(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                    const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  const Dims d = dims_of(q, k);
  const T* qp = q.ptr<T>();
  const T* kp = k.ptr<T>();
  const T* vp = v.ptr<T>();
  const T* op = out.ptr<T>();
  const L* lp = lse.ptr<L>();
  const T* gp = dout.ptr<T>();
  T* dqp = dq.ptr<T>();
  T* dkp = dk.ptr<T>();
  T* dvp = dv.ptr<T>();
  const int64_t qrows = d.B * d.H * d.T;
  std::vector<double> Dt(static_cast<size_t>(qrows));

#pragma omp parallel
  {
    std::vector<double> acc(static_cast<size_t>(d.hd));
#pragma omp for schedule(dynamic, 16)
    for (int64_t row = 0; row < qrows; ++row) {
      const int64_t t = row % d.T, h = (row / d.T) % d.H, b = row / (d.T * d.H);
      const int64_t g = h / d.group;
      const T* qr = qp + d.q_at(b, t, h);
      const T* gr = gp + d.q_at(b, t, h);
      const double lse_t = static_cast<double>(lp[d.lse_at(b, h, t)]);
      const double D = dot_hd(gr, op + d.q_at(b, t, h), d.hd);
      Dt[row] = D;
      for (int64_t c = 0; c < d.hd; ++c) acc[c] = 0;
      for (int64_t j = 0; j <= t; ++j) {
        const T* kr = kp + d.kv_at(b, j, g);
        const double p = std::exp(dot_hd(qr, kr, d.hd) * d.scale - lse_t);
        const double ds = p * (dot_hd(gr, vp + d.kv_at(b, j, g), d.hd) - D);
        for (int64_t c = 0; c < d.hd; ++c) acc[c] += ds * static_cast<double>(kr[c]);
      }
      T* dqr = dqp + d.q_at(b, t, h);
      for (int64_t c = 0; c < d.hd; ++c) dqr[c] = static_cast<T>(acc[c] * d.scale);
    }
  }

  const int64_t kvrows = d.B * d.Hkv * d.T;
#pragma omp parallel
  {
    std::vector<double> acck(static_cast<size_t>(d.hd)), accv(static_cast<size_t>(d.hd));
#pragma omp for schedule(dynamic, 16)
    for (int64_t row = 0; row < kvrows; ++row) {
      const int64_t j = row % d.T, g = (row / d.T) % d.Hkv, b = row / (d.T * d.Hkv);
      const T* kr = kp + d.kv_at(b, j, g);
      const T* vr = vp + d.kv_at(b, j, g);
      for (int64_t c = 0; c < d.hd; ++c) acck[c] = accv[c] = 0;
      for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
        for (int64_t t = j; t < d.T; ++t) {
          const T* qr = qp + d.q_at(b, t, h);
          const T* gr = gp + d.q_at(b, t, h);
          const double lse_t = static_cast<double>(lp[d.lse_at(b, h, t)]);
          const double p = std::exp(dot_hd(qr, kr, d.hd) * d.scale - lse_t);
          const double ds = p * (dot_hd(gr, vr, d.hd) - Dt[(b * d.H + h) * d.T + t]);
          for (int64_t c = 0; c < d.hd; ++c) {
            acck[c] += ds * static_cast<double>(qr[c]);
            accv[c] += p * static_cast<double>(gr[c]);
          }
        }
      }
      T* dkr = dkp + d.kv_at(b, j, g);
      T* dvr = dvp + d.kv_at(b, j, g);
      for (int64_t c = 0; c < d.hd; ++c) {
        dkr[c] = static_cast<T>(acck[c] * d.scale);
        dvr[c] = static_cast<T>(accv[c]);
      }
    }
  }
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse) {
  visit_float(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (lse.dtype() == DType::f64) forward_typed<T, double>(q, k, v, out, lse);
    else forward_typed<T, float>(q, k, v, out, lse);
  });
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  visit_float(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (lse.dtype() == DType::f64) backward_typed<T, double>(q, k, v, out, lse, dout, dq, dk, dv);
    else backward_typed<T, float>(q, k, v, out, lse, dout, dq, dk, dv);
  });
}

}  // namespace dtk::ops::cpu
