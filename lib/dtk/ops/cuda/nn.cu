// CUDA neural-network row ops: softmax / log-softmax, cross entropy, RMSNorm (forward and
// backward), RoPE and embedding. Row ops give one block to a row (threads_for_row picks the block
// size from the row length), with deterministic block reductions; softmax and RMSNorm's forward
// read a row a few times, which after the first pass comes from L1/L2; RMSNorm's backward and
// cross entropy read it once in each direction (a 128k vocabulary's row does not stay in L1).
// Every kernel reads all of its inputs for an element before writing that element, so the
// in-place uses the contract allows are safe.
#include <map>
#include <mutex>
#include <tuple>

#include "dtk/ops/cuda/common.cuh"

namespace dtk::ops::cuda {
using namespace kern;

namespace {

// Rows are all leading dims flattened; n is the last dim.
int64_t last_dim(const Tensor& t) { return t.ndim() == 0 ? 1 : t.dim(-1); }
int64_t rows_of(const Tensor& t) {
  const int64_t n = last_dim(t);
  return n == 0 ? 0 : t.numel() / n;
}

// Rows stored as S (T, or bf16_t for float), computed in T.
template <typename T, typename S>
__device__ T row_max(const S* x, int64_t n, T* scratch) {
  T m = -d_inf<T>();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = max_nan(m, ld<T>(x[i]));
  return block_reduce(m, MaxOp{}, -d_inf<T>(), scratch);
}

// sum exp(x - m) with m the row maximum: every term is at most 1, so nothing overflows.
template <typename T, typename S>
__device__ T row_sumexp(const S* x, int64_t n, T m, T* scratch) {
  T s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += d_exp(ld<T>(x[i]) - m);
  return block_reduce(s, SumOp{}, T(0), scratch);
}

template <typename T, bool Log>
__global__ void softmax_forward_kernel(const T* x, T* y, int64_t n) {
  __shared__ T scratch[32];
  const T* xr = x + blockIdx.x * n;
  T* yr = y + blockIdx.x * n;
  const T m = row_max(xr, n, scratch);
  const T s = row_sumexp(xr, n, m, scratch);
  if constexpr (Log) {
    const T lse = m + d_log(s);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] - lse;
  } else {
    const T inv = T(1) / s;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = d_exp(xr[i] - m) * inv;
  }
}

// softmax: dx = y (dy - sum(dy y)); log_softmax: dx = dy - exp(y) sum(dy).
template <typename T, bool Log>
__global__ void softmax_backward_kernel(const T* y, const T* dy, T* dx, int64_t n) {
  __shared__ T scratch[32];
  const T* yr = y + blockIdx.x * n;
  const T* dyr = dy + blockIdx.x * n;
  T* dxr = dx + blockIdx.x * n;
  T s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += Log ? dyr[i] : dyr[i] * yr[i];
  s = block_reduce(s, SumOp{}, T(0), scratch);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if constexpr (Log)
      dxr[i] = dyr[i] - d_exp(yr[i]) * s;
    else
      dxr[i] = yr[i] * (dyr[i] - s);
  }
}

// One pass over a row: each thread keeps the running maximum m of its elements and the sum s of
// exp(x - m) (rescaled when m grows, as flash attention's online softmax: one exp an element); the
// block then takes the maximum M of the threads' m and the sum of s exp(m - M). Returns
// log(sum) + M. A NaN makes s NaN, and so does a second +inf (exp(inf - inf)), as on the CPU; a
// -inf adds exp(-inf) = 0, so it is skipped (with m still -inf, exp(-inf - -inf) would be NaN).
template <typename T, typename S>
__device__ T row_logsumexp(const S* x, int64_t n, T* scratch) {
  T m = -d_inf<T>(), s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const T v = ld<T>(x[i]);
    if (v > m) {
      s = s * d_exp(m - v) + T(1);
      m = v;
    } else if (v != -d_inf<T>()) {
      s += d_exp(v - m);
    }
  }
  const T M = block_reduce(m, MaxOp{}, -d_inf<T>(), scratch);
  const T part = m == -d_inf<T>() ? T(0) : s * d_exp(m - M);
  const T sum = block_reduce(part, SumOp{}, T(0), scratch);
  return M + d_log(sum);
}

