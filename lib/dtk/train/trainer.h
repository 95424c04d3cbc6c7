// dtk::train — the one training loop that every *-train program runs.
//
// A step: the rank's share of the global batch (data::Sampler) in micro-batches; forward and
// backward of each, gradients accumulated with weight n_micro / global_batch (so the sum over
// ranks is the global-batch mean gradient); gradient synchronisation (the strategy's
// parallelism: bucketed all-reduce overlapped with the last backward, a compressor, or
// reduce-scatter); clipping by global norm; the optimizer step at the schedule's learning rate.
// Every eval_every steps the validation loss; metrics as JSON lines; a checkpoint every
// checkpoint_every steps and at the end, of the state every piece declares (core/placed.h).
//
// Programs differ only in their Strategy (strategy.h): where parameters live and how gradients
// are aggregated, and the optimizer that steps what the rank holds. The loop sees parameters only
// through parallel::Parallelism: it never assumes that a rank holds the whole model.
#pragma once
#include <string>

#include "dtk/comm/comm.h"
#include "dtk/train/options.h"
#include "dtk/train/strategy.h"

namespace dtk::train {

// Runs the whole training; returns the exit code: 0, or cli::kExitStopped. Resuming a run that is
// already at its last step returns 0 at once (a resubmitted job that had finished).
int run(const ResolvedRun& r, const Strategy& s, comm::Runtime& rt);

}  // namespace dtk::train
