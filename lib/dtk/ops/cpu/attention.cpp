// CPU causal self-attention with grouped-query heads, as matrix products in the tensor's precision
// (f32 for training, f64 for the gradient checks).
//
// The queries of each (batch, head) go in tiles of kTile rows. A tile's scores S = scale Q K^T
// are one GEMM over only the keys it can see (0 .. its last row): the causal mask skips the
// tiles above the diagonal. Softmax runs in place on S (the row's masked tail set to 0), and the
// tile's output is out = P V, another GEMM. The forward saves lse, the log-sum-exp of each score
// row; the backward recomputes P = exp(S - lse) tile by tile, so it is the exact gradient of the
// forward:
//   dP = dout V^T,  D_t = dout_t . out_t,  dS = P (dP - D_t),
//   dq = scale dS K,  dk += scale dS^T q,  dv += P^T dout.
// Q, K, V and their gradients are read and written in place through leading dimensions
// (q [B, T, H, hd] is, for one (b, h), a [T, hd] matrix with row stride H hd): no copies.
//
// Threads: the forward's tasks are (batch, head, tile), the backward's (batch, kv head), which
// owns its dk and dv rows and sums over the group's heads and tiles in a fixed order: no races,
// no atomics, and results that do not depend on the number of threads. Each task's GEMMs run on
// one thread (OpenBLAS's OpenMP build does not fork inside a parallel region); when there are
// fewer tasks than threads, the tasks run one after another and each GEMM uses every thread.
//
// Layouts: q, out, dq [B, T, H, hd]; k, v, dk, dv [B, T, Hkv, hd]; lse [B, H, T].
// Query head h reads kv head h / (H / Hkv).
//
// bf16 (lse f32) runs the same tiles and tasks with f32 GEMMs and rounds at ops.h's points: the
// inputs are widened to f32 copies (exactly); a row's softmax takes its visible keys in one block,
// so m is the row's max; P, dS and the outputs are rounded to bf16 where ops.h says; dk and dv
// accumulate in f32 buffers over the group's heads and tiles and are rounded at the end.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dtk/core/half.h"
#include "dtk/ops/backend.h"
#include "dtk/ops/cpu/internal.h"

namespace dtk::ops::cpu {

namespace {

constexpr int64_t kTile = 64;  // query rows per tile

struct Dims {
  int64_t B, T, H, Hkv, hd, group, tiles;
  int q_ld, kv_ld;  // row strides of one head's [T, hd] matrix
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
  d.tiles = (d.T + kTile - 1) / kTile;
  d.q_ld = static_cast<int>(d.H * d.hd);
  d.kv_ld = static_cast<int>(d.Hkv * d.hd);
  d.scale = 1.0 / std::sqrt(static_cast<double>(d.hd));
  return d;
}

// The backward's row: p[0, n) = exp(s - lse), ds = p (dp - D); both zero on [n, width).
template <typename T>
inline void softmax_grad_row_t(T* s, T* dp, T lse, T D, int64_t n, int64_t width) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const T p = vexp(s[j] - lse);
    s[j] = p;
    dp[j] = p * (dp[j] - D);
  }
  for (int64_t j = n; j < width; ++j) s[j] = dp[j] = 0;
}
DTK_SIMD_CLONES void softmax_grad_row(float* s, float* dp, float lse, float D, int64_t n, int64_t width) {
  softmax_grad_row_t(s, dp, lse, D, n, width);
}
void softmax_grad_row(double* s, double* dp, double lse, double D, int64_t n, int64_t width) {
  softmax_grad_row_t(s, dp, lse, D, n, width);
}

// This thread's scratch of at least n elements, kept between calls (no allocation per step).
template <typename T>
T* scratch(size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Runs f(task) for task in [0, n): in parallel with one thread per task when there are enough
// tasks, else one after another (each GEMM then threads itself).
template <typename F>
void for_tasks(int64_t n, F&& f) {
  const int threads = omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) if (n >= threads && threads > 1)
  for (int64_t i = 0; i < n; ++i) f(i);
}