// logits stored as S (T, or bf16_t for float), losses and lse as T.
template <typename T, typename S>
__global__ void cross_entropy_forward_kernel(const S* logits, const int32_t* targets, T* losses, T* lse, int64_t V) {
  __shared__ T scratch[32];
  const int32_t t = targets[blockIdx.x];
  if (t < 0) {  // ignored: the whole block leaves before any barrier
    if (threadIdx.x == 0) losses[blockIdx.x] = lse[blockIdx.x] = T(0);
    return;
  }
  const S* xr = logits + blockIdx.x * V;
  const T l = row_logsumexp<T>(xr, V, scratch);
  if (threadIdx.x == 0) {
    lse[blockIdx.x] = l;
    losses[blockIdx.x] = l - ld<T>(xr[t]);
  }
}

// One read of each row: exp(x - lse) is the softmax.
template <typename T, typename S>
__global__ void cross_entropy_backward_kernel(const S* logits, const int32_t* targets, const T* lse, T scale,
                                              S* dlogits, int64_t V) {
  const int32_t t = targets[blockIdx.x];
  const S* xr = logits + blockIdx.x * V;
  S* dr = dlogits + blockIdx.x * V;
  if (t < 0) {
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) dr[i] = st<S>(T(0));
    return;
  }
  const T l = lse[blockIdx.x];
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    T d = d_exp(ld<T>(xr[i]) - l) * scale;  // (softmax - onehot) * scale, rounded as the CPU rounds it
    if (i == t) d -= scale;
    dr[i] = st<S>(d);
  }
}

// x = a + b (b null: x is a, not written), then y = x r w with r = (mean(x^2) + eps)^(-1/2).
// Each thread reads back only the elements of x it wrote itself. a, x and rstd are T; b, w and y
// stored as SB, SW, SY (T, or bf16_t for float).
template <typename T, typename SB, typename SW, typename SY>
__global__ void rmsnorm_forward_kernel(const T* a, const SB* b, const SW* w, T eps, T* x, SY* y, T* rstd, int64_t D) {
  __shared__ T scratch[32];
  const T* ar = a + blockIdx.x * D;
  SY* yr = y + blockIdx.x * D;
  T ss = 0;
  if (b) {
    const SB* br = b + blockIdx.x * D;
    T* xw = x + blockIdx.x * D;
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
      const T v = ar[i] + ld<T>(br[i]);
      xw[i] = v;
      ss += v * v;
    }
    ar = xw;
  } else {
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) ss += ar[i] * ar[i];
  }
  const T* xr = ar;
  ss = block_reduce(ss, SumOp{}, T(0), scratch);
  const T r = T(1) / d_sqrt(ss / T(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) yr[i] = st<SY>(xr[i] * r * ld<T>(w[i]));
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// y_i = x_i r w_i with r = (mean(x^2) + eps)^(-1/2), dr/dx_j = -r^3 x_j / D, so
// dx_j = r (w_j dy_j - x_j c) with c = r^2 / D * sum_i dy_i w_i x_i: the row's sum of
// rms_term(dy_i, w_i, x_i), then rms_grad(r, w_j, dy_j, x_j, c), in both backward kernels.
template <typename T>
__device__ __forceinline__ T rms_term(T dy, T w, T x) {
  return dy * w * x;
}
template <typename T>
__device__ __forceinline__ T rms_grad(T r, T w, T dy, T x, T c) {
  return r * (w * dy - x * c);
}

// w and dy stored as SW and SD (T, or bf16_t for float).
template <typename T, typename SW, typename SD>
__global__ void rmsnorm_backward_dx_kernel(const T* x, const SW* w, const T* rstd, const SD* dy, T* dx, int64_t D,
                                           bool accumulate) {
  __shared__ T scratch[32];
  const T* xr = x + blockIdx.x * D;
  const SD* dyr = dy + blockIdx.x * D;
  T* dxr = dx + blockIdx.x * D;
  const T r = rstd[blockIdx.x];
  T s = 0;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) s += rms_term(ld<T>(dyr[i]), ld<T>(w[i]), xr[i]);
  s = block_reduce(s, SumOp{}, T(0), scratch);
  const T c = r * r * s / T(D);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const T g = rms_grad(r, ld<T>(w[i]), ld<T>(dyr[i]), xr[i], c);
    dxr[i] = accumulate ? dxr[i] + g : g;
  }
}

