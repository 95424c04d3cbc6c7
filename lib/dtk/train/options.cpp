#include "dtk/train/options.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/core/checks.h"
#include "dtk/core/error.h"
#include "dtk/data/dataset.h"
#include "dtk/nn/hf.h"

namespace fs = std::filesystem;

namespace dtk::train {

namespace {

// Options that shape the state a checkpoint holds: a resume cannot change them.
constexpr std::string_view kStateOptions[] = {"--optimizer", "--compressor", "--rank", "--max-preconditioner-dim",
                                              "--factor-dtype", "--no-error-feedback", "--error-mode",
                                              "--auto-ranks"};

}  // namespace

fs::path checkpoint_path(const std::string& arg) {
  fs::path p(arg);
  if (nn::hf::is_folder(p)) return p;
  if (fs::is_directory(p) && !fs::exists(p / "index.h5")) {
    auto latest = ckpt::Directory(p, 1).latest();
    if (!latest) fail_usage(arg + ": a directory without checkpoints");
    return *latest;
  }
  if (!fs::exists(p)) fail_usage(arg + ": no such checkpoint");
  return p;
}

// The node's cores are shared so that ranks never run more busy threads than there are cores;
// the launcher's binding: mpiexec --bind-to, srun --cpus-per-task.
std::pair<int, std::string> resolve_threads(const Options& o, const comm::Runtime& rt) {
  if (o.threads > 0) return {o.threads, "--threads"};
  if (const char* env = std::getenv("OMP_NUM_THREADS"); env && std::atoi(env) > 0)
    return {std::atoi(env), "OMP_NUM_THREADS"};
  const int node = std::max(1, static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
  cpu_set_t set;
  CPU_ZERO(&set);
  const int bound = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : node;
  if (bound > 0 && bound < node)
    return {bound, fmt::format("{} CPUs bound to this rank by the launcher", bound)};
  const int ranks = std::max(1, rt.local_size());
  return {std::max(1, node / ranks), fmt::format("{} cores shared by {} rank(s) on this node", node, ranks)};
}

nn::ModelConfig resolve_model(const Options& o) {
  const nn::SizeOptions sizes{o.dim,       o.layers, o.heads,     o.kv_heads, o.ffn_hidden,
                              o.vocab,     o.seq_len, o.input_dim, o.classes,  o.input_shape};
  const std::string resume = resume_from(o);
  const std::string& from = !resume.empty() ? resume : o.init_from;
  if (!from.empty() && nn::hf::is_folder(from)) {
    // A Hugging Face folder's config: --model may name a preset of the same architecture.
    nn::ModelConfig c = nn::hf::read_config(from);
    if (!o.model.empty()) {
      nn::ModelConfig p = nn::preset(o.model);
      p.seq_len = c.seq_len, p.preset = c.preset;
      if (p != c)
        fail_usage("--model {} contradicts {}'s config.json (hidden_size {}, {} layers, {} heads, {} kv heads, "
                   "intermediate_size {}, vocabulary {})", o.model, from, c.dim, c.n_layers, c.n_heads, c.n_kv_heads,
                   c.ffn_hidden, c.vocab);
      c.preset = o.model;
    }
    return nn::restated(c, sizes);
  }
  if (!from.empty()) {
    // Options may restate the checkpoint's model, never contradict it.
    ckpt::Reader r(checkpoint_path(from));
    const auto c = read_config<nn::ModelConfig>(r.metadata().model_config, "model config");
    if (!o.model.empty() && o.model != c.preset)
      fail_usage("--model " + o.model + " contradicts the checkpoint's model (" + c.preset + ")");
    return nn::restated(c, sizes);
  }
  nn::ModelConfig c = nn::preset(o.model.empty() ? "llama-tiny" : o.model);
  if (o.sync_batchnorm && c.arch != nn::Arch::resnet)
    fail_usage("--sync-batchnorm applies to models with batch norm (resnet), not " + c.preset);
  nn::SizeOptions s = sizes;
  // A resnet takes its images' shape from the data file unless --input-shape says otherwise.
  if (c.arch == nn::Arch::resnet && s.input_shape.empty()) s.input_shape = data::image_shape(o.data);
  return nn::with_sizes(c, s);
}

Options validate(Options o, int world_size) {
  const nn::ModelConfig c = resolve_model(o);
  if (o.global_batch < world_size)
    fail_usage("--global-batch {} gives some of the {} ranks no sample; use at least one sample per rank",
               o.global_batch, world_size);
  // (A pattern of shards, 'dir/train-*.bin', is no file: open_dataset finds its files.)
  const auto missing = [](const std::string& spec) {
    return spec.find_first_of("*?[") == std::string::npos && !fs::exists(spec);
  };
  if (o.data != "synthetic" && missing(o.data)) fail_usage("--data " + o.data + ": no such file");
  if (!o.val_data.empty() && missing(o.val_data)) fail_usage("--val-data " + o.val_data + ": no such file");
  // Opening the datasets checks them against the model (vocabulary, shapes).
  const int64_t samples = data::open_dataset(o.data, c, false, o.seed)->size();
  if (!o.val_data.empty()) data::open_dataset(o.val_data, c, true, o.seed);
  if (o.epochs > 0 || !o.decay_epochs.empty()) {
    const double per_epoch = static_cast<double>(samples) / static_cast<double>(o.global_batch);
    if (o.epochs > 0) {
      const double s = std::ceil(o.epochs * per_epoch);
      if (s > 1e15) fail_usage("--epochs {} of {} is beyond any number of steps", o.epochs, o.data);
      o.steps = std::max<int64_t>(1, static_cast<int64_t>(s));
      spdlog::info("--epochs {}: {} steps ({} samples, global batch {})", o.epochs, o.steps, samples, o.global_batch);
    }
    if (!o.decay_epochs.empty()) {
      o.decay_steps.clear();
      for (double e : o.decay_epochs) o.decay_steps.push_back(std::max<int64_t>(1, std::llround(e * per_epoch)));
    }
  }
  if (o.warmup > o.steps)
    fail_usage("--warmup {} is longer than --steps {}", o.warmup, o.steps);
  const std::string flag = o.decay_epochs.empty() ? "--decay-steps" : "--decay-epochs";
  const std::string decay = flag + (o.decay_epochs.empty() ? "" : " (in steps)");
  const bool step_decay = o.schedule == optim::ScheduleKind::step;
  if (step_decay && o.decay_steps.empty()) fail_usage("--schedule step needs --decay-steps or --decay-epochs");
  if (!step_decay && !o.decay_steps.empty())
    fail_usage(flag + " needs --schedule step (the schedule is " + std::string(name_of(o.schedule)) + ")");
  for (size_t i = 0; i < o.decay_steps.size(); ++i) {
    if (i > 0 && o.decay_steps[i] <= o.decay_steps[i - 1])
      fail_usage("{} must increase: {} follows {}", decay, o.decay_steps[i], o.decay_steps[i - 1]);
    if (o.decay_steps[i] >= o.steps)
      fail_usage("{} {} is not before --steps {}: that decay would never apply", decay, o.decay_steps[i], o.steps);
  }
  const Device d = parse_device(o.device);
  if (d.is_cuda()) cuda::require_gpu();
  if (o.backend == comm::Backend::nccl && !d.is_cuda())
    fail_usage("--backend nccl moves GPU buffers: add --device cuda");
  if (o.stop_at > o.steps)
    fail_usage("--stop-at {} is beyond --steps {}", o.stop_at, o.steps);
  if (o.stop_at > 0 && o.checkpoint_dir.empty() && o.save.empty())
    fail_usage("--stop-at needs --checkpoint-dir or --save, or the run is lost");
  if (o.checkpoint_every > 0 && o.checkpoint_dir.empty())
    fail_usage("--checkpoint-every needs --checkpoint-dir");
  // Outputs, checked here on every rank so that a run that cannot write them ends before it starts
  // (exit 2 everywhere), creating nothing: the run creates --checkpoint-dir, and rank 0 opens
  // --metrics, only after validation.
  if (!o.checkpoint_dir.empty()) check_output_dir("--checkpoint-dir", o.checkpoint_dir);
  if (!o.save.empty()) check_output_file("--save", o.save);
  if (o.metrics != "-") {
    check_output_file("--metrics", o.metrics);
    std::error_code ec;
    if (fs::is_regular_file(o.metrics, ec) && fs::file_size(o.metrics, ec) > 0 && !o.metrics_append &&
        resume_from(o).empty())
      fail_usage("--metrics {}: the file exists (another run's metrics?); --metrics-append adds to it, or remove it",
                 o.metrics);
  }
  if (o.auto_resume && o.checkpoint_dir.empty()) fail_usage("--auto-resume needs --checkpoint-dir");
  if (const std::string resume = resume_from(o); !resume.empty()) {
    ckpt::Reader r(checkpoint_path(resume));
    const int64_t stop = last_step(o);
    if (r.metadata().step > stop)
      fail_usage("--resume {} is at step {}, beyond {} {}; raise it to train further", resume, r.metadata().step,
                 o.stop_at > 0 ? "--stop-at" : "--steps", stop);
    // Options given again that the checkpoint's state cannot follow (its tensors would not fit).
    for (const Options::Change& c : o.resume_changes)
      if (std::find(std::begin(kStateOptions), std::end(kStateOptions), c.option) != std::end(kStateOptions))
        fail_usage("{} {} differs from the checkpoint's {} ({}): the optimizer and compressor state it holds cannot "
                   "follow; leave {} out to resume, or start a new run from its weights with --init-from",
                   c.option, c.value, c.checkpoint_value, resume, c.option);
  }
  return o;
}

Options validate_plan_only(Options o, int64_t steps, int world_size) {
  o.checkpoint_dir.clear();
  o.save.clear();
  o.checkpoint_every = o.stop_at = 0;
  o.auto_resume = false;
  o.steps = std::max(o.steps, steps);
  o.epochs = 0;
  o = validate(std::move(o), world_size);
  if (o.metrics == "-") o.metrics = "/dev/null";
  return o;
}

int64_t last_step(const Options& o) { return o.stop_at > 0 ? o.stop_at : o.steps; }

std::string resume_from(const Options& o) {
  if (!o.resume.empty() && nn::hf::is_folder(o.resume))
    fail_usage("--resume {}: a Hugging Face folder holds weights, not a run to continue; start from it with --init-from",
               o.resume);
  if (!o.resume.empty() || !o.auto_resume || o.checkpoint_dir.empty()) return o.resume;
  if (!fs::is_directory(o.checkpoint_dir) || !ckpt::Directory(o.checkpoint_dir, 1).latest()) return "";
  return o.checkpoint_dir;
}

nlohmann::json resumed_run_options(const Options& o) {
  const std::string from = resume_from(o);
  if (from.empty()) return nullptr;
  const nlohmann::json extra = ckpt::Reader(checkpoint_path(from)).metadata().extra;
  return extra.is_object() ? extra.value("run_options", nlohmann::json()) : nlohmann::json();
}

}  // namespace dtk::train
