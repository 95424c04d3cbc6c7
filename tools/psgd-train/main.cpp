// psgd-train: data-parallel training with PowerSGD gradient compression (see man psgd-train).
#include "dtk/cli/checks.h"
#include "dtk/cli/cli.h"
#include "dtk/train/command_line.h"
#include "dtk/compress/auto.h"
#include "dtk/compress/compressor.h"
#include "dtk/core/error.h"
#include "dtk/parallel/data_parallel.h"
#include "dtk/train/trainer.h"

#include <algorithm>

namespace {
using namespace dtk;

struct Args {
  train::Options train;
  compress::Config compressor;
  bool no_warm_start = false, no_error_feedback = false, print_plan = false;
  CLI::Option* rank = nullptr;
};

cli::Program program(Args& a) {
  cli::Program p;
  p.name = "psgd-train";
  p.marks_launch = true;  // after the first step (train::run)
  p.description =
      "Data-parallel training with PowerSGD gradient compression (Vogels et al., 2019): rank-r power iteration "
      "with warm start and error feedback, aggregated by all-reduce; plain, top-k, random-k and signum "
      "aggregation as baselines.";
  p.footer = train::metrics_help(train::MetricSource::compression) +
             "Exit status: 0 done, 1 a failure while training, 2 bad usage or bad input, " + cli::kExitStoppedHelp +
             ".\n"
             "Example: mpiexec -n 4 psgd-train --model llama-tiny --data synthetic --compressor powersgd --rank 2 "
             "--steps 300";
  p.add_options = [&a](CLI::App& app) {
    train::add_options(app, a.train);
    compress::Config& c = a.compressor;
    const char* g = "Compression";
    cli::add_enum(app, "--compressor", c.kind, "gradient aggregation (none: bucketed all-reduce)")->group(g);
    a.rank = app.add_option("--rank", c.rank, "PowerSGD rank r")->group(g)->check(cli::at_least(1));
    app.add_option("--start-iter", c.start_iter, "plain all-reduce for the first K steps")
        ->group(g)->check(cli::at_least(0));
    app.add_option("--min-compression-rate", c.min_compression_rate,
                   "compress a matrix only when it shrinks at least this much")->group(g)->check(cli::positive());
    app.add_flag("--no-warm-start", a.no_warm_start, "draw a new Q every step instead of reusing the last")->group(g);
    app.add_flag("--no-error-feedback", a.no_error_feedback, "drop what the compression leaves out")->group(g);
    cli::add_enum(app, "--error-mode", c.error_mode,
                  "error feedback: projection (M - P(P^T M), bounded per rank) or full (M - P Q^T)")->group(g);
    cli::add_enum(app, "--orthogonalize", c.orthogonalize, "auto (Gram-Schmidt for rank <= 2, QR above), mgs or qr")
        ->group(g);
    cli::add_enum(app, "--comm-dtype", c.comm_dtype, "P and Q on the wire", {DType::f32, DType::bf16})->group(g);
    app.add_option("--compress-ratio", c.ratio, "topk/randomk: fraction of each gradient's coordinates sent")
        ->group(g)->check(cli::positive())->check(cli::at_most(1));
    const char* ga = "Compression: auto";
    app.add_option("--auto-ranks", c.auto_ranks,
                   "the PowerSGD ranks auto chooses between, LOW,HIGH: Accordion's low in regular regimes, high in "
                   "critical ones")->group(ga)->delimiter(',')->expected(2)->check(cli::at_least(1))->type_name("LOW,HIGH");
    app.add_option("--accordion-eta", c.accordion_eta,
                   "a bucket's regime is critical when its mean gradient norm changed by at least this fraction since "
                   "the last interval")->group(ga)->check(cli::positive());
    app.add_option("--auto-interval", c.auto_interval, "auto decides every K steps from --start-iter on")
        ->group(ga)->check(cli::at_least(1));
    app.add_option("--auto-refresh", c.auto_refresh, "auto measures the link again every K steps (0: once)")
        ->group(ga)->check(cli::at_least(0));
    app.add_flag("--print-plan", a.print_plan,
                 "with auto: print its first plan (JSON: per bucket the choice, the measured costs and the predicted "
                 "step) once made at --start-iter, then stop without saving")->group(ga);
  };
  p.validate = [&a](comm::Runtime& rt) -> cli::Work {
    compress::Config c = a.compressor;
    if (c.kind == compress::Kind::auto_ && a.rank->count() > 0)
      fail_usage("--compressor auto chooses the rank itself: give it --auto-ranks LOW,HIGH, not --rank");
    if (comm::CostModel link; c.kind == compress::Kind::auto_) compress::auto_link_from_env(link);  // malformed: exit 2 now
    if (a.print_plan && c.kind != compress::Kind::auto_)
      fail_usage("--print-plan prints auto's plan: it needs --compressor auto");
    train::Options t = a.train;
    if (a.print_plan) {  // nothing is saved: a job's checkpoint options (its --config's) stay idle
      t.checkpoint_dir.clear();
      t.save.clear();
      t.checkpoint_every = t.stop_at = 0;
      t.auto_resume = false;
      t.steps = std::max<int64_t>(t.steps, c.start_iter + 1);  // the plan is made at --start-iter
      t.epochs = 0;
    }
    train::Options o = train::validate(t, rt.size());
    // --print-plan: stdout carries the plan alone (the metrics go nowhere unless --metrics names a file).
    if (a.print_plan && o.metrics == "-") o.metrics = "/dev/null";
    c.warm_start = !a.no_warm_start;
    c.error_feedback = !a.no_error_feedback;
    c.seed = o.seed;
    c.validate();
    train::Strategy s = train::strategy("psgd-train", o, rt.size());
    s.config = c;
    if (c.kind != compress::Kind::none) {
      // The replicated placement with the compressor, its buckets of --bucket-size.
      s.parallelism = [c, bucket_bytes = o.bucket_bytes, print = a.print_plan](nn::Model& model, comm::Communicator& world,
                                                                                comm::Communicator&) {
        auto sync = std::make_unique<parallel::GradSync>(model, world,
                                                         compress::make_compressor(c, world, model.params(), bucket_bytes));
        if (print) sync->print_plan();
        return sync;
      };
      s.extra["compressor"] = nullptr;  // the checkpoint holds a compressor's state
    }
    return [o, s](comm::Runtime& rt) { return train::run(o, s, rt); };
  };
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  return dtk::cli::main(argc, argv, program(a));
}