// RMSNorm's backward in one pass over x and dy: a block takes rows g, g + G, g + 2G, ... (G from R
// alone: rmsnorm_groups), holds each row's x, dy and (once) w in registers, K per thread (column
// c = threadIdx.x + k blockDim.x), writes the row's dx as rmsnorm_backward_dx_kernel does, and
// adds the row's dy x rstd to its K double accumulators; partial[g][c] = the block's sum of its
// rows' terms, which col_finish_kernel adds up in g's order and onto dw. Deterministic (the block
// size and G depend on D and R only); the row's inputs are all read before the block reduction's
// barrier, so dx may alias x or dy. At most 512 threads: launch_bounds keeps the registers within
// what such a block may have (spilling, if need be, rather than failing to launch).
constexpr int kRmsNormThreads = 512;
template <typename T, typename SW, typename SD, int K>
__global__ void __launch_bounds__(kRmsNormThreads)
    rmsnorm_backward_kernel(const T* x, const SW* w, const T* rstd, const SD* dy, T* dx, int64_t R, int64_t D,
                            bool accumulate, double* partial) {
  __shared__ T scratch[32];
  T wv[K];
  double acc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t c = threadIdx.x + int64_t(k) * blockDim.x;
    wv[k] = c < D ? ld<T>(w[c]) : T(0);
    acc[k] = 0;
  }
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const T* xr = x + r * D;
    const SD* dyr = dy + r * D;
    T* dxr = dx + r * D;
    const T rs = rstd[r];
    T xv[K], dv[K];
    T s = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = threadIdx.x + int64_t(k) * blockDim.x;
      xv[k] = c < D ? xr[c] : T(0);
      dv[k] = c < D ? ld<T>(dyr[c]) : T(0);
      if (c < D) s += rms_term(dv[k], wv[k], xv[k]);
    }
    s = block_reduce(s, SumOp{}, T(0), scratch);
    const T cf = rs * rs * s / T(D);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = threadIdx.x + int64_t(k) * blockDim.x;
      if (c >= D) continue;
      const T g = rms_grad(rs, wv[k], dv[k], xv[k], cf);
      dxr[c] = accumulate ? dxr[c] + g : g;
      acc[k] += double(dv[k]) * double(xv[k]) * double(rs);
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t c = threadIdx.x + int64_t(k) * blockDim.x;
    if (c < D) partial[blockIdx.x * D + c] = acc[k];
  }
}

// The row groups of rmsnorm_backward_kernel: 8 rows or more a block, so that the partials (G D
// doubles) stay small beside x and dy, and at most 1024 blocks.
inline unsigned rmsnorm_groups(int64_t R) {
  const int64_t g = (R + 7) / 8;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 1024 ? 1024 : g));
}
// The widest row it holds in registers, 16 a thread (Llama 3 70B's 8192; wider rows take two passes).
constexpr int64_t kRmsNormFoldMaxD = 16 * kRmsNormThreads;

// dw_c += sum_r dy[r, c] x[r, c] rstd[r], as a deterministic column reduction (in double): rows
// wider than kRmsNormFoldMaxD, where dw is its own pass before the dx kernel.
template <typename T, typename SD>
struct DwLoad {
  const T* x;
  const SD* dy;
  const T* rstd;
  int64_t D;
  __device__ double operator()(int64_t r, int64_t c) const {
    return double(ld<T>(dy[r * D + c])) * double(x[r * D + c]) * double(rstd[r]);
  }
};
template <typename T>
struct DwAccumulate {
  T* dw;
  __device__ void operator()(int64_t c, double acc) const { dw[c] = T(double(dw[c]) + acc); }  // the CPU's one rounding
};
struct AddD {
  __device__ double operator()(double a, double b) const { return a + b; }
};

