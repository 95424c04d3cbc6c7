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

bool sharded(parallel::Parallelism& par) { return par.rows(0) != nullptr; }

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
  for (PlacedTensor& t : prefixed("optim/", optim->state())) s.push_back(std::move(t));
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
  m.optim_config["clip"] = o.clip;
  m.data_position = {{"step", step}, {"global_batch", o.global_batch}, {"seed", o.seed},
                     {"samples_seen", step * o.global_batch}, {"data", o.data}};
  m.rng_state = {{"generator", "philox4x32-10"}, {"seed", o.seed},
                 {"note", "counter-based: every draw is a function of (seed, step), nothing else to restore"}};
  m.extra = {{"program_config", strategy.config}};
  for (const auto& [key, value] : strategy.extra.items()) m.extra[key] = value;
  m.extra["state_ranks"] = par.state_rank().second;  // whose per-rank state this is (ckpt::load_state)
  m.extra["run_options"] = o.run_options;            // what a resume keeps (train::add_options)
  auto p = std::make_unique<PendingSave>(path, step, host);
  const std::vector<ckpt::StateEntry> entries = ckpt::entries(placed(false, true));
  if (!sharded(par)) {
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
  if (sharded(par) ? par.checkpoint_comm() == nullptr : host.rank() != 0) return;
  std::vector<Tensor> mine;
  for (const PlacedTensor& t : placed()) mine.push_back(t.value);
  snapshot.reserve(mine);
}

int64_t RunState::resume(const std::filesystem::path& path) const {
  ckpt::Reader r(path);
  const auto& meta = r.metadata();
  const auto state = placed();
  // Every rank loads its part; a checkpoint whose state does not fit this run (another
  // program's, or other options') ends every rank with the same line (exit 2).
  ckpt::Restored restored = ckpt::Restored::exact;
  std::string err;
  try {
    restored = load(r, par, state);
  } catch (const std::exception& e) {
    err = fmt::format("{}; it was written by {} with --optimizer {}{}: resume with the same program and options, "
                      "or take its weights only with --init-from",
                      e.what(), meta.program, meta.optim_config.value("name", std::string("?")),
                      meta.extra.contains("compressor") ? " and a compressor" : "");
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
  // State of another number of ranks: carried over exactly (PowerSGD's and randomk's error
  // feedback, by their mean; Shampoo's blocks, named by parameter and block: no warning),
  // approximately (topk's and signum's error feedback) or not at all. The worst over the ranks,
  // so that every rank rebuilds the optimizer alike and rank 0 says so.
  int64_t worst = static_cast<int64_t>(restored);
  host.all_reduce({&worst, 1, DType::i64, {}}, {&worst, 1, DType::i64, {}}, comm::ReduceOp::max, comm::Mode::sync).wait();
  restored = static_cast<ckpt::Restored>(worst);
  if (restored == ckpt::Restored::fresh && sharded(par)) optim = strategy.optimizer(par);  // Shampoo afresh
  if (first && restored != ckpt::Restored::exact) {
    const int64_t before = meta.extra.value("state_ranks", meta.world_size);
    const std::string sizes = fmt::format("{} was written by {} rank{}, this job has {}", path.string(), before,
                                          before == 1 ? "" : "s", par.state_rank().second);
    const nlohmann::json& cc = strategy.config.contains("compressor") ? strategy.config["compressor"] : strategy.config;
    const std::string kind = cc.value("kind", std::string("the compressor"));  // psgd-train's config, fsdp-train's part
    if (restored == ckpt::Restored::approximate && sharded(par))
      spdlog::warn("{}: {}'s error feedback was saved as its mean over the replica groups, which does not continue it "
                   "exactly ({} compresses each replica's own gradient)", path.string(), kind, kind);
    else if (restored == ckpt::Restored::approximate)
      spdlog::warn("{}: {}'s per-rank error feedback is carried over as its mean over ranks, which does not continue "
                   "it exactly ({} compresses each rank's own gradient)", sizes, kind, kind);
    else if (sharded(par))
      spdlog::warn("{}: its Shampoo blocks were cut from the shards (fsdp-train before the whole parameters' blocks, "
                   "dtk-checkpoint(5)), so Shampoo starts afresh", path.string());
    else
      spdlog::warn("{}: per-rank state starts afresh", sizes);
  }
  spdlog::info("resuming from {} at step {}", path.string(), meta.step);
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