template <typename T, typename L>
void forward_typed(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse) {
  const Dims d = dims_of(q, k);
  const T* qp = q.ptr<T>();
  const T* kp = k.ptr<T>();
  const T* vp = v.ptr<T>();
  T* op = out.ptr<T>();
  L* lp = lse.ptr<L>();
  // Tasks (b, h, tile), the largest tiles (most keys) first for a balanced dynamic schedule.
  for_tasks(d.B * d.H * d.tiles, [&](int64_t task) {
    const int64_t tile = d.tiles - 1 - task % d.tiles, h = (task / d.tiles) % d.H, b = task / (d.tiles * d.H);
    const int64_t g = h / d.group, t0 = tile * kTile, t1 = std::min(d.T, t0 + kTile), m = t1 - t0;
    T* S = scratch<T>(static_cast<size_t>(kTile * d.T));
    const int n = static_cast<int>(t1), hd = static_cast<int>(d.hd);
    blas_gemm(false, true, static_cast<int>(m), n, hd, d.scale, qp + d.q_at(b, t0, h), d.q_ld, kp + d.kv_at(b, 0, g),
              d.kv_ld, 0.0, S, n);
    for (int64_t r = 0; r < m; ++r) {  // the row's visible keys 0..t, the rest masked to 0
      T* row = S + r * n;
      const int64_t seen = t0 + r + 1;
      lp[d.lse_at(b, h, t0 + r)] = static_cast<L>(softmax_row(row, row, seen, T(1)));
      std::fill(row + seen, row + n, T(0));
    }
    blas_gemm(false, false, static_cast<int>(m), hd, n, 1.0, S, n, vp + d.kv_at(b, 0, g), d.kv_ld, 0.0,
              op + d.q_at(b, t0, h), d.q_ld);
  });
}

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
  const int hd = static_cast<int>(d.hd);
  for_tasks(d.B * d.Hkv, [&](int64_t task) {
    const int64_t g = task % d.Hkv, b = task / d.Hkv;
    T* S = scratch<T>(static_cast<size_t>(2 * kTile * d.T));
    T* dP = S + kTile * d.T;
    T* dkg = dkp + d.kv_at(b, 0, g);
    T* dvg = dvp + d.kv_at(b, 0, g);
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t c = 0; c < d.hd; ++c) dkg[t * d.kv_ld + c] = dvg[t * d.kv_ld + c] = T(0);
    const T* kg = kp + d.kv_at(b, 0, g);
    const T* vg = vp + d.kv_at(b, 0, g);
    for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
      for (int64_t tile = 0; tile < d.tiles; ++tile) {
        const int64_t t0 = tile * kTile, t1 = std::min(d.T, t0 + kTile);
        const int m = static_cast<int>(t1 - t0), n = static_cast<int>(t1);
        const T* qt = qp + d.q_at(b, t0, h);
        const T* gt = gp + d.q_at(b, t0, h);
        blas_gemm(false, true, m, n, hd, d.scale, qt, d.q_ld, kg, d.kv_ld, 0.0, S, n);  // S = scale q K^T
        blas_gemm(false, true, m, n, hd, 1.0, gt, d.q_ld, vg, d.kv_ld, 0.0, dP, n);     // dP = dout V^T
        for (int64_t r = 0; r < m; ++r) {
          const int64_t t = t0 + r;
          const T D = dot(gp + d.q_at(b, t, h), op + d.q_at(b, t, h), d.hd);
          softmax_grad_row(S + r * n, dP + r * n, static_cast<T>(lp[d.lse_at(b, h, t)]), D, t + 1, n);
        }
        blas_gemm(false, false, m, hd, n, d.scale, dP, n, kg, d.kv_ld, 0.0, dqp + d.q_at(b, t0, h), d.q_ld);  // dq
        blas_gemm(true, false, n, hd, m, d.scale, dP, n, qt, d.q_ld, 1.0, dkg, d.kv_ld);  // dk += scale dS^T q
        blas_gemm(true, false, n, hd, m, 1.0, S, n, gt, d.q_ld, 1.0, dvg, d.kv_ld);       // dv += P^T dout
      }
    }
  });
}