// One thread per rotated pair of x (npairs pairs, H heads), then of x2 (npairs2, H2 heads:
// rope_qk's k, in the same launch), from the host's table of cos and sin (rope_table: computed in
// double, kept in T on the device): no transcendental per element, and the CPU's very factors.
// x and y stored as S (T, or bf16_t for float).
template <typename T, typename S>
__global__ void rope_kernel(const S* x, S* y, int64_t npairs, int64_t H, const S* x2, S* y2, int64_t npairs2,
                            int64_t H2, int64_t T_, int64_t half, const T* cos_t, const T* sin_t, T sign) {
  for (int64_t p = global_tid(); p < npairs + npairs2; p += grid_stride()) {
    const bool second = p >= npairs;
    const int64_t q = second ? p - npairs : p;
    const S* xs = second ? x2 : x;
    S* ys = second ? y2 : y;
    const int64_t i = q % half;
    const int64_t t = (q / half / (second ? H2 : H)) % T_;
    const T c = cos_t[t * half + i], s = sign * sin_t[t * half + i];
    const T x0 = ld<T>(xs[2 * q]), x1 = ld<T>(xs[2 * q + 1]);
    ys[2 * q] = st<S>(x0 * c - x1 * s);
    ys[2 * q + 1] = st<S>(x0 * s + x1 * c);
  }
}

// The device copies of rope_table's tables, per (T, hd, theta, pos0, dtype, GPU): uploaded once
// (a synchronous copy at the first use of a shape), then read by every layer and step. Returned
// by value (two tensor handles): a copy outlives another thread's clearing of the cache.
struct DeviceRope {
  Tensor cos, sin;
};
DeviceRope device_rope(int64_t T_, int64_t hd, double theta, int64_t pos0, DType t, Device d) {
  static std::mutex mu;
  // Never destroyed: device memory is not freed after the CUDA runtime has gone at exit.
  static auto& cache = *new std::map<std::tuple<int64_t, int64_t, double, int64_t, DType, int>, DeviceRope>;
  const auto key = std::make_tuple(T_, hd, theta, pos0, t, d.index);
  std::lock_guard lock(mu);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  if (cache.size() >= 64) cache.clear();  // as rope_table's (a reference handed out earlier is spent by then)
  const auto table = rope_table(T_, hd, theta, pos0);
  const Shape shape{T_, hd / 2};
  DeviceRope r;
  if (t == DType::f64) {
    r.cos = Tensor::from_host(table->cos.data(), shape, t, d);
    r.sin = Tensor::from_host(table->sin.data(), shape, t, d);
  } else {
    r.cos = Tensor::from_host(table->cosf.data(), shape, DType::f32, d);
    r.sin = Tensor::from_host(table->sinf.data(), shape, DType::f32, d);
  }
  return cache.emplace(key, std::move(r)).first->second;
}

// table and out stored as ST and SO (T, or bf16_t for float), converted through T.
template <typename T, typename ST, typename SO>
__global__ void embedding_forward_kernel(const ST* table, const int32_t* ids, SO* out, int64_t N, int64_t D) {
  for (int64_t e = global_tid(); e < N * D; e += grid_stride()) {
    const int64_t n = e / D, d = e - n * D;
    out[e] = st<SO>(ld<T>(table[static_cast<int64_t>(ids[n]) * D + d]));
  }
}

}  // namespace

void softmax_forward(const Tensor& x, Tensor& y) {
  const int64_t n = last_dim(x), R = rows_of(x);
  if (R == 0) return;
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    softmax_forward_kernel<T, false><<<static_cast<unsigned>(R), threads_for_row(n), 0, stream()>>>(
        x.ptr<T>(), y.ptr<T>(), n);
  });
  check_launch("softmax_forward");
}

void log_softmax_forward(const Tensor& x, Tensor& y) {
  const int64_t n = last_dim(x), R = rows_of(x);
  if (R == 0) return;
  visit_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    softmax_forward_kernel<T, true><<<static_cast<unsigned>(R), threads_for_row(n), 0, stream()>>>(
        x.ptr<T>(), y.ptr<T>(), n);
  });
  check_launch("log_softmax_forward");
}

