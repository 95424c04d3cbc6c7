// CUDA causal self-attention with grouped-query heads, forward and backward.
//
// The straightforward kernel set: one warp per row, online softmax, nothing materialised.
//   forward  — a warp per query row (b, h, t): for each key j <= t the score is a warp dot
//              product, then the running max m, running sum l and the output accumulator are
//              updated as in FlashAttention's online softmax; out = acc / l, lse = m + log l.
//   backward — P is recomputed from lse (P = exp(s - lse)), never stored:
//              D[t] = dout[t] . out[t]; dS = P (dout . v_j - D[t]);
//              dq kernel: a warp per query row, dq = scale * sum_j dS k_j;
//              dk/dv kernel: a warp per key row (b, hkv, j), looping over the query heads of its
//              group and over t >= j: dv = sum P dout_t, dk = scale * sum dS q_t.
// Each output element is written by one lane that sums in a fixed order: no atomics, results
// bit-identical run to run. Lanes own the head dims lane, lane + 32, ... (coalesced row loads);
// a lane keeps S accumulators in registers, and heads wider than 32 S are done in chunks of 32 S
// dims (the scores are recomputed per chunk, in the same order, so every chunk sees the same P).
// Consecutive warps of a block take consecutive rows of one head, so K/V rows are shared in L1.
//
// bf16 tensors go to the tensor-core kernels of flash_attention.cu instead (their rounding points
// are ops.h's), through aligned copies when a tensor's data is not 16-byte aligned.
#include "dtk/ops/cuda/common.cuh"

namespace dtk::ops::cuda {
using namespace kern;

// flash_attention.cu: bf16 q, k, v, out, dout, dq, dk, dv, f32 lse, hd 64 or 128, every pointer
// 16-byte aligned.
void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse);
void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv);

