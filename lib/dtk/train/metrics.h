// Training output: metrics as JSON lines (stdout or a file) and progress on stderr — a live line
// on a terminal, a log line every few steps otherwise (SLURM logs). Rank 0 only.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

namespace dtk::train {

class Metrics {
 public:
  Metrics(const std::string& path, bool active);  // path "-": stdout
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;
  void write(const nlohmann::ordered_json& record);  // one line, flushed

 private:
  std::FILE* f_ = nullptr;
  bool own_ = false;
};

class Progress {
 public:
  Progress(bool active, int64_t total_steps, int64_t log_every);
  // val_loss and val_accuracy NaN: not evaluated at this step (or not a classifier).
  void update(int64_t step, double loss, double val_loss, double lr, double step_s, double val_accuracy = NAN);
  void done();  // ends the live line

 private:
  bool active_, tty_;
  int64_t total_, every_;
  double ema_s_ = 0;
  bool live_ = false;
};

}  // namespace dtk::train