void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const int64_t n = last_dim(y), R = rows_of(y);
  if (R == 0) return;
  visit_float(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    softmax_backward_kernel<T, false><<<static_cast<unsigned>(R), threads_for_row(n), 0, stream()>>>(
        y.ptr<T>(), dy.ptr<T>(), dx.ptr<T>(), n);
  });
  check_launch("softmax_backward");
}

void log_softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  const int64_t n = last_dim(y), R = rows_of(y);
  if (R == 0) return;
  visit_float(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    softmax_backward_kernel<T, true><<<static_cast<unsigned>(R), threads_for_row(n), 0, stream()>>>(
        y.ptr<T>(), dy.ptr<T>(), dx.ptr<T>(), n);
  });
  check_launch("log_softmax_backward");
}

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor& lse) {
  const int64_t N = logits.dim(0), V = logits.dim(1);
  if (N == 0) return;
  visit_compute(losses.dtype(), [&](auto tag) {
    using T = decltype(tag);
    visit_storage<T>(logits.dtype(), [&](auto stag) {
      using S = decltype(stag);
      cross_entropy_forward_kernel<T, S><<<static_cast<unsigned>(N), threads_for_row(V), 0, stream()>>>(
          logits.ptr<S>(), targets.ptr<int32_t>(), losses.ptr<T>(), lse.ptr<T>(), V);
    });
  });
  check_launch("cross_entropy_forward");
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, double scale,
                            Tensor& dlogits) {
  const int64_t N = logits.dim(0), V = logits.dim(1);
  if (N == 0) return;
  visit_compute(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
    visit_storage<T>(logits.dtype(), [&](auto stag) {
      using S = decltype(stag);
      cross_entropy_backward_kernel<T, S><<<static_cast<unsigned>(N), threads_for_row(V), 0, stream()>>>(
          logits.ptr<S>(), targets.ptr<int32_t>(), lse.ptr<T>(), T(scale), dlogits.ptr<S>(), V);
    });
  });
  check_launch("cross_entropy_backward");
}

// y = rmsnorm(x) over rows, x = a + b first when b is given.
void rmsnorm_forward(const Tensor& a, const Tensor* b, const Tensor& w, double eps, Tensor& x, Tensor& y,
                     Tensor& rstd) {
  const int64_t D = last_dim(a), R = rows_of(a);
  if (R == 0) return;
  visit_compute(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    visit_storage<T>(b ? b->dtype() : a.dtype(), [&](auto btag) {
      visit_storage<T>(w.dtype(), [&](auto wtag) {
        visit_storage<T>(y.dtype(), [&](auto ytag) {
          using SB = decltype(btag);
          using SW = decltype(wtag);
          using SY = decltype(ytag);
          rmsnorm_forward_kernel<T, SB, SW, SY><<<static_cast<unsigned>(R), threads_for_row(D), 0, stream()>>>(
              a.ptr<T>(), b ? b->ptr<SB>() : nullptr, w.ptr<SW>(), T(eps), x.ptr<T>(), y.ptr<SY>(), rstd.ptr<T>(), D);
        });
      });
    });
  });
  check_launch(b ? "add_rmsnorm_forward" : "rmsnorm_forward");
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                      Tensor& dw, bool accumulate) {
  const int64_t D = last_dim(x), R = rows_of(x);
  if (R == 0) return;
  visit_compute(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    visit_storage<T>(w.dtype(), [&](auto wtag) {
      visit_storage<T>(dy.dtype(), [&](auto dtag) {
        using SW = decltype(wtag);
        using SD = decltype(dtag);
        if (D > kRmsNormFoldMaxD) {
          // dw first: it reads dy, which dx may overwrite when the caller passes them aliased.
          column_reduce<double>("rmsnorm_backward(dw)", R, D, DwLoad<T, SD>{x.ptr<T>(), dy.ptr<SD>(), rstd.ptr<T>(), D},
                                AddD{}, 0.0, DwAccumulate<T>{dw.ptr<T>()}, x.device());
          rmsnorm_backward_dx_kernel<T, SW, SD><<<static_cast<unsigned>(R), threads_for_row(D), 0, stream()>>>(
              x.ptr<T>(), w.ptr<SW>(), rstd.ptr<T>(), dy.ptr<SD>(), dx.ptr<T>(), D, accumulate);
          return;
        }
        const unsigned G = rmsnorm_groups(R);
        Tensor partial = Tensor::empty({static_cast<int64_t>(G) * D}, DType::f64, x.device());
        // K: the fewest columns a thread (a power of two) that cover the row with kRmsNormThreads.
        auto launch = [&](auto k) {
          constexpr int K = decltype(k)::value;
          const int64_t threads = ((D + K - 1) / K + 31) / 32 * 32;
          rmsnorm_backward_kernel<T, SW, SD, K><<<G, static_cast<unsigned>(threads), 0, stream()>>>(
              x.ptr<T>(), w.ptr<SW>(), rstd.ptr<T>(), dy.ptr<SD>(), dx.ptr<T>(), R, D, accumulate,
              partial.ptr<double>());
        };
        const int64_t per_thread = (D + kRmsNormThreads - 1) / kRmsNormThreads;
        if (per_thread <= 1) launch(std::integral_constant<int, 1>{});
        else if (per_thread <= 2) launch(std::integral_constant<int, 2>{});
        else if (per_thread <= 4) launch(std::integral_constant<int, 4>{});
        else if (per_thread <= 8) launch(std::integral_constant<int, 8>{});
        else launch(std::integral_constant<int, 16>{});
        check_launch("rmsnorm_backward");
        col_finish_kernel<double><<<grid_for(D, 256), 256, 0, stream()>>>(D, G, partial.ptr<double>(), AddD{},
                                                                           DwAccumulate<T>{dw.ptr<T>()});
      });
    });
  });
  check_launch("rmsnorm_backward");
}

