// shampoo-train: data-parallel training with Distributed Shampoo (see man shampoo-train).
#include "dtk/cli/cli.h"
#include "dtk/core/error.h"
#include "dtk/optim/shampoo.h"
#include "dtk/train/trainer.h"

namespace {
using namespace dtk;

cli::Program program() {
  static train::Options o;
  static optim::ShampooConfig c;
  static bool no_bias_correction = false;
  o.optimizer = "shampoo";
  cli::Program p;
  p.name = "shampoo-train";
  p.description =
      "Data-parallel training with Distributed Shampoo (Shi et al., 2023): blocked Kronecker-factored "
      "preconditioning with grafting; each rank computes the inverse roots and search directions of its own "
      "blocks, and one all-gather per step shares the directions. AdamW and SGD run in the same loop for "
      "comparison.";
  p.footer =
      "Metrics (JSON lines on stdout or --metrics): step, loss, val_loss, lr, grad_norm, tokens_per_s, step_time_ms, "
      "compute_ms, sync_ms, optim_ms, peak_mem_bytes, comm_bytes, optim_state_bytes.\n"
      "Exit status: 0 done, 1 a failure while training (a factor with NaN, four failed roots in a row), 2 bad usage "
      "or bad input.\n"
      "Example: mpiexec -n 4 shampoo-train --model llama-tiny --optimizer shampoo --precondition-frequency 20 "
      "--steps 300";
  p.add_options = [](CLI::App& app) {
    train::add_options(app, o);
    app.get_option("--optimizer")->description("shampoo (default), adamw or sgd");
    const char* g = "Shampoo";
    app.add_option("--max-preconditioner-dim", c.max_preconditioner_dim,
                   "merge dims while their product stays below this, and split dims into blocks of at most it")
        ->group(g)->check(CLI::PositiveNumber);
    app.add_option("--precondition-frequency", c.precondition_frequency, "recompute the inverse roots every K steps")
        ->group(g)->check(CLI::PositiveNumber);
    app.add_option("--start-preconditioning-step", c.start_preconditioning_step,
                   "grafting alone before this step (-1: --precondition-frequency)")->group(g);
    app.add_option("--shampoo-epsilon", c.epsilon, "added to the factors' eigenvalues")->group(g)->check(CLI::PositiveNumber);
    app.add_option("--factor-dtype", c.factor_dtype, "Kronecker factors in f32 or f64")
        ->group(g)->check(CLI::IsMember({"f32", "f64"}));
    app.add_option("--exponent-override", c.exponent_override, "root F^(-1/x) instead of F^(-1/(2 order)) (0: off)")
        ->group(g)->check(CLI::NonNegativeNumber);
    app.add_option("--root-method", c.root_method, "inverse roots by eigh or (coupled) newton iteration")
        ->group(g)->check(CLI::IsMember({"eigh", "newton"}));
    app.add_option("--grafting", c.grafting, "step-size grafting: adam, rmsprop, adagrad, sgd or none")
        ->group(g)->check(CLI::IsMember({"none", "sgd", "adagrad", "rmsprop", "adam"}));
    app.add_option("--grafting-beta2", c.grafting_beta2, "second-moment decay of rmsprop/adam grafting")
        ->group(g)->check(CLI::Range(0.0, 1.0));
    app.add_option("--grafting-epsilon", c.grafting_epsilon, "epsilon of the grafting method")
        ->group(g)->check(CLI::PositiveNumber);
    app.add_flag("--no-bias-correction", no_bias_correction, "no bias correction of the filtered gradient and factors")
        ->group(g);
    app.add_option("--trainers-per-group", c.trainers_per_group,
                   "split the world into groups of g ranks that each compute every block (0: one group)")
        ->group(g)->check(CLI::NonNegativeNumber);
    app.add_option("--direction-dtype", c.communication_dtype, "search directions all-gathered in f32 or bf16")
        ->group(g)->check(CLI::IsMember({"f32", "bf16"}));
  };
  p.validate = [](comm::Runtime& rt) {
    if (o.optimizer != "shampoo" && o.optimizer != "adamw" && o.optimizer != "sgd")
      fail_usage("unknown --optimizer '" + o.optimizer + "' (expected shampoo, adamw or sgd)");
    c = train::shampoo_config(o, c);  // the common --beta1, --beta2, --weight-decay, --momentum, --nesterov
    c.use_bias_correction = !no_bias_correction;
    if (o.optimizer == "shampoo") c.validate();
    if (c.trainers_per_group > 0 && rt.size() % c.trainers_per_group != 0)
      fail_usage("--trainers-per-group " + std::to_string(c.trainers_per_group) + " does not divide the " +
                 std::to_string(rt.size()) + " ranks");
    train::validate(o, rt.size());
  };
  p.run = [](comm::Runtime& rt) {
    train::Strategy s;
    s.program = "shampoo-train";
    if (o.optimizer == "shampoo") {
      s.config = c.to_json();
      s.optimizer = [](const std::vector<nn::Param>& params, comm::Communicator& comm) {
        return optim::make_shampoo(c, params, comm);
      };
    }
    return train::run(o, s, rt);
  };
  return p;
}

}  // namespace

int main(int argc, char** argv) { return dtk::cli::main(argc, argv, program()); }
