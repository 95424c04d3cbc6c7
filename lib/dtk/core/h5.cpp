#include "dtk/core/h5.h"

#include <spdlog/spdlog.h>

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

void quiet() {
  static std::once_flag once;
  std::call_once(once, [] { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); });
}

namespace {
// One entry of HDF5's error stack as a line of the debug log.
std::string describe(const H5E_error2_t& e) {
  return std::string(e.func_name ? e.func_name : "?") + "(): " + (e.desc ? e.desc : "") + " (" +
         (e.file_name ? e.file_name : "?") + ":" + std::to_string(e.line) + ")";
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

}  // namespace dtk::h5
