// The MPI backend. Host buffers go to MPI as they are; device buffers are staged through pinned
// host memory (copied in before the operation starts, copied out when it completes), so several
// ranks can share one GPU. MPI has no bf16 or f16: they travel as 2-byte datatypes of ours with
// reduction ops of ours; avg is a sum divided on completion.
//
// The communication thread (comm_thread.h) runs async operations on host buffers in program
// order while the caller computes.
//
// All-reduce algorithms, chosen by size (DTK_ALLREDUCE_ALGO=auto, the default): large all-
// reduces (from kLargeBytes, on more than one rank), sync ones included, go through MPI's
// nonblocking call, which Open MPI runs with libnbc; Runtime selects libnbc's ring for it at
// MPI_Init (OMPI_MCA_coll_libnbc_iallreduce_algorithm=1 unless the user set it): every rank
// sends and receives 2 (W - 1) / W of the buffer, the bandwidth optimum. Left to itself, Open MPI
// picks libnbc's binomial tree below 4 ranks (the buffer crosses the link twice in sequence) and
// its blocking all-reduce was as slow on a 1 Gbit/s link (1.53 s for 111 MB, a ring needs 0.89).
// A ring over point-to-point messages of our own reached the link's rate only in some runs
// there (50-100%, bimodal), libnbc's ring in every run. Smaller sync all-reduces are MPI's
// blocking call (latency-optimal algorithms). Reduce-scatters from kRingReduceScatterBytes are
// a ring of our own over point-to-point messages: with Open MPI 4.1 on 2 ranks of one host its
// blocking reduce-scatter took 0.58 ms for 256 KiB and 3.3 ms for 1 MiB (the ring: 0.015, 0.053),
// every one of tuned's four algorithms fell to 0.16-0.25 GB/s above 4-16 MiB, and libnbc's
// nonblocking one took 81 ms for 16 MiB (the ring: 1.4).
// DTK_ALLREDUCE_ALGO=mpi leaves every choice to MPI.
#include "dtk/comm/mpi/mpi_comm.h"
#include "dtk/comm/mpi/comm_thread.h"
#include "dtk/comm/mpi/staging.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <vector>
#include <mutex>
#include <string_view>
#include <thread>
#include <utility>

#include "dtk/comm/flight.h"
#include "dtk/comm/watchdog.h"
#include "dtk/core/error.h"

namespace dtk::comm {
namespace {

MPI_Datatype g_bf16 = MPI_DATATYPE_NULL, g_f16 = MPI_DATATYPE_NULL;
MPI_Op g_half_ops[2][3];  // [bf16, f16][sum, max, min]

template <bool BF16, int OP>
void half_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = BF16 ? bf16_to_float(a[i]) : f16_to_float(a[i]);
    const float y = BF16 ? bf16_to_float(b[i]) : f16_to_float(b[i]);
    const float r = OP == 0 ? x + y : OP == 1 ? (x > y ? x : y) : (x < y ? x : y);
    b[i] = BF16 ? float_to_bf16(r) : float_to_f16(r);
  }
}

MPI_Datatype datatype(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::bf16: return g_bf16;
    case DType::f16: return g_f16;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::u8: return MPI_UINT8_T;
    case DType::u16: return MPI_UINT16_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(DType t, ReduceOp op) {
  const int k = op == ReduceOp::max ? 1 : op == ReduceOp::min ? 2 : 0;  // avg: a sum, then a division
  if (t == DType::bf16) return g_half_ops[0][k];
  if (t == DType::f16) return g_half_ops[1][k];
  return k == 1 ? MPI_MAX : k == 2 ? MPI_MIN : MPI_SUM;
}

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  fail(std::string("MPI ") + what + ": " + std::string(msg, len));
}

int as_int(size_t n, const char* what) {
  if (n > static_cast<size_t>(INT_MAX))
    fail_usage("{}: {} elements exceed MPI's count limit of 2^31-1", what, n);
  return static_cast<int>(n);
}

