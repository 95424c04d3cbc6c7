// comm-bench's engine: for every collective and size, check the results, time the operation,
// agree on the numbers across ranks, and report them (table or JSON) from rank 0.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "collectives.h"
#include "dtk/comm/comm.h"

namespace dtk::bench {

enum class TimeAgg { mean, min, max };

// A testing aid (DTK_COMM_BENCH_DELAY_RANK=RANK:MICROSECONDS): rank `rank` sleeps `us` before
// each timed iteration, as a rank slowed by its own work would, so that the straggler report has
// a known straggler to name. rank -1: none.
struct Delay {
  int rank = -1;
  double us = 0;
};
inline constexpr const char* kDelayEnv = "DTK_COMM_BENCH_DELAY_RANK";
// The value of kDelayEnv (nullptr or empty: none) for a job of `nranks`; UsageError naming the
// variable when it is not RANK:MICROSECONDS with a rank of the job and a non-negative time.
Delay parse_delay(const char* value, int nranks);

struct Options {
  std::vector<const Collective*> ops;
  uint64_t min_bytes = 8, max_bytes = 64ull << 20;
  double factor = 2;   // next size = size * factor, unless step > 0
  uint64_t step = 0;   // next size = size + step
  int iters = 20, warmup = 5, check = 1;
  DType dtype = DType::f32;
  comm::ReduceOp redop = comm::ReduceOp::sum;
  int root = 0;
  comm::Backend backend = comm::Backend::automatic;
  Device device = Device::cpu();
  bool inplace = false, json = false, async = false;
  TimeAgg agg = TimeAgg::mean;
  bool fit = false;                // fit time = alpha + bytes / bandwidth per collective (comm/cost.h)
  std::vector<uint64_t> predict;   // sizes to predict with the fit
  std::string iters_json;          // every iteration's time on every rank, written by rank 0
  Delay delay;
};

std::vector<uint64_t> sweep_sizes(const Options& o);

// Returns the exit code: 0, or 1 when any element was wrong.
int run_benchmark(comm::Runtime& rt, const Options& o);

}  // namespace dtk::bench
