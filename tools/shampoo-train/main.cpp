// shampoo-train: data-parallel training with Distributed Shampoo (see man shampoo-train).
#include "dtk/cli/cli.h"
#include "dtk/ops/kernels.h"
#include "dtk/train/command_line.h"
#include "dtk/core/error.h"
#include "dtk/optim/shampoo.h"
#include "dtk/train/trainer.h"

namespace {
using namespace dtk;

struct Args {
  train::Options train;
  optim::ShampooConfig shampoo;
};

cli::Program program(Args& a) {
  cli::Program p;
  p.name = "shampoo-train";
  p.marks_launch = true;  // after the first step (train::run)
  p.cpu_kernels = ops::select_cpu_kernels;
  p.description =
      "Data-parallel training with Distributed Shampoo (Shi et al., 2023): blocked Kronecker-factored "
      "preconditioning with grafting; each rank computes the inverse roots and search directions of its own "
      "blocks, and one all-gather per step shares the directions. --preconditioner eigenvalue-corrected (SOAP) "
      "and spectral (Muon) use the same blocks. AdamW and SGD run in the same loop for comparison.";
  p.footer =
      train::metrics_help({train::MetricSource::shampoo}) +
      "Exit status: 0 done, 1 a failure while training (a factor with NaN, four failed roots in a row), 2 bad usage "
      "or bad input, " + cli::kExitStoppedHelp + ".\n"
      "Example: mpiexec -n 4 shampoo-train --model llama-tiny --optimizer shampoo --precondition-frequency 20 "
      "--steps 300";
  p.add_options = [&a](CLI::App& app) {
    train::add_options(app, a.train);
    train::add_shampoo_options(app, a.shampoo);
  };
  p.validate = [&a](comm::Runtime& rt) -> cli::Work {
    // Shampoo's plan (its blocks) is made with it: printed before the first step.
    const train::ResolvedRun r =
        a.train.runtime.print_plan ? train::validate_plan_only(a.train, 1, rt.size()) : train::validate(a.train, rt.size());
    const train::Options& o = r.options;
    train::Strategy s = train::strategy("shampoo-train", o, rt.size(), a.shampoo);
    if (o.optimization.optimizer == optim::Kind::shampoo) s.config = s.optimizer_config;
    return [r, s](comm::Runtime& rt) { return train::run(r, s, rt); };
  };
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  a.train.optimization.optimizer = dtk::optim::Kind::shampoo;
  return dtk::cli::main(argc, argv, program(a));
}
