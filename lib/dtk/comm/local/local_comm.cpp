// A world of one: every collective is a copy (or nothing, in place); a send to oneself is held
// until the matching receive.
#include "dtk/comm/comm.h"

#include <cstring>
#include <deque>
#include <vector>

#include "dtk/core/error.h"

namespace dtk::comm {
namespace {

void copy(const Buffer& dst, const Buffer& src) {
  if (dst.data == src.data || !src.bytes()) return;
  if (dst.device.is_cuda() || src.device.is_cuda())
    cuda::memcpy(dst.data, src.data, src.bytes());
  else
    std::memmove(dst.data, src.data, src.bytes());
}

class LocalCommunicator final : public Communicator {
 public:
  Backend backend() const override { return Backend::local; }
  bool accepts(const Device&) const override { return true; }

  Work all_reduce(Buffer send, Buffer recv, ReduceOp, Mode) override {
    check_counts("all_reduce", send, recv, recv.count, send.count);
    copy(recv, send);  // sum, avg, max and min of one value are that value
    return {};
  }
  Work reduce_scatter(Buffer send, Buffer recv, ReduceOp, Mode) override {
    check_counts("reduce_scatter", send, recv, recv.count, recv.count);
    copy(recv, send);
    return {};
  }
  Work all_gather(Buffer send, Buffer recv, Mode) override {
    check_counts("all_gather", send, recv, send.count, send.count);
    copy(recv, send);
    return {};
  }
  Work reduce_scatter_v(Buffer send, Buffer recv, const std::vector<size_t>& counts, ReduceOp op, Mode m) override {
    check_one("reduce_scatter_v", counts);
    return reduce_scatter(send, recv, op, m);
  }
  Work all_gather_v(Buffer send, Buffer recv, const std::vector<size_t>& counts, Mode m) override {
    check_one("all_gather_v", counts);
    return all_gather(send, recv, m);
  }
  Work broadcast(Buffer, int root, Mode) override {
    check_root("broadcast", root);
    return {};
  }
  Work all_to_all(Buffer send, Buffer recv, Mode) override {
    check_counts("all_to_all", send, recv, recv.count, send.count);
    copy(recv, send);
    return {};
  }
  Work send(Buffer buf, int peer, int tag, Mode) override {
    check_root("send", peer);
    Message m{tag, std::vector<char>(buf.bytes())};
    if (buf.bytes()) copy({m.data.data(), buf.count, buf.dtype, Device::cpu()}, buf);
    pending_.push_back(std::move(m));
    return {};
  }
  // A receive posted before its send completes when waited on, as with MPI.
  Work recv(Buffer buf, int peer, int tag, Mode) override {
    check_root("recv", peer);
    if (take(buf, tag)) return {};
    struct Pending final : Work::State {
      LocalCommunicator* self;
      Buffer buf;
      int tag;
      Pending(LocalCommunicator* s, Buffer b, int t) : self(s), buf(b), tag(t) {}
      bool test() override { return self->take(buf, tag); }
      void wait() override {
        if (!test()) fail_usage("recv: in a world of one, a receive needs a matching send to this rank before its wait");
      }
    };
    return Work(std::make_shared<Pending>(this, buf, tag));
  }
  Work send_recv(Buffer send, int dst, Buffer recv, int src, int, Mode) override {
    check_root("send_recv", dst);
    check_root("send_recv", src);
    check_counts("send_recv", send, recv, recv.count, send.count);
    copy(recv, send);
    return {};
  }
  Work barrier(Mode) override { return {}; }
  std::shared_ptr<Communicator> split(int, int) override { return make_local_communicator(); }

 private:
  void check_one(const char* op, const std::vector<size_t>& counts) const {
    if (counts.size() != 1) fail_usage("{}: {} counts for 1 rank", op, counts.size());
  }
  bool take(const Buffer& buf, int tag) {
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (it->tag != tag) continue;
      if (it->data.size() != buf.bytes())
        fail_usage("recv: expected {} bytes, the matching send had {}", buf.bytes(), it->data.size());
      copy(buf, {it->data.data(), buf.count, buf.dtype, Device::cpu()});
      pending_.erase(it);
      return true;
    }
    return false;
  }
  struct Message {
    int tag;
    std::vector<char> data;
  };
  std::deque<Message> pending_;
};

}  // namespace

std::shared_ptr<Communicator> make_local_communicator() { return std::make_shared<LocalCommunicator>(); }

}  // namespace dtk::comm
