// The NCCL backend: device buffers, operations on one CUDA stream per process (the lane), which
// first waits (an event) for the work already queued on the caller's current stream, so the
// inputs are ready. Completion is an event recorded on the lane after the operation.
// Work::wait makes the current stream wait for that event: the host never blocks there, and
// the stream's later work sees the result. Work::synchronize and sync operations block the
// host until the event completes, through cuda::wait_event (watched, polling NCCL's errors).
// A Work dropped unwaited makes the stream that issued it wait for the event (comm.h).
// Events come from a pool, not one cudaEventCreate per collective.
//
// One lane for the world and every communicator split from it (HSDP's shard and replica
// groups): NCCL kernels of two communicators on two streams may run at once, and then deadlock
// unless every rank interleaves them identically (NCCL's documentation, "Using multiple NCCL
// communicators concurrently"). On one stream they run in the order the host issued them, which
// is the same on every rank (program order), so no two can wait on each other.
//
// Nonblocking communicators (ncclConfig_t::blocking = 0): no NCCL call waits for the peers. A call
// that must (set-up, a split, an operation's first connection to a peer, the shutdown's
// finalize) returns ncclInProgress and continues on NCCL's own thread; the caller then polls
// ncclCommGetAsyncError until the communicator is ncclSuccess again (wait_ready), under the
// watchdog, before it uses the communicator again (NCCL forbids using one in progress) or
// records the completion event (the operation is on the lane only then). So every wait for
// another rank is one of ours, watched, and the watchdog's expiry can abort the communicators
// (ncclCommAbort) while this thread polls, as NCCL's fault tolerance intends: with blocking
// communicators the abort would run beside a thread inside a blocking NCCL call on the same
// communicator, which NCCL does not support. NCCL_COMM_BLOCKING=1 in the environment makes them
// blocking again; every call site takes either answer.
//
// Every live communicator is in a registry: comm::wait_for_device polls their asynchronous
// errors while the host waits for the GPU, and the watchdog's expiry aborts them
// (ncclCommAbort: the peers' kernels see the end instead of waiting for ever). NCCL calls on one
// communicator are serialised by its handle's lock (the caller's operations, other threads'
// polls, its destruction, the abort), since a communicator may not be used by two threads at
// once and a destroyed or aborted one not at all; the lock is never held while waiting.
#include "dtk/comm/nccl/nccl_comm.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

#include "dtk/comm/flight.h"
#include "dtk/comm/watchdog.h"
#include "dtk/core/error.h"
#include "dtk/core/tensor.h"

namespace dtk::comm {
namespace {

// For a call whose ncclInProgress the caller handles (wait_ready) before this.
void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) fail(std::string("NCCL ") + what + ": " + ncclGetErrorString(r));
}
void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

ncclConfig_t nonblocking_config() {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  c.blocking = 0;
  return c;
}

ncclDataType_t nccl_type(DType t, const char* op, bool reduces) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
    case DType::u16:
      if (reduces) fail_usage(std::string(op) + ": NCCL cannot reduce u16; use the mpi backend or another dtype");
      return ncclFloat16;  // moved, never reduced: any 2-byte type carries the bits
  }
  return ncclFloat32;
}

// On one rank an average is the sum: ncclSum, which NCCL copies. ncclAvg there goes through
// NCCL's one-rank reduce kernel, which before NCCL 2.29.7 left the last count % blocks elements
// unwritten (NVIDIA/nccl#1950; gpu-check's comm-nccl-n1 found it with NCCL 2.28.3 on an H200).
ncclRedOp_t nccl_op(ReduceOp op, int nranks) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return nranks == 1 ? ncclSum : ncclAvg;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  return ncclSum;
}

cudaStream_t compute_stream() { return static_cast<cudaStream_t>(cuda::current_stream().handle); }

// A live NCCL communicator. Every NCCL call on it holds `mu`; `dead` (under mu) once it was
// destroyed or aborted, by whoever came first: nothing may touch `comm` after that.
struct Handle {
  std::mutex mu;
  ncclComm_t comm = nullptr;
  bool dead = false;
};

struct Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<Handle>> live;
  std::atomic<bool> aborting{false};  // abort_all ran: pollers leave the communicators alone
};
Registry& registry() {
  static auto* r = new Registry;  // never destroyed: the watchdog may use it during exit
  return *r;
}

std::vector<std::shared_ptr<Handle>> live_handles() {
  Registry& reg = registry();
  std::lock_guard lock(reg.mu);
  return reg.live;
}

