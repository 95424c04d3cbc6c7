// The process-wide runtime: MPI set-up (only when a launcher started us, or a backend needs it),
// launcher checks, the watchdog and the world communicators.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/comm/flight.h"
#include "dtk/comm/mpi/mpi_comm.h"
#include "dtk/comm/side_channel.h"
#include "dtk/comm/watchdog.h"
#include "dtk/core/error.h"
#include "dtk/core/tensor.h"
#ifdef DTK_HAVE_NCCL
#include "dtk/comm/nccl/nccl_comm.h"
#endif

namespace dtk::comm {
namespace {
Runtime* g_runtime = nullptr;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

int srun_tasks() { return env_int("SLURM_STEP_NUM_TASKS", env_int("SLURM_NTASKS", 1)); }

// What tells this host from another of the same name: the kernel's boot id and this process's
// network namespace.
std::string machine_identity() {
  std::string id;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {0};
    if (std::fgets(buf, sizeof buf, f)) id = std::string(buf, strcspn(buf, "\n"));
    std::fclose(f);
  }
  char ns[64] = {0};
  if (readlink("/proc/self/ns/net", ns, sizeof ns - 1) > 0) id += std::string(" ") + ns;
  return id;
}

// srun started several tasks without PMIx (no --mpi=pmix: --mpi=none, or pmi2): Open MPI can
// only fail inside MPI_Init then (exit 1, a screenful), so dtk says it first.
bool srun_without_pmix() {
#ifdef OPEN_MPI
  return srun_tasks() > 1 && std::getenv("PMIX_RANK") == nullptr;
#else
  return false;
#endif
}
}  // namespace

void wait_for_device(const char* what, size_t bytes, bool (*done)(void*), void* event) {
  watchdog::Scope scope(what, bytes);
  // Spin a little (short kernels end within microseconds), then sleep longer and longer up to
  // 200 us, looking at NCCL's errors between sleeps: the waiting host costs next to no CPU and
  // answers within a fraction of a step.
  constexpr int kSpins = 64;
  for (int i = 0; !done(event); ++i) {
    if (i < kSpins) {
      std::this_thread::yield();
      continue;
    }
    if (watchdog::ending()) break;
#ifdef DTK_HAVE_NCCL
    nccl_check_async_errors(what);
#endif
    std::this_thread::sleep_for(std::chrono::microseconds(std::min(200, 1 << std::min(i - kSpins, 8))));
  }
  // The watchdog is ending the job: its expiry aborted NCCL, which ends the kernels this waited
  // for without their results. Nothing may go on from here.
  if (watchdog::ending()) watchdog::park();
}

Runtime::Runtime(int* argc, char*** argv, Options opts)
    : opts_(opts), launcher_(detect_launcher()), argc_(argc), argv_(argv) {
  if (g_runtime) fail("dtk::comm::Runtime: only one runtime per process");
  g_runtime = this;
  if (launcher_ != Launcher::singleton && !(launcher_ == Launcher::srun && srun_without_pmix())) init_mpi();
  watchdog::start(opts_.timeout_s, rank_, size_);
  cuda::set_wait_hook(&wait_for_device);
}

Runtime::~Runtime() {
  finish(0);
  g_runtime = nullptr;
}

void Runtime::finish(int code) {
  if (finished_) return;
  finished_ = true;
  mpi_world_.reset();
  nccl_world_.reset();
  local_world_.reset();
  cuda::set_wait_hook(nullptr);
  watchdog::stop();
  if (mpi_) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
    if (code != 0) side::leave_together(rank_, size_, kLeaveTogetherS);
  }
  side::stop();
}

Runtime& Runtime::get() {
  if (!g_runtime) fail("dtk::comm::Runtime::get: no runtime exists (create one first in main)");
  return *g_runtime;
}

void Runtime::set_timeout(double timeout_s) {
  if (!(timeout_s > 0)) fail_usage("the communication timeout must be positive, got {}", timeout_s);
  opts_.timeout_s = timeout_s;
  watchdog::set_timeout(timeout_s);
}

