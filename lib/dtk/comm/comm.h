// Communicator: collectives over MPI (host buffers; device buffers staged through pinned host
// memory), NCCL (device buffers, own CUDA stream) or a local world of one.
//
// Every collective returns a Work handle. Mode::async starts the operation and returns at once
// (MPI nonblocking collectives, or an enqueue on NCCL's stream); Mode::sync completes it before
// returning, the host included (MPI's blocking collectives: the fastest path for small
// messages; NCCL: the host waits for the stream). Operations are started in program order,
// which must be the same on every rank, as with MPI and NCCL.
//
// Completion, the same contract on every backend:
// - Work::wait(): the results are ready for what the caller does next: the host may read host
//   buffers, and work queued next on the caller's current CUDA stream sees device buffers. MPI
//   (and staged device buffers) block the host until completion. NCCL makes the current stream
//   wait for the operation (an event) and returns at once, as PyTorch's Work.wait() does: the
//   host runs ahead and keeps the GPU fed. Time it with a StreamTimer (core/tensor.h), not the
//   host clock.
// - Work::synchronize(): the host blocks until the operation has completed, on every backend
//   (a host-side timing, a device result read from the host without a stream).
// Every host wait, including the host's waits for the GPU (cuda::wait_event), runs under the
// watchdog (watchdog.h): a wait longer than the runtime's timeout ends the job with one line
// naming the rank and the operation; while the host waits for the GPU, NCCL's asynchronous
// errors are polled, and a communicator that failed ends the job the same way. When a rank dies,
// the launcher (mpiexec, srun) ends the others.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dtk/core/device.h"
#include "dtk/core/dtype.h"
#include "dtk/core/enums.h"
#include "dtk/core/tensor.h"

namespace dtk::comm {

enum class ReduceOp { sum, avg, max, min };
enum class Backend { automatic, mpi, nccl, local };
DTK_ENUM_NAMES(Backend, {Backend::automatic, "auto"}, {Backend::mpi, "mpi"}, {Backend::nccl, "nccl"},
               {Backend::local, "local"})
enum class Mode { async, sync };

std::string_view reduce_op_name(ReduceOp op);
ReduceOp parse_reduce_op(std::string_view s);
std::string_view backend_name(Backend b);   // name_of
Backend parse_backend(std::string_view s);  // parse_enum: "unknown backend ..."

// A typed view of memory. count is in elements of dtype.
struct Buffer {
  void* data = nullptr;
  size_t count = 0;
  DType dtype = DType::f32;
  Device device{};

  size_t bytes() const { return count * dtype_size(dtype); }
  Buffer slice(size_t offset, size_t n) const {
    return {static_cast<char*>(data) + offset * dtype_size(dtype), n, dtype, device};
  }
};

// All of a (contiguous) tensor, where it lives.
inline Buffer buffer_of(const Tensor& t) { return {t.data(), static_cast<size_t>(t.numel()), t.dtype(), t.device()}; }

// A handle on an operation in flight. Copyable; wait() and synchronize() are idempotent.
// [[nodiscard]]: an async operation is waited where its result is needed; a sync call's Work is
// complete already (`.wait()` on it does nothing: the way to discard it). Dropping the last copy
// of an async Work unwaited is safe but serialises: NCCL's makes the stream that issued it wait
// for it (so that stream's later work, the caching allocator's reuse of scratch included, never
// runs ahead of it), MPI's completes it on the host (an operation of the communication thread
// completes there, in order, but the caller is not ordered after it).
class [[nodiscard]] Work {
 public:
  struct State {
    virtual ~State() = default;
    virtual bool test() = 0;  // true when complete (and finished)
    virtual void wait() = 0;  // see the file comment
    virtual void synchronize() { wait(); }  // the host blocks until complete (backends whose wait does not)
  };
  Work() = default;  // a completed operation
  explicit Work(std::shared_ptr<State> s) : state_(std::move(s)) {}
  void wait() {
    if (state_) {
      state_->wait();
      state_.reset();
    }
  }
  void synchronize() {
    if (state_) {
      state_->synchronize();
      state_.reset();
    }
  }
  bool test() {
    if (state_ && state_->test()) state_.reset();
    return !state_;
  }

