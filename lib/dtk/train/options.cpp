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
  if (o.runtime.threads > 0) return {o.runtime.threads, "--threads"};
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
  const Options::Model& m = o.model;
  const nn::SizeOptions sizes{m.dim,   m.layers,  m.heads,     m.kv_heads, m.ffn_hidden,
                              m.vocab, m.seq_len, m.input_dim, m.classes,  m.input_shape};
  const std::string& from = o.checkpoint.init_from;
  if (o.resumed) {
    // Options may restate the checkpoint's model, never contradict it.
    const auto c = read_config<nn::ModelConfig>(o.resumed->metadata().model_config, "model config");
    if (!o.model.preset.empty() && o.model.preset != c.preset)
      fail_usage("--model " + o.model.preset + " contradicts the checkpoint's model (" + c.preset + ")");
    return nn::restated(c, sizes);
  }
  if (!from.empty() && nn::hf::is_folder(from)) {
    // A Hugging Face folder's config: --model may name a preset of the same architecture.
    nn::ModelConfig c = nn::hf::read_config(from);
    if (!o.model.preset.empty()) {
      nn::ModelConfig p = nn::preset(o.model.preset);
      p.seq_len = c.seq_len, p.preset = c.preset;
      if (p != c)
        fail_usage("--model {} contradicts {}'s config.json (hidden_size {}, {} layers, {} heads, {} kv heads, "
                   "intermediate_size {}, vocabulary {})", o.model.preset, from, c.dim, c.n_layers, c.n_heads,
                   c.n_kv_heads, c.ffn_hidden, c.vocab);
      c.preset = o.model.preset;
    }
    return nn::restated(c, sizes);
  }
  if (!from.empty()) {  // --init-from a checkpoint: its model, which options may restate
    ckpt::Reader r(checkpoint_path(from));
    const auto c = read_config<nn::ModelConfig>(r.metadata().model_config, "model config");
    if (!o.model.preset.empty() && o.model.preset != c.preset)
      fail_usage("--model " + o.model.preset + " contradicts the checkpoint's model (" + c.preset + ")");
    return nn::restated(c, sizes);
  }
  nn::ModelConfig c = nn::preset(o.model.preset.empty() ? "llama-tiny" : o.model.preset);
  if (o.model.sync_batchnorm && c.arch != nn::Arch::resnet)
    fail_usage("--sync-batchnorm applies to models with batch norm (resnet), not " + c.preset);
  nn::SizeOptions s = sizes;
  // A resnet takes its images' shape from the data file unless --input-shape says otherwise.
  if (c.arch == nn::Arch::resnet && s.input_shape.empty()) s.input_shape = data::image_shape(o.data.train);
  return nn::with_sizes(c, s);
}

