// Internal to dtk::data: a minimal RAII layer over the HDF5 C API for the dataset files (data
// sits below ckpt in the module order, so it cannot use ckpt's helpers). Every HDF5 call of the
// data module runs under lock(): the HDF5 library dtk links is not built thread-safe, and the
// training loop may assemble batches on a thread of its own.
#pragma once
#include <hdf5.h>

#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace dtk::data::h5io {

// An owned hid_t, closed with the right H5?close for its kind.
class Id {
 public:
  Id() = default;
  explicit Id(hid_t id) : id_(id) {}
  ~Id() { reset(); }
  Id(Id&& o) noexcept : id_(std::exchange(o.id_, H5I_INVALID_HID)) {}
  Id& operator=(Id&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = std::exchange(o.id_, H5I_INVALID_HID);
    }
    return *this;
  }
  Id(const Id&) = delete;
  Id& operator=(const Id&) = delete;
  hid_t get() const { return id_; }
  operator hid_t() const { return id_; }
  bool valid() const { return id_ >= 0; }
  void reset();

 private:
  hid_t id_ = H5I_INVALID_HID;
};

std::unique_lock<std::recursive_mutex> lock();
void quiet();              // no printing by HDF5 itself (once per process)
std::string last_error();  // the innermost message of HDF5's error stack, then clears it
// Error("<what>: <HDF5 message>") when id / status is negative.
hid_t check(hid_t id, const std::string& what);
void check_status(herr_t status, const std::string& what);

// File access properties for data files: the default driver, with file locking where the file
// system supports it and none where it does not (Lustre, some NFS mounts), instead of an error.
Id file_access();

// Attributes.
bool has_attr(hid_t obj, const char* name);
// An integer attribute (any integer type, a scalar or one element); nullopt-like: false when
// absent; UsageError(`where`) when it is not one integer.
bool read_int_attr(hid_t obj, const char* name, int64_t* out, const std::string& where);
bool read_double_attr(hid_t obj, const char* name, double* out);
// Writes a JSON value as an attribute: integers as i64, other numbers as f64, strings as UTF-8
// strings, booleans as i64 0/1, anything else as its JSON text.
void write_attr(hid_t obj, const std::string& name, const nlohmann::json& v);

// Rows of dim 0 of a dataset, many ranges at once. Each range is (first row, rows); the union of
// the ranges is read in one H5Dread (file order), and `offsets[k]` says where range k starts in
// `out` (in rows). row_elems is the number of elements per row; mem_type the buffer's type.
void read_ranges(hid_t dset, int rank, const std::vector<hsize_t>& dims,
                 const std::vector<std::pair<int64_t, int64_t>>& ranges, hid_t mem_type, size_t elem_bytes,
                 std::vector<unsigned char>& out, std::vector<int64_t>& offsets, const std::string& what);

}  // namespace dtk::data::h5io
