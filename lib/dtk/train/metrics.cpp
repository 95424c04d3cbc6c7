#include "dtk/train/metrics.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <spdlog/spdlog.h>

#include "dtk/core/error.h"
#include "dtk/ops/kernels.h"

namespace dtk::train {

namespace {

// Keeps the lines of `path` up to step `after` (and any line without a step): written beside it
// and renamed over it, so that a failure leaves it as it was.
void keep_until(const std::string& path, int64_t after) {
  std::ifstream in(path);
  if (!in) return;  // none yet
  std::string kept, line;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() > after) {
      ++dropped;
      continue;
    }
    kept += line + "\n";
  }
  if (dropped == 0) return;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kept;
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      fail("--metrics " + path + ": cannot write " + tmp);
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    fail("--metrics " + path + ": " + std::strerror(err));
  }
  spdlog::info("--metrics {}: continued after step {}; {} line(s) of later steps removed (this run writes them again)",
               path, after, dropped);
}

}  // namespace

nlohmann::ordered_json step_metrics(const StepRecord& r) {
  nlohmann::ordered_json m = {{"step", r.step}, {"loss", r.loss}};
  if (!std::isnan(r.accuracy)) m["accuracy"] = r.accuracy;
  m.update(nlohmann::ordered_json{{"lr", r.lr},
                                  {"grad_norm", r.grad_norm},
                                  {r.tokens ? "tokens_per_s" : "samples_per_s", r.items / r.step_s},
                                  {"model_flops_per_s", r.flops_per_item * r.items / r.step_s},
                                  {"step_time_ms", r.step_s * 1e3},
                                  {"compute_ms", r.compute_s * 1e3},
                                  {"sync_ms", r.sync_s * 1e3},
                                  {"optim_ms", r.optim_s * 1e3},
                                  {"peak_mem_bytes", r.peak_mem},
                                  {"persistent_mem_bytes", r.persistent_mem},
                                  {"optim_state_bytes", r.optim_state_bytes}});
  return m;
}

void log_cpu_kernel_warnings(comm::Communicator& host, int rank) {
  const std::vector<std::string> warnings = ops::cpu_kernel_warnings();
  std::string all;
  for (const std::string& w : warnings) all += w + "\n";
  const double h = static_cast<double>(std::hash<std::string>{}(all) >> 12);  // exact in a double
  const comm::Range same = comm::min_max_over_ranks(host, {h}, Device::cpu())[0];
  if (rank == 0 || same.min != same.max)
    for (const std::string& w : warnings) spdlog::warn("{}", w);
}

bool print_plans(const std::vector<Component*>& parts, int rank) {
  nlohmann::ordered_json all;
  for (const Component* c : parts) {
    if (!c->plan_final()) return false;
    if (nlohmann::json p = c->plan(); !p.is_null()) all[std::string(c->component_name())] = std::move(p);
  }
  // Every rank finds the same: one line from rank 0, exit 2 everywhere.
  if (all.empty()) throw AgreedError("--print-plan: no part of this run makes a plan", 2);
  if (rank == 0) std::printf("%s\n", (all.size() == 1 ? all.begin().value() : all).dump(2).c_str());
  std::fflush(stdout);
  return true;
}

Metrics::Metrics(const std::string& path, bool active, int64_t after) {
  if (!active) return;
  if (path == "-") {
    f_ = stdout;
  } else {
    if (after >= 0) keep_until(path, after);
    f_ = std::fopen(path.c_str(), "a");
    if (!f_) fail_usage("--metrics " + path + ": " + std::strerror(errno));
    own_ = true;
  }
}

Metrics::~Metrics() {
  if (own_) std::fclose(f_);
}

void Metrics::write(const nlohmann::ordered_json& record) {
  if (!f_) return;
  const std::string line = record.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  std::fprintf(f_, "%s\n", line.c_str());
  std::fflush(f_);
}

Progress::Progress(bool active, int64_t total_steps, int64_t log_every)
    : active_(active), tty_(active && isatty(STDERR_FILENO)), total_(total_steps), every_(log_every) {}

void Progress::update(int64_t step, double loss, double val_loss, double lr, double step_s, double val_accuracy) {
  if (!active_) return;
  ema_s_ = ema_s_ == 0 ? step_s : 0.9 * ema_s_ + 0.1 * step_s;
  const double eta = ema_s_ * static_cast<double>(total_ - step);
  char val[48] = "";
  if (std::isfinite(val_loss) && std::isfinite(val_accuracy))
    std::snprintf(val, sizeof val, " val %.4f acc %.2f%%", val_loss, 100 * val_accuracy);
  else if (std::isfinite(val_loss))
    std::snprintf(val, sizeof val, " val %.4f", val_loss);
  char line[200];
  std::snprintf(line, sizeof line, "step %lld/%lld loss %.4f%s lr %.3g %.0f ms/step eta %.0fs",
                static_cast<long long>(step), static_cast<long long>(total_), loss, val, lr, ema_s_ * 1e3, eta);
  if (tty_) {
    std::fprintf(stderr, "\r\033[K%s", line);
    std::fflush(stderr);
    live_ = true;
  } else if (step % every_ == 0 || step == total_ || std::isfinite(val_loss)) {
    spdlog::info("{}", line);
  }
}

void Progress::done() {
  if (live_) std::fprintf(stderr, "\n");
  live_ = false;
}

}  // namespace dtk::train
