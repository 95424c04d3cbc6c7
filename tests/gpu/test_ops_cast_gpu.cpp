// ops::cast from every dtype to every dtype on the GPU against the CPU. Both backends convert each
// element with the same function (ops/convert.h): integers from floats truncate toward zero and
// saturate, NaN gives 0; 16-bit floats round to nearest even through f32, in integer arithmetic;
// the rest are C++ conversions, which round to nearest on both (no fast-math flags on either
// compiler). That is defined for every input, NaN and infinities included, so the inputs span
// every class of value, and every result must be the same bits (tol 0): NaN for NaN, whatever the
// payload, which IEEE 754 leaves to the implementation.
//
// The inputs of a dtype: for u8, u16, bf16 and f16 every bit pattern; for the others the values at
// the edges of every conversion (ties of each rounding, the ends of each integer range, half the
// smallest subnormal, the largest finite value and the next one up), then Philox bit patterns
// (every exponent, NaNs and subnormals among them) and Philox normals at the magnitudes of each
// integer range.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dtk/core/philox.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/ops.h"
#include "../common/gpu_check.h"

namespace dtk {
namespace {

using namespace gpu_test;

constexpr uint64_t kSeed = 31;
constexpr int64_t kRandom = 1 << 16;  // Philox draws per dtype

uint64_t random_bits(uint64_t counter) {
  const philox::U4 r = philox::philox4x32(kSeed, counter);
  return static_cast<uint64_t>(r.x[0]) << 32 | r.x[1];
}

// Values at the edges of the conversions, as doubles (an f32 source rounds them once more).
Vec edge_doubles() {
  const double lim = std::numeric_limits<double>::max(), flt = std::numeric_limits<float>::max();
  Vec v = {0.0, 0.5, 1.5, 2.5, 0.49999999999999994, 1 - std::ldexp(1, -24),
           // ties of bf16 (8 significant bits), f16 (11) and f32 (24) next to 1, and beside them
           1 + std::ldexp(1, -8), 1 + 3 * std::ldexp(1, -8), 1 + std::ldexp(1, -11), 1 + 3 * std::ldexp(1, -11),
           1 + std::ldexp(1, -24), 1 + 3 * std::ldexp(1, -24), 1 + std::ldexp(1, -24) + std::ldexp(1, -40),
           // the ends of u8, u16, i32 and i64, just inside and just outside
           0.9, 127.5, 255, 255.5, 256, 65535, 65535.5, 65536, 2147483647, 2147483647.5, 2147483648, 2147483648.5,
           4294967296.0, std::ldexp(1, 53) + 2, std::ldexp(1, 63) - 1024, std::ldexp(1, 63), std::ldexp(1, 63) + 2048,
           1e19, 1e30,
           // f16's largest finite value, the last value that rounds to it, the first that overflows
           65504, 65519.99609375, 65520, 70000,
           // f16's smallest normal, smallest subnormal, half of it (a tie to 0), 1.5 of it (a tie up)
           std::ldexp(1, -14), std::ldexp(1, -24), std::ldexp(1, -25), 1.5 * std::ldexp(1, -24), 1e-8,
           // f32's largest finite value, the tie between it and 2^128 (overflows), its subnormals
           flt, flt + std::ldexp(1, 103), 1e39, std::numeric_limits<float>::min(), std::ldexp(1, -149),
           std::ldexp(1, -150), 1e-300, std::numeric_limits<double>::denorm_min(), lim, INFINITY, std::nan("")};
  const size_t n = v.size();
  for (size_t i = 0; i < n; ++i) v.push_back(-v[i]);  // -0 and -NaN included
  return v;
}

template <typename T>
void append(std::vector<unsigned char>& bytes, T x) {
  const size_t at = bytes.size();
  bytes.resize(at + sizeof(T));
  std::memcpy(bytes.data() + at, &x, sizeof(T));
}

// The source elements of dtype t, as host bytes.
std::vector<unsigned char> source_bytes(DType t) {
  std::vector<unsigned char> b;
  switch (t) {
    case DType::u8:
      for (int x = 0; x < 256; ++x) append(b, static_cast<uint8_t>(x));
      break;
    case DType::u16:
    case DType::bf16:
    case DType::f16:
      for (int x = 0; x < 65536; ++x) append(b, static_cast<uint16_t>(x));
      break;
    case DType::f32:
    case DType::f64: {
      Vec v = edge_doubles();
      const double scales[] = {1.0, 300.0, 7e4, 3e9, 1e19};
      for (uint64_t s = 0; s < 5; ++s)
        for (uint64_t i = 0; i < 4096; ++i) v.push_back(scales[s] * philox::normal(kSeed, (s << 20) + i));
      for (double x : v) {
        if (t == DType::f32)
          append(b, static_cast<float>(x));
        else
          append(b, x);
      }
      for (int64_t i = 0; i < kRandom; ++i) {
        const uint64_t r = random_bits(uint64_t(i));
        if (t == DType::f32)
          append(b, static_cast<uint32_t>(r));
        else
          append(b, r);
      }
      break;
    }
    case DType::i32:
    case DType::i64: {
      const std::vector<int64_t> edges = {0,           1,           -1,         255,        256,         -256,
                                          65535,       65536,       -65536,     2049,       16777217,    16777219,
                                          -16777217,   INT32_MAX,   INT32_MIN,  INT32_MAX - 64,
                                          int64_t(INT32_MAX) + 1,   int64_t(INT32_MIN) - 1,  (int64_t(1) << 53) + 1,
                                          -(int64_t(1) << 53) - 1,  (int64_t(1) << 62) + 513, INT64_MAX, INT64_MIN,
                                          INT64_MAX - 511,          INT64_MIN + 1};
      std::vector<int64_t> v;
      for (int64_t e : edges)
        if (t == DType::i64 || (e >= INT32_MIN && e <= INT32_MAX)) v.push_back(e);
      // Philox bits shifted right by a random count: every magnitude, not only the largest
      for (int64_t i = 0; i < kRandom; ++i) {
        const uint64_t r = random_bits(uint64_t(i) + 1000000);
        const int shift = static_cast<int>(r & (t == DType::i64 ? 63 : 31));
        if (t == DType::i64)
          v.push_back(static_cast<int64_t>(r) >> shift);
        else
          v.push_back(static_cast<int32_t>(static_cast<uint32_t>(r >> 32)) >> shift);
      }
      for (int64_t x : v) {
        if (t == DType::i64)
          append(b, x);
        else
          append(b, static_cast<int32_t>(x));
      }
      break;
    }
  }
  return b;
}

TEST(GpuCast, EveryDtypeToEveryDtypeMatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (DType from : kAllDTypes) {
    const std::vector<unsigned char> bytes = source_bytes(from);
    const int64_t n = static_cast<int64_t>(bytes.size() / dtype_size(from));
    const Tensor src = Tensor::from_host(bytes.data(), {n}, from), gsrc = src.to(kGpu);
    for (DType to : kAllDTypes) {
      Tensor want = Tensor::empty({n}, to), got = Tensor::empty({n}, to, kGpu);
      ops::cast(src, want);
      ops::cast(gsrc, got);
      std::string first;
      const double err = exact_err(got, want, &first);
      const std::string op = "cast(" + std::string(dtype_name(from)) + "->" + std::string(dtype_name(to)) + ")";
      report(op, std::string(dtype_name(to)), err, 0);
      if (!first.empty()) ADD_FAILURE() << op << ", the first difference (GPU against CPU): " << first;
    }
  }
}

// The same conversions on views one element into their buffers (every pointer misaligned for
// 16-byte loads), of a length that is no multiple of a vector width: the kernels must not assume
// alignment or whole vectors.
TEST(GpuCast, MisalignedViewsMatchCpu) {
  SKIP_WITHOUT_GPU();
  for (DType from : kAllDTypes) {
    const std::vector<unsigned char> bytes = source_bytes(from);
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(bytes.size() / dtype_size(from)), 4099);
    const Tensor src = Tensor::from_host(bytes.data(), {n}, from).slice(1, n);
    const Tensor gsrc = Tensor::from_host(bytes.data(), {n}, from, kGpu).slice(1, n);
    for (DType to : kAllDTypes) {
      Tensor want = Tensor::empty({n}, to).slice(1, n);
      Tensor gbuf = Tensor::zeros({n}, to, kGpu), got = gbuf.slice(1, n);
      ops::cast(src, want);
      ops::cast(gsrc, got);
      const std::string op = "cast(" + std::string(dtype_name(from)) + "->" + std::string(dtype_name(to)) + ",view)";
      double err = exact_err(got, want);
      // element 0 of the buffer is outside the view: it must still be 0
      err = std::max(err, gbuf.slice(0, 1).to_doubles()[0] == 0 ? 0.0 : INFINITY);
      report(op, std::string(dtype_name(to)), err, 0);
    }
  }
}

}  // namespace
}  // namespace dtk
