#include "dtk/core/dtype.h"

#include <cmath>

#include "dtk/core/enums.h"
#include "dtk/core/error.h"

namespace dtk {

void fail(const std::string& what) { throw Error(what); }
void fail_usage(const std::string& what) { throw UsageError(what); }

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64:
    case DType::i64: return 8;
    case DType::f32:
    case DType::i32: return 4;
    case DType::bf16:
    case DType::f16:
    case DType::u16: return 2;
    case DType::u8: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t) { return name_of(t); }

DType parse_dtype(std::string_view s) {
  DType t{};
  if (try_parse_enum(s, t)) return t;
  struct Alias { std::string_view name; DType t; };
  static constexpr Alias aliases[] = {
      {"float", DType::f32},    {"float32", DType::f32}, {"double", DType::f64}, {"float64", DType::f64},
      {"bfloat16", DType::bf16}, {"half", DType::f16},    {"float16", DType::f16}, {"int32", DType::i32},
      {"int", DType::i32},      {"int64", DType::i64},   {"uint8", DType::u8},   {"uint16", DType::u16}};
  for (const auto& a : aliases)
    if (a.name == s) return a.t;
  fail_usage("unknown dtype '" + std::string(s) + "' (expected " + choices_of<DType>() + ")");
}

bool dtype_is_float(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16;
}

double load_as_double(DType t, const void* data, size_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(data)[i];
    case DType::f64: return static_cast<const double*>(data)[i];
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::f16: return f16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::i32: return static_cast<const int32_t*>(data)[i];
    case DType::i64: return static_cast<double>(static_cast<const int64_t*>(data)[i]);
    case DType::u8: return static_cast<const uint8_t*>(data)[i];
    case DType::u16: return static_cast<const uint16_t*>(data)[i];
  }
  return 0;
}

void store_from_double(DType t, void* data, size_t i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(data)[i] = static_cast<float>(v); break;
    case DType::f64: static_cast<double*>(data)[i] = v; break;
    // double -> float -> 16 bit can round twice; every caller stores values exact in float
    case DType::bf16: static_cast<uint16_t*>(data)[i] = float_to_bf16(static_cast<float>(v)); break;
    case DType::f16: static_cast<uint16_t*>(data)[i] = float_to_f16(static_cast<float>(v)); break;
    case DType::i32: static_cast<int32_t*>(data)[i] = static_cast<int32_t>(static_cast<int64_t>(v)); break;
    case DType::i64: static_cast<int64_t*>(data)[i] = static_cast<int64_t>(v); break;
    case DType::u8: static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(static_cast<int64_t>(v)); break;
    case DType::u16: static_cast<uint16_t*>(data)[i] = static_cast<uint16_t>(static_cast<int64_t>(v)); break;
  }
}

}  // namespace dtk