namespace {

constexpr int kWarps = 4;             // warps (rows) per block
constexpr size_t kMaxSmem = 48 << 10;  // stage rows in shared memory only below the default limit

struct Dims {
  int64_t B, T, H, Hkv, hd;
  __host__ __device__ int64_t group() const { return H / Hkv; }
};

template <typename T>
__device__ __forceinline__ T warp_dot(const T* a, const T* b, int64_t hd, int lane) {
  T s = 0;
  for (int64_t d = lane; d < hd; d += 32) s += a[d] * b[d];
  return warp_sum(s);
}

// Copies a row into this warp's shared-memory slot (or, without staging, returns the row itself).
template <typename T>
__device__ __forceinline__ const T* stage(const T* row, T* slot, bool use_smem, int64_t hd, int lane) {
  if (!use_smem) return row;
  for (int64_t d = lane; d < hd; d += 32) slot[d] = row[d];
  __syncwarp();
  return slot;
}

template <typename T, typename L, int S>
__global__ void attention_forward_kernel(const T* q, const T* k, const T* v, T* out, L* lse, Dims dm, T scale,
                                         bool use_smem) {
  extern __shared__ unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x * int64_t(kWarps) + warp;  // (b, h, t), t fastest
  if (row >= dm.B * dm.H * dm.T) return;
  const int64_t t = row % dm.T, h = (row / dm.T) % dm.H, b = row / (dm.T * dm.H);
  const int64_t hk = h / dm.group(), hd = dm.hd;
  const T* qr = stage(q + ((b * dm.T + t) * dm.H + h) * hd, smem + warp * hd, use_smem, hd, lane);
  const int64_t kv_stride = dm.Hkv * hd;
  const T* kb = k + (b * dm.T * dm.Hkv + hk) * hd;
  const T* vb = v + (b * dm.T * dm.Hkv + hk) * hd;
  T* orow = out + ((b * dm.T + t) * dm.H + h) * hd;
  for (int64_t c0 = 0; c0 < hd; c0 += 32 * S) {
    T m = -d_inf<T>(), l = 0, acc[S];
#pragma unroll
    for (int i = 0; i < S; ++i) acc[i] = 0;
    for (int64_t j = 0; j <= t; ++j) {
      const T* kr = kb + j * kv_stride;
      const T* vr = vb + j * kv_stride;
      const T s = warp_dot(qr, kr, hd, lane) * scale;
      const T m_new = s > m ? s : m;
      const T corr = d_exp(m - m_new);  // exp(-inf) = 0 on the first key
      const T p = d_exp(s - m_new);
      l = l * corr + p;
#pragma unroll
      for (int i = 0; i < S; ++i) {
        const int64_t d = c0 + lane + 32 * i;
        acc[i] = acc[i] * corr + (d < hd ? p * vr[d] : T(0));
      }
      m = m_new;
    }
    const T inv = T(1) / l;  // l >= 1: the key j = t always counts
#pragma unroll
    for (int i = 0; i < S; ++i) {
      const int64_t d = c0 + lane + 32 * i;
      if (d < hd) orow[d] = acc[i] * inv;
    }
    if (c0 == 0 && lane == 0) lse[(b * dm.H + h) * dm.T + t] = L(m + d_log(l));
  }
}

// D[b, h, t] = dout . out over the head dim (the softmax-backward row term).
template <typename T>
__global__ void attention_delta_kernel(const T* out, const T* dout, T* delta, Dims dm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x * int64_t(kWarps) + warp;
  if (row >= dm.B * dm.H * dm.T) return;
  const int64_t t = row % dm.T, h = (row / dm.T) % dm.H, b = row / (dm.T * dm.H);
  const int64_t off = ((b * dm.T + t) * dm.H + h) * dm.hd;
  const T s = warp_dot(out + off, dout + off, dm.hd, lane);
  if (lane == 0) delta[row] = s;  // row is (b * H + h) * T + t, the lse layout
}

template <typename T, typename L, int S>
__global__ void attention_dq_kernel(const T* q, const T* k, const T* v, const L* lse, const T* delta, const T* dout,
                                    T* dq, Dims dm, T scale, bool use_smem) {
  extern __shared__ unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x * int64_t(kWarps) + warp;
  if (row >= dm.B * dm.H * dm.T) return;
  const int64_t t = row % dm.T, h = (row / dm.T) % dm.H, b = row / (dm.T * dm.H);
  const int64_t hk = h / dm.group(), hd = dm.hd;
  const int64_t qoff = ((b * dm.T + t) * dm.H + h) * hd;
  const T* qr = stage(q + qoff, smem + (2 * warp) * hd, use_smem, hd, lane);
  const T* dor = stage(dout + qoff, smem + (2 * warp + 1) * hd, use_smem, hd, lane);
  const T lse_t = T(lse[row]), d_t = delta[row];
  const int64_t kv_stride = dm.Hkv * hd;
  const T* kb = k + (b * dm.T * dm.Hkv + hk) * hd;
  const T* vb = v + (b * dm.T * dm.Hkv + hk) * hd;
  for (int64_t c0 = 0; c0 < hd; c0 += 32 * S) {
    T acc[S];
#pragma unroll
    for (int i = 0; i < S; ++i) acc[i] = 0;
    for (int64_t j = 0; j <= t; ++j) {
      const T* kr = kb + j * kv_stride;
      const T* vr = vb + j * kv_stride;
      T sd = 0, dpd = 0;
      for (int64_t d = lane; d < hd; d += 32) {
        sd += qr[d] * kr[d];
        dpd += dor[d] * vr[d];
      }
      const T s = warp_sum(sd) * scale, dp = warp_sum(dpd);
      const T p = d_exp(s - lse_t);
      const T ds = p * (dp - d_t);
#pragma unroll
      for (int i = 0; i < S; ++i) {
        const int64_t d = c0 + lane + 32 * i;
        if (d < hd) acc[i] += ds * kr[d];
      }
    }
#pragma unroll
    for (int i = 0; i < S; ++i) {
      const int64_t d = c0 + lane + 32 * i;
      if (d < hd) dq[qoff + d] = acc[i] * scale;
    }
  }
}

template <typename T, typename L, int S>
__global__ void attention_dkdv_kernel(const T* q, const T* k, const T* v, const L* lse, const T* delta,
                                      const T* dout, T* dk, T* dv, Dims dm, T scale, bool use_smem) {
  extern __shared__ unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x * int64_t(kWarps) + warp;  // (b, hk, j), j fastest
  if (row >= dm.B * dm.Hkv * dm.T) return;
  const int64_t j = row % dm.T, hk = (row / dm.T) % dm.Hkv, b = row / (dm.T * dm.Hkv);
  const int64_t hd = dm.hd, G = dm.group();
  const int64_t kvoff = ((b * dm.T + j) * dm.Hkv + hk) * hd;
  const T* kr = stage(k + kvoff, smem + (2 * warp) * hd, use_smem, hd, lane);
  const T* vr = stage(v + kvoff, smem + (2 * warp + 1) * hd, use_smem, hd, lane);
  const int64_t q_stride = dm.H * hd;
  for (int64_t c0 = 0; c0 < hd; c0 += 32 * S) {
    T dk_acc[S], dv_acc[S];
#pragma unroll
    for (int i = 0; i < S; ++i) dk_acc[i] = dv_acc[i] = 0;
    for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
      const T* qb = q + (b * dm.T * dm.H + h) * hd;
      const T* dob = dout + (b * dm.T * dm.H + h) * hd;
      const int64_t lrow = (b * dm.H + h) * dm.T;
      for (int64_t t = j; t < dm.T; ++t) {
        const T* qr = qb + t * q_stride;
        const T* dor = dob + t * q_stride;
        T sd = 0, dpd = 0;
        for (int64_t d = lane; d < hd; d += 32) {
          sd += qr[d] * kr[d];
          dpd += dor[d] * vr[d];
        }
        const T s = warp_sum(sd) * scale, dp = warp_sum(dpd);
        const T p = d_exp(s - T(lse[lrow + t]));
        const T ds = p * (dp - delta[lrow + t]);
#pragma unroll
        for (int i = 0; i < S; ++i) {
          const int64_t d = c0 + lane + 32 * i;
          if (d < hd) {
            dv_acc[i] += p * dor[d];
            dk_acc[i] += ds * qr[d];
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < S; ++i) {
      const int64_t d = c0 + lane + 32 * i;
      if (d < hd) {
        dk[kvoff + d] = dk_acc[i] * scale;
        dv[kvoff + d] = dv_acc[i];
      }
    }
  }
}

Dims dims_of(const Tensor& q, const Tensor& k) { return Dims{q.dim(0), q.dim(1), q.dim(2), k.dim(2), q.dim(3)}; }

// Calls f(std::integral_constant<int, S>) with S accumulators per lane for head dim hd.
template <typename F>
void visit_slots(int64_t hd, F&& f) {
  if (hd <= 32)
    f(std::integral_constant<int, 1>{});
  else if (hd <= 64)
    f(std::integral_constant<int, 2>{});
  else if (hd <= 128)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}

// Calls f(L{}) with L the element type of lse: f32, or the dtype of q.
template <typename F>
void visit_lse(const Tensor& lse, F&& f) {
  if (lse.dtype() == DType::f64)
    f(double{});
  else
    f(float{});
}

// The flash kernels move 16-byte chunks: a tensor whose data is not 16-byte aligned (a view at an
// odd offset) is replaced by an aligned copy, queued on the ops' stream. `t` itself when aligned.
bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; }

Tensor aligned(const Tensor& t) {
  if (aligned16(t)) return t;
  Tensor c = Tensor::empty(t.shape(), t.dtype(), t.device());
  c.copy_from_async(t, dtk::cuda::current_stream());
  return c;
}

// Where to compute output `t`: `t` itself when aligned, else a fresh tensor that copy_back copies
// into `t` afterwards, in stream order.
Tensor aligned_out(const Tensor& t) { return aligned16(t) ? t : Tensor::empty(t.shape(), t.dtype(), t.device()); }

void copy_back(Tensor& t, const Tensor& computed) {
  if (computed.data() != t.data()) t.copy_from_async(computed, dtk::cuda::current_stream());
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse) {
  if (q.dtype() == DType::bf16) {
    Tensor o = aligned_out(out);
    flash_attention_forward(aligned(q), aligned(k), aligned(v), o, lse);
    copy_back(out, o);
    return;
  }
  const Dims dm = dims_of(q, k);
  const int64_t rows = dm.B * dm.H * dm.T;
  if (rows == 0 || dm.hd == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows + kWarps - 1) / kWarps);
  visit_float(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const size_t smem = kWarps * dm.hd * sizeof(T);
    const bool use_smem = smem <= kMaxSmem;
    const T scale = T(1.0 / std::sqrt(static_cast<double>(dm.hd)));
    visit_lse(lse, [&](auto ltag) {
      using L = decltype(ltag);
      visit_slots(dm.hd, [&](auto slots) {
        attention_forward_kernel<T, L, decltype(slots)::value><<<blocks, kWarps * 32, use_smem ? smem : 0, stream()>>>(
            q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), out.ptr<T>(), lse.ptr<L>(), dm, scale, use_smem);
      });
    });
  });
  check_launch("attention_forward");
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  if (q.dtype() == DType::bf16) {
    Tensor gq = aligned_out(dq), gk = aligned_out(dk), gv = aligned_out(dv);
    flash_attention_backward(aligned(q), aligned(k), aligned(v), aligned(out), lse, aligned(dout), gq, gk, gv);
    copy_back(dq, gq);
    copy_back(dk, gk);
    copy_back(dv, gv);
    return;
  }
  const Dims dm = dims_of(q, k);
  const int64_t rows = dm.B * dm.H * dm.T, kv_rows = dm.B * dm.Hkv * dm.T;
  if (rows == 0 || dm.hd == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows + kWarps - 1) / kWarps);
  const unsigned kv_blocks = static_cast<unsigned>((kv_rows + kWarps - 1) / kWarps);
  visit_float(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    Tensor delta = Tensor::empty({rows}, q.dtype(), q.device());
    attention_delta_kernel<T><<<blocks, kWarps * 32, 0, stream()>>>(out.ptr<T>(), dout.ptr<T>(), delta.ptr<T>(), dm);
    check_launch("attention_backward(delta)");
    const size_t smem = 2 * kWarps * dm.hd * sizeof(T);
    const bool use_smem = smem <= kMaxSmem;
    const size_t dyn = use_smem ? smem : 0;
    const T scale = T(1.0 / std::sqrt(static_cast<double>(dm.hd)));
    visit_lse(lse, [&](auto ltag) {
      using L = decltype(ltag);
      visit_slots(dm.hd, [&](auto slots) {
        constexpr int S = decltype(slots)::value;
        attention_dq_kernel<T, L, S><<<blocks, kWarps * 32, dyn, stream()>>>(
            q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), lse.ptr<L>(), delta.ptr<T>(), dout.ptr<T>(), dq.ptr<T>(), dm, scale,
            use_smem);
        check_launch("attention_backward(dq)");
        attention_dkdv_kernel<T, L, S><<<kv_blocks, kWarps * 32, dyn, stream()>>>(
            q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), lse.ptr<L>(), delta.ptr<T>(), dout.ptr<T>(), dk.ptr<T>(), dv.ptr<T>(),
            dm, scale, use_smem);
        check_launch("attention_backward(dk, dv)");
      });
    });
  });
}

}  // namespace dtk::ops::cuda
