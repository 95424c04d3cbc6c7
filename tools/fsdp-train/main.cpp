// fsdp-train: fully sharded data-parallel training after SimpleFSDP (see man fsdp-train).
#include <algorithm>

#include "dtk/cli/checks.h"
#include "dtk/cli/cli.h"
#include "dtk/ops/kernels.h"
#include "dtk/train/command_line.h"
#include "dtk/compress/auto.h"
#include "dtk/core/error.h"
#include "dtk/optim/shampoo.h"
#include "dtk/parallel/diloco.h"
#include "dtk/parallel/fsdp.h"
#include "dtk/train/trainer.h"

namespace {
using namespace dtk;

struct Args {
  train::Options train;
  parallel::FsdpConfig fsdp;
  optim::ShampooConfig shampoo;
  train::CompressorOptions compressor;
  train::SyncOptions sync;
  double bucket_memory_mb = 0;
  bool no_overlap = false;
};

cli::Program program(Args& a) {
  cli::Program p;
  p.name = "fsdp-train";
  p.marks_launch = true;  // after the first step (train::run)
  p.cpu_kernels = ops::select_cpu_kernels;
  p.description =
      "Fully sharded data-parallel training after SimpleFSDP (Zhang et al., 2024): every rank keeps a dim-0 shard "
      "of each parameter in f32 with its gradient and optimizer state; a bucket of blocks is all-gathered (bf16 by "
      "default) before it computes and its gradients reduce-scattered after its backward, bucketed and reordered so "
      "that communication hides behind compute.";
  p.footer =
      train::metrics_help(
          {train::MetricSource::sharded, train::MetricSource::compression, train::MetricSource::auto_compression,
           train::MetricSource::shampoo, train::MetricSource::outer}) +
      "Exit status: 0 done, 1 a failure while training, 2 bad usage or bad input, " + cli::kExitStoppedHelp + ".\n"
      "Example: mpiexec -n 4 fsdp-train --model llama-small --buckets auto --activation-checkpointing --steps 300";
  p.add_options = [&a](CLI::App& app) {
    train::Options& o = a.train;
    parallel::FsdpConfig& c = a.fsdp;
    train::add_options(app, o);
    app.remove_option(app.get_option("--bucket-size"));  // the replicated all-reduce's; FSDP buckets by --buckets
    train::add_shampoo_options(app, a.shampoo);
    a.compressor.compressor.kind = compress::Kind::none;  // today's HSDP unless asked
    train::add_compressor_options(app, a.compressor,
                                  "HSDP's plain all-reduce across the replica groups (--sync: the pseudo-gradients' mean)");
    train::add_sync_options(app, a.sync, false);  // the replicas are the --replicate groups
    const char* g = "Sharding";
    cli::add_enum(app, "--param-dtype", c.param_dtype, "parameters all-gathered in this precision (--precision bf16 computes with them as gathered; f32 and tf32 upcast)",
                  {DType::bf16, DType::f32})->group("Precision");
    cli::add_enum(app, "--reduce-dtype", c.reduce_dtype, "gradients reduce-scattered in this precision",
                  {DType::f32, DType::bf16})->group("Precision");
    cli::add_enum(app, "--reshard-after-forward", c.reshard_after_forward,
                  "free gathered parameters after forward and gather again in backward: default (every bucket but "
                  "the last), always or never")->group(g);
    app.add_option("--prefetch", c.prefetch, "buckets gathered ahead of the one computing (forward and backward)")
        ->group(g)->check(cli::at_least(0));
    app.add_option("--buckets", c.buckets,
                   "param (a collective per parameter), block (one per block), N (N blocks per bucket), auto "
                   "(planned from measured costs) or a plan file (JSON, as --print-plan writes)")->group(g);
    cli::add_size(app, "--bucket-memory", c.bucket_memory,
                  "auto: the largest gathered bucket (default: twice the largest block's)")->group(g);
    app.add_option("--replicate", c.replicate,
                   "HSDP: R groups of N/R ranks, sharded within, replicated across (--sync: the replicas that "
                   "synchronise as it says)")
        ->group(g)->check(cli::at_least(1));
    app.add_flag("--no-overlap", a.no_overlap, "issue every collective when needed and wait at once (the baseline)")
        ->group(g);
    app.add_flag("--keep-unsharded-grad", c.keep_unsharded_grad,
                 "with --micro-batch: keep the whole f32 gradient across micro-batches and reduce-scatter once a "
                 "step (fewer collectives; every rank holds the whole model's gradient, as DDP does)")->group(g);
  };
  p.validate = [&a](comm::Runtime& rt) -> cli::Work {
    // The plan comes after two timed steps; --compressor auto's after its first decision, at
    // --start-iter; --sync-every auto's after its timed steps.
    const bool is_auto = a.compressor.compressor.kind == compress::Kind::auto_;
    parallel::OuterConfig outer = a.sync.config();
    const bool local_sgd = outer.sync != parallel::Sync::every_step;
    const int64_t plan_steps = std::max<int64_t>({3, is_auto ? a.compressor.compressor.start_iter + 2 : 0,
                                                  local_sgd && outer.every == 0 ? parallel::kAutoEverySteps + 1 : 0});
    const train::ResolvedRun r = a.train.runtime.print_plan ? train::validate_plan_only(a.train, plan_steps, rt.size())
                                                            : train::validate(a.train, rt.size());
    const train::Options& o = r.options;
    parallel::FsdpConfig c = a.fsdp;
    c.overlap = !a.no_overlap;
    c.print_plan = o.runtime.print_plan;  // measured, for the prediction it prints
    parallel::validate(c, rt.size());
    compress::Config cc = a.compressor.config(o.data.seed);
    const bool shampoo = o.optimization.optimizer == optim::Kind::shampoo;
    if (local_sgd) {
      // DiLoCo across the --replicate groups; each shards the model within as FSDP does.
      outer.group = rt.size() / c.replicate;
      parallel::validate_sync(outer, cc.kind, shampoo, rt.size());
      if (a.compressor.start_iter->count() == 0) cc.start_iter = 0;  // outer steps: compressed from the first
      if (o.resumed && o.resumed->metadata().world_size == rt.size()) {
        const nlohmann::json was = o.resumed->metadata().extra.value("program_config", nlohmann::json::object());
        if (const int before = was.value("replicate", 1); before != c.replicate)
          fail_usage("--replicate {} differs from the checkpoint's {} ({}): with --sync each rank's local weights and "
                     "inner optimizer state are its own; resume with --replicate {}, or on another number of ranks (a "
                     "new round from the outer weights)", c.replicate, before, o.resumed->arg, before);
      }
    } else {
      parallel::validate_compressor(cc, c.replicate, c.buckets);
    }
    if (comm::CostModel link; cc.kind == compress::Kind::auto_ || (local_sgd && outer.every == 0))
      compress::auto_link_from_env(link);  // malformed: exit 2 now
    std::optional<compress::Config> compressor;
    if (cc.kind != compress::Kind::none) compressor = cc;
    // Shampoo's blocks are split over the shard group (parallel/parallelism.h, optimizer_comm).
    train::Strategy s = train::strategy("fsdp-train", o, rt.size() / c.replicate, a.shampoo);
    s.config = c;
    if (o.optimization.optimizer == optim::Kind::shampoo) s.config["shampoo"] = s.optimizer_config;
    // The sharded placement: the model's parameters live in its shards.
    s.storage = nn::Storage::external;
    if (compressor) s.config["compressor"] = *compressor;
    if (local_sgd) {
      s.config["sync"] = outer;
      s.parallelism = [c, compressor, outer](nn::Model& model, comm::Communicator& world, comm::Communicator& host) {
        parallel::FsdpConfig within = c;
        within.replicate = 1;
        const parallel::InnerPlacement inner = [&model, within](comm::Communicator& group, comm::Communicator& group_host) {
          return std::make_unique<parallel::Fsdp>(model, group, group_host, within);
        };
        return std::make_unique<parallel::DiLoCo>(model, outer, compressor, world, host, inner);
      };
    } else {
      // Dion's factors aggregate its matrices across the replica groups: HSDP's all-reduce leaves them out.
      const optim::ShampooConfig sc = train::shampoo_config(o, a.shampoo);
      s.parallelism = [c, compressor, shampoo, sc](nn::Model& model, comm::Communicator& world, comm::Communicator& host) {
        return std::make_unique<parallel::Fsdp>(model, world, host, c, compressor,
                                                shampoo ? optim::dion_local_gradients(sc, model.params()) : std::vector<char>{});
      };
    }
    return [r, s](comm::Runtime& rt) { return train::run(r, s, rt); };
  };
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  return dtk::cli::main(argc, argv, program(a));
}
