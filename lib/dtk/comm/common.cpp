// Names, argument checks and launcher detection shared by every backend.
#include <cstdlib>
#include <string>

#include "dtk/comm/comm.h"
#include "dtk/core/error.h"
#include "dtk/core/tensor.h"

namespace dtk::comm {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

ReduceOp parse_reduce_op(std::string_view s) {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min})
    if (reduce_op_name(op) == s) return op;
  fail_usage("unknown reduction '" + std::string(s) + "' (expected sum, avg, max or min)");
}

std::string_view backend_name(Backend b) { return name_of(b); }

Backend parse_backend(std::string_view s) { return parse_enum<Backend>(s, "--backend"); }

void wait_all(std::vector<Work>& works) {
  for (auto& w : works) w.wait();
  works.clear();
}

std::vector<Range> min_max_over_ranks(Communicator& comm, const std::vector<double>& values, Device d) {
  const size_t n = values.size();
  std::vector<double> both(2 * n);
  for (size_t i = 0; i < n; ++i) {
    both[i] = values[i];
    both[n + i] = -values[i];
  }
  Tensor t = Tensor::from_doubles(both, {static_cast<int64_t>(2 * n)}, DType::f64, d);
  const Buffer b{t.data(), 2 * n, DType::f64, d};
  comm.all_reduce(b, b, ReduceOp::max, Mode::sync).wait();
  const std::vector<double> r = t.to_doubles();
  std::vector<Range> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = {-r[n + i], r[i]};
  return out;
}

void Communicator::check_counts(const char* op, const Buffer& send, const Buffer& recv, size_t send_count,
                                size_t recv_count) const {
  if (send.dtype != recv.dtype) fail_usage(std::string(op) + ": send and receive buffers differ in dtype");
  if (send.count != send_count || recv.count != recv_count)
    fail_usage("{}: expected {} elements to send and {} to receive on {} ranks, got {} and {}", op, send_count,
               recv_count, size_, send.count, recv.count);
  if (!accepts(send.device) || !accepts(recv.device))
    fail_usage(std::string(op) + ": the " + std::string(backend_name(backend())) +
               " backend cannot use buffers on " + send.device.str());
}

void Communicator::check_root(const char* op, int root) const {
  if (root < 0 || root >= size_)
    fail_usage("{}: root {} is not a rank of a world of {}", op, root, size_);
}

std::string_view launcher_name(Launcher l) {
  switch (l) {
    case Launcher::singleton: return "singleton";
    case Launcher::openmpi: return "mpiexec (Open MPI)";
    case Launcher::mpich: return "mpiexec (MPICH/PMI)";
    case Launcher::srun: return "srun";
  }
  return "?";
}

Launcher detect_launcher() {
  auto has = [](const char* v) { return std::getenv(v) != nullptr; };
  if (has("OMPI_COMM_WORLD_SIZE")) return Launcher::openmpi;
  const bool slurm_step = has("SLURM_STEP_ID") && has("SLURM_PROCID");
  if (slurm_step) return Launcher::srun;
  if (has("PMI_RANK") || has("PMI_SIZE") || has("PMIX_RANK")) return Launcher::mpich;
  return Launcher::singleton;
}

}  // namespace dtk::comm
