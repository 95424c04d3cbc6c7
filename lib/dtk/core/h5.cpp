#include "dtk/core/h5.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <vector>

#include "dtk/core/error.h"

namespace dtk::h5 {

void Id::reset() {
  if (close() < 0) H5Eclear2(H5E_DEFAULT);
}

herr_t Id::close() {
  if (id_ < 0) return 0;
  herr_t status = 0;
  switch (H5Iget_type(id_)) {
    case H5I_FILE: status = H5Fclose(id_); break;
    case H5I_GROUP: status = H5Gclose(id_); break;
    case H5I_DATASET: status = H5Dclose(id_); break;
    case H5I_DATASPACE: status = H5Sclose(id_); break;
    case H5I_DATATYPE: status = H5Tclose(id_); break;
    case H5I_ATTR: status = H5Aclose(id_); break;
    case H5I_GENPROP_LST: status = H5Pclose(id_); break;
    default: break;
  }
  id_ = H5I_INVALID_HID;
  return status;
}

std::unique_lock<std::recursive_mutex> lock() {
  static std::recursive_mutex m;
  return std::unique_lock<std::recursive_mutex>(m);
}

void quiet() {
  static std::once_flag once;
  std::call_once(once, [] {
    const auto g = lock();
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  });
}

namespace {
// One entry of HDF5's error stack as a line of the debug log.
std::string describe(const H5E_error2_t& e) {
  return fmt::format("{}(): {} ({}:{})", e.func_name ? e.func_name : "?", e.desc ? e.desc : "",
                     e.file_name ? e.file_name : "?", e.line);
}

// The meaningful part of the innermost entry: a failed system call's own message (the sec2
// driver reports "file write failed: time = ..., filename = ..., errno = 28, error message =
// 'No space left on device', buf = 0x..., ..."), else the whole description.
std::string meaningful(const std::string& desc) {
  const std::string key = "error message = '";
  const size_t at = desc.find(key);
  if (at != std::string::npos) {
    const size_t end = desc.find('\'', at + key.size());
    if (end != std::string::npos) {
      const size_t colon = desc.find(':');
      const std::string what = colon != std::string::npos && colon < at ? desc.substr(0, colon) + ": " : "";
      return what + desc.substr(at + key.size(), end - at - key.size());
    }
  }
  std::string d = desc;
  for (char& c : d)
    if (c == '\n' || c == '\r') c = ' ';
  return d;
}
}  // namespace

std::string last_error() {
  std::vector<H5E_error2_t> stack;  // innermost first; the strings live until H5Eclear2
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned, const H5E_error2_t* e, void* data) -> herr_t {
        static_cast<std::vector<H5E_error2_t>*>(data)->push_back(*e);
        return 0;
      },
      &stack);
  std::string msg;
  for (const auto& e : stack) {
    spdlog::debug("HDF5: {}", describe(e));
    if (msg.empty() && e.desc && *e.desc) msg = meaningful(e.desc);
  }
  H5Eclear2(H5E_DEFAULT);
  return msg;
}

hid_t check(hid_t id, const std::string& what) {
  if (id < 0) {
    const std::string m = last_error();
    fail(what + (m.empty() ? "" : ": " + m));
  }
  return id;
}

void check_status(herr_t status, const std::string& what) {
  if (status < 0) {
    const std::string m = last_error();
    fail(what + (m.empty() ? "" : ": " + m));
  }
}

// ------------------------------------------------------------------------------ attributes

bool has_attr(hid_t obj, const char* name) { return H5Aexists(obj, name) > 0; }

void set_attr(hid_t obj, const char* name, const std::string& value) {
  if (H5Aexists(obj, name) > 0) H5Adelete(obj, name);
  Id type(H5Tcopy(H5T_C_S1));
  H5Tset_size(type, value.size() ? value.size() : 1);
  H5Tset_cset(type, H5T_CSET_UTF8);
  Id space(H5Screate(H5S_SCALAR));
  Id attr(check(H5Acreate2(obj, name, type, space, H5P_DEFAULT, H5P_DEFAULT), std::string("attribute ") + name));
  const std::string v = value.empty() ? std::string(1, '\0') : value;
  check_status(H5Awrite(attr, type, v.data()), std::string("attribute ") + name);
}

void set_attr(hid_t obj, const char* name, int64_t value) { set_attr(obj, name, std::vector<int64_t>{value}); }

void set_attr(hid_t obj, const char* name, const std::vector<int64_t>& value) {
  if (H5Aexists(obj, name) > 0) H5Adelete(obj, name);
  const hsize_t n = value.size();
  Id space(n == 1 ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &n, nullptr));
  Id attr(check(H5Acreate2(obj, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT), std::string("attribute ") + name));
  if (n) check_status(H5Awrite(attr, H5T_NATIVE_INT64, value.data()), std::string("attribute ") + name);
}

std::string get_attr_string(hid_t obj, const char* name) {
  Id attr(check(H5Aopen(obj, name, H5P_DEFAULT), std::string("attribute ") + name + " is missing"));
  Id type(H5Aget_type(attr));
  if (H5Tget_class(type) != H5T_STRING) fail(std::string("attribute ") + name + " is not a string");
  if (H5Tis_variable_str(type) > 0) {
    char* s = nullptr;
    Id mt(H5Tcopy(H5T_C_S1));
    H5Tset_size(mt, H5T_VARIABLE);
    H5Tset_cset(mt, H5Tget_cset(type));  // h5py writes UTF-8; the conversion needs the same set
    check_status(H5Aread(attr, mt, &s), std::string("attribute ") + name);
    std::string out = s ? s : "";
    H5free_memory(s);
    return out;
  }
  const size_t n = H5Tget_size(type);
  std::string out(n, '\0');
  check_status(H5Aread(attr, type, out.data()), std::string("attribute ") + name);
  while (!out.empty() && out.back() == '\0') out.pop_back();
  return out;
}

