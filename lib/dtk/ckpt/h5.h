// Thin RAII over the HDF5 C API (internal to ckpt): owned ids, errors as dtk::Error with the
// message of HDF5's error stack, and dtk's dtypes as HDF5 types (bf16 and f16 as IEEE-style
// float types that h5dump, h5diff and h5py understand).
#pragma once
#include <hdf5.h>

#include <string>
#include <utility>

#include "dtk/core/dtype.h"
#include "dtk/core/tensor.h"

namespace dtk::ckpt::h5 {

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

// Silences HDF5's own printing of errors (once per process); failures become exceptions.
void quiet();
// The innermost message of the current HDF5 error stack ("" when empty).
std::string last_error();
// Throws Error("<what>: <HDF5 message>") when id < 0 / status < 0.
hid_t check(hid_t id, const std::string& what);
void check_status(herr_t status, const std::string& what);

hid_t file_type(DType t);    // the on-disk type (little-endian); do not close predefined ones: use Id(H5Tcopy(...))
hid_t memory_type(DType t);  // the in-memory type of our buffers
// The dtype of an on-disk type; UsageError naming `what` for types dtk does not use.
DType dtype_of(hid_t type, const std::string& what);

// Attributes on an object (a file, group or dataset).
void set_attr(hid_t obj, const char* name, const std::string& value);
void set_attr(hid_t obj, const char* name, int64_t value);
void set_attr(hid_t obj, const char* name, const std::vector<int64_t>& value);
bool has_attr(hid_t obj, const char* name);
std::string get_attr_string(hid_t obj, const char* name);
int64_t get_attr_int(hid_t obj, const char* name);
std::vector<int64_t> get_attr_ints(hid_t obj, const char* name);

// Creates every missing group on the path to `name` ("a/b/c" creates "a" and "a/b").
void make_parents(hid_t file, const std::string& name);

}  // namespace dtk::ckpt::h5
