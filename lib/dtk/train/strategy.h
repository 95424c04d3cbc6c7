// dtk::train — a program's strategy: where the parameters live and how their gradients are
// aggregated (a parallel::Parallelism), and what steps them (an optim::Optimizer). Every
// *-train program builds one (strategy() gives the replicated one with the optimizer of the
// options; a program replaces what it adds) and the loop (trainer.h) runs it, knowing nothing of
// PowerSGD, Shampoo or FSDP: what it needs from them is each component's (core/component.h).
#pragma once
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "dtk/comm/comm.h"
#include "dtk/nn/model.h"
#include "dtk/optim/optimizer.h"
#include "dtk/parallel/parallelism.h"
#include "dtk/train/options.h"

namespace dtk::optim {
struct ShampooConfig;
}

namespace dtk::train {

struct Strategy {
  using MakeParallelism =
      std::function<std::unique_ptr<parallel::Parallelism>(nn::Model&, comm::Communicator& world, comm::Communicator& host)>;
  using MakeOptimizer = std::function<std::unique_ptr<optim::Optimizer>(parallel::Parallelism&)>;

  std::string program;  // written into checkpoints and logs
  // The model's parameter storage that the parallelism binds (external: a sharded one's).
  nn::Storage storage = nn::Storage::flat;
  // Built on the model, after it; its state (parameters, a compressor's) is checkpointed.
  MakeParallelism parallelism;
  // Built over what the parallelism holds (params(), optimizer_comm(), param_rows()); again,
  // afresh, when a resume cannot restore its per-rank state.
  MakeOptimizer optimizer;
  // The optimizer's configuration as strategy() resolved it (Shampoo's with the common options
  // applied), for a program to record in `config`.
  nlohmann::json optimizer_config;
  nlohmann::json config = nlohmann::json::object();  // program options, saved in checkpoints (extra.program_config)
};

// The replicated strategy of the options: parallel::GradSync's plain bucketed all-reduce
// (--bucket-size), and the optimizer of --optimizer: SGD or AdamW from the common options, or
// Shampoo from `shampoo` (a program's Shampoo options) with the common options applied:
// --beta1 filters the gradient, --beta2 decays the factors, --weight-decay is decoupled,
// --momentum and --nesterov act on the search direction. Checks Shampoo's options (UsageError
// naming the option), once.
// optimizer_ranks: the ranks Shampoo splits its blocks over (the world; fsdp-train: the shard group).
Strategy strategy(std::string program, const Options& o, int optimizer_ranks, const optim::ShampooConfig& shampoo);
Strategy strategy(std::string program, const Options& o, int optimizer_ranks);  // Shampoo's defaults

// The Shampoo configuration strategy() resolves (its `shampoo` with the common options applied).
optim::ShampooConfig shampoo_config(const Options& o, const optim::ShampooConfig& shampoo);

}  // namespace dtk::train