template <typename T>
void divide(T* p, size_t n, int by) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / by);
}
// avg = sum / n on the host copy of the result
void post_divide(DType t, void* p, size_t n, int by) {
  switch (t) {
    case DType::f32: divide(static_cast<float*>(p), n, by); break;
    case DType::f64: divide(static_cast<double*>(p), n, by); break;
    case DType::i32: divide(static_cast<int32_t*>(p), n, by); break;
    case DType::i64: divide(static_cast<int64_t*>(p), n, by); break;
    case DType::u8: divide(static_cast<uint8_t*>(p), n, by); break;
    case DType::u16: divide(static_cast<uint16_t*>(p), n, by); break;
    case DType::bf16:
    case DType::f16: {
      auto* h = static_cast<uint16_t*>(p);
      const bool bf = t == DType::bf16;
      for (size_t i = 0; i < n; ++i) {
        const float v = (bf ? bf16_to_float(h[i]) : f16_to_float(h[i])) / static_cast<float>(by);
        h[i] = bf ? float_to_bf16(v) : float_to_f16(v);
      }
      break;
    }
  }
}

// How the communication thread waits for requests: test, and give the core away in between.
void poll(MPI_Request* r, int n, const char* what) {
  for (;;) {
    int flag = 0;
    check_mpi(MPI_Testall(n, r, &flag, MPI_STATUSES_IGNORE), what);
    if (flag) return;
    sched_yield();
  }
}
void block(MPI_Request* r, int n, const char* what) { check_mpi(MPI_Waitall(n, r, MPI_STATUSES_IGNORE), what); }
using WaitFn = void (*)(MPI_Request*, int, const char*);

constexpr size_t kLargeBytes = 1 << 20;
constexpr size_t kRingReduceScatterBytes = 128 << 10;

// DTK_ALLREDUCE_ALGO: true for auto (the default), false for mpi.
bool automatic_algorithms() {
  static const bool a = [] {
    const char* e = std::getenv("DTK_ALLREDUCE_ALGO");
    const std::string_view v = e ? e : "auto";
    if (v != "auto" && v != "mpi") fail_usage("DTK_ALLREDUCE_ALGO=" + std::string(v) + ": expected auto or mpi");
    return v == "auto";
  }();
  return a;
}

// Staging memory of operations abandoned while an exception unwinds: MPI may still use it, so it
// is never freed (the job is on its way to MPI_Abort).
void abandon(std::vector<std::shared_ptr<void>> keep) {
  static std::mutex mu;
  static auto* held = new std::vector<std::shared_ptr<void>>;
  std::lock_guard lock(mu);
  for (auto& k : keep) held->push_back(std::move(k));
}

struct MpiWork final : Work::State {
  MPI_Request req[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};  // send_recv uses two
  const char* what = "";
  size_t bytes = 0;
  Staging staging;
  flight::Ticket ticket;
  bool finished = false;

  // Dropped unwaited (comm.h): completed here, since MPI still uses its staging memory and a
  // staged result has yet to reach the device. Not while an exception unwinds: a peer may never
  // complete it then, and the staging is abandoned instead.
  ~MpiWork() override {
    if (finished) return;
    if (std::uncaught_exceptions() == 0) {
      try {
        wait();
        return;
      } catch (const std::exception&) {
      }
    }
    abandon(std::move(staging.keep));
  }