 private:
  std::shared_ptr<State> state_;
};

void wait_all(std::vector<Work>& works);

class Communicator {
 public:
  virtual ~Communicator() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  virtual Backend backend() const = 0;
  // Where this communicator's buffers may live: nccl needs device buffers; mpi and local take both.
  virtual bool accepts(const Device& d) const = 0;

  // recv.count == send.count; in place when send.data == recv.data. avg of integers truncates.
  virtual Work all_reduce(Buffer send, Buffer recv, ReduceOp op, Mode mode = Mode::async) = 0;
  // send.count == size() * recv.count; rank r receives the reduction of block r.
  // In place when recv.data == send block rank().
  virtual Work reduce_scatter(Buffer send, Buffer recv, ReduceOp op, Mode mode = Mode::async) = 0;
  // recv.count == size() * send.count; in place when send.data == recv block rank().
  virtual Work all_gather(Buffer send, Buffer recv, Mode mode = Mode::async) = 0;
  // Uneven variants: counts[r] elements for rank r, packed in rank order in the full buffer.
  virtual Work reduce_scatter_v(Buffer send, Buffer recv, const std::vector<size_t>& counts, ReduceOp op,
                                Mode mode = Mode::async) = 0;
  virtual Work all_gather_v(Buffer send, Buffer recv, const std::vector<size_t>& counts,
                            Mode mode = Mode::async) = 0;
  virtual Work broadcast(Buffer buf, int root, Mode mode = Mode::async) = 0;
  // send.count == recv.count == size() * block; block r of send goes to rank r.
  virtual Work all_to_all(Buffer send, Buffer recv, Mode mode = Mode::async) = 0;
  // Point to point. NCCL matches by order, not tag; a ring (everyone sends to the next and
  // receives from the previous) must use send_recv, which NCCL runs as one group.
  virtual Work send(Buffer buf, int peer, int tag = 0, Mode mode = Mode::async) = 0;
  virtual Work recv(Buffer buf, int peer, int tag = 0, Mode mode = Mode::async) = 0;
  virtual Work send_recv(Buffer send, int dst, Buffer recv, int src, int tag = 0, Mode mode = Mode::async) = 0;
  virtual Work barrier(Mode mode = Mode::sync) = 0;

  // Ranks with the same colour form a new communicator, ordered by key (then by rank).
  virtual std::shared_ptr<Communicator> split(int color, int key) = 0;

