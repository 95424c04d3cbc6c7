// comm-bench's engine: for every collective and size, check the results, time the operation,
// agree on the numbers across ranks, and report them (table or JSON) from rank 0.
#pragma once
#include <cstdint>
#include <vector>

#include "collectives.h"
#include "dtk/comm/comm.h"

namespace dtk::bench {

enum class TimeAgg { mean, min, max };

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
};

std::vector<uint64_t> sweep_sizes(const Options& o);

// Returns the exit code: 0, or 1 when any element was wrong.
int run_benchmark(comm::Runtime& rt, const Options& o);

}  // namespace dtk::bench
