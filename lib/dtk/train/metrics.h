// Training output: metrics as JSON lines (stdout or a file) and progress on stderr — a live line
// on a terminal, a log line every few steps otherwise (SLURM logs). Rank 0 only.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/core/component.h"

namespace dtk::train {

// Who writes a metric: the loop (every *-train program), a compressor chosen by the program
// (psgd-train, fsdp-train's HSDP), the compressor auto (psgd-train), the sharded placement
// (fsdp-train), the Shampoo optimizer (every program's --optimizer shampoo), DiLoCo's outer steps
// (psgd-train's --sync diloco|streaming).
enum class MetricSource { loop, compression, auto_compression, sharded, shampoo, outer };

// The schema of the metrics lines, in the order a line has them: every key once. The --help
// footers (train::metrics_help) are made from it; tests/repo/metrics_keys.sh checks that runs
// write exactly these keys and that the man pages list them.
struct MetricKey {
  std::string_view name;
  MetricSource source;
  std::string_view when;  // empty: every step
};
inline constexpr MetricKey kMetricKeys[] = {
    {"step", MetricSource::loop, ""},
    {"loss", MetricSource::loop, ""},
    {"accuracy", MetricSource::loop, "classifiers: top-1 on the step's batch"},
    {"lr", MetricSource::loop, ""},
    {"grad_norm", MetricSource::loop, ""},
    {"tokens_per_s", MetricSource::loop, "llama"},
    {"samples_per_s", MetricSource::loop, "classifiers"},
    {"model_flops_per_s", MetricSource::loop, ""},
    {"step_time_ms", MetricSource::loop, ""},
    {"compute_ms", MetricSource::loop, ""},
    {"sync_ms", MetricSource::loop, ""},
    {"optim_ms", MetricSource::loop, ""},
    {"peak_mem_bytes", MetricSource::loop, ""},
    {"persistent_mem_bytes", MetricSource::loop, ""},
    {"optim_state_bytes", MetricSource::loop, ""},
    {"comm_bytes", MetricSource::loop, ""},
    {"comm_bytes_uncompressed", MetricSource::compression, ""},
    {"compression_ratio", MetricSource::compression, ""},
    {"compress_ranks", MetricSource::auto_compression, "auto: the PowerSGD rank of each bucket or 0 for none"},
    {"outer_bytes", MetricSource::outer, "--sync diloco|streaming: the pseudo-gradient payload this rank sent after the step"},
    {"outer_comm_ms", MetricSource::outer, "--sync diloco|streaming: the time the step was held by the outer exchange"},
    {"outer_grad_norm", MetricSource::outer, "steps that apply an outer step: the mean pseudo-gradient's L2 norm"},
    {"all_gather_bytes", MetricSource::sharded, ""},
    {"reduce_scatter_bytes", MetricSource::sharded, ""},
    {"all_reduce_bytes", MetricSource::sharded, "HSDP"},
    {"exposed_comm_ms", MetricSource::sharded, ""},
    {"shard_bytes", MetricSource::sharded, ""},
    {"arena_bytes", MetricSource::sharded, ""},
    {"optim_comm_bytes", MetricSource::shampoo, "--optimizer shampoo"},
    {"val_loss", MetricSource::loop, "evaluation steps"},
    {"val_accuracy", MetricSource::loop, "evaluation steps of classifiers"},
    {"checkpoint_write_ms", MetricSource::loop, "steps that complete a checkpoint: from its start to its files written"},
    {"checkpoint_blocked_ms", MetricSource::loop, "checkpoint steps: the time the step was held by checkpointing"},
    {"blas", MetricSource::loop, "the run's first line: the CPU backend's BLAS and its kernels"},
    {"cpu", MetricSource::loop, "the run's first line: the processor and its features"},
    {"precision", MetricSource::loop, "the run's first line: the model's arithmetic as --precision set it"},
};

// The loop's part of a step's metrics line (the schema's keys from step to optim_state_bytes);
// the parallelism, the evaluation and the checkpoints add theirs after.
struct StepRecord {
  int64_t step = 0;
  double loss = 0, accuracy = NAN;  // accuracy NaN: not a classifier (no key)
  double lr = 0, grad_norm = 0;
  bool tokens = true;     // items are tokens (llama), else samples
  double items = 0;       // per step, over every rank
  double flops_per_item = 0, step_s = 0, compute_s = 0, sync_s = 0, optim_s = 0;
  int64_t peak_mem = 0, persistent_mem = 0, optim_state_bytes = 0;
};
nlohmann::ordered_json step_metrics(const StepRecord& r);

// The warnings of the CPU kernels' choice (ops::cpu_kernel_warnings): once, from rank 0, when
// every rank of host (all of the job's) has the same ones (one kind of node), else from each rank
// that has any. Collective over host.
void log_cpu_kernel_warnings(comm::Communicator& host, int rank);

// --print-plan: when every component's plan is final, rank 0 prints them (JSON on stdout: one as
// it is, several by component name) and it returns true; false while one is not final. A run
// none of whose components makes a plan is a UsageError.
bool print_plans(const std::vector<Component*>& parts, int rank);

class Metrics {
 public:
  // path "-": stdout. A file is appended to; with `after` >= 0 it first loses the lines of steps
  // after `after` (a resumed run writes them again), replaced atomically.
  Metrics(const std::string& path, bool active, int64_t after = -1);
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