 protected:
  void check_counts(const char* op, const Buffer& send, const Buffer& recv, size_t send_count,
                    size_t recv_count) const;
  void check_root(const char* op, int root) const;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
};

// The minimum and maximum over the ranks of each value: one max all-reduce of (v, -v) in a
// buffer on `d`, so it runs on every backend (NCCL needs device memory). The values agree on
// every rank iff min == max. Collective.
struct Range {
  double min = 0, max = 0;
};
std::vector<Range> min_max_over_ranks(Communicator& comm, const std::vector<double>& values, Device d);

// A world of one (the local backend): this rank alone, buffers on any device, every collective a
// copy. Made locally, without the other ranks (no collective split).
std::shared_ptr<Communicator> make_local_communicator();

// Where a rank computes: its host, its GPU's UUID (cuda::device_uuid), the index it uses and
// how many GPUs it sees.
struct GpuPlacement {
  std::string host, uuid;
  int index = 0, visible = 0;
};
// The one-line problem when two ranks of a host would drive the same physical GPU (NCCL
// refuses that: "Duplicate GPU detected"), naming them and what to do; empty when every rank has
// its own. Indices alone do not tell: ranks given their own CUDA_VISIBLE_DEVICES (srun
// --gpus-per-task=1) all use index 0 of different GPUs. placements[r] is rank r's.
std::string shared_gpu_problem(const std::vector<GpuPlacement>& placements);

// Where a rank runs: its host name and what tells hosts apart when names repeat (the kernel's
// boot id and the rank's network namespace; empty where /proc does not say).
struct HostIdentity {
  std::string name, machine;
};
// The one-line problem when two ranks report one host name from different hosts (other boot ids
// or network namespaces: cloned machines, netlab's namespaces): Open MPI 4.1 crashes splitting
// such ranks by host (SIGSEGV in ob1's match callback inside MPI_Comm_split_type, a bare MPI
// program included), and dtk counts a host's ranks and reaches its peers by name; empty when
// names and hosts agree. hosts[r] is rank r's.
std::string repeated_host_name_problem(const std::vector<HostIdentity>& hosts);

// The host's wait for the GPU, which Runtime installs as cuda::set_wait_hook (see the file
// comment): polls done(event) under the watchdog and, while NCCL communicators live, their
// asynchronous errors. Public for tests.
void wait_for_device(const char* what, size_t bytes, bool (*done)(void*), void* event);

// NCCL's version as "2.28.3" (the library loaded, not the header built against), or "none" in
// a build without NCCL.
std::string nccl_version();

// How the process was started.
enum class Launcher { singleton, openmpi, mpich, srun };
std::string_view launcher_name(Launcher l);
Launcher detect_launcher();

// The process-wide communication runtime: MPI set-up and tear-down, the watchdog, and the
// world communicators. One per process, created first in main and destroyed last.
class Runtime {
 public:
  struct Options {
    double timeout_s = 600;  // a wait longer than this ends the job
  };
  Runtime(int* argc, char*** argv, Options opts);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  static Runtime& get();
  // UsageError when the launch is broken: srun started N > 1 tasks without PMIx (Open MPI; MPI
  // is then not initialised), MPI sees a world of 1 in each, or two hosts share a name
  // (repeated_host_name_problem; the same line on every rank).
  void check_launch() const;  // the one runtime (error when none exists)

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }  // ranks on this host (by host name)
  Launcher launcher() const { return launcher_; }
  bool mpi_initialized() const { return mpi_; }
  double timeout_s() const { return opts_.timeout_s; }
  void set_timeout(double timeout_s);

  // The world communicator of a backend (created on first use, then shared). automatic gives nccl
  // for a cuda device when NCCL and a GPU exist, mpi when MPI runs, local otherwise. nccl refuses
  // (UsageError, the same line on every rank) a rank without a GPU and two ranks of a host on
  // one GPU (gpu_sharing). Collective for nccl.
  std::shared_ptr<Communicator> world(Backend b = Backend::automatic, Device d = Device::cpu());
  Backend resolve(Backend b, Device d) const;
  // The device this rank computes on for `d`: a cuda device becomes GPU local_rank % (GPUs this
  // rank sees), made current; UsageError without one. The cpu as it is.
  Device bind_device(Device d);
  // Why NCCL cannot run over these ranks' GPUs (shared_gpu_problem over every rank's bound GPU;
  // the same line on every rank), or empty. Collective.
  std::string gpu_sharing();

  // Small host-side agreements over the whole job (exit codes, headers); no-ops in a world of one.
  int max_over_ranks(int v);
  int broadcast_int(int v, int root);
  std::vector<std::string> gather_strings(const std::string& mine);  // each at most 255 chars
  static std::string hostname();
  // Ends every rank now with this exit code (MPI_Abort when more than one rank runs).
  [[noreturn]] void abort(int code);
  // Tears the runtime down (the destructor calls it with 0) for a process that exits with `code`
  // right after (cli::main, with _exit). For a code other than 0 each rank, done with
  // MPI_Finalize, waits up to kLeaveTogetherS for every other rank to be done too
  // (side::leave_together): Open MPI's mpiexec ends a job at the first non-zero exit and kills
  // (SIGTERM, 1 s later) the ranks still inside MPI_Finalize, which waits there on mpiexec.
  void finish(int code);
  static constexpr double kLeaveTogetherS = 10;

 private:
  void init_mpi();
  Options opts_;
  Launcher launcher_;
  bool mpi_ = false, finished_ = false;
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  int runtime_comm_ = -1;  // the flight recorder's id of the runtime's own calls (flight.h)
  std::shared_ptr<Communicator> mpi_world_, nccl_world_, local_world_;
  std::string host_problem_;  // repeated_host_name_problem at MPI's start
  int* argc_;
  char*** argv_;
};

}  // namespace dtk::comm