// Frees a communicator at once, its operations on the GPU ended (ncclCommAbort; idempotent).
void abort_one(Handle& h) {
  std::lock_guard lock(h.mu);
  if (h.dead) return;
  h.dead = true;
  ncclCommAbort(h.comm);
}

// Aborts every live communicator (idempotent). Each waits for its lock, which no one holds
// for longer than one NCCL call (nonblocking: none waits for a peer).
void abort_all() {
  if (registry().aborting.exchange(true)) return;
  for (const auto& h : live_handles()) abort_one(*h);
}

std::shared_ptr<Handle> enrol(ncclComm_t c) {
  static std::once_flag hooked;
  std::call_once(hooked, [] { watchdog::on_expire(&abort_all); });
  auto h = std::make_shared<Handle>();
  h->comm = c;
  Registry& reg = registry();
  std::lock_guard lock(reg.mu);
  reg.live.push_back(h);
  return h;
}

void leave(const std::shared_ptr<Handle>& h) {
  Registry& reg = registry();
  std::lock_guard lock(reg.mu);
  reg.live.erase(std::remove(reg.live.begin(), reg.live.end(), h), reg.live.end());
}

// A communicator this thread needed was aborted: the watchdog is ending the job (stay until it
// exits: the results never arrived), or another thread found a communicator failed and raises
// that error.
[[noreturn]] void gone(const char* what) {
  if (watchdog::ending()) watchdog::park();
  fail("NCCL: the communicator was aborted during {}; a peer rank has probably failed", what);
}

// The handle's lock for one NCCL call, on a communicator that must still be alive.
class Use {
 public:
  Use(Handle& h, const char* what) : lock_(h.mu) {
    if (h.dead) {
      lock_.unlock();
      gone(what);
    }
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

[[noreturn]] void failed(const char* what, ncclResult_t r, const std::string& detail) {
  abort_all();
  fail("NCCL failed during {}: {}{}; a peer rank has probably died or the network failed", what, ncclGetErrorString(r),
       detail.empty() ? "" : " (" + detail + ")");
}

// After a call on h that returned ncclInProgress: polls its state until NCCL's thread has
// finished (ncclSuccess; an error fails, after aborting every communicator). The caller holds a
// watchdog Scope. Spins briefly, then sleeps up to 1 ms between polls, the lock released.
void wait_ready(const std::shared_ptr<Handle>& h, const char* what) {
  constexpr int kSpins = 64;
  for (int i = 0;; ++i) {
    ncclResult_t state = ncclSuccess;
    std::string detail;
    {
      Use use(*h, what);
      const ncclResult_t r = ncclCommGetAsyncError(h->comm, &state);
      if (r != ncclSuccess) state = r;
      if (state != ncclSuccess && state != ncclInProgress) detail = ncclGetLastError(h->comm);
    }
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) failed(what, state, detail);
    if (i < kSpins)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(1000, 1 << std::min(i - kSpins, 10))));
  }
}

// One NCCL call on h, made under its lock, then waited for while it is in progress.
template <typename Call>
void call_and_wait(const std::shared_ptr<Handle>& h, const char* what, Call call) {
  ncclResult_t r;
  {
    Use use(*h, what);
    r = call();
  }
  if (r == ncclInProgress) {
    wait_ready(h, what);
    return;
  }
  check_nccl(r, what);
}

// Completion events, reused. Blocking-sync events: a host wait on one sleeps instead of spinning.
class EventPool {
 public:
  ~EventPool() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  cudaEvent_t get() {
    std::lock_guard lock(mu_);
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync), "event");
    return e;
  }
  void put(cudaEvent_t e) {
    std::lock_guard lock(mu_);
    free_.push_back(e);
  }

 private:
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

struct NcclWork final : Work::State {
  std::shared_ptr<EventPool> pool;
  cudaEvent_t event = nullptr;
  cudaStream_t issuer = nullptr;  // the stream current when it was issued
  const char* what = "";
  size_t bytes = 0;
  std::shared_ptr<void> keep;  // scratch memory of the operation, used on the lane
  bool ordered = false;        // a stream waits for the event (or the host did)
  flight::Ticket ticket;       // completed when the host sees the event (flight.h)

