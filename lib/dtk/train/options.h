// dtk::train — the options every *-train program shares, and their resolution: the model a run
// trains (its preset, sizes, or the checkpoint's), checks that end a bad command line before any
// work (UsageError naming the option), --epochs into steps, the checkpoint a run resumes, the
// CPU threads of a rank. The training loop (trainer.h) only reads them.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/comm/comm.h"
#include "dtk/data/augment.h"
#include "dtk/nn/model.h"
#include "dtk/optim/optimizer.h"

namespace dtk::train {

// The checkpoint a run resumes (--resume, --auto-resume), opened once: its metadata serves the
// options kept from it, the model, the checks; its tensors, the resume itself.
struct Resumed {
  std::string arg;             // --resume's argument, or the checkpoint directory (--auto-resume)
  std::filesystem::path path;  // as checkpoint_path resolved it: a file, or a sharded state's directory
  std::shared_ptr<const ckpt::Reader> reader;
  const ckpt::Metadata& metadata() const { return reader->metadata(); }
};

// The options every *-train program shares (add_options registers them), by section.
struct Options {
  struct Model {
    std::string preset;  // --model; empty: llama-tiny, or the checkpoint's model with --resume/--init-from
    std::optional<int64_t> dim, layers, heads, kv_heads, ffn_hidden, vocab, seq_len, input_dim, classes;
    std::vector<int64_t> input_shape;  // resnet: C, H, W (default: the image file's, else the preset's)
    bool sync_batchnorm = false;       // batch statistics over all ranks (SyncBatchNorm)
    nn::Checkpointing activation_checkpointing = nn::Checkpointing::none;
    nn::Precision precision = nn::Precision::f32;  // the weight products' arithmetic
  } model;
  struct Data {
    std::string train = "synthetic", val;        // --data, --val-data
    int64_t global_batch = 32, micro_batch = 0;  // micro_batch 0: the rank's whole share at once
    data::Augment augment = data::Augment::none;  // of the training images
    uint64_t seed = 0;                            // the samples, the initial weights, every draw
  } data;
  struct Optimization {
    optim::Kind optimizer = optim::Kind::adamw;
    std::optional<double> momentum;  // unset: SGD 0.9, Shampoo none (0.9 with --nesterov)
    double weight_decay = 0.0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
    bool nesterov = false;
    double clip = 1.0;  // 0: no clipping
  } optimization;
  struct Schedule {
    int64_t steps = 300;
    double epochs = 0;    // > 0: steps from passes over --data (validate resolves it)
    int64_t stop_at = 0;  // stop after this step (a checkpoint is written), as if interrupted; 0: --steps
    double lr = 3e-3;     // the peak
    optim::ScheduleKind kind = optim::ScheduleKind::cosine;
    int64_t warmup = 0;
    double min_lr_ratio = 0.1;
    std::vector<int64_t> decay_steps;  // --schedule step
    std::vector<double> decay_epochs;  // ... given in epochs (validate resolves them into decay_steps)
    double decay_factor = 0.1;
  } schedule;
  struct Evaluation {
    int64_t every = 50, batches = 4;  // --eval-every (0: at the end), --eval-batches
  } evaluation;
  struct Checkpoint {
    std::string dir;  // --checkpoint-dir
    int64_t every = 0;
    int keep = 3;
    // Checkpoints before the last written in the background (run_state.h's PendingSave): the step
    // waits only for a copy of the state in host memory.
    bool async = true;
    std::string save, resume, init_from;
    bool auto_resume = false;  // resume from dir's latest when it has one
  } checkpoint;
  struct Runtime {
    std::string device = "cpu";
    comm::Backend backend = comm::Backend::automatic;  // of the model's collectives (host values go by MPI)
    int threads = 0;  // CPU threads of each rank; 0: OMP_NUM_THREADS, else the rank's share of the node's cores
    size_t bucket_bytes = 25u << 20;
    int64_t log_every = 10;
    std::string metrics = "-";
    bool metrics_append = false;  // add to an existing --metrics file (else refused, or continued on resume)
    bool print_plan = false;      // print the components' plans once final, then stop (validate_plan_only)
  } runtime;
  // The options that define the run (kept_on_resume) as given, {"--lr": ["3e-4"], ...}, the
  // checkpoint's included when resuming: saved in checkpoints (train::add_options fills it).
  nlohmann::json run_options = nlohmann::json::object();
  // Options given again on resume whose values differ from the checkpoint's.
  struct Change {
    std::string option, value, checkpoint_value;
    bool shapes_state = false;  // the option shapes the checkpoint's state (marked where it is declared)
  };
  std::vector<Change> resume_changes;
  // The checkpoint it resumes, opened when the options are parsed (open_resumed; validate opens
  // it when they were not); null: a fresh start (or --init-from).
  std::shared_ptr<const Resumed> resumed;
};

// The checkpoint the options resume, opened (a UsageError naming it when it cannot be read);
// null when they resume none.
std::shared_ptr<const Resumed> open_resumed(const Options& o);

// A run as validate() resolved it, which the trainer takes: the options (--epochs into steps,
// --decay-epochs into decay_steps, the resumed checkpoint open) and the model.
struct ResolvedRun {
  Options options;
  nn::ModelConfig model;
};

// Resuming: the options given when the checkpoint's run began (Options::run_options, saved in
// its metadata), null when there is no checkpoint to resume or it predates the record. Opens the
// checkpoint into o.resumed; throws as validate would on a bad one.
nlohmann::json resumed_run_options(Options& o);

// Checks the options (UsageError naming the option) and returns the resolved model config (the
// resumed checkpoint's: o.resumed, open).
nn::ModelConfig resolve_model(const Options& o);
// Checks the options (UsageError naming the option) and returns the run resolved: --epochs into
// steps and --decay-epochs into decay_steps (an epoch: the training data's samples /
// --global-batch steps), the model, the resumed checkpoint open.
ResolvedRun validate(Options o, int world_size);
// validate() for a run that only prints a plan (--print-plan) and stops: no checkpoint and no
// save (a job's checkpoint options, from its --config, stay idle), at least `steps` steps (the
// plan is made after some), no epochs; its metrics go nowhere unless --metrics names a file, so
// that stdout carries the plan alone.
ResolvedRun validate_plan_only(Options o, int64_t steps, int world_size);

// The step the run ends at: --stop-at, else --steps.
int64_t last_step(const Options& o);

// A checkpoint argument: a file, or a checkpoint directory (its latest entry); UsageError when
// there is none.
std::filesystem::path checkpoint_path(const std::string& arg);

// This rank's CPU threads and why: --threads; OMP_NUM_THREADS; the CPUs the launcher bound the
// rank to when fewer than the node's; else the node's cores shared equally among its ranks.
std::pair<int, std::string> resolve_threads(const Options& o, const comm::Runtime& rt);

}  // namespace dtk::train
