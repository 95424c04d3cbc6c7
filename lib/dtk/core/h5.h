// Thin RAII over the HDF5 C API, shared by the modules that read and write HDF5 files (data,
// ckpt): owned ids closed with the right H5?close, HDF5's own error printing silenced, and
// failures as dtk::Error carrying the innermost message of HDF5's error stack.
//
// The HDF5 library dtk links (Debian's) is not built thread-safe, and two threads may use it: the
// training loop (data files) and a checkpoint written in the background (train's
// --async-checkpoint). Every HDF5 call of the data module and of ckpt's FileWriter runs under
// lock(), held briefly (a batch's rows, a few MiB of a dataset), so that neither waits long for
// the other.
#pragma once
#include <hdf5.h>

#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace dtk::h5 {

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
  void reset();  // closes it, ignoring a failure (destructors; see close())
  // Closes it and returns the status of the close (for files: whether everything reached the
  // disk), so that a caller can check it: an id is closed once, whatever the status.
  herr_t close();

 private:
  hid_t id_ = H5I_INVALID_HID;
};

// The one lock over the HDF5 library (recursive: a locked helper may call another).
std::unique_lock<std::recursive_mutex> lock();

// Silences HDF5's own printing of errors (once per process); failures become exceptions.
void quiet();
// The most meaningful line of the current HDF5 error stack, which it clears ("" when empty):
// the innermost entry's description, or for a failed system call the system's message ("file
// write failed: No space left on device"). Every entry of the stack goes to the debug log
// (spdlog::debug), so one line reaches the user and --log-level debug shows the rest.
std::string last_error();
// Throws Error("<what>: <HDF5 message>") when id < 0 / status < 0.
hid_t check(hid_t id, const std::string& what);
void check_status(herr_t status, const std::string& what);

// Attributes on an object (a file, group or dataset). Strings are written as fixed-length
// UTF-8, integers as i64 (a scalar for one value); a written attribute replaces one of the name.
bool has_attr(hid_t obj, const char* name);
void set_attr(hid_t obj, const char* name, const std::string& value);
void set_attr(hid_t obj, const char* name, int64_t value);
void set_attr(hid_t obj, const char* name, const std::vector<int64_t>& value);
// A JSON value: integers and booleans as i64, other numbers as f64, strings as strings,
// anything else as its JSON text.
void write_attr(hid_t obj, const std::string& name, const nlohmann::json& v);
// Readers: Error when missing or of another kind (fixed and variable-length strings both read).
std::string get_attr_string(hid_t obj, const char* name);
int64_t get_attr_int(hid_t obj, const char* name);
std::vector<int64_t> get_attr_ints(hid_t obj, const char* name);
// An integer attribute (any integer type, one value): false when absent; UsageError(`where`)
// when it is not one integer.
bool read_int_attr(hid_t obj, const char* name, int64_t* out, const std::string& where);
// A number attribute (one float or integer): false when absent or not one number.
bool read_double_attr(hid_t obj, const char* name, double* out);

// What a dataset's header claims, checked before a reader allocates for it or trusts it
// (UsageError "<what> ..."): its elements of `elem_bytes` each fit in int64 bytes, and its data
// is all there: every chunk of a chunked dataset present (dtk's writers write every one; a
// missing chunk is a truncated or forged file, whose rows HDF5 would return as fill values), a
// contiguous one's storage allocated. Virtual and compact datasets pass.
void check_stored(hid_t dset, const std::vector<hsize_t>& dims, size_t elem_bytes, const std::string& what);

}  // namespace dtk::h5