  ~NcclWork() override {
    // Dropped unwaited: the issuing stream waits for the operation all the same (comm.h), so
    // its later work never reads the results early, and scratch that goes back to the caching
    // allocator (which hands it out in that stream's order) is not reused while the lane reads it.
    if (!ordered && event) cudaStreamWaitEvent(issuer, event, 0);
    if (event) pool->put(event);  // a later record is safe: stream waits already enqueued keep theirs
  }
  bool test() override {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaErrorNotReady) {
      nccl_check_async_errors(what);
      return false;
    }
    check_cuda(e, what);
    ordered = true;
    flight::complete(ticket);
    return true;
  }
  // The current stream waits for completion; the host goes on.
  void wait() override {
    check_cuda(cudaStreamWaitEvent(compute_stream(), event, 0), what);
    ordered = true;
  }
  // The host waits for completion: watched, NCCL's errors polled (comm::wait_for_device).
  void synchronize() override {
    cuda::wait_event(event, what, bytes);
    ordered = true;
    flight::complete(ticket);
  }
};

// The stream and events that every communicator of the process shares (see the file comment).
struct Lane {
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;  // the current stream's work before an operation
  std::shared_ptr<EventPool> events = std::make_shared<EventPool>();
  Lane() {
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    check_cuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "event");
  }
  ~Lane() {
    try {
      cuda::stream_synchronize(Stream{stream}, "the NCCL stream's last operations");
    } catch (const std::exception&) {
      abort_all();  // a failed communicator: nothing more will complete on this stream
    }
    cudaEventDestroy(ready);
    cudaStreamDestroy(stream);
  }
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
};

class NcclCommunicator final : public Communicator {
 public:
  // A ready communicator (enrolled); flight: its id in the flight recorder and members its world
  // ranks in its rank order (flight.h), or -1 and empty until set_flight.
  NcclCommunicator(std::shared_ptr<Handle> handle, int local_rank, int local_size, std::shared_ptr<Lane> lane,
                   int flight, std::vector<int> members)
      : handle_(std::move(handle)), comm_(handle_->comm), lane_(std::move(lane)), stream_(lane_->stream),
        flight_(flight), members_(std::move(members)) {
    int n = 0, r = 0;
    {
      Use use(*handle_, "the communicator's set-up");
      check_nccl(ncclCommCount(comm_, &n), "comm count");
      check_nccl(ncclCommUserRank(comm_, &r), "comm rank");
    }
    size_ = n;
    rank_ = r;
    local_rank_ = local_rank;
    local_size_ = local_size;
  }
  // Its operations end with the lane's, then it is finalised (which waits for its peers: under
  // the watchdog) and destroyed; a failure aborts it instead, and an aborted one is freed
  // already. (The barrier's scratch goes back to the cache after this body, once the lane has
  // passed its operations.)
  ~NcclCommunicator() override {
    try {
      watchdog::Scope scope("NCCL communicator shutdown", 0);
      cuda::stream_synchronize(Stream{stream_}, "the NCCL stream's last operations");
      call_and_wait(handle_, "the NCCL communicator's shutdown", [&] { return ncclCommFinalize(comm_); });
      std::lock_guard lock(handle_->mu);
      if (!handle_->dead) {
        handle_->dead = true;
        ncclCommDestroy(comm_);
      }
    } catch (const std::exception&) {
      abort_one(*handle_);
    }
    leave(handle_);
  }

  Backend backend() const override { return Backend::nccl; }
  bool accepts(const Device& d) const override { return d.is_cuda(); }