std::vector<int64_t> get_attr_ints(hid_t obj, const char* name) {
  Id attr(check(H5Aopen(obj, name, H5P_DEFAULT), std::string("attribute ") + name + " is missing"));
  Id space(H5Aget_space(attr));
  const hssize_t n = H5Sget_simple_extent_npoints(space);
  std::vector<int64_t> out(static_cast<size_t>(n));
  if (n) check_status(H5Aread(attr, H5T_NATIVE_INT64, out.data()), std::string("attribute ") + name);
  return out;
}

int64_t get_attr_int(hid_t obj, const char* name) {
  const auto v = get_attr_ints(obj, name);
  if (v.size() != 1) fail(std::string("attribute ") + name + " is not a single integer");
  return v[0];
}

namespace {
// The attribute's element count, opened; UsageError unless it holds exactly one value.
Id open_single(hid_t obj, const char* name, const std::string& where) {
  Id attr(check(H5Aopen(obj, name, H5P_DEFAULT), where + ": cannot open attribute " + name));
  Id space(H5Aget_space(attr));
  if (H5Sget_simple_extent_npoints(space) != 1)
    fail_usage(where + ": attribute " + name + " must hold one value");
  return attr;
}
}  // namespace

bool read_int_attr(hid_t obj, const char* name, int64_t* out, const std::string& where) {
  if (!has_attr(obj, name)) return false;
  Id attr = open_single(obj, name, where);
  Id type(H5Aget_type(attr));
  if (H5Tget_class(type) != H5T_INTEGER) fail_usage(where + ": attribute " + name + " is not an integer");
  check_status(H5Aread(attr, H5T_NATIVE_INT64, out), where + ": attribute " + name);
  return true;
}

bool read_double_attr(hid_t obj, const char* name, double* out) {
  if (!has_attr(obj, name)) return false;
  Id attr(H5Aopen(obj, name, H5P_DEFAULT));
  if (!attr.valid()) return false;
  Id space(H5Aget_space(attr));
  Id type(H5Aget_type(attr));
  const H5T_class_t c = H5Tget_class(type);
  if (H5Sget_simple_extent_npoints(space) != 1 || (c != H5T_FLOAT && c != H5T_INTEGER)) return false;
  return H5Aread(attr, H5T_NATIVE_DOUBLE, out) >= 0;
}

void write_attr(hid_t obj, const std::string& name, const nlohmann::json& v) {
  const char* n = name.c_str();
  if (v.is_boolean()) return set_attr(obj, n, int64_t{v.get<bool>() ? 1 : 0});
  if (v.is_number_unsigned()) return set_attr(obj, n, static_cast<int64_t>(v.get<uint64_t>()));
  if (v.is_number_integer()) return set_attr(obj, n, v.get<int64_t>());
  if (v.is_number()) {
    if (H5Aexists(obj, n) > 0) H5Adelete(obj, n);
    const double x = v.get<double>();
    Id space(H5Screate(H5S_SCALAR));
    Id a(check(H5Acreate2(obj, n, H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT), "attribute " + name));
    return check_status(H5Awrite(a, H5T_NATIVE_DOUBLE, &x), "attribute " + name);
  }
  set_attr(obj, n, v.is_string() ? v.get<std::string>() : v.dump());
}

void check_stored(hid_t dset, const std::vector<hsize_t>& dims, size_t elem_bytes, const std::string& what) {
  int64_t numel = 1;
  for (hsize_t d : dims)
    if (d > static_cast<hsize_t>(std::numeric_limits<int64_t>::max()) ||
        __builtin_mul_overflow(numel, static_cast<int64_t>(d), &numel) ||
        numel > std::numeric_limits<int64_t>::max() / static_cast<int64_t>(std::max<size_t>(1, elem_bytes)))
      fail_usage("{} has shape [{}], more than any tensor can hold", what, fmt::join(dims, ", "));
  if (numel == 0) return;
  Id dcpl(H5Dget_create_plist(dset));
  const H5D_layout_t layout = H5Pget_layout(dcpl);
  if (layout == H5D_CONTIGUOUS) {
    if (H5Dget_storage_size(dset) < static_cast<hsize_t>(numel) * elem_bytes)
      fail_usage("{} holds {} of its {} bytes (truncated or damaged)", what, H5Dget_storage_size(dset),
                 static_cast<hsize_t>(numel) * elem_bytes);
    return;
  }
  if (layout != H5D_CHUNKED) return;
  const int nd = H5Pget_chunk(dcpl, 0, nullptr);
  if (nd != static_cast<int>(dims.size())) fail_usage("{}: its chunks do not match its shape", what);
  std::vector<hsize_t> chunk(dims.size());
  H5Pget_chunk(dcpl, nd, chunk.data());
  hsize_t expected = 1, stored = 0;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (chunk[i] == 0) fail_usage("{}: a chunk dimension is 0", what);
    expected *= (dims[i] + chunk[i] - 1) / chunk[i];  // <= numel: no overflow
  }
  Id space(H5Dget_space(dset));
  if (H5Dget_num_chunks(dset, space, &stored) < 0) {
    const std::string m = last_error();
    fail_usage("{}: its chunks cannot be listed ({})", what, m);
  }
  if (stored != expected) fail_usage("{} holds {} of its {} chunks (truncated or damaged)", what, stored, expected);
}

}  // namespace dtk::h5