// ---------------------------------------------------------------------------- bf16

// x (bf16) widened to f32, exactly.
std::vector<float> widen(const Tensor& x) {
  const int64_t n = x.numel();
  std::vector<float> out(static_cast<size_t>(n));
  const uint16_t* p = x.ptr<uint16_t>();
#pragma omp parallel for if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(p[i]);
  return out;
}


void forward_bf16(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse) {
  const Dims d = dims_of(q, k);
  const std::vector<float> qf = widen(q), kf = widen(k), vf = widen(v);
  uint16_t* op = out.ptr<uint16_t>();
  float* lp = lse.ptr<float>();
  const int hd = static_cast<int>(d.hd);
  for_tasks(d.B * d.H * d.tiles, [&](int64_t task) {
    const int64_t tile = d.tiles - 1 - task % d.tiles, h = (task / d.tiles) % d.H, b = task / (d.tiles * d.H);
    const int64_t g = h / d.group, t0 = tile * kTile, t1 = std::min(d.T, t0 + kTile), m = t1 - t0;
    const int n = static_cast<int>(t1);
    float* S = scratch<float>(static_cast<size_t>(kTile * (d.T + d.hd)));
    float* O = S + kTile * d.T;
    float l[kTile];
    blas_gemm(false, true, static_cast<int>(m), n, hd, d.scale, qf.data() + d.q_at(b, t0, h), d.q_ld,
              kf.data() + d.kv_at(b, 0, g), d.kv_ld, 0.0, S, n);  // S = scale Q K^T (f32)
    for (int64_t r = 0; r < m; ++r) {  // the row's visible keys 0..t; P = exp(S - m), l = sum P (f32)
      float* row = S + r * n;
      const int64_t seen = t0 + r + 1;
      const float mx = *std::max_element(row, row + seen);
      float sum = 0;
      for (int64_t j = 0; j < seen; ++j) {
        const float p = vexp(row[j] - mx);
        sum += p;
        row[j] = round_bf16(p);  // bf16(P) for P V
      }
      std::fill(row + seen, row + n, 0.0f);
      l[r] = sum;
      lp[d.lse_at(b, h, t0 + r)] = mx + std::log(sum);
    }
    blas_gemm(false, false, static_cast<int>(m), hd, n, 1.0, S, n, vf.data() + d.kv_at(b, 0, g), d.kv_ld, 0.0, O, hd);
    for (int64_t r = 0; r < m; ++r) {
      uint16_t* orow = op + d.q_at(b, t0 + r, h);
      for (int c = 0; c < hd; ++c) orow[c] = float_to_bf16(O[r * hd + c] / l[r]);
    }
  });
}

