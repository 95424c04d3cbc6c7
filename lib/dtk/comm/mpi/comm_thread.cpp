// The MPI backend's communication thread (comm_thread.h).
#include "dtk/comm/mpi/comm_thread.h"

#include <string_view>

namespace dtk::comm {

bool comm_thread_wanted() {
  static const bool on = [] {
    const char* e = std::getenv("DTK_COMM_THREAD");
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    return level == MPI_THREAD_MULTIPLE && !(e && std::string_view(e) == "0");
  }();
  return on;
}

}  // namespace dtk::comm
