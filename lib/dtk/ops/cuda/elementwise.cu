// CUDA elementwise ops and activations (forward and backward). One generic "map" kernel: a
// grid-stride loop that reads each input as 16-byte packs (4 floats or 2 doubles) when every
// pointer is aligned, then finishes the tail element by element. The per-element math is a small
// functor, so each op is a line. In place is allowed everywhere: element i is read before it is
// written, by the same thread.
#include "dtk/ops/cuda/common.cuh"

namespace dtk::ops::cuda {
using namespace kern;

namespace {

template <typename T, int N, typename F, typename... P>
__device__ __forceinline__ void apply_pack(Pack<T, N>& o, const F& f, const P&... p) {
#pragma unroll
  for (int j = 0; j < N; ++j) o.v[j] = f(p.v[j]...);
}

// out[i] = f(in0[i], in1[i], ...). VEC elements per pack (1 when the pointers are not aligned).
template <int VEC, typename T, typename F, typename... In>
__global__ void map_kernel(T* out, int64_t n, F f, const In*... in) {
  const int64_t nvec = n / VEC;
  for (int64_t i = global_tid(); i < nvec; i += grid_stride()) {
    Pack<T, VEC> o;
    apply_pack(o, f, reinterpret_cast<const Pack<In, VEC>*>(in)[i]...);
    reinterpret_cast<Pack<T, VEC>*>(out)[i] = o;
  }
  for (int64_t i = nvec * VEC + global_tid(); i < n; i += grid_stride()) out[i] = f(in[i]...);
}

template <typename T, typename F, typename... In>
void launch_map(const char* name, T* out, int64_t n, F f, const In*... in) {
  if (n == 0) return;
  constexpr int VEC = 16 / sizeof(T);
  const bool aligned = aligned_for<T, VEC>(out) && (aligned_for<In, VEC>(in) && ...);
  constexpr int threads = 256;
  if (aligned)
    map_kernel<VEC><<<grid_for(n / VEC + 1, threads), threads, 0, stream()>>>(out, n, f, in...);
  else
    map_kernel<1><<<grid_for(n, threads), threads, 0, stream()>>>(out, n, f, in...);
  check_launch(name);
}

// The mixed-precision form (ops.h): out[i] = f(in0[i], ...) computed in C, each tensor stored as
// its own type (C or bf16_t), element by element.
template <typename C, typename F, typename So, typename... Si>
__global__ void map_mixed_kernel(So* out, int64_t n, F f, const Si*... in) {
  for (int64_t i = global_tid(); i < n; i += grid_stride()) out[i] = st<So>(f(ld<C>(in[i])...));
}

// ---- functors: T is the element type; scalars arrive as T (rounded once on the host)
template <typename T> struct AddF { __device__ T operator()(T a, T b) const { return a + b; } };
template <typename T> struct SubF { __device__ T operator()(T a, T b) const { return a - b; } };
template <typename T> struct MulF { __device__ T operator()(T a, T b) const { return a * b; } };
template <typename T> struct DivF { __device__ T operator()(T a, T b) const { return a / b; } };
template <typename T> struct AddScalarF { T s; __device__ T operator()(T a) const { return a + s; } };
template <typename T> struct ScaleF { T s; __device__ T operator()(T a) const { return s * a; } };
template <typename T> struct AxpyF { T alpha; __device__ T operator()(T x, T y) const { return y + alpha * x; } };
template <typename T> struct LerpF { T w; __device__ T operator()(T a, T b) const { return a + w * (b - a); } };
template <typename T> struct SqrtF { __device__ T operator()(T a) const { return d_sqrt(a); } };
// 1 / sqrt rather than the rsqrt intrinsic: correctly rounded sqrt and division, closest to the CPU.
template <typename T> struct RsqrtF { __device__ T operator()(T a) const { return T(1) / d_sqrt(a); } };
template <typename T> struct PowF { T p; __device__ T operator()(T a) const { return d_pow(a, p); } };
// NaN stays NaN; +-0 gives 0.
template <typename T> struct SignF {
  __device__ T operator()(T a) const { return a > T(0) ? T(1) : (a < T(0) ? T(-1) : (a == T(0) ? T(0) : a)); }
};
template <typename T> struct AbsF { __device__ T operator()(T a) const { return d_abs(a); } };
// Comparisons rather than fmin/fmax so that NaN propagates.
template <typename T> struct ClampF {
  T lo, hi;
  __device__ T operator()(T a) const { return a < lo ? lo : (a > hi ? hi : a); }
};
template <typename T> struct WhereF {
  __device__ T operator()(uint8_t c, T a, T b) const { return c ? a : b; }
};

template <typename T> __device__ __forceinline__ T sigmoid(T x) { return T(1) / (T(1) + d_exp(-x)); }

template <typename T> struct SiluF { __device__ T operator()(T x) const { return x * sigmoid(x); } };
// d/dx x s(x) = s + x s (1 - s)
template <typename T> struct SiluBwdF {
  __device__ T operator()(T x, T dy) const {
    const T s = sigmoid(x);
    return dy * (s + x * s * (T(1) - s));
  }
};

// GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <typename T> struct GeluF {
  __device__ T operator()(T x) const {
    const T k = T(0.7978845608028654);  // sqrt(2 / pi)
    return T(0.5) * x * (T(1) + d_tanh(k * (x + T(0.044715) * x * x * x)));
  }
};
// sech^2 = 1 - tanh^2 (no cosh, which overflows for large |x|).
template <typename T> struct GeluBwdF {
  __device__ T operator()(T x, T dy) const {
    const T k = T(0.7978845608028654);
    const T t = d_tanh(k * (x + T(0.044715) * x * x * x));
    const T sech2 = T(1) - t * t;
    const T grad = T(0.5) * (T(1) + t) + T(0.5) * x * sech2 * k * (T(1) + T(3) * T(0.044715) * x * x);
    return dy * grad;
  }
};
template <typename T> struct ReluF { __device__ T operator()(T x) const { return x > T(0) ? x : T(0); } };
template <typename T> struct ReluBwdF { __device__ T operator()(T x, T dy) const { return x > T(0) ? dy : T(0); } };
template <typename T> struct SwigluF { __device__ T operator()(T a, T b) const { return a * sigmoid(a) * b; } };

// SwiGLU backward has two outputs; a plain grid-stride kernel (coalesced, scalar) is enough here.
// T computes, S stores (T, or bf16_t for float).
template <typename T, typename S>
__global__ void swiglu_backward_kernel(const S* a, const S* b, const S* dy, S* da, S* db, int64_t n) {
  for (int64_t i = global_tid(); i < n; i += grid_stride()) {
    const T av = ld<T>(a[i]), bv = ld<T>(b[i]), g = ld<T>(dy[i]);
    const T s = sigmoid(av);
    const T silu = av * s;
    // read everything before writing: da / db may alias a / b / dy
    da[i] = st<S>(g * bv * (s + av * s * (T(1) - s)));
    db[i] = st<S>(g * silu);
  }
}

// Unary and binary helpers that dispatch on the dtype of `out`.
template <template <typename> class F>
void unary(const char* name, const Tensor& a, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    launch_map(name, out.ptr<T>(), out.numel(), F<T>{}, a.ptr<T>());
  });
}
template <template <typename> class F>
void binary(const char* name, const Tensor& a, const Tensor& b, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    launch_map(name, out.ptr<T>(), out.numel(), F<T>{}, a.ptr<T>(), b.ptr<T>());
  });
}

