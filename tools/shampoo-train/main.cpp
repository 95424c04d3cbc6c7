// shampoo-train: data-parallel training with Distributed Shampoo (see man shampoo-train).
#include "dtk/cli/cli.h"
#include "dtk/core/error.h"
#include "dtk/optim/shampoo.h"
#include "dtk/train/trainer.h"

namespace {
using namespace dtk;

cli::Program program() {
  static train::Options o;
  o.optimizer = "shampoo";
  cli::Program p;
  p.name = "shampoo-train";
  p.description =
      "Data-parallel training with Distributed Shampoo (Shi et al., 2023): blocked Kronecker-factored "
      "preconditioning with grafting; each rank computes the inverse roots and search directions of its own "
      "blocks, and one all-gather per step shares the directions. AdamW and SGD run in the same loop for "
      "comparison.";
  p.footer =
      train::metrics_help("") +
      "Exit status: 0 done, 1 a failure while training (a factor with NaN, four failed roots in a row), 2 bad usage "
      "or bad input, " + train::kExitStoppedHelp + ".\n"
      "Example: mpiexec -n 4 shampoo-train --model llama-tiny --optimizer shampoo --precondition-frequency 20 "
      "--steps 300";
  p.add_options = [](CLI::App& app) {
    train::add_options(app, o);
    app.get_option("--optimizer")->description("shampoo (default), adamw or sgd");
    train::add_shampoo_options(app, o, true);
  };
  p.validate = [](comm::Runtime& rt) { train::validate(o, rt.size()); };
  p.run = [](comm::Runtime& rt) {
    train::Strategy s;
    s.program = "shampoo-train";
    if (o.optimizer == "shampoo") s.config = train::shampoo_config(o).to_json();
    return train::run(o, s, rt);
  };
  return p;
}

}  // namespace

int main(int argc, char** argv) { return dtk::cli::main(argc, argv, program()); }