void Runtime::init_mpi() {
  if (mpi_) return;
  int provided = 0;
  mpi_select_algorithms();
  MPI_Init_thread(argc_, argv_, MPI_THREAD_MULTIPLE, &provided);  // the communication threads (mpi_comm.cpp)
  mpi_ = true;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  // The ranks on this host, by host name: they share its cores and GPUs. (MPI's shared-memory
  // split follows the launcher's node names instead, and SLURM can run several emulated nodes
  // on one host: their ranks then each took every core.)
  constexpr int kName = 256;
  std::vector<char> names(static_cast<size_t>(kName) * size_), mine(kName, 0);
  gethostname(mine.data(), kName - 1);
  MPI_Allgather(mine.data(), kName, MPI_CHAR, names.data(), kName, MPI_CHAR, MPI_COMM_WORLD);
  local_rank_ = local_size_ = 0;
  for (int r = 0; r < size_; ++r)
    if (std::strncmp(names.data() + static_cast<size_t>(r) * kName, mine.data(), kName) == 0) {
      local_rank_ += r < rank_;
      ++local_size_;
    }
  mpi_types_init();
  // The runtime's own calls on MPI_COMM_WORLD, numbered apart from the communicators'.
  std::vector<int> all(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) all[r] = r;
  runtime_comm_ = flight::enrol("runtime", all);
  // The watchdog's side channel (watchdog.h): every rank's host and port.
  if (size_ > 1) {
    const int port = watchdog::open_side_channel();
    std::vector<int> ports(static_cast<size_t>(size_));
    MPI_Allgather(&port, 1, MPI_INT, ports.data(), 1, MPI_INT, MPI_COMM_WORLD);
    std::vector<std::string> hosts;
    for (int r = 0; r < size_; ++r) hosts.emplace_back(names.data() + static_cast<size_t>(r) * kName);
    side::set_peers(hosts, ports, rank_);
    // Before any communicator is split by host (Open MPI crashes there when two hosts share a name).
    std::vector<char> ids(static_cast<size_t>(kName) * size_), id(kName, 0);
    machine_identity().copy(id.data(), kName - 1);
    MPI_Allgather(id.data(), kName, MPI_CHAR, ids.data(), kName, MPI_CHAR, MPI_COMM_WORLD);
    std::vector<HostIdentity> all;
    for (int r = 0; r < size_; ++r) all.push_back({hosts[r], ids.data() + static_cast<size_t>(r) * kName});
    host_problem_ = repeated_host_name_problem(all);
  }
}

std::string repeated_host_name_problem(const std::vector<HostIdentity>& hosts) {
  std::map<std::string, size_t> first;  // host name -> the first rank that reported it with a known machine
  for (size_t r = 0; r < hosts.size(); ++r) {
    const HostIdentity& h = hosts[r];
    if (h.machine.empty()) continue;
    const auto [it, fresh] = first.emplace(h.name, r);
    if (fresh || hosts[it->second].machine == h.machine) continue;
    return fmt::format("ranks {} and {} both run on a host named '{}', but on different hosts (other boot ids or "
                       "network namespaces): Open MPI crashes splitting ranks by host when two hosts share a name, and "
                       "dtk counts a host's ranks by name; give each host its own name (hostname(1); network "
                       "namespaces: a UTS namespace each, unshare --uts)",
                       it->second, r, h.name);
  }
  return "";
}

void Runtime::check_launch() const {
  if (!host_problem_.empty()) fail_usage("{}", host_problem_);
  if (launcher_ == Launcher::srun) {
    const int tasks = srun_tasks();
    if (srun_without_pmix())
      fail_usage("srun started {} tasks without PMIx, which Open MPI needs to join them into one job: run "
                 "`srun --mpi=pmix ...` (SLURM's pmix plugin needs libpmix-dev on the nodes; --mpi=pmi2 does not work "
                 "with Open MPI), or start the job with mpiexec.",
                 tasks);
    if (tasks > 1 && size_ == 1)
      fail_usage("srun started {} tasks but MPI sees a world of 1 in each: this MPI did not reach SLURM's process "
                 "manager. Run `srun --mpi=pmix ...` (see `srun --mpi=list`), or start the job with mpiexec.",
                 tasks);
  }
}

Backend Runtime::resolve(Backend b, Device d) const {
  if (b != Backend::automatic) return b;
#ifdef DTK_HAVE_NCCL
  if (d.is_cuda() && cuda::device_count() > 0) return Backend::nccl;
#else
  (void)d;
#endif
  return mpi_ ? Backend::mpi : Backend::local;
}