// A binary op of the mixed-precision ops: any of a, b and out f32 or bf16.
template <template <typename> class F>
void binary_mixed(const char* name, const Tensor& a, const Tensor& b, Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  visit_storage<float>(a.dtype(), [&](auto sa) {
    visit_storage<float>(b.dtype(), [&](auto sb) {
      visit_storage<float>(out.dtype(), [&](auto so) {
        using SA = decltype(sa);
        using SB = decltype(sb);
        using SO = decltype(so);
        map_mixed_kernel<float><<<grid_for(n, 256), 256, 0, stream()>>>(out.ptr<SO>(), n, F<float>{}, a.ptr<SA>(),
                                                                          b.ptr<SB>());
      });
    });
  });
  check_launch(name);
}

}  // namespace

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  if (any_bf16({&a, &b, &out})) return binary_mixed<AddF>("add", a, b, out);
  binary<AddF>("add", a, b, out);
}
void sub(const Tensor& a, const Tensor& b, Tensor& out) { binary<SubF>("sub", a, b, out); }
void mul(const Tensor& a, const Tensor& b, Tensor& out) { binary<MulF>("mul", a, b, out); }
void div(const Tensor& a, const Tensor& b, Tensor& out) { binary<DivF>("div", a, b, out); }

void add_scalar(const Tensor& a, double s, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    launch_map("add_scalar", out.ptr<T>(), out.numel(), AddScalarF<T>{T(s)}, a.ptr<T>());
  });
}

