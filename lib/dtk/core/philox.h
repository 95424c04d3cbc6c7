// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) and the
// uniform and normal draws built on it. Header-only and usable from CUDA device code, so that the
// CPU and the GPU compute the same numbers bit for bit: the draws use only integer arithmetic,
// IEEE-exact operations (+, -, *, /, sqrt, each correctly rounded) and explicit fma, never a
// library log or cos (whose last bits differ between glibc and CUDA), and no expression that a
// compiler may contract into an fma on one side only.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DTK_HD __host__ __device__ __forceinline__
#else
#define DTK_HD inline
#endif

namespace dtk::philox {

struct U4 {
  uint32_t x[4];
};

DTK_HD uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// The Philox-4x32-10 bijection of a 128-bit counter under a 64-bit key (Random123's
// philox4x32_R(10, ...)).
DTK_HD U4 philox4x32_10(U4 ctr, uint32_t k0, uint32_t k1) {
  uint32_t c0 = ctr.x[0], c1 = ctr.x[1], c2 = ctr.x[2], c3 = ctr.x[3];
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo(0xD2511F53u, c0, &hi0);
    const uint32_t lo1 = mulhilo(0xCD9E8D57u, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return U4{{c0, c1, c2, c3}};
}

// Four 32-bit words for counter (lo, hi, 0, 0) under key seed: the stream every fill uses.
DTK_HD U4 philox4x32(uint64_t seed, uint64_t counter) {
  return philox4x32_10(U4{{static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0u, 0u}},
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// 53-bit uniform in [0, 1) from two words.
DTK_HD double to_unit(uint32_t a, uint32_t b) {
  const uint64_t bits = ((static_cast<uint64_t>(a) << 32) | b) >> 11;
  return static_cast<double>(bits) * 0x1p-53;
}

// log(u) for u in (0, 1], from its exponent and an atanh series on the mantissa in
// [1/sqrt2, sqrt2): |s| <= 0.1716, 12 terms give full double accuracy.
DTK_HD double log_unit(double u) {
  int e = 0;
  double m = std::frexp(u, &e);  // exact: u = m 2^e, m in [0.5, 1)
  if (m < 0.70710678118654752) {
    m = m * 2.0;  // exact
    e -= 1;
  }
  const double s = (m - 1.0) / (m + 1.0);
  const double s2 = s * s;
  double p = 1.0 / 25.0;
  p = std::fma(p, s2, 1.0 / 23.0);
  p = std::fma(p, s2, 1.0 / 21.0);
  p = std::fma(p, s2, 1.0 / 19.0);
  p = std::fma(p, s2, 1.0 / 17.0);
  p = std::fma(p, s2, 1.0 / 15.0);
  p = std::fma(p, s2, 1.0 / 13.0);
  p = std::fma(p, s2, 1.0 / 11.0);
  p = std::fma(p, s2, 1.0 / 9.0);
  p = std::fma(p, s2, 1.0 / 7.0);
  p = std::fma(p, s2, 1.0 / 5.0);
  p = std::fma(p, s2, 1.0 / 3.0);
  p = std::fma(p, s2, 1.0);
  const double log_m = (2.0 * s) * p;
  return std::fma(static_cast<double>(e), 0.69314718055994530942, log_m);
}

// sin and cos of theta in [-pi/4, pi/4], Taylor to degree 17 / 16.
DTK_HD void sincos_small(double t, double* sn, double* cs) {
  const double t2 = t * t;
  double s = 1.0 / 355687428096000.0;  // 1/17!
  s = std::fma(s, t2, -1.0 / 1307674368000.0);
  s = std::fma(s, t2, 1.0 / 6227020800.0);
  s = std::fma(s, t2, -1.0 / 39916800.0);
  s = std::fma(s, t2, 1.0 / 362880.0);
  s = std::fma(s, t2, -1.0 / 5040.0);
  s = std::fma(s, t2, 1.0 / 120.0);
  s = std::fma(s, t2, -1.0 / 6.0);
  s = std::fma(s, t2, 1.0);
  *sn = t * s;
  double c = 1.0 / 20922789888000.0;  // 1/16!
  c = std::fma(c, t2, -1.0 / 87178291200.0);
  c = std::fma(c, t2, 1.0 / 479001600.0);
  c = std::fma(c, t2, -1.0 / 3628800.0);
  c = std::fma(c, t2, 1.0 / 40320.0);
  c = std::fma(c, t2, -1.0 / 720.0);
  c = std::fma(c, t2, 1.0 / 24.0);
  c = std::fma(c, t2, -0.5);
  *cs = std::fma(c, t2, 1.0);
}

// cos(2 pi t) for t in [0, 1): reduced to a quarter turn exactly, then sincos_small.
DTK_HD double cos_turns(double t) {
  const double k = std::floor(t * 4.0 + 0.5);  // t * 4 is exact
  const double r = t - k * 0.25;               // exact, in [-1/8, 1/8]
  double sn, cs;
  sincos_small(r * 6.28318530717958647692, &sn, &cs);
  switch (static_cast<int>(k) & 3) {
    case 0: return cs;
    case 1: return -sn;
    case 2: return -cs;
    default: return sn;
  }
}

// The draws of element `index` of a fill (seed, offset): counter offset + index.
DTK_HD double uniform(uint64_t seed, uint64_t counter) {
  const U4 w = philox4x32(seed, counter);
  return to_unit(w.x[0], w.x[1]);
}

// Box-Muller: sqrt(-2 log u1) cos(2 pi u2), u1 in (0, 1].
DTK_HD double normal(uint64_t seed, uint64_t counter) {
  const U4 w = philox4x32(seed, counter);
  const double u1 = 1.0 - to_unit(w.x[0], w.x[1]);
  const double u2 = to_unit(w.x[2], w.x[3]);
  return std::sqrt(-2.0 * log_unit(u1)) * cos_turns(u2);
}

}  // namespace dtk::philox
