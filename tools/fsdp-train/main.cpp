// fsdp-train: fully sharded data-parallel training after SimpleFSDP (see man fsdp-train).
#include "dtk/cli/cli.h"
#include "dtk/core/checks.h"
#include "dtk/core/error.h"
#include "dtk/parallel/fsdp.h"
#include "dtk/train/trainer.h"

namespace {
using namespace dtk;

cli::Program program() {
  static train::Options o;
  static parallel::FsdpConfig c;
  static std::string param_dtype = "bf16", reduce_dtype = "f32", reshard = "default";
  static double bucket_memory_mb = 0;
  static bool no_overlap = false;
  cli::Program p;
  p.name = "fsdp-train";
  p.description =
      "Fully sharded data-parallel training after SimpleFSDP (Zhang et al., 2024): every rank keeps a dim-0 shard "
      "of each parameter in f32 with its gradient and optimizer state; a bucket of blocks is all-gathered (bf16 by "
      "default) before it computes and its gradients reduce-scattered after its backward, bucketed and reordered so "
      "that communication hides behind compute.";
  p.footer =
      train::metrics_help("all_gather_bytes, reduce_scatter_bytes, all_reduce_bytes (HSDP), exposed_comm_ms, "
                          "shard_bytes, arena_bytes") +
      "Exit status: 0 done, 1 a failure while training, 2 bad usage or bad input, " + train::kExitStoppedHelp + ".\n"
      "Example: mpiexec -n 4 fsdp-train --model llama-small --buckets auto --activation-checkpointing --steps 300";
  p.add_options = [](CLI::App& app) {
    train::add_options(app, o);
    app.remove_option(app.get_option("--bucket-mb"));  // the replicated all-reduce's; FSDP buckets by --buckets
    app.get_option("--optimizer")->description("adamw (default), sgd or shampoo (its blocks cut from each rank's shards)");
    train::add_shampoo_options(app, o, false);
    const char* g = "Sharding";
    app.add_option("--param-dtype", param_dtype, "parameters all-gathered in bf16 (compute upcasts to f32) or f32")
        ->group(g)->check(CLI::IsMember({"bf16", "f32"}));
    app.add_option("--reduce-dtype", reduce_dtype, "gradients reduce-scattered in f32 or bf16")
        ->group(g)->check(CLI::IsMember({"f32", "bf16"}));
    app.add_option("--reshard-after-forward", reshard,
                   "free gathered parameters after forward and gather again in backward: default (every bucket but "
                   "the last), always or never")->group(g)->check(CLI::IsMember({"default", "always", "never"}));
    app.add_option("--prefetch", c.prefetch, "buckets gathered ahead of the one computing (forward and backward)")
        ->group(g)->check(cli::at_least(0));
    app.add_option("--buckets", c.buckets,
                   "param (a collective per parameter), block (one per block), N (N blocks per bucket), auto "
                   "(planned from measured costs) or a plan file (JSON, as --print-plan writes)")->group(g);
    app.add_option("--bucket-memory", bucket_memory_mb, "auto: the largest gathered bucket in MiB (default: twice the largest block's)")
        ->group(g)->check(cli::at_least(0));
    app.add_flag("--print-plan", c.print_plan,
                 "print the bucket plan as JSON with its predicted exposed communication (after calibrating the "
                 "collectives and timing two steps), then exit")->group(g);
    app.add_option("--replicate", c.replicate, "HSDP: R groups of N/R ranks, sharded within, replicated across")
        ->group(g)->check(cli::at_least(1));
    app.add_flag("--no-overlap", no_overlap, "issue every collective when needed and wait at once (the baseline)")
        ->group(g);
    app.add_flag("--keep-unsharded-grad", c.keep_unsharded_grad,
                 "with --micro-batch: keep the whole f32 gradient across micro-batches and reduce-scatter once a "
                 "step (fewer collectives; every rank holds the whole model's gradient, as DDP does)")->group(g);
  };
  p.validate = [](comm::Runtime& rt) {
    train::validate(o, rt.size());
    c.bucket_memory = bucket_memory_mb * (1 << 20);
    parallel::validate(c, rt.size());
    if (c.print_plan && (!o.checkpoint_dir.empty() || !o.save.empty()))
      fail_usage("--print-plan exits before training; leave out --checkpoint-dir and --save");
  };
  p.run = [](comm::Runtime& rt) {
    c.param_dtype = parse_dtype(param_dtype);
    c.reduce_dtype = parse_dtype(reduce_dtype);
    c.reshard = parallel::parse_reshard(reshard);
    c.overlap = !no_overlap;
    // --print-plan: stdout carries the plan alone (the metrics of its two timed steps go nowhere
    // unless --metrics names a file).
    if (c.print_plan && o.metrics == "-") o.metrics = "/dev/null";
    train::Strategy s;
    s.program = "fsdp-train";
    s.config = {{"param_dtype", param_dtype}, {"reduce_dtype", reduce_dtype}, {"reshard_after_forward", reshard},
                {"prefetch", c.prefetch}, {"buckets", c.buckets}, {"replicate", c.replicate}, {"overlap", c.overlap},
                {"keep_unsharded_grad", c.keep_unsharded_grad}};
    if (o.optimizer == "shampoo") s.config["shampoo"] = train::shampoo_config(o).to_json();
    s.sharded = [](nn::Model& model, comm::Communicator& world, comm::Communicator& host) {
      return std::make_unique<parallel::Fsdp>(model, world, host, c);
    };
    return train::run(o, s, rt);
  };
  return p;
}

}  // namespace

int main(int argc, char** argv) { return dtk::cli::main(argc, argv, program()); }
