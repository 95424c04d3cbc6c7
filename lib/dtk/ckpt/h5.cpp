#include "dtk/ckpt/h5.h"

#include <mutex>
#include <vector>

#include "dtk/core/error.h"

namespace dtk::ckpt::h5 {

namespace {
// A 16-bit IEEE-style float: sign bit 15, `ebits` exponent bits above `mbits` mantissa bits.
hid_t make_half(size_t ebits, size_t mbits, size_t bias) {
  hid_t t = H5Tcopy(H5T_IEEE_F32LE);
  H5Tset_fields(t, 15, mbits, ebits, 0, mbits);
  H5Tset_precision(t, 16);
  H5Tset_size(t, 2);
  H5Tset_ebias(t, bias);
  return t;
}
hid_t bf16_type() {
  static hid_t t = make_half(8, 7, 127);  // kept for the process
  return t;
}
hid_t f16_type() {
  static hid_t t = make_half(5, 10, 15);
  return t;
}
}  // namespace

hid_t file_type(DType t) {
  switch (t) {
    case DType::f32: return H5T_IEEE_F32LE;
    case DType::f64: return H5T_IEEE_F64LE;
    case DType::bf16: return bf16_type();
    case DType::f16: return f16_type();
    case DType::i32: return H5T_STD_I32LE;
    case DType::i64: return H5T_STD_I64LE;
    case DType::u8: return H5T_STD_U8LE;
    case DType::u16: return H5T_STD_U16LE;
  }
  return H5T_IEEE_F32LE;
}

hid_t memory_type(DType t) {
  switch (t) {
    case DType::f32: return H5T_NATIVE_FLOAT;
    case DType::f64: return H5T_NATIVE_DOUBLE;
    case DType::bf16: return bf16_type();  // our buffers hold the same little-endian bits
    case DType::f16: return f16_type();
    case DType::i32: return H5T_NATIVE_INT32;
    case DType::i64: return H5T_NATIVE_INT64;
    case DType::u8: return H5T_NATIVE_UINT8;
    case DType::u16: return H5T_NATIVE_UINT16;
  }
  return H5T_NATIVE_FLOAT;
}

DType dtype_of(hid_t type, const std::string& what) {
  const H5T_class_t cls = H5Tget_class(type);
  const size_t size = H5Tget_size(type);
  if (cls == H5T_FLOAT) {
    if (size == 4) return DType::f32;
    if (size == 8) return DType::f64;
    if (size == 2) {
      size_t spos, epos, esize, mpos, msize;
      H5Tget_fields(type, &spos, &epos, &esize, &mpos, &msize);
      if (esize == 8 && msize == 7) return DType::bf16;
      if (esize == 5 && msize == 10) return DType::f16;
    }
  } else if (cls == H5T_INTEGER) {
    const bool sign = H5Tget_sign(type) == H5T_SGN_2;
    if (sign && size == 4) return DType::i32;
    if (sign && size == 8) return DType::i64;
    if (!sign && size == 1) return DType::u8;
    if (!sign && size == 2) return DType::u16;
  }
  fail_usage("{}: a data type dtk does not use (class {}, {} bytes)", what, static_cast<int>(cls), size);
}

void make_parents(hid_t file, const std::string& name) {
  for (size_t pos = name.find('/'); pos != std::string::npos; pos = name.find('/', pos + 1)) {
    const std::string g = name.substr(0, pos);
    if (g.empty()) continue;
    if (H5Lexists(file, g.c_str(), H5P_DEFAULT) > 0) continue;
    Id grp(check(H5Gcreate2(file, g.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "create group " + g));
  }
}

}  // namespace dtk::ckpt::h5
