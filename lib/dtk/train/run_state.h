// dtk::train — what the training loop saves and restores: the run's state (the parallelism's
// model and synchronisation state, the optimizer's), every piece placed by its owner
// (core/placed.h), with the run's metadata, as a full checkpoint or a sharded state.
#pragma once
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dtk/ckpt/state.h"
#include "dtk/comm/comm.h"
#include "dtk/core/placed.h"
#include "dtk/nn/model.h"
#include "dtk/optim/optimizer.h"
#include "dtk/parallel/parallelism.h"
#include "dtk/train/options.h"
#include "dtk/train/strategy.h"

namespace dtk::train {

// A checkpoint on its way to disk (RunState::begin_save). Its files are written on this rank's
// own thread in the background, or by finish() when it is not one; that thread touches HDF5
// (under core/h5.h's lock) and never communicates, so the training thread's collectives meet
// no other. The ranks learn that every writer is done, or that one failed, from done() and
// failed() carried in a collective of the training thread (the step's all-reduce), and complete
// the checkpoint together in finish().
class PendingSave {
 public:
  PendingSave(std::filesystem::path path, int64_t step, comm::Communicator& host);
  ~PendingSave();  // waits for the thread; the checkpoint stays incomplete (`latest` is not moved)
  PendingSave(const PendingSave&) = delete;
  PendingSave& operator=(const PendingSave&) = delete;
  bool done() const { return done_.load(std::memory_order_acquire); }  // this rank's files written (or none to write)
  bool failed() const { return done() && !error_.empty(); }
  // Collective over host: waits for this rank's files (the watchdog's Patient: others may be
  // waiting for the slowest writer), then the ranks agree and the checkpoint is completed, or
  // every rank throws the same AgreedError(1) and nothing is left behind.
  void finish();
  const std::filesystem::path& path() const { return path_; }
  int64_t step() const { return step_; }
  double write_s() const { return write_s_; }  // from begin_save to this rank's files written

 private:
  friend struct RunState;
  void start(bool background);
  std::filesystem::path path_;
  int64_t step_;
  comm::Communicator& host_;
  std::unique_ptr<ckpt::StateWrite> write_;  // null where this rank takes no part in the write (HSDP's other groups)
  std::string error_;                        // of the gathering, or of write()
  std::atomic<bool> done_{false};
  std::thread thread_;
  double begun_ = 0, write_s_ = 0;
};

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
  // saving: the state as a save gathers it (Parallelism::saved_sync_state, collective).
  std::vector<PlacedTensor> placed(bool weights_only = false, bool saving = false) const;
  // Writes the checkpoint of step `step`: a full one through rank 0, or, sharded, a sharded
  // state by the ranks of the parallelism's checkpoint_comm(). A failure is the same
  // AgreedError (exit 1) on every rank.
  void save(const std::filesystem::path& path, int64_t step, const optim::Schedule& schedule) const;
  // The same in parts: the state is gathered in host memory (copied into `snapshot`) before it
  // returns, and with `background` the files are written on a thread while training goes on;
  // PendingSave::finish() completes it (and must, before the next checkpoint begins).
  std::unique_ptr<PendingSave> begin_save(const std::filesystem::path& path, int64_t step,
                                          const optim::Schedule& schedule, ckpt::Snapshot* snapshot,
                                          bool background) const;
  // Makes room in `snapshot` for what this rank writes of its own state (begin_save's copy).
  void reserve(ckpt::Snapshot& snapshot) const;
  // Restores a checkpoint and returns its step. State that does not fit this run is the same
  // AgreedError (exit 2) on every rank; per-rank state of another number of ranks starts afresh
  // (a warning says so).
  int64_t resume(const Resumed& from) const;
  // The weights only (--init-from).
  void init_from(const std::filesystem::path& path) const;
};

// Runs f where `mine`; a failure of f on any rank becomes the same AgreedError (exit 1) on every
// rank of `host`.
void agreed(comm::Communicator& host, bool mine, const std::function<void()>& f);

}  // namespace dtk::train
