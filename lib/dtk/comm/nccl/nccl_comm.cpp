// The NCCL backend: device buffers, operations on one CUDA stream per process (the lane), which
// first waits (an event) for the work already queued on the caller's current stream, so the
// inputs are ready. Completion is an event recorded on the lane after the operation.
// Work::wait makes the current stream wait for that event: the host never blocks there, and
// the stream's later work sees the result. Work::synchronize and sync operations block the
// host until the event completes, through cuda::wait_event (watched, polling NCCL's errors).
// Events come from a pool, not one cudaEventCreate per collective.
//
// One lane for the world and every communicator split from it (HSDP's shard and replica
// groups): NCCL kernels of two communicators on two streams may run at once, and then deadlock
// unless every rank interleaves them identically (NCCL's documentation, "Using multiple NCCL
// communicators concurrently"). On one stream they run in the order the host issued them, which
// is the same on every rank (program order), so no two can wait on each other.
//
// Every live communicator is in a registry: comm::wait_for_device polls their asynchronous
// errors while the host waits for the GPU, and the watchdog's expiry aborts them
// (ncclCommAbort: the peers' kernels see the end instead of waiting for ever).
#include "dtk/comm/nccl/nccl_comm.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <string_view>
#include <vector>

#include "dtk/comm/flight.h"
#include "dtk/comm/watchdog.h"
#include "dtk/core/error.h"
#include "dtk/core/tensor.h"

namespace dtk::comm {
namespace {

void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress) fail(std::string("NCCL ") + what + ": " + ncclGetErrorString(r));
}
void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
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

// A live NCCL communicator; aborted once, by whoever finds the job failed first.
struct Handle {
  ncclComm_t comm = nullptr;
  std::atomic<bool> aborted{false};
};

struct Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<Handle>> live;
  std::atomic<bool> aborting{false};  // set before any abort: pollers stop touching the communicators
};
Registry& registry() {
  static auto* r = new Registry;  // never destroyed: the watchdog may use it during exit
  return *r;
}

// Aborts every live communicator (idempotent). The pollers see `aborting` first and leave the
// communicators alone; the short pause lets a poll in progress finish.
void abort_all() {
  Registry& reg = registry();
  if (reg.aborting.exchange(true)) return;
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  std::vector<std::shared_ptr<Handle>> live;
  {
    std::lock_guard lock(reg.mu);
    live = reg.live;
  }
  for (const auto& h : live)
    if (!h->aborted.exchange(true)) ncclCommAbort(h->comm);
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
  const char* what = "";
  size_t bytes = 0;
  std::shared_ptr<void> keep;  // scratch memory of the operation, used on the lane
  bool ordered = false;        // the current stream waits for the event (or the host did)
  flight::Ticket ticket;       // completed when the host sees the event (flight.h)

  ~NcclWork() override {
    // Scratch goes back to the caching allocator, which hands it out in the current stream's
    // order: that stream must not run ahead of the operation still reading it.
    if (keep && !ordered) cudaStreamWaitEvent(compute_stream(), event, 0);
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
  // label and members: its name and world ranks in the flight recorder (flight.h).
  NcclCommunicator(ncclComm_t comm, int local_rank, int local_size, std::shared_ptr<Lane> lane,
                   const std::string& label, std::vector<int> members)
      : comm_(comm), handle_(enrol(comm)), lane_(std::move(lane)), stream_(lane_->stream),
        flight_(flight::enrol(label, std::move(members))) {
    int n = 0, r = 0;
    check_nccl(ncclCommCount(comm_, &n), "comm count");
    check_nccl(ncclCommUserRank(comm_, &r), "comm rank");
    size_ = n;
    rank_ = r;
    local_rank_ = local_rank;
    local_size_ = local_size;
  }
  // Its operations end with the lane's; an aborted communicator is already freed. (The barrier's
  // scratch goes back to the cache after this body, once the lane has passed its operations.)
  ~NcclCommunicator() override {
    if (!handle_->aborted.exchange(true)) {
      try {
        cuda::stream_synchronize(Stream{stream_}, "the NCCL stream's last operations");
        ncclCommDestroy(comm_);
      } catch (const std::exception&) {
        ncclCommAbort(comm_);
      }
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
  // a broadcast from each rank of its block.
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
  // The new communicator shares this one's lane (see the file comment).
  std::shared_ptr<Communicator> split(int color, int key) override {
    ncclComm_t sub = nullptr;
    {
      watchdog::Scope scope("NCCL communicator split", 0);
      check_nccl(ncclCommSplit(comm_, color, key, &sub, nullptr), "split");
    }
    return std::make_shared<NcclCommunicator>(sub, local_rank_, local_size_, lane_,
                                              flight::split_label(flight_, color), std::vector<int>{});
  }

 private:
  template <typename Call>
  Work enqueue(const char* what, size_t bytes, Mode mode, Call call, std::shared_ptr<void> keep = {}) {
    check_cuda(cudaEventRecord(lane_->ready, compute_stream()), "event record");  // the inputs' producers
    check_cuda(cudaStreamWaitEvent(stream_, lane_->ready, 0), "stream wait");
    const std::string_view kind(what);  // send, recv, send_recv: point to point
    const flight::Ticket t = flight::issue(flight_, what, bytes, kind == "send" || kind == "recv" || kind == "send_recv");
    check_nccl(call(), what);
    auto w = std::make_shared<NcclWork>();
    w->ticket = t;
    w->pool = lane_->events;
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

  ncclComm_t comm_;
  std::shared_ptr<Handle> handle_;
  std::shared_ptr<Lane> lane_;
  cudaStream_t stream_;
  int flight_;
  Tensor scratch_;  // the barrier's
};

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, bool mpi_initialized) {
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  ncclUniqueId id;
  if (mpi_initialized) {
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    MPI_Comm node;
    MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
    if (rank == 0) check_nccl(ncclGetUniqueId(&id), "unique id");
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm);
  } else {
    check_nccl(ncclGetUniqueId(&id), "unique id");
  }
  ncclComm_t c = nullptr;
  {
    watchdog::Scope scope("NCCL communicator set-up", 0);
    check_nccl(ncclCommInitRank(&c, size, id, rank), "init");
  }
  std::vector<int> members(static_cast<size_t>(size));  // comm is MPI_COMM_WORLD (Runtime::world)
  for (int r = 0; r < size; ++r) members[r] = r;
  return std::make_shared<NcclCommunicator>(c, local_rank, local_size, std::make_shared<Lane>(), "nccl world",
                                            std::move(members));
}

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  if (v < 10000) return fmt::format("{}.{}.{}", v / 1000, v / 100 % 10, v % 100);  // before 2.9: XYZZ
  return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);                // since: XYYZZ
}

void nccl_check_async_errors(const char* what) {
  Registry& reg = registry();
  if (reg.aborting.load()) return;  // the job is ending: the communicators are being aborted
  std::vector<std::shared_ptr<Handle>> live;
  {
    std::lock_guard lock(reg.mu);
    live = reg.live;
  }
  for (const auto& h : live) {
    ncclResult_t r = ncclSuccess;
    if (h->aborted.load() || ncclCommGetAsyncError(h->comm, &r) != ncclSuccess) continue;
    if (r == ncclSuccess || r == ncclInProgress) continue;
    const std::string detail = ncclGetLastError(h->comm);
    abort_all();
    fail("NCCL failed while waiting for {}: {}{}; a peer rank has probably died or the network failed", what,
         ncclGetErrorString(r), detail.empty() ? "" : " (" + detail + ")");
  }
}

}  // namespace dtk::comm