  bool test() override {
    int flag = 0;
    check_mpi(MPI_Testall(2, req, &flag, MPI_STATUSES_IGNORE), what);
    if (flag) finish();
    return flag != 0;
  }
  void wait() override {
    {
      watchdog::Scope scope(what, bytes);
      check_mpi(MPI_Waitall(2, req, MPI_STATUSES_IGNORE), what);
    }
    finish();
  }
  void finish() {
    finished = true;
    flight::complete(ticket);
    auto steps = std::move(staging.on_done);
    staging.on_done.clear();
    for (auto& f : steps) f();
    staging.keep.clear();
  }
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, bool owned, const std::string& label) : comm_(comm), owned_(owned) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    // Its ranks in the world, for the flight recorder.
    std::vector<int> mine(static_cast<size_t>(size_)), world(static_cast<size_t>(size_));
    for (int i = 0; i < size_; ++i) mine[i] = i;
    MPI_Group g, w;
    MPI_Comm_group(comm_, &g);
    MPI_Comm_group(MPI_COMM_WORLD, &w);
    MPI_Group_translate_ranks(g, size_, mine.data(), w, world.data());
    MPI_Group_free(&g);
    MPI_Group_free(&w);
    flight_ = flight::enrol(label, world);
    MPI_Comm node;
    {
      watchdog::Scope scope("communicator set-up (its ranks per host)", 0);
      MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node);
    }
    MPI_Comm_rank(node, &local_rank_);
    MPI_Comm_size(node, &local_size_);
    MPI_Comm_free(&node);
    if (comm_thread_wanted()) thread_ = std::make_unique<CommThread>();
  }
  ~MpiCommunicator() override {
    thread_.reset();  // finishes what is queued
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Comm_free(&comm_);
  }

  Backend backend() const override { return Backend::mpi; }
  bool accepts(const Device&) const override { return true; }

  Work all_reduce(Buffer send, Buffer recv, ReduceOp op, Mode mode) override {
    check_counts("all_reduce", send, recv, recv.count, send.count);
    const int n = as_int(send.count, "all_reduce");
    auto st = stage(send, recv);
    const bool inplace = st.send == st.recv;
    if (op == ReduceOp::avg) add_divide(st, recv, st.recv, recv.count);
    auto dt = datatype(send.dtype);
    auto mop = mpi_op(send.dtype, op);
    const bool large = size_ > 1 && send.bytes() >= kLargeBytes && automatic_algorithms();
    return launch("all_reduce", send.bytes(), mode, std::move(st), [=, this](Staging& s, MPI_Request* r) {
      const void* sb = inplace ? MPI_IN_PLACE : s.send;
      if (r) return MPI_Iallreduce(sb, s.recv, n, dt, mop, comm_, r);
      if (!large) return MPI_Allreduce(sb, s.recv, n, dt, mop, comm_);
      MPI_Request q;  // large and blocking: the nonblocking call's ring, waited for
      const int rc = MPI_Iallreduce(sb, s.recv, n, dt, mop, comm_, &q);
      return rc != MPI_SUCCESS ? rc : MPI_Wait(&q, MPI_STATUS_IGNORE);
    });
  }

  Work reduce_scatter(Buffer send, Buffer recv, ReduceOp op, Mode mode) override {
    check_counts("reduce_scatter", send, recv, recv.count * size_, recv.count);
    const int n = as_int(recv.count, "reduce_scatter");
    Buffer out = recv;
    std::shared_ptr<void> tmp;
    if (overlaps(send, recv)) {  // MPI forbids aliasing: receive into a scratch block
      tmp = std::shared_ptr<void>(std::malloc(recv.bytes() ? recv.bytes() : 1), std::free);
      out = {tmp.get(), recv.count, recv.dtype, Device::cpu()};
    }
    auto st = stage(send, out);
    if (tmp) {
      st.keep.push_back(tmp);
      st.on_done.push_back([recv, tmp] { copy_to(recv, tmp.get()); });
    }
    if (op == ReduceOp::avg) add_divide(st, recv, st.recv, recv.count);
    auto dt = datatype(send.dtype);
    auto mop = mpi_op(send.dtype, op);
    const bool ring = size_ > 1 && send.bytes() >= kRingReduceScatterBytes && automatic_algorithms();
    if (ring && (mode == Mode::sync || threaded(st))) {
      const size_t block = recv.bytes();
      return run("reduce_scatter", send.bytes(), mode, std::move(st), [=, this](Staging& s, WaitFn wait) {
        ring_reduce_scatter(s, n, block, dt, mop, wait);
      });
    }
    return launch("reduce_scatter", send.bytes(), mode, std::move(st), [=, this](Staging& s, MPI_Request* r) {
      return r ? MPI_Ireduce_scatter_block(s.send, s.recv, n, dt, mop, comm_, r)
               : MPI_Reduce_scatter_block(s.send, s.recv, n, dt, mop, comm_);
    });
  }

  Work all_gather(Buffer send, Buffer recv, Mode mode) override {
    check_counts("all_gather", send, recv, send.count, send.count * size_);
    const int n = as_int(send.count, "all_gather");
    const bool inplace = send.data == static_cast<char*>(recv.data) + rank_ * send.bytes();
    auto st = stage(send, recv);
    auto dt = datatype(send.dtype);
    return launch("all_gather", recv.bytes(), mode, std::move(st), [=, this](Staging& s, MPI_Request* r) {
      const void* sb = inplace ? MPI_IN_PLACE : s.send;
      return r ? MPI_Iallgather(sb, n, dt, s.recv, n, dt, comm_, r) : MPI_Allgather(sb, n, dt, s.recv, n, dt, comm_);
    });
  }

  Work reduce_scatter_v(Buffer send, Buffer recv, const std::vector<size_t>& counts, ReduceOp op,
                        Mode mode) override {
    const size_t total = check_v("reduce_scatter_v", counts);
    check_counts("reduce_scatter_v", send, recv, total, counts[rank_]);
    std::vector<int> ints(size_);
    for (int i = 0; i < size_; ++i) ints[i] = as_int(counts[i], "reduce_scatter_v");
    Buffer out = recv;
    std::shared_ptr<void> tmp;
    if (overlaps(send, recv)) {
      tmp = std::shared_ptr<void>(std::malloc(recv.bytes() ? recv.bytes() : 1), std::free);
      out = {tmp.get(), recv.count, recv.dtype, Device::cpu()};
    }
    auto st = stage(send, out);
    if (tmp) {
      st.keep.push_back(tmp);
      st.on_done.push_back([recv, tmp] { copy_to(recv, tmp.get()); });
    }
    if (op == ReduceOp::avg) add_divide(st, recv, st.recv, recv.count);
    st.ints = std::move(ints);
    auto dt = datatype(send.dtype);
    auto mop = mpi_op(send.dtype, op);
    return launch("reduce_scatter_v", send.bytes(), mode, std::move(st), [=, this](Staging& s, MPI_Request* r) {
      return r ? MPI_Ireduce_scatter(s.send, s.recv, s.ints.data(), dt, mop, comm_, r)
               : MPI_Reduce_scatter(s.send, s.recv, s.ints.data(), dt, mop, comm_);
    });
  }

  Work all_gather_v(Buffer send, Buffer recv, const std::vector<size_t>& counts, Mode mode) override {
    const size_t total = check_v("all_gather_v", counts);
    check_counts("all_gather_v", send, recv, counts[rank_], total);
    std::vector<int> ints(2 * size_);  // counts, then displacements
    size_t off = 0;
    for (int i = 0; i < size_; ++i) {
      ints[i] = as_int(counts[i], "all_gather_v");
      ints[size_ + i] = as_int(off, "all_gather_v");
      off += counts[i];
    }
    size_t my_off = 0;
    for (int i = 0; i < rank_; ++i) my_off += counts[i];
    const bool inplace = send.data == static_cast<char*>(recv.data) + my_off * dtype_size(send.dtype);
    auto st = stage(send, recv);
    const int n = ints[rank_];
    st.ints = std::move(ints);
    auto dt = datatype(send.dtype);
    const int size = size_;
    return launch("all_gather_v", recv.bytes(), mode, std::move(st), [=, this](Staging& s, MPI_Request* r) {
      const void* sb = inplace ? MPI_IN_PLACE : s.send;
      const int* c = s.ints.data();
      return r ? MPI_Iallgatherv(sb, n, dt, s.recv, c, c + size, dt, comm_, r)
               : MPI_Allgatherv(sb, n, dt, s.recv, c, c + size, dt, comm_);
    });
  }

  Work broadcast(Buffer buf, int root, Mode mode) override {
    check_counts("broadcast", buf, buf, buf.count, buf.count);
    check_root("broadcast", root);
    const int n = as_int(buf.count, "broadcast");
    auto st = stage(buf, buf);
    auto dt = datatype(buf.dtype);
    return launch("broadcast", buf.bytes(), mode, std::move(st), [=, this](Staging& s, MPI_Request* r) {
      return r ? MPI_Ibcast(s.recv, n, dt, root, comm_, r) : MPI_Bcast(s.recv, n, dt, root, comm_);
    });
  }

  Work all_to_all(Buffer send, Buffer recv, Mode mode) override {
    check_counts("all_to_all", send, recv, recv.count, send.count);
    if (send.count % size_)
      fail_usage("all_to_all: {} elements do not split into {} equal blocks", send.count, size_);
    const int n = as_int(send.count / size_, "all_to_all");
    Buffer in = send;
    std::shared_ptr<void> tmp;
    if (overlaps(send, recv)) {  // in place: send from a copy
      tmp = std::shared_ptr<void>(std::malloc(send.bytes() ? send.bytes() : 1), std::free);
      copy_from(tmp.get(), send);
      in = {tmp.get(), send.count, send.dtype, Device::cpu()};
    }
    auto st = stage(in, recv);
    if (tmp) st.keep.push_back(tmp);
    auto dt = datatype(send.dtype);
    return launch("all_to_all", send.bytes(), mode, std::move(st), [=, this](Staging& s, MPI_Request* r) {
      return r ? MPI_Ialltoall(s.send, n, dt, s.recv, n, dt, comm_, r)
               : MPI_Alltoall(s.send, n, dt, s.recv, n, dt, comm_);
    });
  }

  Work send(Buffer buf, int peer, int tag, Mode mode) override {
    check_root("send", peer);
    const int n = as_int(buf.count, "send");
    Staging st = stage(buf, Buffer{});
    st.queued = false;
    auto dt = datatype(buf.dtype);
    return launch("send", buf.bytes(), mode, std::move(st), [=, this](Staging& s, MPI_Request* r) {
      return r ? MPI_Isend(s.send, n, dt, peer, tag, comm_, r) : MPI_Send(s.send, n, dt, peer, tag, comm_);
    });
  }

  Work recv(Buffer buf, int peer, int tag, Mode mode) override {
    check_root("recv", peer);
    const int n = as_int(buf.count, "recv");
    Staging st = stage(Buffer{}, buf);
    st.queued = false;
    auto dt = datatype(buf.dtype);
    return launch("recv", buf.bytes(), mode, std::move(st), [=, this](Staging& s, MPI_Request* r) {
      return r ? MPI_Irecv(s.recv, n, dt, peer, tag, comm_, r)
               : MPI_Recv(s.recv, n, dt, peer, tag, comm_, MPI_STATUS_IGNORE);
    });
  }

  Work send_recv(Buffer sbuf, int dst, Buffer rbuf, int src, int tag, Mode mode) override {
    check_root("send_recv", dst);
    check_root("send_recv", src);
    if (sbuf.dtype != rbuf.dtype) fail_usage("send_recv: send and receive buffers differ in dtype");
    const int ns = as_int(sbuf.count, "send_recv"), nr = as_int(rbuf.count, "send_recv");
    auto st = stage(sbuf, rbuf);
    auto dt = datatype(sbuf.dtype);
    return launch("send_recv", sbuf.bytes() + rbuf.bytes(), mode, std::move(st),
                  [=, this](Staging& s, MPI_Request* r) {
                    if (!r)
                      return MPI_Sendrecv(s.send, ns, dt, dst, tag, s.recv, nr, dt, src, tag, comm_, MPI_STATUS_IGNORE);
                    const int rc = MPI_Irecv(s.recv, nr, dt, src, tag, comm_, &r[0]);
                    return rc != MPI_SUCCESS ? rc : MPI_Isend(s.send, ns, dt, dst, tag, comm_, &r[1]);
                  });
  }

  Work barrier(Mode mode) override {
    return launch("barrier", 0, mode, Staging{}, [this](Staging&, MPI_Request* r) {
      return r ? MPI_Ibarrier(comm_, r) : MPI_Barrier(comm_);
    });
  }

  // A collective over this communicator: after what is queued (program order), watched and
  // recorded as one of its operations.
  std::shared_ptr<Communicator> split(int color, int key) override {
    MPI_Comm sub;
    Staging none;
    now(flight::issue(flight_, "split", 0), "communicator split", 0, none,
        [&] { check_mpi(MPI_Comm_split(comm_, color, key, &sub), "split"); }).wait();
    return make_mpi_communicator(sub, true, flight::split_label(flight_, color));
  }

 private:
  // The ring reduce-scatter (see the file comment): W - 1 steps; at step k rank r sends the
  // partial sum of block (r - k - 1) mod W to rank r + 1 and adds its own share of block
  // (r - k - 2) mod W to what rank r - 1 sent, so that the last step leaves block r, summed
  // over every rank, in s.recv. The two receive buffers alternate (s.recv and a scratch block
  // kept for the next call), the last being s.recv.
  void ring_reduce_scatter(Staging& s, int n, size_t block, MPI_Datatype dt, MPI_Op op, WaitFn wait) {
    constexpr int kTag = 0x5253;  // "RS": apart from the tags of send and recv
    const int W = size_, r = rank_;
    if (ring_scratch_.size() < block) ring_scratch_.resize(block);
    char* const in = static_cast<char*>(s.send);
    char* const buf[2] = {static_cast<char*>(s.recv), ring_scratch_.data()};
    for (int k = 0; k < W - 1; ++k) {
      const int sent = ((r - k - 1) % W + W) % W, got = ((r - k - 2) % W + W) % W;
      char* const dst = buf[(W - 2 - k) % 2];
      const char* const src = k == 0 ? in + static_cast<size_t>(sent) * block : buf[(W - 1 - k) % 2];
      MPI_Request q[2];
      check_mpi(MPI_Irecv(dst, n, dt, (r + W - 1) % W, kTag, comm_, &q[0]), "reduce_scatter");
      check_mpi(MPI_Isend(src, n, dt, (r + 1) % W, kTag, comm_, &q[1]), "reduce_scatter");
      wait(q, 2, "reduce_scatter");
      check_mpi(MPI_Reduce_local(in + static_cast<size_t>(got) * block, dst, n, dt, op), "reduce_scatter");
    }
  }

  // Whether an async operation with this staging runs on the communication thread.
  bool threaded(const Staging& st) const { return thread_ && !st.device && st.queued; }

  // Runs call(staging, nullptr) (blocking, no allocation) or call(staging, &request) (nonblocking),
  // the latter on the communication thread when there is one.
  template <typename Call>
  Work launch(const char* what, size_t bytes, Mode mode, Staging st, Call call) {
    const std::string_view kind(what);  // send, recv, send_recv: point to point
    const flight::Ticket t = flight::issue(flight_, what, bytes, kind == "send" || kind == "recv" || kind == "send_recv");
    if (mode == Mode::sync) return now(t, what, bytes, st, [&] { check_mpi(call(st, nullptr), what); });
    if (threaded(st))
      return queue(t, what, bytes, std::move(st), [what, call](Staging& s, WaitFn wait) {
        MPI_Request r[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
        check_mpi(call(s, r), what);
        wait(r, 2, what);
      });
    auto w = std::make_shared<MpiWork>();
    w->what = what;
    w->bytes = bytes;
    w->ticket = t;
    w->staging = std::move(st);
    check_mpi(call(w->staging, w->req), what);
    return Work(std::move(w));
  }

  // Runs body(staging, wait) to completion: on the caller's thread with blocking waits (sync), or
  // on the communication thread with polling waits (async; the caller checks threaded() first).
  template <typename Body>
  Work run(const char* what, size_t bytes, Mode mode, Staging st, Body body) {
    const flight::Ticket t = flight::issue(flight_, what, bytes);
    if (mode == Mode::sync) return now(t, what, bytes, st, [&] { body(st, &block); });
    return queue(t, what, bytes, std::move(st), std::move(body));
  }
  // An operation issued (numbered) already, to the communication thread.
  template <typename Body>
  Work queue(flight::Ticket t, const char* what, size_t bytes, Staging st, Body body) {
    return Work(thread_->submit(what, bytes, [st = std::move(st), body, t]() mutable {
      body(st, &poll);
      flight::complete(t);
      for (auto& f : st.on_done) f();
    }));
  }

  // A sync operation: once everything queued has completed (program order), f() on this thread
  // under the watchdog, then the staging's completion steps.
  template <typename F>
  Work now(flight::Ticket t, const char* what, size_t bytes, Staging& st, F f) {
    if (thread_) thread_->drain(what, bytes);
    {
      watchdog::Scope scope(what, bytes);
      f();
    }
    flight::complete(t);
    for (auto& step : st.on_done) step();
    return Work();
  }

  size_t check_v(const char* op, const std::vector<size_t>& counts) const {
    if (counts.size() != static_cast<size_t>(size_))
      fail_usage("{}: {} counts for {} ranks", op, counts.size(), size_);
    size_t total = 0;
    for (size_t c : counts) total += c;
    return total;
  }

  // avg: divide the host result first, before any copy of it to its final place.
  void add_divide(Staging& st, const Buffer& recv, void* host, size_t count) {
    const int n = size_;
    const DType t = recv.dtype;
    st.on_done.insert(st.on_done.begin(), [t, host, count, n] { post_divide(t, host, count, n); });
  }

  static void copy_to(const Buffer& dst, const void* host) {
    if (dst.device.is_cuda())
      cuda::memcpy(dst.data, host, dst.bytes());
    else
      std::memcpy(dst.data, host, dst.bytes());
  }
  static void copy_from(void* host, const Buffer& src) {
    if (src.device.is_cuda())
      cuda::memcpy(host, src.data, src.bytes());
    else
      std::memcpy(host, src.data, src.bytes());
  }

  MPI_Comm comm_;
  bool owned_;
  int flight_ = -1;  // this communicator in the flight recorder
  std::unique_ptr<CommThread> thread_;  // null: async operations are MPI's nonblocking calls
  std::vector<char> ring_scratch_;  // ring_reduce_scatter's (used by one operation at a time: program order)
};

}  // namespace

void mpi_types_init() {
  if (g_bf16 != MPI_DATATYPE_NULL) return;
  MPI_Type_contiguous(2, MPI_BYTE, &g_bf16);
  MPI_Type_commit(&g_bf16);
  MPI_Type_contiguous(2, MPI_BYTE, &g_f16);
  MPI_Type_commit(&g_f16);
  MPI_Op_create(&half_reduce<true, 0>, 1, &g_half_ops[0][0]);
  MPI_Op_create(&half_reduce<true, 1>, 1, &g_half_ops[0][1]);
  MPI_Op_create(&half_reduce<true, 2>, 1, &g_half_ops[0][2]);
  MPI_Op_create(&half_reduce<false, 0>, 1, &g_half_ops[1][0]);
  MPI_Op_create(&half_reduce<false, 1>, 1, &g_half_ops[1][1]);
  MPI_Op_create(&half_reduce<false, 2>, 1, &g_half_ops[1][2]);
}

void mpi_select_algorithms() {
  if (automatic_algorithms()) setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", 0);
}

std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, bool owned, const std::string& label) {
  mpi_types_init();
  return std::make_shared<MpiCommunicator>(comm, owned, label);
}

}  // namespace dtk::comm
