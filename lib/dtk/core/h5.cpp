#include "dtk/core/h5.h"

#include <mutex>

#include "dtk/core/error.h"

namespace dtk::h5 {

void Id::reset() {
  if (id_ < 0) return;
  switch (H5Iget_type(id_)) {
    case H5I_FILE: H5Fclose(id_); break;
    case H5I_GROUP: H5Gclose(id_); break;
    case H5I_DATASET: H5Dclose(id_); break;
    case H5I_DATASPACE: H5Sclose(id_); break;
    case H5I_DATATYPE: H5Tclose(id_); break;
    case H5I_ATTR: H5Aclose(id_); break;
    case H5I_GENPROP_LST: H5Pclose(id_); break;
    default: break;
  }
  id_ = H5I_INVALID_HID;
}

void quiet() {
  static std::once_flag once;
  std::call_once(once, [] { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); });
}

std::string last_error() {
  std::string msg;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned, const H5E_error2_t* e, void* data) -> herr_t {
        auto* out = static_cast<std::string*>(data);
        if (out->empty() && e->desc) *out = e->desc;
        return 0;
      },
      &msg);
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
