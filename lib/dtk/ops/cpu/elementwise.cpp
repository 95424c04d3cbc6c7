// CPU elementwise ops. Each is a plain loop over the flattened tensors in the element type T
// (scalars rounded to T once, as the CUDA backend does). Element i is read before it is written,
// so out may alias an input.
#include <cmath>
#include <cstdint>

#include "dtk/ops/backend.h"
#include "dtk/ops/cpu/internal.h"

namespace dtk::ops::cpu {

namespace {

// out[i] = f(a[i])
template <typename T, typename F>
void map1(const Tensor& a, Tensor& out, F f) {
  const T* x = a.ptr<T>();
  T* y = out.ptr<T>();
  const int64_t n = out.numel();
#pragma omp parallel for if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] = f(x[i]);
}

// out[i] = f(a[i], b[i])
template <typename T, typename F>
void map2(const Tensor& a, const Tensor& b, Tensor& out, F f) {
  const T* x = a.ptr<T>();
  const T* z = b.ptr<T>();
  T* y = out.ptr<T>();
  const int64_t n = out.numel();
#pragma omp parallel for if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] = f(x[i], z[i]);
}

}  // namespace

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  if (any_bf16({&a, &b, &out})) {
    F32Copies f;
    Tensor o = f.out(out);
    add(f.in(a), f.in(b), o);
    return f.done();
  }
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map2<T>(a, b, out, [](T x, T y) { return x + y; });
  });
}

void sub(const Tensor& a, const Tensor& b, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map2<T>(a, b, out, [](T x, T y) { return x - y; });
  });
}

void mul(const Tensor& a, const Tensor& b, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map2<T>(a, b, out, [](T x, T y) { return x * y; });
  });
}

void div(const Tensor& a, const Tensor& b, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map2<T>(a, b, out, [](T x, T y) { return x / y; });
  });
}

void add_scalar(const Tensor& a, double s, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T st = static_cast<T>(s);
    map1<T>(a, out, [st](T x) { return x + st; });
  });
}

void scale(const Tensor& a, double s, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T st = static_cast<T>(s);
    map1<T>(a, out, [st](T x) { return st * x; });
  });
}

void axpy(double alpha, const Tensor& x, Tensor& y) {
  visit_float(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T al = static_cast<T>(alpha);
    map2<T>(x, y, y, [al](T xi, T yi) { return yi + al * xi; });
  });
}

void lerp(const Tensor& a, const Tensor& b, double w, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T wt = static_cast<T>(w);
    map2<T>(a, b, out, [wt](T x, T y) { return x + wt * (y - x); });
  });
}

void sqrt(const Tensor& a, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map1<T>(a, out, [](T x) { return std::sqrt(x); });
  });
}

void rsqrt(const Tensor& a, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map1<T>(a, out, [](T x) { return T(1) / std::sqrt(x); });
  });
}

void pow(const Tensor& a, double p, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T pt = static_cast<T>(p);
    map1<T>(a, out, [pt](T x) { return std::pow(x, pt); });
  });
}

void sign(const Tensor& a, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    // NaN stays NaN; +-0 gives 0.
    map1<T>(a, out, [](T x) { return x > T(0) ? T(1) : (x < T(0) ? T(-1) : (x == T(0) ? T(0) : x)); });
  });
}

void abs(const Tensor& a, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    map1<T>(a, out, [](T x) { return std::abs(x); });
  });
}

void clamp(const Tensor& a, double lo, double hi, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T l = static_cast<T>(lo), h = static_cast<T>(hi);
    // comparisons rather than fmin/fmax so that NaN propagates
    map1<T>(a, out, [l, h](T x) { return x < l ? l : (x > h ? h : x); });
  });
}

void where(const Tensor& cond_u8, const Tensor& a, const Tensor& b, Tensor& out) {
  visit_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const uint8_t* c = cond_u8.ptr<uint8_t>();
    const T* x = a.ptr<T>();
    const T* z = b.ptr<T>();
    T* y = out.ptr<T>();
    const int64_t n = out.numel();
#pragma omp parallel for if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) y[i] = c[i] ? x[i] : z[i];
  });
}

}  // namespace dtk::ops::cpu
