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
  train::CompressorOptions compressor;
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
    train::add_compressor_options(app, a.compressor, "bucketed all-reduce");
  };
  p.validate = [&a](comm::Runtime& rt) -> cli::Work {
    train::Options o = train::validate(a.train, rt.size());
    const compress::Config c = a.compressor.config(o.seed);
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
