// psgd-train: data-parallel training with PowerSGD gradient compression (see man psgd-train).
#include "dtk/cli/checks.h"
#include "dtk/cli/cli.h"
#include "dtk/train/command_line.h"
#include "dtk/compress/compressor.h"
#include "dtk/core/error.h"
#include "dtk/parallel/data_parallel.h"
#include "dtk/train/trainer.h"

namespace {
using namespace dtk;

struct Args {
  train::Options train;
  compress::Config compressor;
  bool no_warm_start = false, no_error_feedback = false;
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
    app.add_option("--rank", c.rank, "PowerSGD rank r")->group(g)->check(cli::at_least(1));
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
  };
  p.validate = [&a](comm::Runtime& rt) -> cli::Work {
    train::Options o = train::validate(a.train, rt.size());
    compress::Config c = a.compressor;
    c.warm_start = !a.no_warm_start;
    c.error_feedback = !a.no_error_feedback;
    c.seed = o.seed;
    c.validate();
    train::Strategy s = train::strategy("psgd-train", o, rt.size());
    s.config = c;
    if (c.kind != compress::Kind::none) {
      // The replicated placement with the compressor, its buckets of --bucket-size.
      s.parallelism = [c, bucket_bytes = o.bucket_bytes](nn::Model& model, comm::Communicator& world, comm::Communicator&) {
        return std::make_unique<parallel::GradSync>(model, world,
                                                    compress::make_compressor(c, world, model.params(), bucket_bytes));
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
