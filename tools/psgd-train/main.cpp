// psgd-train: data-parallel training with PowerSGD gradient compression (see man psgd-train).
#include "dtk/cli/checks.h"
#include "dtk/cli/cli.h"
#include "dtk/ops/kernels.h"
#include "dtk/train/command_line.h"
#include "dtk/compress/auto.h"
#include "dtk/compress/compressor.h"
#include "dtk/core/error.h"
#include "dtk/parallel/data_parallel.h"
#include "dtk/parallel/diloco.h"
#include "dtk/train/trainer.h"

#include <algorithm>
#include <optional>

namespace {
using namespace dtk;

struct Args {
  train::Options train;
  train::CompressorOptions compressor;
  train::SyncOptions sync;
};

cli::Program program(Args& a) {
  cli::Program p;
  p.name = "psgd-train";
  p.marks_launch = true;  // after the first step (train::run)
  p.cpu_kernels = ops::select_cpu_kernels;
  p.description =
      "Data-parallel training with PowerSGD gradient compression (Vogels et al., 2019): rank-r power iteration "
      "with warm start and error feedback, aggregated by all-reduce; plain, top-k, random-k and signum "
      "aggregation as baselines.";
  p.footer = train::metrics_help({train::MetricSource::compression, train::MetricSource::auto_compression,
                                   train::MetricSource::shampoo, train::MetricSource::outer}) +
             "Exit status: 0 done, 1 a failure while training, 2 bad usage or bad input, " + cli::kExitStoppedHelp +
             ".\n"
             "Example: mpiexec -n 4 psgd-train --model llama-tiny --data synthetic --compressor powersgd --rank 2 "
             "--steps 300";
  p.add_options = [&a](CLI::App& app) {
    train::add_options(app, a.train);
    train::add_compressor_options(app, a.compressor, "bucketed all-reduce");
    train::add_sync_options(app, a.sync, true);
  };
  p.validate = [&a](comm::Runtime& rt) -> cli::Work {
    const bool is_auto = a.compressor.compressor.kind == compress::Kind::auto_;
    const parallel::OuterConfig outer = a.sync.config();
    const bool local_sgd = outer.sync != parallel::Sync::every_step;
    if (a.train.runtime.print_plan && !is_auto && !local_sgd && a.train.optimization.optimizer != optim::Kind::shampoo)
      fail_usage("--print-plan: psgd-train makes a plan with --compressor auto (its decisions), --sync diloco|streaming "
                 "(its fragments) or --optimizer shampoo");
    // auto's plan is made at step --start-iter and printed before the next one; --sync-every
    // auto's after its timed steps; the others' at once.
    const int64_t plan_steps = is_auto                       ? a.compressor.compressor.start_iter + 2
                               : local_sgd && outer.every == 0 ? parallel::kAutoEverySteps + 1
                                                               : 1;
    const train::ResolvedRun r = a.train.runtime.print_plan ? train::validate_plan_only(a.train, plan_steps, rt.size())
                                                            : train::validate(a.train, rt.size());
    const train::Options& o = r.options;
    compress::Config c = a.compressor.config(o.data.seed);
    if (comm::CostModel link; is_auto || (local_sgd && outer.every == 0)) compress::auto_link_from_env(link);  // malformed: exit 2 now
    train::Strategy s = train::strategy("psgd-train", o, rt.size());
    if (local_sgd) {
      parallel::validate_sync(outer, c.kind, o.optimization.optimizer == optim::Kind::shampoo, rt.size());
      if (a.compressor.start_iter->count() == 0) c.start_iter = 0;  // outer steps: compressed from the first
      std::optional<compress::Config> outer_c;
      if (c.kind != compress::Kind::none) outer_c = c;
      s.parallelism = [outer, outer_c, bucket_bytes = o.runtime.bucket_bytes](nn::Model& model, comm::Communicator& world,
                                                                             comm::Communicator& host) {
        // Within a replica (a sync group) plain data parallelism.
        const parallel::InnerPlacement inner = [&model, bucket_bytes](comm::Communicator& group, comm::Communicator&) {
          return std::make_unique<parallel::GradSync>(model, group, bucket_bytes);
        };
        return std::make_unique<parallel::DiLoCo>(model, outer, outer_c, world, host, inner);
      };
    } else if (c.kind != compress::Kind::none) {
      // The replicated placement with the compressor, its buckets of --bucket-size.
      s.parallelism = [c, bucket_bytes = o.runtime.bucket_bytes](nn::Model& model, comm::Communicator& world, comm::Communicator&) {
        return std::make_unique<parallel::GradSync>(model, world,
                                                    compress::make_compressor(c, world, model.params(), bucket_bytes));
      };
    }
    s.config = c;
    if (local_sgd) s.config["sync"] = outer;
    return [r, s](comm::Runtime& rt) { return train::run(r, s, rt); };
  };
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  return dtk::cli::main(argc, argv, program(a));
}
