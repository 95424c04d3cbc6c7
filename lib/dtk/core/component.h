// dtk — what a component of a training strategy (the parallelism, the gradient compressor it
// runs, the optimizer) tells the training loop about itself, so that the loop, the resume and
// --print-plan name no technique (torchtitan's Stateful, in dtk's words). Each component also
// holds its state as placed tensors (core/placed.h: Parallelism::state and sync_state,
// Compressor::state, Optimizer::state) and adds its metrics to a step's line; the options that
// shape its state are marked where they are declared (train/command_line.cpp), so that a resume
// refuses to change them.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace dtk {

// How completely a component's state was restored from a checkpoint (ckpt::load_state): every
// tensor as saved (or, per-rank state on another number of ranks, by its exact Resize::mean);
// some per-rank state carried over by a mean that is not exact (Resize::mean_approximate); some
// left as it was (Resize::fresh), or owned state the checkpoint lacks (Resize::if_present).
enum class Restored { exact, approximate, fresh };

// The checkpoint a resume reads, for the components' words about it.
struct RestoreSource {
  std::string path;
  int64_t ranks_before = 1, ranks_now = 1;  // the ranks its per-rank state is indexed by, then and now
  // "PATH was written by N ranks, this job has M"
  std::string sizes() const {
    return path + " was written by " + std::to_string(ranks_before) + " rank" + (ranks_before == 1 ? "" : "s") +
           ", this job has " + std::to_string(ranks_now);
  }
};

class Component {
 public:
  virtual ~Component() = default;
  // Its name as a key of --print-plan's output when several components have a plan.
  virtual std::string_view component_name() const = 0;
  // The warning line for a resume that restored this component's state less than exactly
  // (outcome approximate or fresh); "" for the loop's generic one.
  virtual std::string restore_note(Restored outcome, const RestoreSource& from) const {
    (void)outcome, (void)from;
    return "";
  }
  // What it decided, as --print-plan prints it (JSON); null when it makes no plan.
  virtual nlohmann::json plan() const { return nullptr; }
  // Its plan is final (it may take steps of measurement first); --print-plan waits for it.
  virtual bool plan_final() const { return true; }
};

}  // namespace dtk