  Work all_reduce(Buffer send, Buffer recv, ReduceOp op, Mode mode) override {
    check_counts("all_reduce", send, recv, recv.count, send.count);
    auto t = nccl_type(send.dtype, "all_reduce", true);
    return enqueue("all_reduce", send.bytes(), mode, [&] {
      return ncclAllReduce(send.data, recv.data, send.count, t, nccl_op(op, size_), comm_, stream_);
    });
  }
  Work reduce_scatter(Buffer send, Buffer recv, ReduceOp op, Mode mode) override {
    check_counts("reduce_scatter", send, recv, recv.count * size_, recv.count);
    auto t = nccl_type(send.dtype, "reduce_scatter", true);
    return enqueue("reduce_scatter", send.bytes(), mode, [&] {
      return ncclReduceScatter(send.data, recv.data, recv.count, t, nccl_op(op, size_), comm_, stream_);
    });
  }
  Work all_gather(Buffer send, Buffer recv, Mode mode) override {
    check_counts("all_gather", send, recv, send.count, send.count * size_);
    auto t = nccl_type(send.dtype, "all_gather", false);
    return enqueue("all_gather", recv.bytes(), mode, [&] {
      return ncclAllGather(send.data, recv.data, send.count, t, comm_, stream_);
    });
  }
  // Uneven collectives as one group of rooted operations: a reduce to each rank of its block,
  // a broadcast from each rank of its block. (In a group the calls only queue; ncclGroupEnd
  // answers for them all, ncclInProgress included.)
  Work reduce_scatter_v(Buffer send, Buffer recv, const std::vector<size_t>& counts, ReduceOp op,
                        Mode mode) override {
    const auto offs = offsets("reduce_scatter_v", counts);
    check_counts("reduce_scatter_v", send, recv, offs.back(), counts[rank_]);
    auto t = nccl_type(send.dtype, "reduce_scatter_v", true);
    const size_t es = dtype_size(send.dtype);
    return enqueue("reduce_scatter_v", send.bytes(), mode, [&] {
      ncclResult_t r = ncclGroupStart();
      for (int q = 0; q < size_ && r == ncclSuccess; ++q)
        r = ncclReduce(static_cast<char*>(send.data) + offs[q] * es, recv.data, counts[q], t, nccl_op(op, size_), q, comm_,
                       stream_);
      const ncclResult_t e = ncclGroupEnd();
      return r != ncclSuccess ? r : e;
    });
  }
  Work all_gather_v(Buffer send, Buffer recv, const std::vector<size_t>& counts, Mode mode) override {
    const auto offs = offsets("all_gather_v", counts);
    check_counts("all_gather_v", send, recv, counts[rank_], offs.back());
    auto t = nccl_type(send.dtype, "all_gather_v", false);
    const size_t es = dtype_size(send.dtype);
    return enqueue("all_gather_v", recv.bytes(), mode, [&] {
      ncclResult_t r = ncclGroupStart();
      for (int q = 0; q < size_ && r == ncclSuccess; ++q)
        r = ncclBroadcast(send.data, static_cast<char*>(recv.data) + offs[q] * es, counts[q], t, q, comm_, stream_);
      const ncclResult_t e = ncclGroupEnd();
      return r != ncclSuccess ? r : e;
    });
  }
  Work broadcast(Buffer buf, int root, Mode mode) override {
    check_counts("broadcast", buf, buf, buf.count, buf.count);
    check_root("broadcast", root);
    auto t = nccl_type(buf.dtype, "broadcast", false);
    return enqueue("broadcast", buf.bytes(), mode,
                   [&] { return ncclBroadcast(buf.data, buf.data, buf.count, t, root, comm_, stream_); });
  }
  Work all_to_all(Buffer send, Buffer recv, Mode mode) override {
    check_counts("all_to_all", send, recv, recv.count, send.count);
    if (send.count % size_)
      fail_usage("all_to_all: {} elements do not split into {} equal blocks", send.count, size_);
    auto t = nccl_type(send.dtype, "all_to_all", false);
    const size_t block = send.count / size_, bb = block * dtype_size(send.dtype);
    std::shared_ptr<void> scratch;
    const char* src = static_cast<const char*>(send.data);
    if (send.data == recv.data && send.bytes()) {  // in place: send from a device copy (cached memory)
      auto copy = std::make_shared<Tensor>(Tensor::empty({static_cast<int64_t>(send.bytes())}, DType::u8, send.device));
      src = static_cast<const char*>(copy->data());
      scratch = std::shared_ptr<void>(copy, copy->data());
    }
    return enqueue("all_to_all", send.bytes(), mode, [&] {
      if (scratch)  // after the stream's wait for the inputs
        check_cuda(cudaMemcpyAsync(scratch.get(), send.data, send.bytes(), cudaMemcpyDeviceToDevice, stream_), "copy");
      ncclResult_t r = ncclGroupStart();
      for (int q = 0; q < size_ && r == ncclSuccess; ++q) {
        r = ncclSend(src + q * bb, block, t, q, comm_, stream_);
        if (r == ncclSuccess) r = ncclRecv(static_cast<char*>(recv.data) + q * bb, block, t, q, comm_, stream_);
      }
      const ncclResult_t e = ncclGroupEnd();
      return r != ncclSuccess ? r : e;
    }, scratch);
  }
  // NCCL matches point-to-point operations by order, not by tag.
  Work send(Buffer buf, int peer, int, Mode mode) override {
    check_root("send", peer);
    auto t = nccl_type(buf.dtype, "send", false);
    return enqueue("send", buf.bytes(), mode, [&] { return ncclSend(buf.data, buf.count, t, peer, comm_, stream_); });
  }
  Work recv(Buffer buf, int peer, int, Mode mode) override {
    check_root("recv", peer);
    auto t = nccl_type(buf.dtype, "recv", false);
    return enqueue("recv", buf.bytes(), mode, [&] { return ncclRecv(buf.data, buf.count, t, peer, comm_, stream_); });
  }
  Work send_recv(Buffer sbuf, int dst, Buffer rbuf, int src, int, Mode mode) override {
    check_root("send_recv", dst);
    check_root("send_recv", src);
    if (sbuf.dtype != rbuf.dtype) fail_usage("send_recv: send and receive buffers differ in dtype");
    auto t = nccl_type(sbuf.dtype, "send_recv", false);
    return enqueue("send_recv", sbuf.bytes() + rbuf.bytes(), mode, [&] {
      ncclResult_t r = ncclGroupStart();
      if (r == ncclSuccess) r = ncclSend(sbuf.data, sbuf.count, t, dst, comm_, stream_);
      if (r == ncclSuccess) r = ncclRecv(rbuf.data, rbuf.count, t, src, comm_, stream_);
      const ncclResult_t e = ncclGroupEnd();
      return r != ncclSuccess ? r : e;
    });
  }
  Work barrier(Mode mode) override {
    if (!scratch_.defined()) scratch_ = Tensor::zeros({1}, DType::f32, Device::cuda(cuda::current_device()));
    return enqueue("barrier", 0, mode, [&] {
      return ncclAllReduce(scratch_.data(), scratch_.data(), 1, ncclFloat32, ncclSum, comm_, stream_);
    });
  }
  // A collective over this communicator, recorded as one of its operations. The new
  // communicator shares this one's lane (see the file comment) and is enrolled in the flight
  // recorder with its world ranks, which its members exchange over it (its rank order by
  // construction), as part of the split.
  std::shared_ptr<Communicator> split(int color, int key) override {
    if (color < 0) fail_usage("split: colour {} is negative", color);
    const flight::Ticket t = flight::issue(flight_, "split", 0);
    watchdog::Scope scope("NCCL communicator split", 0);
    ncclConfig_t config = nonblocking_config();
    ncclComm_t sub = nullptr;
    // In progress, the split runs on this communicator: wait for it, then for NCCL's thread to
    // fill in the new one (it may lag the parent's state), then for the new one to be ready.
    call_and_wait(handle_, "an NCCL communicator split",
                  [&] { return ncclCommSplit(comm_, color, key, &sub, &config); });
    const std::atomic_ref<ncclComm_t> filled(sub);
    while (!filled.load()) {
      { Use alive(*handle_, "an NCCL communicator split"); }  // an abort meanwhile: not waited for
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    auto h = enrol(filled.load());
    try {
      wait_ready(h, "an NCCL communicator split");
    } catch (const std::exception&) {
      abort_one(*h);
      leave(h);
      throw;
    }
    auto child = std::make_shared<NcclCommunicator>(h, local_rank_, local_size_, lane_, -1, std::vector<int>{});
    Tensor mine = Tensor::from_host(&members_[rank_], {1}, DType::i32, Device::cuda(cuda::current_device()));
    Tensor all = Tensor::empty({child->size_}, DType::i32, mine.device());
    child->all_gather(buffer_of(mine), buffer_of(all), Mode::sync).wait();
    const Tensor host = all.to(Device::cpu());
    std::vector<int> members(host.ptr<int32_t>(), host.ptr<int32_t>() + child->size_);
    child->flight_ = flight::enrol(flight::split_label(flight_, color), members);
    child->members_ = std::move(members);
    flight::complete(t);
    return child;
  }

 private:
  // Issues call() (an NCCL operation on the lane) under the watchdog: the call itself, and the
  // wait for it while it is in progress (connection set-up with its peers). The completion event
  // is recorded once the operation is on the lane.
  template <typename Call>
  Work enqueue(const char* what, size_t bytes, Mode mode, Call call, std::shared_ptr<void> keep = {}) {
    watchdog::Scope scope(what, bytes);
    const cudaStream_t issuer = compute_stream();
    check_cuda(cudaEventRecord(lane_->ready, issuer), "event record");  // the inputs' producers
    check_cuda(cudaStreamWaitEvent(stream_, lane_->ready, 0), "stream wait");
    const std::string_view kind(what);  // send, recv, send_recv: point to point
    const flight::Ticket t = flight::issue(flight_, what, bytes, kind == "send" || kind == "recv" || kind == "send_recv");
    call_and_wait(handle_, what, call);
    auto w = std::make_shared<NcclWork>();
    w->ticket = t;
    w->pool = lane_->events;
    w->issuer = issuer;
    w->what = what;
    w->bytes = bytes;
    w->keep = std::move(keep);
    w->event = lane_->events->get();
    check_cuda(cudaEventRecord(w->event, stream_), "event record");
    if (mode == Mode::sync) {
      w->synchronize();
      return Work();
    }
    return Work(std::move(w));
  }
  std::vector<size_t> offsets(const char* op, const std::vector<size_t>& counts) const {
    if (counts.size() != static_cast<size_t>(size_))
      fail_usage("{}: {} counts for {} ranks", op, counts.size(), size_);
    std::vector<size_t> offs(size_ + 1, 0);
    for (int i = 0; i < size_; ++i) offs[i + 1] = offs[i] + counts[i];
    return offs;
  }

  std::shared_ptr<Handle> handle_;
  ncclComm_t comm_;
  std::shared_ptr<Lane> lane_;
  cudaStream_t stream_;
  int flight_;
  std::vector<int> members_;  // world ranks, in this communicator's rank order
  Tensor scratch_;  // the barrier's
};

// One step of the world's set-up over MPI, recorded among the runtime's own operations and
// watched: a rank that never arrives is named, not waited for in silence.
template <typename F>
void setup_step(int runtime_flight, const char* what, size_t bytes, F f) {
  const flight::Ticket t = flight::issue(runtime_flight, what, bytes);
  watchdog::Scope scope(what, bytes);
  f();
  flight::complete(t);
}

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, bool mpi_initialized, int runtime_flight) {
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  ncclUniqueId id;
  if (mpi_initialized) {
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    MPI_Comm node;
    setup_step(runtime_flight, "NCCL set-up: ranks per host", 0,
               [&] { MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node); });
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
    if (rank == 0) check_nccl(ncclGetUniqueId(&id), "unique id");
    setup_step(runtime_flight, "NCCL set-up: unique id broadcast", sizeof(id),
               [&] { MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm); });
  } else {
    check_nccl(ncclGetUniqueId(&id), "unique id");
  }
  std::shared_ptr<Handle> h;
  setup_step(runtime_flight, "NCCL communicator set-up", 0, [&] {
    ncclConfig_t config = nonblocking_config();
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&c, size, id, rank, &config);
    if (!c) check_nccl(r == ncclSuccess || r == ncclInProgress ? ncclInternalError : r, "init");
    h = enrol(c);  // from here on the watchdog's expiry can abort it
    try {
      if (r == ncclInProgress)
        wait_ready(h, "the NCCL communicator's set-up");
      else
        check_nccl(r, "init");
    } catch (const std::exception&) {
      abort_one(*h);
      leave(h);
      throw;
    }
  });
  std::vector<int> members(static_cast<size_t>(size));  // comm is MPI_COMM_WORLD (Runtime::world)
  for (int r = 0; r < size; ++r) members[r] = r;
  const int flight = flight::enrol("nccl world", members);
  return std::make_shared<NcclCommunicator>(h, local_rank, local_size, std::make_shared<Lane>(), flight,
                                            std::move(members));
}

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  if (v < 10000) return fmt::format("{}.{}.{}", v / 1000, v / 100 % 10, v % 100);  // before 2.9: XYZZ
  return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);                // since: XYYZZ
}

// A poll beside the communicators' owner (another thread's wait for the GPU included): a
// communicator whose lock is taken is in use, and skipped this time.
void nccl_check_async_errors(const char* what) {
  if (registry().aborting.load()) return;  // the job is ending: the communicators are being aborted
  for (const auto& h : live_handles()) {
    ncclResult_t r = ncclSuccess;
    std::string detail;
    {
      std::unique_lock lock(h->mu, std::try_to_lock);
      if (!lock.owns_lock() || h->dead || ncclCommGetAsyncError(h->comm, &r) != ncclSuccess) continue;
      if (r == ncclSuccess || r == ncclInProgress) continue;
      detail = ncclGetLastError(h->comm);
    }
    failed(fmt::format("the wait for {}", what).c_str(), r, detail);
  }
}

}  // namespace dtk::comm
