// Helpers for the compressor tests (tests/unit/test_compress.cpp, tests/mpi/test_compress_mpi.cpp):
// parameters whose grads are views of one flat buffer (as nn::Model holds them), deterministic
// pseudo-random values that every rank can compute for every rank, and small host linear algebra
// in double.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtk/compress/compressor.h"
#include "dtk/core/error.h"

namespace dtk::testing {

using Vec = std::vector<double>;

// A communicator of one rank, and PowerSGD's configuration of the tests.
inline std::shared_ptr<comm::Communicator> local() {
  static auto c = comm::make_local_communicator();
  return c;
}

inline compress::Config psgd(int rank = 2, int64_t start_iter = 0) {
  compress::Config c;
  c.kind = compress::Kind::powersgd;
  c.rank = rank;
  c.start_iter = start_iter;
  c.seed = 7;
  return c;
}

// One configuration of each kind (PowerSGD at rank 2 after one plain step, the sparse kinds at
// ratio 0.1).
inline std::vector<compress::Config> one_of_each_kind() {
  std::vector<compress::Config> cfgs;
  for (compress::Kind kind : enum_values<compress::Kind>()) {
    if (kind == compress::Kind::auto_) continue;  // its choices are measured: tests/unit/test_compress_auto.cpp
    compress::Config c = psgd(2, 1);
    c.kind = kind;
    c.ratio = 0.1;
    cfgs.push_back(c);
  }
  return cfgs;
}

struct Grads {
  Tensor flat;  // f32 [total] (contiguous layout)
  std::vector<nn::Param> params;
};

// Gradients for the given (name, shape) list: views of one flat buffer in order (contiguous), or
// separate tensors.
inline Grads make_grads(const std::vector<std::pair<std::string, Shape>>& specs, Device d = Device::cpu(),
                        bool contiguous = true) {
  Grads g;
  int64_t total = 0;
  for (const auto& s : specs) total += shape_numel(s.second);
  g.flat = Tensor::zeros({total}, DType::f32, d);
  int64_t off = 0;
  for (const auto& s : specs) {
    const int64_t n = shape_numel(s.second);
    Tensor grad = contiguous ? g.flat.slice(off, off + n).reshape(s.second) : Tensor::zeros(s.second, DType::f32, d);
    g.params.push_back({s.first, Tensor(), grad, 0});
    off += n;
  }
  return g;
}

inline void set(nn::Param& p, const Vec& v) {
  p.grad.copy_from(Tensor::from_doubles(v, p.grad.shape(), DType::f32, Device::cpu()));
}
inline Vec get(const nn::Param& p) { return p.grad.to_doubles(); }
inline Vec get(const Tensor& t) { return t.to_doubles(); }

// A deterministic value in [-1, 1) for (seed, i): splitmix64.
inline double hashed(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + i + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0;
}
inline Vec random_vec(int64_t n, uint64_t seed, double scale = 1.0) {
  Vec v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = scale * hashed(seed, static_cast<uint64_t>(i));
  return v;
}
// Rounded to f32, as the grads hold it.
inline Vec as_f32(Vec v) {
  for (auto& x : v) x = static_cast<float>(x);
  return v;
}

inline Tensor state_of(compress::Compressor& c, const std::string& name) {
  for (const PlacedTensor& t : c.state())
    if (t.name == name) return t.value;
  ADD_FAILURE() << "no state tensor " << name;
  return Tensor::zeros({1}, DType::f32);
}

// Row-major host matrices.
inline Vec matmul(const Vec& a, const Vec& b, int64_t n, int64_t k, int64_t m, bool ta = false, bool tb = false) {
  Vec c(static_cast<size_t>(n * m), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j) {
      double s = 0;
      for (int64_t l = 0; l < k; ++l) s += (ta ? a[l * n + i] : a[i * k + l]) * (tb ? b[j * k + l] : b[l * m + j]);
      c[i * m + j] = s;
    }
  return c;
}
// Inverse of a small square matrix (Gauss-Jordan with partial pivoting).
inline Vec inverse(Vec a, int64_t n) {
  Vec inv(static_cast<size_t>(n * n), 0.0);
  for (int64_t i = 0; i < n; ++i) inv[i * n + i] = 1;
  for (int64_t c = 0; c < n; ++c) {
    int64_t p = c;
    for (int64_t r = c + 1; r < n; ++r)
      if (std::abs(a[r * n + c]) > std::abs(a[p * n + c])) p = r;
    for (int64_t j = 0; j < n; ++j) {
      std::swap(a[c * n + j], a[p * n + j]);
      std::swap(inv[c * n + j], inv[p * n + j]);
    }
    const double d = a[c * n + c];
    for (int64_t j = 0; j < n; ++j) {
      a[c * n + j] /= d;
      inv[c * n + j] /= d;
    }
    for (int64_t r = 0; r < n; ++r)
      if (r != c) {
        const double f = a[r * n + c];
        for (int64_t j = 0; j < n; ++j) {
          a[r * n + j] -= f * a[c * n + j];
          inv[r * n + j] -= f * inv[c * n + j];
        }
      }
  }
  return inv;
}
inline double norm(const Vec& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}
inline Vec sub(const Vec& a, const Vec& b) {
  Vec c(a.size());
  for (size_t i = 0; i < a.size(); ++i) c[i] = a[i] - b[i];
  return c;
}
inline Vec add(const Vec& a, const Vec& b) {
  Vec c(a.size());
  for (size_t i = 0; i < a.size(); ++i) c[i] = a[i] + b[i];
  return c;
}
inline Vec scaled(const Vec& a, double s) {
  Vec c(a.size());
  for (size_t i = 0; i < a.size(); ++i) c[i] = a[i] * s;
  return c;
}
inline double max_abs_diff(const Vec& a, const Vec& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}
inline bool all_finite(const Vec& v) {
  for (double x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

// P^ recovered from an update U = P^ Q^T and the aggregated Q [m, r]: P^ = U Q (Q^T Q)^-1.
inline Vec recover_p(const Vec& u, const Vec& q, int64_t n, int64_t m, int64_t r) {
  const Vec qtq = matmul(q, q, r, m, r, true, false);
  return matmul(matmul(u, q, n, m, r), inverse(qtq, r), n, r, r);
}

}  // namespace dtk::testing
