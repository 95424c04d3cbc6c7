// The MPI backend's staging of device buffers through pinned host memory (internal to comm/mpi).
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "dtk/comm/comm.h"

namespace dtk::comm {

// The host memory an MPI call works on, and what to do when it completes.
struct Staging {
  void* send = nullptr;
  void* recv = nullptr;
  std::vector<std::shared_ptr<void>> keep;
  std::vector<std::function<void()>> on_done;  // in order
  std::vector<int> ints;  // counts and displacements of v-collectives, alive until completion
  bool device = false;    // a buffer is in device memory (copies run on the caller's thread)
  bool queued = true;     // may wait its turn on the communication thread (not a lone send or
                          // receive: its peer operation may be queued behind it)
};

// Host pointers for send and recv: the buffers themselves on the host; pinned copies for device
// buffers (one copy when one lies inside the other, so in-place stays in place), reused across
// operations. A lone send or receive passes an empty Buffer{} for the other side.
Staging stage(const Buffer& send, const Buffer& recv, bool copy_recv_in = false);
// The two buffers share a byte.
bool overlaps(const Buffer& a, const Buffer& b);

}  // namespace dtk::comm
