// bf16 and f16 <-> float conversions, round to nearest even, for host and CUDA device code alike
// (the same bits on both: integer arithmetic and exact float operations only).
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DTK_HD __host__ __device__ __forceinline__
#else
#define DTK_HD inline
#endif

namespace dtk {

DTK_HD uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
DTK_HD float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

DTK_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
DTK_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }
// f32 rounded to the nearest bf16 (ties to even), kept in an f32: a bf16 value stored as f32.
DTK_HD float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// f32 rounded to TF32, the tensor cores' 19-bit float (f32's exponent, 10 explicit mantissa
// bits), kept in an f32: round to nearest, ties away from zero (PTX cvt.rna.tf32.f32); NaN and
// infinity unchanged, a value past TF32's largest finite rounds to infinity.
DTK_HD float round_tf32(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u) return f;
  return bits_float((u + 0x1000u) & 0xffffe000u);
}

DTK_HD uint16_t float_to_f16(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to infinity
  if (absx < 0x38800000u) {
    // Subnormal result: the value in units of 2^-24 is absx's significand shifted right; round
    // the shifted-out bits to nearest even.
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the smallest: zero
    const uint32_t e = absx >> 23;                               // biased exponent, 102..112
    const uint32_t m = (absx & 0x7fffffu) | 0x800000u;           // 24-bit significand
    const uint32_t shift = 126u - e;                             // 14..24
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t r = absx - 0x38000000u;  // rebias the exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

DTK_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    int e = -1;  // normalise the subnormal
    do {
      man <<= 1;
      ++e;
    } while (!(man & 0x400u));
    return bits_float(sign | ((112u - e) << 23) | ((man & 0x3ffu) << 13));
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

}  // namespace dtk