std::shared_ptr<Communicator> Runtime::world(Backend b, Device d) {
  switch (resolve(b, d)) {
    case Backend::local:
      if (size_ > 1)
        fail_usage("the local backend is a world of one, but this job has {} ranks", size_);
      if (!local_world_) local_world_ = make_local_communicator();
      return local_world_;
    case Backend::mpi:
      init_mpi();
      if (!mpi_world_) {  // a duplicate: its communication thread never meets the runtime's own calls
        MPI_Comm dup;
        {
          watchdog::Scope scope("the world communicator's set-up", 0);
          MPI_Comm_dup(MPI_COMM_WORLD, &dup);
        }
        mpi_world_ = make_mpi_communicator(dup, true, "world");
      }
      return mpi_world_;
    case Backend::nccl:
#ifdef DTK_HAVE_NCCL
      if (!nccl_world_) {
        // Agreed: every rank raises the same usage error (exit 2) together.
        if (const std::string problem = gpu_sharing(); !problem.empty()) throw AgreedError(problem, 2);
        nccl_world_ = make_nccl_communicator(MPI_COMM_WORLD, mpi_, runtime_comm_);
      }
      return nccl_world_;
#else
      fail_usage("the nccl backend is not in this build (no CUDA or no NCCL at build time); use --backend mpi");
#endif
    case Backend::automatic: break;
  }
  fail("unreachable backend");
}

Device Runtime::bind_device(Device d) {
  if (!d.is_cuda()) return d;
  cuda::require_gpu();
  const Device g = Device::cuda(local_rank_ % cuda::device_count());
  cuda::set_device(g.index);
  return g;
}

std::string Runtime::gpu_sharing() {
  const int n = cuda::device_count();
  if (max_over_ranks(n == 0)) return "the nccl backend needs a GPU per rank, and a rank sees none; use --backend mpi";
  const Device g = bind_device(Device::cuda());
  std::ostringstream mine;
  mine << hostname() << '\t' << cuda::device_uuid(g.index) << '\t' << g.index << '\t' << n;
  std::vector<GpuPlacement> all;
  for (const std::string& s : gather_strings(mine.str())) {
    std::istringstream in(s);
    GpuPlacement p;
    std::getline(in, p.host, '\t');
    std::getline(in, p.uuid, '\t');
    in >> p.index >> p.visible;
    all.push_back(p);
  }
  return shared_gpu_problem(all);
}

std::string shared_gpu_problem(const std::vector<GpuPlacement>& placements) {
  std::map<std::pair<std::string, std::string>, size_t> first;  // (host, GPU) -> the first rank on it
  for (size_t r = 0; r < placements.size(); ++r) {
    const GpuPlacement& p = placements[r];
    const auto [it, fresh] = first.emplace(std::pair{p.host, p.uuid}, r);
    if (fresh) continue;
    return fmt::format("NCCL needs a GPU per rank, but ranks {} and {} on host {} both use GPU {} ({} visible to "
                       "each): start at most {} rank{} per host there, give each rank its own GPU "
                       "(CUDA_VISIBLE_DEVICES, srun --gpus-per-task=1), or use --backend mpi",
                       it->second, r, p.host, p.index, p.visible, p.visible, p.visible == 1 ? "" : "s");
  }
  return "";
}

int Runtime::max_over_ranks(int v) {
  if (!mpi_ || size_ == 1) return v;
  const flight::Ticket t = flight::issue(runtime_comm_, "exit-code agreement", sizeof(int));
  watchdog::Scope scope("exit-code agreement", sizeof(int));
  int out = v;
  MPI_Allreduce(&v, &out, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  flight::complete(t);
  return out;
}

int Runtime::broadcast_int(int v, int root) {
  if (!mpi_ || size_ == 1) return v;
  const flight::Ticket t = flight::issue(runtime_comm_, "broadcast of an int", sizeof(int));
  watchdog::Scope scope("broadcast of an int", sizeof(int));
  MPI_Bcast(&v, 1, MPI_INT, root, MPI_COMM_WORLD);
  flight::complete(t);
  return v;
}

std::vector<std::string> Runtime::gather_strings(const std::string& mine) {
  constexpr size_t kLen = 256;
  std::vector<char> send(kLen, 0), recv(kLen * size_, 0);
  mine.copy(send.data(), kLen - 1);
  if (mpi_ && size_ > 1) {
    const flight::Ticket t = flight::issue(runtime_comm_, "gather of rank names", recv.size());
    watchdog::Scope scope("gather of rank names", recv.size());
    MPI_Allgather(send.data(), kLen, MPI_CHAR, recv.data(), kLen, MPI_CHAR, MPI_COMM_WORLD);
    flight::complete(t);
  } else {
    recv = send;
  }
  std::vector<std::string> out;
  for (int r = 0; r < size_; ++r) out.emplace_back(recv.data() + r * kLen);
  return out;
}

#ifndef DTK_HAVE_NCCL
std::string nccl_version() { return "none"; }
#endif

std::string Runtime::hostname() {
  char buf[256] = {0};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

void Runtime::abort(int code) {
  if (mpi_ && size_ > 1) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

}  // namespace dtk::comm
