#include "dtk/train/trainer.h"

#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <fmt/format.h>
#include <map>
#include <spdlog/spdlog.h>
#include <tuple>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/comm/watchdog.h"
#include "dtk/core/checks.h"
#include "dtk/core/error.h"
#include "dtk/data/dataset.h"
#include "dtk/ops/ops.h"
#include "dtk/parallel/data_parallel.h"
#include "dtk/train/metrics.h"
#include "dtk/train/stop.h"

namespace fs = std::filesystem;

namespace dtk::train {

namespace {

// A checkpoint argument: a file, or a checkpoint directory (its latest entry).
fs::path checkpoint_path(const std::string& arg) {
  fs::path p(arg);
  if (fs::is_directory(p) && !fs::exists(p / "index.h5")) {
    auto latest = ckpt::Directory(p, 1).latest();
    if (!latest) fail_usage(arg + ": a directory without checkpoints");
    return *latest;
  }
  if (!fs::exists(p)) fail_usage(arg + ": no such checkpoint");
  return p;
}

// This rank's CPU threads and why: --threads; OMP_NUM_THREADS; the CPUs the launcher bound the
// rank to (mpiexec --bind-to, srun --cpus-per-task) when fewer than the node's; else the node's
// cores shared equally among the ranks on it, so that ranks never run more busy threads than
// there are cores.
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

// Options that shape the state a checkpoint holds: a resume cannot change them.
constexpr std::string_view kStateOptions[] = {"--optimizer", "--compressor", "--rank", "--max-preconditioner-dim",
                                              "--factor-dtype", "--no-error-feedback", "--error-mode"};

}  // namespace

nn::ModelConfig resolve_model(const Options& o) {
  nn::ModelConfig c;
  const std::string resume = resume_from(o);
  const std::string& from = !resume.empty() ? resume : o.init_from;
  if (!from.empty()) {
    ckpt::Reader r(checkpoint_path(from));
    c = read_config<nn::ModelConfig>(r.metadata().model_config, "model config");
    // Options may restate the checkpoint's model, never contradict it.
    auto same = [&](const char* opt, const std::optional<int64_t>& v, int64_t have) {
      if (v && *v != have)
        fail_usage("{} {} contradicts the checkpoint's model ({}); leave the size options out to use the checkpoint's",
                   opt, *v, have);
    };
    if (!o.model.empty() && o.model != c.preset)
      fail_usage("--model " + o.model + " contradicts the checkpoint's model (" + c.preset + ")");
    same("--dim", o.dim, c.dim);
    same("--heads", o.heads, c.n_heads);
    same("--kv-heads", o.kv_heads, c.n_kv_heads);
    same("--ffn-hidden", o.ffn_hidden, c.ffn_hidden);
    same("--vocab", o.vocab, c.vocab);
    same("--input-dim", o.input_dim, c.input_dim);
    same("--classes", o.classes, c.classes);
    if (!o.input_shape.empty() && o.input_shape != c.input_shape)
      fail_usage("--input-shape " + shape_str(o.input_shape) + " contradicts the checkpoint's model (" +
                 shape_str(c.input_shape) + ")");
    if (c.arch == "llama") same("--layers", o.layers, c.n_layers);
    // seq_len may change between runs of a llama (RoPE has no trained length).
    if (o.seq_len) c.seq_len = *o.seq_len;
    c.validate();
    return c;
  }
  c = nn::preset(o.model.empty() ? "llama-tiny" : o.model);
  if (!o.input_shape.empty() && c.arch != "resnet") fail_usage("--input-shape applies to resnet models, not " + c.preset);
  if (o.sync_batchnorm && c.arch != "resnet")
    fail_usage("--sync-batchnorm applies to models with batch norm (resnet), not " + c.preset);
  if (c.arch == "resnet") {
    if (o.dim || o.layers || o.heads || o.kv_heads || o.ffn_hidden || o.vocab || o.seq_len || o.input_dim)
      fail_usage("--dim, --layers, --heads, --kv-heads, --ffn-hidden, --vocab, --seq-len and --input-dim do not apply "
                 "to " + c.preset + " (its sizes are the preset's; --input-shape and --classes set its input and output)");
    if (!o.input_shape.empty()) c.input_shape = o.input_shape;
    else if (const auto s = data::image_shape(o.data); !s.empty()) c.input_shape = s;
    if (o.classes) c.classes = *o.classes;
  } else if (c.arch == "llama") {
    if (o.input_dim || o.classes) fail_usage("--input-dim and --classes apply to mlp models, not " + c.preset);
    if (o.dim) c.dim = *o.dim;
    if (o.layers) c.n_layers = *o.layers;
    if (o.heads) c.n_heads = *o.heads;
    if (o.kv_heads) c.n_kv_heads = *o.kv_heads;
    if (o.ffn_hidden) c.ffn_hidden = *o.ffn_hidden;
    if (o.vocab) c.vocab = *o.vocab;
    if (o.seq_len) c.seq_len = *o.seq_len;
  } else {
    if (o.heads || o.kv_heads || o.ffn_hidden || o.vocab || o.seq_len)
      fail_usage("--heads, --kv-heads, --ffn-hidden, --vocab and --seq-len apply to llama models, not " + c.preset);
    if (o.dim || o.layers) {
      const int64_t width = o.dim ? *o.dim : (c.hidden.empty() ? 64 : c.hidden[0]);
      const size_t n = o.layers ? static_cast<size_t>(*o.layers) : c.hidden.size();
      c.hidden.assign(n, width);
    }
    if (o.input_dim) c.input_dim = *o.input_dim;
    if (o.classes) c.classes = *o.classes;
  }
  c.validate();
  return c;
}

Options validate(Options o, int world_size) {
  const nn::ModelConfig c = resolve_model(o);
  if (o.global_batch < world_size)
    fail_usage("--global-batch {} gives some of the {} ranks no sample; use at least one sample per rank",
               o.global_batch, world_size);
  if (o.data != "synthetic" && !fs::exists(o.data)) fail_usage("--data " + o.data + ": no such file");
  if (!o.val_data.empty() && !fs::exists(o.val_data)) fail_usage("--val-data " + o.val_data + ": no such file");
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
  if (o.optimizer == optim::Kind::shampoo) {
    shampoo_config(o).validate();
    const int g = o.shampoo.trainers_per_group;
    if (g > 0 && world_size % g != 0)
      fail_usage("--trainers-per-group {} does not divide the {} ranks", g, world_size);
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

int64_t last_step(const Options& o) { return o.stop_at > 0 ? o.stop_at : o.steps; }

std::string resume_from(const Options& o) {
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

optim::ShampooConfig shampoo_config(const Options& o) {
  optim::ShampooConfig base = o.shampoo;
  base.beta1 = o.beta1;
  base.beta2 = o.beta2;
  base.weight_decay = o.weight_decay;
  base.nesterov = o.nesterov;
  base.momentum = o.momentum.value_or(o.nesterov ? 0.9 : 0.0);
  return base;
}

// ------------------------------------------------------------------------------------ the loop

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

class Trainer {
 public:
  Trainer(const Options& o, const Strategy& s, comm::Runtime& rt)
      : o_(o), s_(s), rt_(rt), device_(parse_device(o.device)), cfg_(resolve_model(o)) {
    const auto [threads, why] = resolve_threads(o, rt);
    ops::set_cpu_threads(threads);
    spdlog::info("CPU threads per rank: {} ({})", threads, why);
    device_ = rt.bind_device(device_);
    comm_ = rt.world(o.backend, device_);
    host_ = rt.world(comm::Backend::automatic, Device::cpu());
    rank_ = comm_->rank();
    world_ = comm_->size();

    model_ = nn::make_model(cfg_, device_, DType::f32, s.sharded ? nn::Storage::external : nn::Storage::flat);
    model_->set_activation_checkpointing(o.activation_checkpointing);
    if (s.sharded) {
      par_ = s.sharded(*model_, *comm_, *host_);
    } else if (s.compressor) {
      compressor_ = s.compressor(*comm_, model_->params(), o.bucket_bytes);
      par_ = std::make_unique<parallel::GradSync>(*model_, *comm_, *compressor_);
    } else {
      par_ = std::make_unique<parallel::GradSync>(*model_, *comm_, o.bucket_bytes);
    }
    model_->set_hooks(par_.get());
    if (o.sync_batchnorm) model_->set_batchnorm_sync([this](Tensor& sums, double& count) {
      comm_->all_reduce(comm::buffer_of(sums), comm::buffer_of(sums), comm::ReduceOp::sum, comm::Mode::sync);
      host_->all_reduce({&count, 1, DType::f64, {}}, {&count, 1, DType::f64, {}}, comm::ReduceOp::sum, comm::Mode::sync);
    });
    par_->init(o.seed);
    train_ = data::open_dataset(o.data, cfg_, false, o.seed);
    if (o.augment != data::Augment::none) {
      const nlohmann::json d = train_->describe();
      if (!d.contains("image_shape"))
        fail_usage("--augment " + std::string(name_of(o.augment)) + " needs image data (a file from data-pack "
                   "mnist or cifar10); " + o.data + " holds none");
      image_shape_ = d["image_shape"].get<std::vector<int64_t>>();  // C, H, W
    }
    if (!o.val_data.empty()) val_ = data::open_dataset(o.val_data, cfg_, true, o.seed);
    else if (o.data == "synthetic") val_ = data::open_dataset("synthetic", cfg_, true, o.seed);
    sampler_ = std::make_unique<data::Sampler>(train_->size(), o.global_batch, o.seed);
    if (val_) val_sampler_ = std::make_unique<data::Sampler>(val_->size(), o.global_batch, o.seed + 1);
    std::tie(begin_, end_) = data::Sampler::shard(o.global_batch, rank_, world_);

    optim_ = make_optimizer();
    schedule_ = {o.schedule, o.lr, o.warmup, o.steps, o.min_lr_ratio, o.decay_steps, o.decay_factor};

    {  // optimizer state held by this rank; the metrics report the largest over ranks
      double bytes = 0;
      for (const PlacedTensor& t : optim_->state()) bytes += static_cast<double>(t.value.bytes());
      host_->all_reduce({&bytes, 1, DType::f64, {}}, {&bytes, 1, DType::f64, {}}, comm::ReduceOp::max, comm::Mode::sync);
      optim_state_bytes_ = static_cast<int64_t>(bytes);
    }
    if (const std::string from = resume_from(o); !from.empty()) resume(checkpoint_path(from));
    else if (!o.init_from.empty()) init_from(checkpoint_path(o.init_from));
    par_->loaded();
    sync_buffers();
    if (!o.checkpoint_dir.empty()) {
      if (rank_ == 0) fs::create_directories(o.checkpoint_dir);
      dir_ = std::make_unique<ckpt::Directory>(o.checkpoint_dir, o.keep);
    }
  }

  int run() {
    describe();
    // A resumed run continues its metrics file after the checkpoint's step (--metrics-append: as it is).
    Metrics metrics(o_.metrics, rank_ == 0, resumed_ && !o_.metrics_append ? start_step_ : -1);
    Progress progress(rank_ == 0, o_.steps, o_.log_every);
    const int64_t items_per_sample = cfg_.arch == "llama" ? cfg_.seq_len : 1;
    const int64_t stop = last_step(o_);
    int64_t end = stop;  // the step the run ends at: earlier when a signal stops it
    for (int64_t step = start_step_; step < stop; ++step) {
      if (!par_->before_step(step)) return 0;  // fsdp-train --print-plan
      reset_peak_memory(device_);
      const int64_t persistent = memory_stats(device_).current;
      const auto t0 = Clock::now();
      const double lr = schedule_.at(step);
      const double loss = train_step(step);
      const auto t_opt = Clock::now();
      const double grad_norm = par_->clip_grad_norm(o_.clip);
      optim_->step(par_->params(), lr);
      wait_device("the step's work on the GPU");
      const double dt = seconds_since(t0), opt_s = seconds_since(t_opt);
      if (!std::isfinite(loss))
        fail("the loss is {} at step {}; lower --lr, raise --warmup or clip (--clip)",
             std::isnan(loss) ? "NaN" : "infinite", step + 1);

      nlohmann::ordered_json m = {{"step", step + 1}, {"loss", loss}};
      if (cfg_.classifier()) m["accuracy"] = accuracy_;
      m.update(nlohmann::ordered_json{{"lr", lr}, {"grad_norm", grad_norm},
                          {cfg_.arch == "llama" ? "tokens_per_s" : "samples_per_s", static_cast<double>(o_.global_batch * items_per_sample) / dt},
                          {"model_flops_per_s", cfg_.train_flops_per_item() * static_cast<double>(o_.global_batch * items_per_sample) / dt},
                          {"step_time_ms", dt * 1e3}, {"compute_ms", compute_s_ * 1e3}, {"sync_ms", sync_s_ * 1e3},
                          {"optim_ms", opt_s * 1e3}, {"peak_mem_bytes", memory_stats(device_).peak},
                          {"persistent_mem_bytes", persistent}, {"optim_state_bytes", optim_state_bytes_}});
      par_->metrics(m);
      const bool last = step + 1 == stop;
      const bool stopping = stop_requested_ && !last;  // a signal: this step is the last
      double val = NAN, val_acc = NAN;
      if (val_ && !stopping && (last || (o_.eval_every > 0 && (step + 1) % o_.eval_every == 0))) {
        std::tie(val, val_acc) = evaluate();
        m["val_loss"] = val;
        if (cfg_.classifier()) m["val_accuracy"] = val_acc;
        else val_acc = NAN;
      }
      metrics.write(m);
      progress.update(step + 1, loss, val, lr, dt, val_acc);
      const comm::watchdog::Patient writing;  // the checkpoints' waits may be long, signal or not
      if (dir_ && (last || stopping || (o_.checkpoint_every > 0 && (step + 1) % o_.checkpoint_every == 0))) {
        const fs::path p = dir_->entry(step + 1, sharded());
        save(p, step + 1);
        agreed(rank_ == 0, [&] { dir_->finish(p); });  // `latest`, pruning
        written(p);
      }
      if (stopping) {
        end = step + 1;
        break;
      }
    }
    progress.done();
    if (!o_.save.empty()) {
      const comm::watchdog::Patient writing;
      save(o_.save, end);
      written(o_.save);
    }
    std::fflush(stdout);
    if (end == stop) return 0;
    if (dir_ || !o_.save.empty())
      spdlog::warn("stopped at step {} of {} on a signal, checkpoint written; --resume continues", end, stop);
    else
      spdlog::warn("stopped at step {} of {} on a signal; nothing saved (no --checkpoint-dir or --save)", end, stop);
    return kExitStopped;
  }

 private:
  // A checkpoint written: its path on stdout for pipelines (| xargs shard-inspect ...), unless the
  // metrics go there: stdout then carries them alone, and the path is logged.
  void written(const fs::path& p) const {
    if (rank_ != 0) return;
    if (o_.metrics == "-") spdlog::info("checkpoint written: {}", p.string());
    else std::printf("%s\n", p.c_str());
  }

  // The host waits for the GPU (watched) where the loop reads its clock: the step's times are
  // the device's, not the launches'.
  void wait_device(const char* what) const {
    if (device_.is_cuda()) cuda::stream_synchronize(cuda::current_stream(), what);
  }

  // Forward and backward over this rank's share of the step's global batch; gradients
  // aggregated on return. Returns the global-batch mean loss (the same on every rank).
  double train_step(int64_t step) {
    const auto t0 = Clock::now();
    par_->zero_grad();
    double loss_sum = 0, correct = 0;
    for_each_micro_batch(*train_, sampler_->global_indices(step), step, [&](const nn::Batch& batch, int64_t k, bool last) {
      loss_sum += model_->forward(batch) * static_cast<double>(k);
      correct += static_cast<double>(std::max<int64_t>(0, model_->correct()));
      if (last) par_->begin(step);  // its buckets start during this backward
      model_->backward(static_cast<double>(k) / static_cast<double>(o_.global_batch));
    });
    wait_device("the forward and backward passes on the GPU");
    const auto t_sync = Clock::now();
    compute_s_ = std::chrono::duration<double>(t_sync - t0).count();
    par_->finish();
    wait_device("the gradient synchronisation");
    sync_s_ = seconds_since(t_sync);
    // The loss (and a classifier's correct predictions) over ranks and, in the same all-reduce,
    // whether a stop signal reached any rank: every rank then finishes this step and stops after it.
    double v[3] = {loss_sum, signals_.received() ? 1.0 : 0.0, correct};
    host_->all_reduce({v, 3, DType::f64, {}}, {v, 3, DType::f64, {}}, comm::ReduceOp::sum, comm::Mode::sync);
    accuracy_ = v[2] / static_cast<double>(o_.global_batch);
    if (v[1] > 0 && !stop_requested_) {
      stop_requested_ = true;
      const int sig = signals_.received();
      spdlog::warn("{} received{}: finishing step {}, then writing a checkpoint (a second signal ends at once)",
                   sig ? signal_name(sig) : "a stop signal", sig ? "" : " by another rank", step + 1);
    }
    return v[0] / static_cast<double>(o_.global_batch);
  }

  // The validation loss and (classifiers) top-1 accuracy over eval_batches fixed global batches
  // (the same every time).
  std::pair<double, double> evaluate() {
    sync_buffers();
    double v[2] = {0, 0};
    for (int64_t b = 0; b < o_.eval_batches; ++b)
      for_each_micro_batch(*val_, val_sampler_->global_indices(b), -1, [&](const nn::Batch& batch, int64_t k, bool) {
        v[0] += model_->evaluate(batch) * static_cast<double>(k);
        v[1] += static_cast<double>(std::max<int64_t>(0, model_->correct()));
      });
    host_->all_reduce({v, 2, DType::f64, {}}, {v, 2, DType::f64, {}}, comm::ReduceOp::sum, comm::Mode::sync);
    const double n = static_cast<double>(o_.global_batch * o_.eval_batches);
    return {v[0] / n, v[1] / n};
  }

  // This rank's rows [begin_, end_) of a global batch, in micro-batches on the device:
  // f(batch, samples, last micro-batch). A training step (step >= 0) augments them (--augment).
  template <class F>
  void for_each_micro_batch(const data::Dataset& ds, const std::vector<int64_t>& global, int64_t step, F&& f) {
    const int64_t n = end_ - begin_, mb = o_.micro_batch > 0 ? o_.micro_batch : n;
    for (int64_t i = 0; i < n; i += mb) {
      const int64_t k = std::min(mb, n - i);
      const std::span<const int64_t> idx{global.data() + begin_ + i, static_cast<size_t>(k)};
      nn::Batch b = ds.get(idx);
      if (step >= 0 && o_.augment != data::Augment::none)
        data::augment(b, o_.augment, image_shape_[0], image_shape_[1], image_shape_[2], idx, o_.seed, step);
      f(b.to(device_), k, i + k >= n);
    }
  }

  // The optimizer over what this rank holds; Shampoo splits its blocks over the ranks that hold
  // the same parameters (collective over them).
  std::unique_ptr<optim::Optimizer> make_optimizer() {
    if (o_.optimizer == optim::Kind::shampoo)
      return optim::make_shampoo(shampoo_config(o_), par_->params(), par_->optimizer_comm(), par_->param_rows());
    optim::OptimConfig oc;
    oc.name = o_.optimizer;
    if (o_.momentum) oc.momentum = *o_.momentum;
    oc.nesterov = o_.nesterov;
    oc.beta1 = o_.beta1;
    oc.beta2 = o_.beta2;
    oc.eps = o_.eps;
    oc.weight_decay = o_.weight_decay;
    return optim::make_optimizer(oc, par_->params(), par_->param_rows());
  }

  // ---- checkpoints
  // The model (the parallelism's parameters and buffers) and, unless only the weights are
  // wanted, the optimizer's and the gradient synchronisation's state: each placed by its owner.
  std::vector<PlacedTensor> state(bool weights_only = false) {
    std::vector<PlacedTensor> s = par_->state();
    if (weights_only) return s;
    for (PlacedTensor& t : prefixed("optim/", optim_->state())) s.push_back(std::move(t));
    for (PlacedTensor& t : par_->sync_state()) s.push_back(std::move(t));
    return s;
  }

  // Rank 0's buffers on every rank, as DDP broadcasts them (broadcast_buffers): with per-rank
  // batch statistics each rank's running statistics follow its own batches, and rank 0's are the
  // model's. Before every evaluation and checkpoint; training forwards use batch statistics.
  void sync_buffers() {
    if (Tensor& b = model_->buffer_values(); b.defined() && world_ > 1)
      comm_->broadcast(comm::buffer_of(b), 0, comm::Mode::sync);
  }

  bool sharded() const { return par_->rows(0) != nullptr; }

  // Returns false when per-rank state could not be restored (ckpt::load_state).
  bool load(const ckpt::Reader& r, const std::vector<PlacedTensor>& state) {
    const auto [rank, size] = par_->state_rank();
    return ckpt::load_state(r, state, rank, size);
  }

  void save(const fs::path& path, int64_t step) {
    ckpt::Metadata m;
    m.program = s_.program;
    m.program_version = DTK_VERSION;
    m.step = step;
    m.world_size = world_;
    m.model_config = cfg_;
    m.optim_config = optim_->config();
    m.optim_config["schedule"] = schedule_;
    m.optim_config["clip"] = o_.clip;
    m.data_position = {{"step", step}, {"global_batch", o_.global_batch}, {"seed", o_.seed},
                       {"samples_seen", step * o_.global_batch}, {"data", o_.data}};
    m.rng_state = {{"generator", "philox4x32-10"}, {"seed", o_.seed},
                   {"note", "counter-based: every draw is a function of (seed, step), nothing else to restore"}};
    m.extra = {{"program_config", s_.config}};
    if (compressor_) m.extra["compressor"] = nullptr;
    m.extra["state_ranks"] = par_->state_rank().second;  // whose per-rank state this is (ckpt::load_state)
    m.extra["run_options"] = o_.run_options;        // what a resume keeps (cli::add_options)
    sync_buffers();
    if (!sharded()) return ckpt::save_state(path, state(), m, *host_);
    // Sharded: the ranks of one shard group write their rows in parallel; HSDP's other groups
    // hold the same shards and learn the outcome: every rank ends with the same AgreedError.
    const auto s = state();
    comm::Communicator* c = par_->checkpoint_comm();
    agreed(c != nullptr, [&] { ckpt::save_sharded_state(path, s, m, *c); });
  }

  // Runs f where `mine`; a failure of f on any rank becomes the same AgreedError on every rank.
  template <class F>
  void agreed(bool mine, F&& f) {
    std::string err;
    if (mine) {
      try {
        f();
      } catch (const std::exception& e) {
        err = *e.what() ? e.what() : "a checkpoint write failed";
      }
    }
    if (const std::string e = ckpt::agree(*host_, err); !e.empty()) throw AgreedError(e, 1);
  }

  void resume(const fs::path& path) {
    ckpt::Reader r(path);
    const auto& meta = r.metadata();
    const auto entries = state();
    // Every rank loads its part; a checkpoint whose state does not fit this run (another
    // program's, or other options') ends every rank with the same line (exit 2).
    bool complete = true;
    std::string err;
    try {
      complete = load(r, entries);
    } catch (const std::exception& e) {
      err = fmt::format("{}; it was written by {} with --optimizer {}{}: resume with the same program and options, "
                        "or take its weights only with --init-from",
                        e.what(), meta.program, meta.optim_config.value("name", std::string("?")),
                        meta.extra.contains("compressor") ? " and a compressor" : "");
    }
    if (const std::string e = ckpt::agree(*host_, err); !e.empty()) throw AgreedError(e, 2);
    if (rank_ == 0 && !o_.resume_changes.empty()) {
      std::string list;
      for (const Options::Change& c : o_.resume_changes)
        list += fmt::format("{}{} {} (the checkpoint's: {})", list.empty() ? "" : ", ", c.option, c.value, c.checkpoint_value);
      spdlog::warn("resuming with options that differ from the checkpoint's: {}", list);
    } else if (rank_ == 0 && !meta.extra.contains("run_options")) {
      spdlog::warn("{} holds no record of its run's options (an older dtk wrote it): the options are this command line's",
                   path.string());
    }
    if (!complete) {
      const int64_t before = meta.extra.value("state_ranks", meta.world_size);
      if (sharded()) {  // Shampoo's blocks follow the shards: a new shard count starts it afresh
        optim_ = make_optimizer();
        spdlog::warn("{} was written by {} shard ranks, this job has {}: the optimizer's per-shard state (Shampoo's "
                     "blocks) cannot be resharded and starts afresh",
                     path.string(), before, par_->state_rank().second);
      } else {
        spdlog::warn("{} was written by {} ranks, this job has {}: per-rank state (error feedback) starts from zero",
                     path.string(), before, world_);
      }
    }
    start_step_ = meta.step;
    resumed_ = true;
    spdlog::info("resuming from {} at step {}", path.string(), start_step_);
  }

  void init_from(const fs::path& path) {
    ckpt::Reader r(path);
    load(r, state(true));
    spdlog::info("weights from {} (step {})", path.string(), r.metadata().step);
  }

  void describe() {
    spdlog::info("{}: {} ({} parameters) on {} rank(s), {}, global batch {}", s_.program, cfg_.preset,
                 cfg_.num_params(), world_, device_.str(), o_.global_batch);
    spdlog::info("data: {}", train_->describe().dump());
    if (!device_.is_cuda())
      if (const std::string w = ops::cpu_backend_warning(); !w.empty()) spdlog::warn("{}", w);
    const double opt = train_->optimal_loss();
    if (std::isfinite(opt)) spdlog::info("the optimal loss on this data is {:.4f} nats", opt);
  }

  StopSignals signals_;  // first, so that a signal during set-up is kept for the first step
  bool stop_requested_ = false;  // agreed over ranks
  const Options& o_;
  const Strategy& s_;
  comm::Runtime& rt_;
  Device device_;
  nn::ModelConfig cfg_;
  std::shared_ptr<comm::Communicator> comm_, host_;
  int rank_ = 0, world_ = 1;
  std::unique_ptr<nn::Model> model_;
  std::unique_ptr<data::Dataset> train_, val_;
  std::unique_ptr<data::Sampler> sampler_, val_sampler_;
  int64_t begin_ = 0, end_ = 0;  // this rank's rows of every global batch
  std::unique_ptr<optim::Optimizer> optim_;
  optim::Schedule schedule_;
  std::unique_ptr<compress::Compressor> compressor_;
  std::unique_ptr<parallel::Parallelism> par_;
  std::unique_ptr<ckpt::Directory> dir_;
  int64_t start_step_ = 0;
  bool resumed_ = false;
  int64_t optim_state_bytes_ = 0;  // the largest over ranks
  std::vector<int64_t> image_shape_;  // C, H, W of the training images (--augment)
  double accuracy_ = NAN;          // the last step's training accuracy (classifiers)
  double compute_s_ = 0, sync_s_ = 0;  // of the last step: forward + backward, and what the sync added after it
};

}  // namespace

int run(const Options& o, const Strategy& s, comm::Runtime& rt) {
  // A resubmitted job whose run already ended has nothing to do, and that is success.
  if (const std::string from = resume_from(o); !from.empty()) {
    const fs::path p = checkpoint_path(from);
    const int64_t at = ckpt::Reader(p).metadata().step;
    if (at == last_step(o)) {
      spdlog::info("{} is at step {}: the run is complete, nothing to do", p.string(), at);
      return 0;
    }
  }
  return Trainer(o, s, rt).run();
}

}  // namespace dtk::train