namespace {
// rope of x into y and, when x2 is given, of x2 into y2 (the same B, T and hd), in one launch.
void rope_launch(const Tensor& x, Tensor& y, const Tensor* x2, Tensor* y2, double theta, int64_t pos0, bool inverse,
                 const char* name) {
  const int64_t T_ = x.dim(1), hd = x.dim(3);
  const int64_t npairs = x.numel() / 2, npairs2 = x2 ? x2->numel() / 2 : 0;
  if (npairs + npairs2 == 0) return;
  visit_compute(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const DeviceRope r = device_rope(T_, hd, theta, pos0, std::is_same_v<T, double> ? DType::f64 : DType::f32,
                                      x.device());
    visit_storage<T>(x.dtype(), [&](auto stag) {
      using S = decltype(stag);
      rope_kernel<T, S><<<grid_for(npairs + npairs2, 256), 256, 0, stream()>>>(
          x.ptr<S>(), y.ptr<S>(), npairs, x.dim(2), x2 ? x2->ptr<S>() : nullptr, y2 ? y2->ptr<S>() : nullptr, npairs2,
          x2 ? x2->dim(2) : 1, T_, hd / 2, r.cos.ptr<T>(), r.sin.ptr<T>(), T(inverse ? -1 : 1));
    });
  });
  check_launch(name);
}
}  // namespace

void rope(const Tensor& x, double theta, int64_t pos0, bool inverse, Tensor& y) {
  rope_launch(x, y, nullptr, nullptr, theta, pos0, inverse, "rope");
}

void rope_qk(Tensor& q, Tensor& k, double theta, int64_t pos0, bool inverse) {
  rope_launch(q, q, &k, &k, theta, pos0, inverse, "rope_qk");
}

void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  const int64_t N = ids.numel(), D = table.dim(1);
  if (N * D == 0) return;
  visit_compute(table.dtype(), [&](auto tag) {
    using T = decltype(tag);
    visit_storage<T>(table.dtype(), [&](auto ttag) {
      visit_storage<T>(out.dtype(), [&](auto otag) {
        using ST = decltype(ttag);
        using SO = decltype(otag);
        embedding_forward_kernel<T, ST, SO><<<grid_for(N * D, 256), 256, 0, stream()>>>(
            table.ptr<ST>(), ids.ptr<int32_t>(), out.ptr<SO>(), N, D);
      });
    });
  });
  check_launch("embedding_forward");
}

// Deterministic (sort-based, no float atomics): see index_add_rows in select.cu.
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  index_add_rows("embedding_backward", ids, dout, dtable.dim(1), dtable);
}

}  // namespace dtk::ops::cuda
