#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "dtk/core/device.h"
#include "dtk/core/dtype.h"
#include "dtk/core/error.h"

namespace dtk {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::f64), 8u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  EXPECT_EQ(dtype_size(DType::u8), 1u);
  for (DType t : kAllDTypes) EXPECT_EQ(parse_dtype(dtype_name(t)), t);
  EXPECT_EQ(parse_dtype("float"), DType::f32);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::bf16);
  EXPECT_THROW(parse_dtype("f8"), UsageError);
}

// bf16 keeps the top 16 bits of a float, rounding the rest to nearest, ties to even.
TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(from_bits(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(float_to_bf16(from_bits(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(float_to_bf16(from_bits(0x3f808001u)), 0x3f81);  // above the tie
  EXPECT_EQ(float_to_bf16(from_bits(0x3f807fffu)), 0x3f80);  // below the tie
  EXPECT_EQ(float_to_bf16(-2.5f), 0xc020);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16(from_bits(0x7f7fffffu)), 0x7f80);  // max float rounds to inf
  for (int i = -256; i <= 256; ++i) EXPECT_EQ(bf16_to_float(float_to_bf16(static_cast<float>(i))), i) << i;
}

TEST(DType, F16RoundsToNearestEven) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);  // halfway to the next binade: rounds to inf
  EXPECT_EQ(float_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(1.0f + 0x1p-11f), 0x3c00);                 // tie, even stays
  EXPECT_EQ(float_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);             // tie, odd rounds up
  EXPECT_EQ(float_to_f16(0x1p-24f), 0x0001);                        // smallest subnormal
  EXPECT_EQ(float_to_f16(0x1p-25f), 0x0000);                        // tie with zero: even
  EXPECT_EQ(float_to_f16(3 * 0x1p-25f), 0x0002);                    // tie between 1 and 2: even
  EXPECT_EQ(float_to_f16(0x1p-14f), 0x0400);                        // smallest normal
  EXPECT_EQ(float_to_f16(0x1p-14f - 0x1p-25f), 0x0400);             // rounds up into the normals
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(std::nanf("")))));
  // Every finite f16 survives the round trip through float.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00) continue;
    EXPECT_EQ(float_to_f16(f16_to_float(static_cast<uint16_t>(h))), h) << h;
  }
}

TEST(DType, LoadAndStoreAsDouble) {
  unsigned char buf[64];
  for (DType t : kAllDTypes) {
    for (double v : {0.0, 1.0, 7.0, 100.0}) {
      store_from_double(t, buf, 3, v);
      EXPECT_EQ(load_as_double(t, buf, 3), v) << dtype_name(t);
    }
  }
  store_from_double(DType::i32, buf, 0, -5.0);
  EXPECT_EQ(load_as_double(DType::i32, buf, 0), -5.0);
  store_from_double(DType::u8, buf, 0, 257.0);  // wraps, as unsigned arithmetic does
  EXPECT_EQ(load_as_double(DType::u8, buf, 0), 1.0);
}

TEST(Device, Parse) {
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_EQ(parse_device("cuda"), Device::cuda(0));
  EXPECT_EQ(parse_device("cuda:3"), Device::cuda(3));
  EXPECT_EQ(Device::cuda(2).str(), "cuda:2");
  EXPECT_THROW(parse_device("cuda:x"), UsageError);
  EXPECT_THROW(parse_device("tpu"), UsageError);
}

}  // namespace
}  // namespace dtk
