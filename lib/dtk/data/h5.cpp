#include "dtk/data/h5.h"

#include <algorithm>

#include "dtk/core/error.h"

namespace dtk::data::h5 {

Id file_access() {
  Id fapl(check(H5Pcreate(H5P_FILE_ACCESS), "file access properties"));
#if H5_VERSION_GE(1, 10, 7)
  H5Pset_file_locking(fapl, true, true);
#endif
  return fapl;
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
  // The data of a file that opened cannot be read: the file is damaged or truncated (bad input).
  if (H5Dread(dset, mem_type, mspace, fspace, H5P_DEFAULT, out.data()) < 0)
    fail_usage(what + ": the data cannot be read (damaged or truncated?): " + last_error());
}

}  // namespace dtk::data::h5
