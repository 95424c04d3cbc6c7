// Element types. bf16 and f16 are stored as their 16-bit patterns (uint16_t); conversion from
// float rounds to nearest even, as CUDA's __float2bfloat16 and __float2half do.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "dtk/core/half.h"

namespace dtk {

enum class DType : uint8_t { f32, f64, bf16, f16, i32, i64, u8, u16 };

inline constexpr DType kAllDTypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16,
                                       DType::i32, DType::i64, DType::u8,   DType::u16};

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);   // "f32", "bf16", ...
DType parse_dtype(std::string_view s);  // accepts our names and float/double/half/bfloat16/int32...
bool dtype_is_float(DType t);

// bf16 / f16 <-> float conversions (round to nearest even): core/half.h.

// Element i of a buffer of type t, as a double (exact for every type but i64 beyond 2^53), and
// the reverse (rounding to the type; integers truncate toward zero and wrap as C++ does).
double load_as_double(DType t, const void* data, size_t i);
void store_from_double(DType t, void* data, size_t i, double v);

}  // namespace dtk