void backward_bf16(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                   const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  const Dims d = dims_of(q, k);
  const std::vector<float> qf = widen(q), kf = widen(k), vf = widen(v), of = widen(out), gf = widen(dout);
  std::vector<float> dkf(static_cast<size_t>(dk.numel()), 0.0f), dvf(static_cast<size_t>(dv.numel()), 0.0f);
  const float* lp = lse.ptr<float>();
  uint16_t* dqp = dq.ptr<uint16_t>();
  uint16_t* dkp = dk.ptr<uint16_t>();
  uint16_t* dvp = dv.ptr<uint16_t>();
  const int hd = static_cast<int>(d.hd);
  for_tasks(d.B * d.Hkv, [&](int64_t task) {
    const int64_t g = task % d.Hkv, b = task / d.Hkv;
    float* S = scratch<float>(static_cast<size_t>(kTile * (2 * d.T + d.hd)));
    float* dP = S + kTile * d.T;
    float* dQ = dP + kTile * d.T;
    const float* kg = kf.data() + d.kv_at(b, 0, g);
    const float* vg = vf.data() + d.kv_at(b, 0, g);
    float* dkg = dkf.data() + d.kv_at(b, 0, g);
    float* dvg = dvf.data() + d.kv_at(b, 0, g);
    for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
      for (int64_t tile = 0; tile < d.tiles; ++tile) {
        const int64_t t0 = tile * kTile, t1 = std::min(d.T, t0 + kTile);
        const int m = static_cast<int>(t1 - t0), n = static_cast<int>(t1);
        const float* qt = qf.data() + d.q_at(b, t0, h);
        const float* gt = gf.data() + d.q_at(b, t0, h);
        blas_gemm(false, true, m, n, hd, d.scale, qt, d.q_ld, kg, d.kv_ld, 0.0, S, n);  // S = scale q K^T
        blas_gemm(false, true, m, n, hd, 1.0, gt, d.q_ld, vg, d.kv_ld, 0.0, dP, n);     // dP = dout V^T
        for (int64_t r = 0; r < m; ++r) {
          const int64_t t = t0 + r;
          const float* orow = of.data() + d.q_at(b, t, h);
          const float* grow = gf.data() + d.q_at(b, t, h);
          float D = 0;
          for (int c = 0; c < hd; ++c) D += grow[c] * orow[c];
          const float L = lp[d.lse_at(b, h, t)];
          float* srow = S + r * n;
          float* prow = dP + r * n;
          for (int64_t j = 0; j <= t; ++j) {
            const float p = vexp(srow[j] - L);
            const float ds = p * (prow[j] - D);
            srow[j] = round_bf16(p);   // bf16(P) for dv
            prow[j] = round_bf16(ds);  // bf16(dS) for dq and dk
          }
          std::fill(srow + t + 1, srow + n, 0.0f);
          std::fill(prow + t + 1, prow + n, 0.0f);
        }
        blas_gemm(false, false, m, hd, n, d.scale, dP, n, kg, d.kv_ld, 0.0, dQ, hd);  // dq = scale dS K
        for (int r = 0; r < m; ++r) {
          uint16_t* qrow = dqp + d.q_at(b, t0 + r, h);
          for (int c = 0; c < hd; ++c) qrow[c] = float_to_bf16(dQ[r * hd + c]);
        }
        blas_gemm(true, false, n, hd, m, d.scale, dP, n, qt, d.q_ld, 1.0, dkg, d.kv_ld);  // dk += scale dS^T q
        blas_gemm(true, false, n, hd, m, 1.0, S, n, gt, d.q_ld, 1.0, dvg, d.kv_ld);       // dv += P^T dout
      }
    }
    for (int64_t t = 0; t < d.T; ++t) {
      const int64_t at = d.kv_at(b, t, g);
      for (int c = 0; c < hd; ++c) {
        dkp[at + c] = float_to_bf16(dkf[at + c]);
        dvp[at + c] = float_to_bf16(dvf[at + c]);
      }
    }
  });
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse) {
  if (q.dtype() == DType::bf16) return forward_bf16(q, k, v, out, lse);
  visit_float(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (lse.dtype() == DType::f64) forward_typed<T, double>(q, k, v, out, lse);
    else forward_typed<T, float>(q, k, v, out, lse);
  });
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  if (q.dtype() == DType::bf16) return backward_bf16(q, k, v, out, lse, dout, dq, dk, dv);
  visit_float(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (lse.dtype() == DType::f64) backward_typed<T, double>(q, k, v, out, lse, dout, dq, dk, dv);
    else backward_typed<T, float>(q, k, v, out, lse, dout, dq, dk, dv);
  });
}

}  // namespace dtk::ops::cpu
