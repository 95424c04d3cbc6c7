// Internal to dtk::data: HDF5 helpers for the dataset files, over core/h5.h's RAII ids and error
// handling. Every HDF5 call of the data module runs under core/h5.h's lock(): the HDF5 library
// dtk links is not built thread-safe, and a checkpoint may be written on a thread of its own.
#pragma once
#include <hdf5.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "dtk/core/h5.h"

namespace dtk::data::h5 {

// core/h5.h: the RAII ids, error handling and attribute helpers.
using namespace dtk::h5;

// File access properties for data files: the default driver, with file locking where the file
// system supports it and none where it does not (Lustre, some NFS mounts), instead of an error.
Id file_access();

// Rows of dim 0 of a dataset, many ranges at once. Each range is (first row, rows); the union of
// the ranges is read in one H5Dread (file order), and `offsets[k]` says where range k starts in
// `out` (in rows). row_elems is the number of elements per row; mem_type the buffer's type.
// Data that cannot be read (a damaged file) is a UsageError naming `what`.
void read_ranges(hid_t dset, int rank, const std::vector<hsize_t>& dims,
                 const std::vector<std::pair<int64_t, int64_t>>& ranges, hid_t mem_type, size_t elem_bytes,
                 std::vector<unsigned char>& out, std::vector<int64_t>& offsets, const std::string& what);

}  // namespace dtk::data::h5
