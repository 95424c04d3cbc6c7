#include "dtk/train/checkpointer.h"

#include <chrono>
#include <cstdio>
#include <spdlog/spdlog.h>

#include "dtk/comm/watchdog.h"

namespace fs = std::filesystem;

namespace dtk::train {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

Checkpointer::Checkpointer(const Options& o, comm::Communicator& host, std::function<RunState()> state,
                           std::function<void()> sync_buffers)
    : o_(o), host_(host), state_(std::move(state)), sync_buffers_(std::move(sync_buffers)) {
  if (o.checkpoint.dir.empty()) return;
  if (host.rank() == 0) {
    std::error_code ec;
    created_dir_ = !fs::exists(o.checkpoint.dir, ec);
    fs::create_directories(o.checkpoint.dir);
  }
  dir_ = std::make_unique<ckpt::Directory>(o.checkpoint.dir, o.checkpoint.keep);
  // Checkpoints in the background copy the state: room for it now, not at the first one.
  if (o.checkpoint.async && o.checkpoint.every > 0 && o.checkpoint.every < last_step(o)) state_().reserve(snapshot_);
}

Checkpointer::~Checkpointer() {
  pending_.reset();  // the write in flight first
  std::error_code ec;
  if (created_dir_ && fs::is_empty(o_.checkpoint.dir, ec) && !ec) fs::remove(o_.checkpoint.dir, ec);
}

bool run_complete(const Options& o, int rank) {
  if (std::error_code ec; rank == 0 && !o.checkpoint.dir.empty() && fs::is_directory(o.checkpoint.dir, ec))
    ckpt::remove_stale_temporaries(o.checkpoint.dir);
  if (!o.resumed || o.resumed->metadata().step != last_step(o)) return false;
  spdlog::info("{} is at step {}: the run is complete, nothing to do", o.resumed->path.string(), last_step(o));
  return true;
}

std::pair<double, double> Checkpointer::progress() const {
  return {pending_ && pending_->done() ? 1.0 : 0.0, pending_ && pending_->failed() ? 1.0 : 0.0};
}

void Checkpointer::learn(double done, double failed) {
  writers_done_ = done == static_cast<double>(host_.size());
  writer_failed_ = failed > 0;
}

void Checkpointer::after_step(int64_t step, bool last, bool stopping, const optim::Schedule& schedule,
                              nlohmann::ordered_json& m) {
  const comm::watchdog::Patient writing;  // the checkpoints' waits may be long, signal or not
  // A write in the background that every rank has finished, or that failed on one, completes now.
  if (pending_ && (writers_done_ || writer_failed_)) complete(m);
  if (!dir_ || !(last || stopping || (o_.checkpoint.every > 0 && step % o_.checkpoint.every == 0))) return;
  const auto t0 = Clock::now();
  if (pending_) complete(m);  // the previous one first
  // The last checkpoint (the run's end, a stop) is waited for anyway: written at once.
  const bool background = o_.checkpoint.async && !last && !stopping;
  sync_buffers_();
  const RunState s = state_();
  pending_ = s.begin_save(dir_->entry(step, s.par.sharded()), step, schedule, &snapshot_, background);
  if (!background) complete(m);
  m["checkpoint_blocked_ms"] = seconds_since(t0) * 1e3;
}

void Checkpointer::save(const fs::path& path, int64_t step, const optim::Schedule& schedule) {
  const comm::watchdog::Patient writing;
  sync_buffers_();
  state_().save(path, step, schedule);
  written(path);
}

// Completes the write in flight (collective; AgreedError(1) on every rank when it failed):
// `latest` and pruning, its path written, its write time in the step's metrics.
void Checkpointer::complete(nlohmann::ordered_json& m) {
  const std::unique_ptr<PendingSave> p = std::move(pending_);
  p->finish();
  agreed(host_, host_.rank() == 0, [&] { dir_->finish(p->path()); });  // `latest`, pruning
  written(p->path());
  m["checkpoint_write_ms"] = p->write_s() * 1e3;
}

// A checkpoint written: its path on stdout for pipelines (| xargs shard-inspect ...), unless the
// metrics go there: stdout then carries them alone, and the path is logged.
void Checkpointer::report_stop(int64_t step, int64_t last) const {
  if (dir_ || !o_.checkpoint.save.empty())
    spdlog::warn("stopped at step {} of {} on a signal, checkpoint written; --resume continues", step, last);
  else
    spdlog::warn("stopped at step {} of {} on a signal; nothing saved (no --checkpoint-dir or --save)", step, last);
}

void Checkpointer::written(const fs::path& p) const {
  if (host_.rank() != 0) return;
  if (o_.runtime.metrics == "-") spdlog::info("checkpoint written: {}", p.string());
  else std::printf("%s\n", p.c_str());
}

}  // namespace dtk::train
