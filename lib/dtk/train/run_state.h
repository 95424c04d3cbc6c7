// dtk::train — what the training loop saves and restores: the run's state (the parallelism's
// model and synchronisation state, the optimizer's), every piece placed by its owner
// (core/placed.h), with the run's metadata, as a full checkpoint or a sharded state.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/core/placed.h"
#include "dtk/nn/model.h"
#include "dtk/optim/optimizer.h"
#include "dtk/parallel/parallelism.h"
#include "dtk/train/options.h"
#include "dtk/train/strategy.h"

namespace dtk::train {

// The parts of a running job that its checkpoints keep. Every call is collective over `host`.
struct RunState {
  const Options& options;
  const Strategy& strategy;
  const nn::ModelConfig& model_config;
  parallel::Parallelism& par;
  std::unique_ptr<optim::Optimizer>& optim;  // a resume builds it afresh when its per-shard state cannot follow
  comm::Communicator& host;                  // the job's host world

  // The model (the parallelism's parameters and buffers) and, unless only the weights are
  // wanted, the optimizer's and the gradient synchronisation's state.
  std::vector<PlacedTensor> placed(bool weights_only = false) const;
  // Writes the checkpoint of step `step`: a full one through rank 0, or, sharded, a sharded
  // state by the ranks of the parallelism's checkpoint_comm(). A failure is the same
  // AgreedError (exit 1) on every rank.
  void save(const std::filesystem::path& path, int64_t step, const optim::Schedule& schedule) const;
  // Restores a checkpoint and returns its step. State that does not fit this run is the same
  // AgreedError (exit 2) on every rank; per-rank state of another number of ranks starts afresh
  // (a warning says so).
  int64_t resume(const std::filesystem::path& path) const;
  // The weights only (--init-from).
  void init_from(const std::filesystem::path& path) const;
};

// Runs f where `mine`; a failure of f on any rank becomes the same AgreedError (exit 1) on every
// rank of `host`.
void agreed(comm::Communicator& host, bool mine, const std::function<void()>& f);

}  // namespace dtk::train