void scale(const Tensor& a, double s, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    launch_map("scale", out.ptr<T>(), out.numel(), ScaleF<T>{T(s)}, a.ptr<T>());
  });
}

void axpy(double alpha, const Tensor& x, Tensor& y) {
  visit_float(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    launch_map("axpy", y.ptr<T>(), y.numel(), AxpyF<T>{T(alpha)}, x.ptr<T>(), static_cast<const T*>(y.ptr<T>()));
  });
}

void lerp(const Tensor& a, const Tensor& b, double w, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    launch_map("lerp", out.ptr<T>(), out.numel(), LerpF<T>{T(w)}, a.ptr<T>(), b.ptr<T>());
  });
}

void sqrt(const Tensor& a, Tensor& out) { unary<SqrtF>("sqrt", a, out); }
void rsqrt(const Tensor& a, Tensor& out) { unary<RsqrtF>("rsqrt", a, out); }

void pow(const Tensor& a, double p, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    launch_map("pow", out.ptr<T>(), out.numel(), PowF<T>{T(p)}, a.ptr<T>());
  });
}

void sign(const Tensor& a, Tensor& out) { unary<SignF>("sign", a, out); }
void abs(const Tensor& a, Tensor& out) { unary<AbsF>("abs", a, out); }

void clamp(const Tensor& a, double lo, double hi, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    launch_map("clamp", out.ptr<T>(), out.numel(), ClampF<T>{T(lo), T(hi)}, a.ptr<T>());
  });
}

void where(const Tensor& cond_u8, const Tensor& a, const Tensor& b, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    launch_map("where", out.ptr<T>(), out.numel(), WhereF<T>{}, cond_u8.ptr<uint8_t>(), a.ptr<T>(), b.ptr<T>());
  });
}

void silu_forward(const Tensor& x, Tensor& y) { unary<SiluF>("silu_forward", x, y); }
void silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) { binary<SiluBwdF>("silu_backward", x, dy, dx); }
void gelu_forward(const Tensor& x, Tensor& y) { unary<GeluF>("gelu_forward", x, y); }
void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) { binary<GeluBwdF>("gelu_backward", x, dy, dx); }
void relu_forward(const Tensor& x, Tensor& y) { unary<ReluF>("relu_forward", x, y); }
void relu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) { binary<ReluBwdF>("relu_backward", x, dy, dx); }
void swiglu_forward(const Tensor& a, const Tensor& b, Tensor& y) {
  if (a.dtype() == DType::bf16) return binary_mixed<SwigluF>("swiglu_forward", a, b, y);
  binary<SwigluF>("swiglu_forward", a, b, y);
}

void swiglu_backward(const Tensor& a, const Tensor& b, const Tensor& dy, Tensor& da, Tensor& db) {
  const int64_t n = a.numel();
  if (n == 0) return;
  visit_compute(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    visit_storage<T>(a.dtype(), [&](auto stag) {
      using S = decltype(stag);
      swiglu_backward_kernel<T, S><<<grid_for(n, 256), 256, 0, stream()>>>(a.ptr<S>(), b.ptr<S>(), dy.ptr<S>(),
                                                                           da.ptr<S>(), db.ptr<S>(), n);
    });
  });
  check_launch("swiglu_backward");
}

}  // namespace dtk::ops::cuda
