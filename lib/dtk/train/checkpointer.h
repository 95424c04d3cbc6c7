// dtk::train — the checkpoints of a run as the training loop sees them: which steps write one
// (--checkpoint-every, the last step, a stop on a signal), whether it is written in the
// background (--async-checkpoint) or at once, its completion once every rank's files are written
// or one has failed (learnt in the step's all-reduce, progress() and learn()), `latest` and
// pruning (ckpt::Directory), and the path of each checkpoint written on stdout.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/ckpt/state.h"
#include "dtk/comm/comm.h"
#include "dtk/train/options.h"
#include "dtk/train/run_state.h"

namespace dtk::train {

// Before a run: rank 0 removes dead writers' temporaries from --checkpoint-dir (even when this run
// writes nothing more); true when the checkpoint it resumes is at its last step already.
bool run_complete(const Options& o, int rank);

class Checkpointer {
 public:
  // `state` gives the run's state as it is now; `sync_buffers` makes every rank's model buffers
  // rank 0's before a write. Creates --checkpoint-dir (rank 0) and makes room for the copies of
  // background writes. Collective over `host`.
  Checkpointer(const Options& o, comm::Communicator& host, std::function<RunState()> state,
               std::function<void()> sync_buffers);
  // A write in flight is waited for and left incomplete (`latest` not moved); a --checkpoint-dir
  // this run created and left empty (a run that failed before its first checkpoint) is removed.
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // This rank's part of the step's all-reduce: its background write done, failed (1 or 0 each).
  std::pair<double, double> progress() const;
  // The sums over ranks of progress(): every rank learns alike whether the write can complete.
  void learn(double done, double failed);
  // After step `step` (1-based) ran: completes a write that every rank has finished or one rank
  // failed, then writes this step's checkpoint when one is due. Collective; the times go into
  // the step's metrics (checkpoint_blocked_ms, checkpoint_write_ms). `last`: the run's last step;
  // `stopping`: a signal stops the run after it.
  void after_step(int64_t step, bool last, bool stopping, const optim::Schedule& schedule, nlohmann::ordered_json& m);
  // A checkpoint at `path` written now (--save), collective.
  void save(const std::filesystem::path& path, int64_t step, const optim::Schedule& schedule);
  // The warning of a run stopped by a signal at `step` of `last`: whether a checkpoint holds it.
  void report_stop(int64_t step, int64_t last) const;

 private:
  void complete(nlohmann::ordered_json& m);
  void written(const std::filesystem::path& p) const;

  const Options& o_;
  comm::Communicator& host_;
  std::function<RunState()> state_;
  std::function<void()> sync_buffers_;
  std::unique_ptr<ckpt::Directory> dir_;
  ckpt::Snapshot snapshot_;  // host memory for the copy of the state a background write writes
  std::unique_ptr<PendingSave> pending_;  // that write; destroyed first: joins its thread
  bool writers_done_ = false, writer_failed_ = false;  // of pending_, agreed in the step's all-reduce
  bool created_dir_ = false;  // rank 0 made --checkpoint-dir
};

}  // namespace dtk::train
