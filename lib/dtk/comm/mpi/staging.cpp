// The MPI backend's staging of device buffers (staging.h).
#include "dtk/comm/mpi/staging.h"

#include <mutex>
#include <utility>

#include "dtk/core/device.h"

namespace dtk::comm {
namespace {

// Pinned host blocks for staging device buffers, reused across operations.
class PinnedPool {
 public:
  std::shared_ptr<void> get(size_t bytes) {
    std::lock_guard lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->first >= bytes) {
        auto block = *it;
        free_.erase(it);
        return wrap(block);
      }
    }
    return wrap({bytes, cuda::malloc_pinned(bytes ? bytes : 1)});
  }

 private:
  std::shared_ptr<void> wrap(std::pair<size_t, void*> block) {
    return std::shared_ptr<void>(block.second, [this, block](void*) {
      std::lock_guard lock(mu_);
      free_.push_back(block);
    });
  }
  std::mutex mu_;
  std::vector<std::pair<size_t, void*>> free_;  // kept for the process's lifetime
};
PinnedPool& pinned_pool() {
  static auto* pool = new PinnedPool;  // never destroyed: blocks may be returned at exit
  return *pool;
}

}  // namespace

bool overlaps(const Buffer& a, const Buffer& b) {
  auto* a0 = static_cast<const char*>(a.data);
  auto* b0 = static_cast<const char*>(b.data);
  return a.bytes() && b.bytes() && a0 < b0 + b.bytes() && b0 < a0 + a.bytes();
}

Staging stage(const Buffer& send, const Buffer& recv, bool copy_recv_in) {
  Staging s;
  s.device = send.device.is_cuda() || recv.device.is_cuda();
  if (!s.device) {
    s.send = send.data;
    s.recv = recv.data;
    return s;
  }
  auto host_of = [&](const Buffer& b, bool copy_in) -> void* {
    if (!b.device.is_cuda()) return b.data;
    auto block = pinned_pool().get(b.bytes());
    if (copy_in) cuda::memcpy(block.get(), b.data, b.bytes());
    s.keep.push_back(block);
    return block.get();
  };
  const auto contains = [](const Buffer& outer, const Buffer& inner) {
    auto* o = static_cast<const char*>(outer.data);
    auto* i = static_cast<const char*>(inner.data);
    return i >= o && i + inner.bytes() <= o + outer.bytes();
  };
  if (send.device == recv.device && contains(send, recv)) {
    s.send = host_of(send, true);
    s.recv = static_cast<char*>(s.send) + (static_cast<char*>(recv.data) - static_cast<char*>(send.data));
  } else if (send.device == recv.device && contains(recv, send)) {
    s.recv = host_of(recv, true);
    s.send = static_cast<char*>(s.recv) + (static_cast<char*>(send.data) - static_cast<char*>(recv.data));
  } else {
    s.send = host_of(send, true);
    s.recv = host_of(recv, copy_recv_in);
  }
  if (recv.device.is_cuda()) {
    void* host = s.recv;
    s.on_done.push_back([recv, host] { cuda::memcpy(recv.data, host, recv.bytes()); });
  }
  return s;
}

}  // namespace dtk::comm