ResolvedRun validate(Options o, int world_size) {
  if (!o.resumed) o.resumed = open_resumed(o);
  const nn::ModelConfig c = resolve_model(o);
  if (o.data.global_batch < world_size)
    fail_usage("--global-batch {} gives some of the {} ranks no sample; use at least one sample per rank",
               o.data.global_batch, world_size);
  // (A pattern of shards, 'dir/train-*.bin', is no file: open_dataset finds its files.)
  const auto missing = [](const std::string& spec) {
    return spec.find_first_of("*?[") == std::string::npos && !fs::exists(spec);
  };
  if (o.data.train != "synthetic" && missing(o.data.train)) fail_usage("--data " + o.data.train + ": no such file");
  if (!o.data.val.empty() && missing(o.data.val)) fail_usage("--val-data " + o.data.val + ": no such file");
  // Opening the datasets checks them against the model (vocabulary, shapes).
  const int64_t samples = data::open_dataset(o.data.train, c, false, o.data.seed)->size();
  if (!o.data.val.empty()) data::open_dataset(o.data.val, c, true, o.data.seed);
  if (o.schedule.epochs > 0 || !o.schedule.decay_epochs.empty()) {
    const double per_epoch = static_cast<double>(samples) / static_cast<double>(o.data.global_batch);
    if (o.schedule.epochs > 0) {
      const double s = std::ceil(o.schedule.epochs * per_epoch);
      if (s > 1e15) fail_usage("--epochs {} of {} is beyond any number of steps", o.schedule.epochs, o.data.train);
      o.schedule.steps = std::max<int64_t>(1, static_cast<int64_t>(s));
      spdlog::info("--epochs {}: {} steps ({} samples, global batch {})", o.schedule.epochs, o.schedule.steps, samples,
                   o.data.global_batch);
    }
    if (!o.schedule.decay_epochs.empty()) {
      o.schedule.decay_steps.clear();
      for (double e : o.schedule.decay_epochs)
        o.schedule.decay_steps.push_back(std::max<int64_t>(1, std::llround(e * per_epoch)));
    }
  }
  if (o.schedule.warmup > o.schedule.steps)
    fail_usage("--warmup {} is longer than --steps {}", o.schedule.warmup, o.schedule.steps);
  const std::string flag = o.schedule.decay_epochs.empty() ? "--decay-steps" : "--decay-epochs";
  const std::string decay = flag + (o.schedule.decay_epochs.empty() ? "" : " (in steps)");
  const bool step_decay = o.schedule.kind == optim::ScheduleKind::step;
  if (step_decay && o.schedule.decay_steps.empty()) fail_usage("--schedule step needs --decay-steps or --decay-epochs");
  if (!step_decay && !o.schedule.decay_steps.empty())
    fail_usage(flag + " needs --schedule step (the schedule is " + std::string(name_of(o.schedule.kind)) + ")");
  for (size_t i = 0; i < o.schedule.decay_steps.size(); ++i) {
    if (i > 0 && o.schedule.decay_steps[i] <= o.schedule.decay_steps[i - 1])
      fail_usage("{} must increase: {} follows {}", decay, o.schedule.decay_steps[i], o.schedule.decay_steps[i - 1]);
    if (o.schedule.decay_steps[i] >= o.schedule.steps)
      fail_usage("{} {} is not before --steps {}: that decay would never apply", decay, o.schedule.decay_steps[i],
                 o.schedule.steps);
  }
  const Device d = parse_device(o.runtime.device);
  if (d.is_cuda()) cuda::require_gpu();
  if (o.runtime.backend == comm::Backend::nccl && !d.is_cuda())
    fail_usage("--backend nccl moves GPU buffers: add --device cuda");
  if (o.schedule.stop_at > o.schedule.steps)
    fail_usage("--stop-at {} is beyond --steps {}", o.schedule.stop_at, o.schedule.steps);
  if (o.schedule.stop_at > 0 && o.checkpoint.dir.empty() && o.checkpoint.save.empty())
    fail_usage("--stop-at needs --checkpoint-dir or --save, or the run is lost");
  if (o.checkpoint.every > 0 && o.checkpoint.dir.empty())
    fail_usage("--checkpoint-every needs --checkpoint-dir");
  // Outputs, checked here on every rank so that a run that cannot write them ends before it starts
  // (exit 2 everywhere), creating nothing: the run creates --checkpoint-dir, and rank 0 opens
  // --metrics, only after validation.
  if (!o.checkpoint.dir.empty()) check_output_dir("--checkpoint-dir", o.checkpoint.dir);
  if (!o.checkpoint.save.empty()) check_output_file("--save", o.checkpoint.save);
  if (o.runtime.metrics != "-") {
    check_output_file("--metrics", o.runtime.metrics);
    std::error_code ec;
    if (fs::is_regular_file(o.runtime.metrics, ec) && fs::file_size(o.runtime.metrics, ec) > 0 &&
        !o.runtime.metrics_append && !o.resumed)
      fail_usage("--metrics {}: the file exists (another run's metrics?); --metrics-append adds to it, or remove it",
                 o.runtime.metrics);
  }
  if (o.checkpoint.auto_resume && o.checkpoint.dir.empty()) fail_usage("--auto-resume needs --checkpoint-dir");
  if (o.resumed) {
    const std::string& resume = o.resumed->arg;
    const int64_t at = o.resumed->metadata().step, stop = last_step(o);
    if (at > stop)
      fail_usage("--resume {} is at step {}, beyond {} {}; raise it to train further", resume, at,
                 o.schedule.stop_at > 0 ? "--stop-at" : "--steps", stop);
    // Options given again that the checkpoint's state cannot follow (its tensors would not fit).
    for (const Options::Change& c : o.resume_changes)
      if (c.shapes_state)
        fail_usage("{} {} differs from the checkpoint's {} ({}): the state it holds cannot follow; leave {} out to "
                   "resume, or start a new run from its weights with --init-from",
                   c.option, c.value, c.checkpoint_value, resume, c.option);
  }
  return {o, c};
}

ResolvedRun validate_plan_only(Options o, int64_t steps, int world_size) {
  o.checkpoint.dir.clear();
  o.checkpoint.save.clear();
  o.checkpoint.every = o.schedule.stop_at = 0;
  o.checkpoint.auto_resume = false;
  if (o.checkpoint.resume.empty()) o.resumed.reset();  // opened for --auto-resume when the options were parsed
  o.schedule.steps = std::max(o.schedule.steps, steps);
  o.schedule.epochs = 0;
  ResolvedRun r = validate(std::move(o), world_size);
  if (r.options.runtime.metrics == "-") r.options.runtime.metrics = "/dev/null";
  return r;
}

int64_t last_step(const Options& o) { return o.schedule.stop_at > 0 ? o.schedule.stop_at : o.schedule.steps; }


namespace {

// The checkpoint the run continues from: --resume, or with --auto-resume the checkpoint
// directory when it holds a checkpoint; empty: a fresh start (or --init-from).
std::string resume_from(const Options& o) {
  if (!o.checkpoint.resume.empty() && nn::hf::is_folder(o.checkpoint.resume))
    fail_usage("--resume {}: a Hugging Face folder holds weights, not a run to continue; start from it with --init-from",
               o.checkpoint.resume);
  if (!o.checkpoint.resume.empty() || !o.checkpoint.auto_resume || o.checkpoint.dir.empty()) return o.checkpoint.resume;
  if (!fs::is_directory(o.checkpoint.dir) || !ckpt::Directory(o.checkpoint.dir, 1).latest()) return "";
  return o.checkpoint.dir;
}

}  // namespace

std::shared_ptr<const Resumed> open_resumed(const Options& o) {
  const std::string from = resume_from(o);
  if (from.empty()) return nullptr;
  auto r = std::make_shared<Resumed>();
  r->arg = from;
  r->path = checkpoint_path(from);
  r->reader = std::make_shared<const ckpt::Reader>(r->path);
  return r;
}

nlohmann::json resumed_run_options(Options& o) {
  if (!o.resumed) o.resumed = open_resumed(o);
  if (!o.resumed) return nullptr;
  const nlohmann::json& extra = o.resumed->metadata().extra;
  return extra.is_object() ? extra.value("run_options", nlohmann::json()) : nlohmann::json();
}

}  // namespace dtk::train
