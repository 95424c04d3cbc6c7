#include "dtk/train/run_state.h"

#include <fmt/format.h>
#include <chrono>
#include <spdlog/spdlog.h>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/ckpt/state.h"
#include "dtk/comm/watchdog.h"
#include "dtk/core/error.h"
#include "dtk/nn/hf.h"

namespace dtk::train {

namespace {

// How completely this rank's state was restored (ckpt::load_state).
ckpt::Restored load(const ckpt::Reader& r, parallel::Parallelism& par, const std::vector<PlacedTensor>& state) {
  const auto [rank, size] = par.state_rank();
  return ckpt::load_state(r, state, rank, size);
}

}  // namespace

void agreed(comm::Communicator& host, bool mine, const std::function<void()>& f) {
  std::string err;
  if (mine) {
    try {
      f();
    } catch (const std::exception& e) {
      err = *e.what() ? e.what() : "a checkpoint write failed";
    }
  }
  if (const std::string e = ckpt::agree(host, err); !e.empty()) throw AgreedError(e, 1);
}

std::vector<PlacedTensor> RunState::placed(bool weights_only, bool saving) const {
  std::vector<PlacedTensor> s = par.state();
  if (weights_only) return s;
  for (PlacedTensor& t : prefixed("optim/", par.optimizer_state(saving ? optim->saved_state() : optim->state())))
    s.push_back(std::move(t));
  for (PlacedTensor& t : saving ? par.saved_sync_state() : par.sync_state()) s.push_back(std::move(t));
  return s;
}

namespace {
double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
}  // namespace

PendingSave::PendingSave(std::filesystem::path path, int64_t step, comm::Communicator& host)
    : path_(std::move(path)), step_(step), host_(host), begun_(now_s()) {}

PendingSave::~PendingSave() {
  if (thread_.joinable()) thread_.join();
}

void PendingSave::start(bool background) {
  auto work = [this] {
    if (error_.empty() && write_ && write_->writes()) error_ = write_->write();
    write_s_ = now_s() - begun_;
    done_.store(true, std::memory_order_release);
  };
  if (background && error_.empty() && write_ && write_->writes()) thread_ = std::thread(work);
  else if (!background) work();
  else done_.store(true, std::memory_order_release);  // nothing of this rank's to write
}

void PendingSave::finish() {
  const comm::watchdog::Patient waiting;
  if (thread_.joinable()) thread_.join();
  std::string err = error_;
  if (write_ && !write_->sharded()) {  // a full checkpoint: host is its communicator
    write_->commit(err);
    return;
  }
  // Sharded: the ranks of one shard group wrote it; HSDP's other groups hold the same shards and
  // learn the outcome: every rank ends with the same AgreedError.
  if (write_) {
    try {
      write_->commit(err);
    } catch (const std::exception& e) {
      err = *e.what() ? e.what() : "a checkpoint write failed";
    }
  }
  if (const std::string e = ckpt::agree(host_, err); !e.empty()) throw AgreedError(e, 1);
}

void RunState::save(const std::filesystem::path& path, int64_t step, const optim::Schedule& schedule) const {
  begin_save(path, step, schedule, nullptr, false)->finish();
}

std::unique_ptr<PendingSave> RunState::begin_save(const std::filesystem::path& path, int64_t step,
                                                  const optim::Schedule& schedule, ckpt::Snapshot* snapshot,
                                                  bool background) const {
  const Options& o = options;
  ckpt::Metadata m;
  m.program = strategy.program;
  m.program_version = DTK_VERSION;
  m.step = step;
  m.world_size = host.size();
  m.model_config = model_config;
  m.optim_config = optim->config();
  m.optim_config["schedule"] = schedule;
  m.optim_config["clip"] = o.optimization.clip;
  m.data_position = {{"step", step}, {"global_batch", o.data.global_batch}, {"seed", o.data.seed},
                     {"samples_seen", step * o.data.global_batch}, {"data", o.data.train}};
  m.rng_state = {{"generator", "philox4x32-10"}, {"seed", o.data.seed},
                 {"note", "counter-based: every draw is a function of (seed, step), nothing else to restore"}};
  m.extra = {{"program_config", strategy.config}};
  m.extra["state_ranks"] = par.state_rank().second;  // whose per-rank state this is (ckpt::load_state)
  m.extra["run_options"] = o.run_options;            // what a resume keeps (train::add_options)
  auto p = std::make_unique<PendingSave>(path, step, host);
  const std::vector<ckpt::StateEntry> entries = ckpt::entries(placed(false, true));
  if (!par.sharded()) {
    p->write_ = std::make_unique<ckpt::StateWrite>(path, entries, m, host, false, snapshot);
  } else if (comm::Communicator* c = par.checkpoint_comm()) {
    // Sharded: the ranks of one shard group write their rows in parallel (an AgreedError among
    // them here is carried to every rank by finish()).
    try {
      p->write_ = std::make_unique<ckpt::StateWrite>(path, entries, m, *c, true, snapshot);
    } catch (const std::exception& e) {
      p->error_ = *e.what() ? e.what() : "a checkpoint write failed";
    }
  }
  p->start(background);
  return p;
}

void RunState::reserve(ckpt::Snapshot& snapshot) const {
  // A full checkpoint is rank 0's to write; a sharded state the checkpoint group's.
  if (par.sharded() ? par.checkpoint_comm() == nullptr : host.rank() != 0) return;
  std::vector<Tensor> mine;
  for (const PlacedTensor& t : placed()) mine.push_back(t.value);
  snapshot.reserve(mine);
}

int64_t RunState::resume(const Resumed& resumed) const {
  const ckpt::Reader& r = *resumed.reader;
  const std::filesystem::path& path = resumed.path;
  const auto& meta = r.metadata();
  // Every rank loads its part, component by component (the model, the gradient synchronisation's
  // state, the optimizer's); a checkpoint whose state does not fit this run (another program's,
  // or other options') ends every rank with the same line (exit 2).
  int64_t outcome[3] = {0, 0, 0};  // Restored of each, the worst over the ranks
  std::string err;
  try {
    outcome[0] = static_cast<int64_t>(load(r, par, par.state()));
    outcome[1] = static_cast<int64_t>(load(r, par, par.sync_state()));
    outcome[2] = static_cast<int64_t>(load(r, par, prefixed("optim/", par.optimizer_state(optim->state()))));
  } catch (const std::exception& e) {
    err = fmt::format("{}; it was written by {} with --optimizer {}: resume with the same program and options, "
                      "or take its weights only with --init-from",
                      e.what(), meta.program, meta.optim_config.value("name", std::string("?")));
  }
  if (const std::string e = ckpt::agree(host, err); !e.empty()) throw AgreedError(e, 2);
  const bool first = host.rank() == 0;
  if (first && !options.resume_changes.empty()) {
    std::string list;
    for (const Options::Change& c : options.resume_changes)
      list += fmt::format("{}{} {} (the checkpoint's: {})", list.empty() ? "" : ", ", c.option, c.value, c.checkpoint_value);
    spdlog::warn("resuming with options that differ from the checkpoint's: {}", list);
  } else if (first && !meta.extra.contains("run_options")) {
    spdlog::warn("{} holds no record of its run's options (an older dtk wrote it): the options are this command line's",
                 path.string());
  }
  // State of another number of ranks: carried over exactly (no warning), approximately, or not at
  // all; every rank learns the worst of each component, so that all rebuild alike, and rank 0
  // gives the component's words for it.
  host.all_reduce({outcome, 3, DType::i64, {}}, {outcome, 3, DType::i64, {}}, comm::ReduceOp::max, comm::Mode::sync).wait();
  const RestoreSource from{path.string(), meta.extra.value("state_ranks", meta.world_size), par.state_rank().second};
  std::vector<std::string> notes;
  const auto note = [&](const Component* c, int64_t o) {
    if (o == static_cast<int64_t>(Restored::exact)) return;
    const std::string n = c ? c->restore_note(static_cast<Restored>(o), from) : "";
    notes.push_back(!n.empty() ? n : from.sizes() + ": per-rank state starts afresh");
  };
  note(nullptr, outcome[0]);
  note(&par, outcome[1]);
  note(optim.get(), outcome[2]);
  std::string updated;
  if (outcome[2] == static_cast<int64_t>(Restored::fresh))
    optim = strategy.optimizer(par);  // afresh, whole
  else
    updated = optim->restored(meta.optim_config);
  if (first)
    for (const std::string& n : notes) spdlog::warn("{}", n);
  if (first && !updated.empty()) spdlog::info("{}: {}", path.string(), updated);
  spdlog::info("resuming from {} at step {}", path.string(), meta.step);
  spdlog::debug("{} was opened {} time(s) by this process", path.string(), ckpt::Reader::times_opened(path));
  return meta.step;
}

void RunState::init_from(const std::filesystem::path& path) const {
  // Every rank reads its part; weights that do not fit this model end every rank with the same
  // line (exit 2).
  std::string err, from;
  try {
    if (nn::hf::is_folder(path)) {
      nn::hf::load(path, model_config, placed(true));
      from = "the Hugging Face folder " + path.string();
    } else {
      ckpt::Reader r(path);
      load(r, par, placed(true));
      from = fmt::format("{} (step {})", path.string(), r.metadata().step);
    }
  } catch (const std::exception& e) {
    err = *e.what() ? e.what() : "--init-from failed";
  }
  if (const std::string e = ckpt::agree(host, err); !e.empty()) throw AgreedError(e, 2);
  spdlog::info("weights from {}", from);
}

}  // namespace dtk::train
