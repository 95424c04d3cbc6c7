#include "dtk/data/h5io.h"

#include <algorithm>

#include "dtk/core/error.h"

namespace dtk::data::h5io {

std::unique_lock<std::recursive_mutex> lock() {
  static std::recursive_mutex m;
  return std::unique_lock<std::recursive_mutex>(m);
}

Id file_access() {
  Id fapl(check(H5Pcreate(H5P_FILE_ACCESS), "file access properties"));
#if H5_VERSION_GE(1, 10, 7)
  H5Pset_file_locking(fapl, true, true);
#endif
  return fapl;
}

bool has_attr(hid_t obj, const char* name) { return H5Aexists(obj, name) > 0; }

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
  if (H5Aexists(obj, n) > 0) H5Adelete(obj, n);
  Id space(H5Screate(H5S_SCALAR));
  const std::string what = "attribute " + name;
  if (v.is_number_integer() || v.is_boolean()) {
    const int64_t x = v.is_boolean() ? (v.get<bool>() ? 1 : 0)
                                     : (v.is_number_unsigned() ? static_cast<int64_t>(v.get<uint64_t>())
                                                               : v.get<int64_t>());
    Id a(check(H5Acreate2(obj, n, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT), what));
    check_status(H5Awrite(a, H5T_NATIVE_INT64, &x), what);
  } else if (v.is_number()) {
    const double x = v.get<double>();
    Id a(check(H5Acreate2(obj, n, H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT), what));
    check_status(H5Awrite(a, H5T_NATIVE_DOUBLE, &x), what);
  } else {
    const std::string s = v.is_string() ? v.get<std::string>() : v.dump();
    Id type(H5Tcopy(H5T_C_S1));
    H5Tset_size(type, s.empty() ? 1 : s.size());
    H5Tset_cset(type, H5T_CSET_UTF8);
    Id a(check(H5Acreate2(obj, n, type, space, H5P_DEFAULT, H5P_DEFAULT), what));
    const std::string buf = s.empty() ? std::string(1, '\0') : s;
    check_status(H5Awrite(a, type, buf.data()), what);
  }
}

void read_ranges(hid_t dset, int rank, const std::vector<hsize_t>& dims,
                 const std::vector<std::pair<int64_t, int64_t>>& ranges, hid_t mem_type, size_t elem_bytes,
                 std::vector<unsigned char>& out, std::vector<int64_t>& offsets, const std::string& what) {
  size_t row_elems = 1;
  for (int d = 1; d < rank; ++d) row_elems *= dims[static_cast<size_t>(d)];
  // The union of the ranges as sorted, disjoint runs (overlapping or touching ranges merge).
  std::vector<std::pair<int64_t, int64_t>> sorted;  // (begin, end)
  sorted.reserve(ranges.size());
  for (const auto& [b, n] : ranges) sorted.emplace_back(b, b + n);
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (const auto& r : sorted) {
    if (!runs.empty() && r.first <= runs.back().second)
      runs.back().second = std::max(runs.back().second, r.second);
    else
      runs.push_back(r);
  }
  std::vector<int64_t> run_offset(runs.size());
  int64_t total = 0;
  for (size_t k = 0; k < runs.size(); ++k) {
    run_offset[k] = total;
    total += runs[k].second - runs[k].first;
  }
  out.resize(static_cast<size_t>(total) * row_elems * elem_bytes);
  offsets.resize(ranges.size());
  for (size_t k = 0; k < ranges.size(); ++k) {
    const int64_t b = ranges[k].first;
    const size_t r = static_cast<size_t>(
        std::upper_bound(runs.begin(), runs.end(), std::make_pair(b, INT64_MAX)) - runs.begin() - 1);
    offsets[k] = run_offset[r] + (b - runs[r].first);
  }
  if (total == 0) return;

  Id fspace(check(H5Dget_space(dset), what));
  std::vector<hsize_t> start(static_cast<size_t>(rank), 0), count(dims.begin(), dims.end());
  for (size_t k = 0; k < runs.size(); ++k) {
    start[0] = static_cast<hsize_t>(runs[k].first);
    count[0] = static_cast<hsize_t>(runs[k].second - runs[k].first);
    check_status(H5Sselect_hyperslab(fspace, k == 0 ? H5S_SELECT_SET : H5S_SELECT_OR, start.data(), nullptr,
                                     count.data(), nullptr),
                 what);
  }
  const hsize_t n = static_cast<hsize_t>(total) * row_elems;
  Id mspace(check(H5Screate_simple(1, &n, nullptr), what));
  check_status(H5Dread(dset, mem_type, mspace, fspace, H5P_DEFAULT, out.data()), what);
}

}  // namespace dtk::data::h5io
