#include "dtk/train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <spdlog/spdlog.h>
#include <tuple>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/cli/cli.h"
#include "dtk/core/checks.h"
#include "dtk/core/error.h"
#include "dtk/ops/kernels.h"
#include "dtk/ops/ops.h"
#include "dtk/train/batches.h"
#include "dtk/train/checkpointer.h"
#include "dtk/train/metrics.h"
#include "dtk/train/run_state.h"
#include "dtk/train/stop.h"

namespace fs = std::filesystem;

namespace dtk::train {

// ------------------------------------------------------------------------------------ the loop

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

class Trainer {
 public:
  Trainer(const ResolvedRun& r, const Strategy& s, comm::Runtime& rt)
      : o_(r.options), s_(s), rt_(rt), device_(parse_device(r.options.runtime.device)), cfg_(r.model) {
    const Options& o = o_;
    const auto [threads, why] = resolve_threads(o, rt);
    ops::set_cpu_threads(threads);
    spdlog::info("CPU threads per rank: {} ({}); BLAS: {}", threads, why, ops::blas_description(false));
    spdlog::info("CPU: {}", ops::cpu_features().describe());
    device_ = rt.bind_device(device_);
    comm_ = rt.world(o.runtime.backend, device_);
    host_ = rt.world(comm::Backend::automatic, Device::cpu());
    rank_ = comm_->rank();
    world_ = comm_->size();

    model_ = nn::make_model(cfg_, device_, DType::f32, s.storage);
    model_->set_activation_checkpointing(o.model.activation_checkpointing);
    model_->set_precision(o.model.precision);
    par_ = s.parallelism(*model_, *comm_, *host_);
    model_->set_hooks(par_.get());
    if (o.model.sync_batchnorm) model_->set_batchnorm_sync([this](Tensor& sums, double& count) {
      comm_->all_reduce(comm::buffer_of(sums), comm::buffer_of(sums), comm::ReduceOp::sum, comm::Mode::sync).wait();
      host_->all_reduce({&count, 1, DType::f64, {}}, {&count, 1, DType::f64, {}}, comm::ReduceOp::sum, comm::Mode::sync).wait();
    });
    par_->init(o.data.seed);
    batches_ = std::make_unique<Batches>(o, cfg_, rank_, world_, device_);
    loss_ = Tensor::zeros({1}, DType::f64, device_);
    grad_norm_ = Tensor::zeros({1}, DType::f64, device_);
    optim_ = s.optimizer(*par_);
    const Options::Schedule& sc = o.schedule;
    schedule_ = {sc.kind, sc.lr, sc.warmup, sc.steps, sc.min_lr_ratio, sc.decay_steps, sc.decay_factor};

    double state = 0;  // the optimizer state this rank holds; the metrics report the largest over ranks
    for (const PlacedTensor& t : optim_->state()) state += static_cast<double>(t.value.bytes());
    optim_state_bytes_ = static_cast<int64_t>(comm::min_max_over_ranks(*host_, {state}, Device::cpu())[0].max);
    if (o.resumed) start_step_ = resumed_at_ = run_state().resume(*o.resumed);
    else if (!o.checkpoint.init_from.empty()) run_state().init_from(checkpoint_path(o.checkpoint.init_from));
    par_->loaded();
    sync_buffers();
    ckpt_ = std::make_unique<Checkpointer>(o, *host_, [this] { return run_state(); }, [this] { sync_buffers(); });
  }

  int run() {
    describe();
    // A resumed run continues its metrics file after the checkpoint's step (--metrics-append: as it is).
    Metrics metrics(o_.runtime.metrics, rank_ == 0, o_.runtime.metrics_append ? -1 : resumed_at_);
    Progress progress(rank_ == 0, o_.schedule.steps, o_.runtime.log_every);
    const int64_t items_per_sample = cfg_.arch == nn::Arch::llama ? cfg_.seq_len : 1;
    const int64_t stop = last_step(o_);
    int64_t end = stop;  // the step the run ends at: earlier when a signal stops it
    for (int64_t step = start_step_; step < stop; ++step) {
      par_->before_step(step);
      if (o_.runtime.print_plan && print_plans(components(), rank_)) return 0;
      reset_peak_memory(device_);
      const int64_t persistent = memory_stats(device_).current;
      const auto t0 = Clock::now();
      const double lr = schedule_.at(step);
      compute_s_ = sync_s_ = 0;
      double opt_s = 0;
      const uint64_t stalls = cuda::host_stalls();
      train_step(step);
      timer_.start();
      par_->clip_grad_norm(o_.optimization.clip, grad_norm_);
      optim_->step(par_->params(), lr);
      par_->after_step(step);
      timer_.stop(&opt_s);
      if (device_.is_cuda())  // what item 4 of issue 44 wants at 0: the host queued the whole step ahead
        spdlog::debug("step {}: the host waited for the GPU {} time(s) before the step's end", step + 1,
                      cuda::host_stalls() - stalls);
      timer_.collect();  // the host's one wait for the GPU in a step (--device cuda), watched
      par_->collect_timings();
      const double grad_norm = grad_norm_.item();
      const double loss = agree(step);
      const double dt = seconds_since(t0);
      if (!std::isfinite(loss))
        fail("the loss is {} at step {}; lower --lr, raise --warmup or clip (--clip)",
             std::isnan(loss) ? "NaN" : "infinite", step + 1);

      nlohmann::ordered_json m = step_metrics({.step = step + 1, .loss = loss, .accuracy = accuracy_, .lr = lr,
                                               .grad_norm = grad_norm, .tokens = cfg_.arch == nn::Arch::llama,
                                               .items = static_cast<double>(o_.data.global_batch * items_per_sample),
                                               .flops_per_item = cfg_.train_flops_per_item(), .step_s = dt,
                                               .compute_s = compute_s_, .sync_s = sync_s_, .optim_s = opt_s,
                                               .peak_mem = static_cast<int64_t>(memory_stats(device_).peak),
                                               .persistent_mem = persistent,
                                               .optim_state_bytes = optim_state_bytes_});
      par_->metrics(m);
      optim_->metrics(m);
      const bool last = step + 1 == stop;
      const bool stopping = stop_requested_ && !last;  // a signal: this step is the last
      double val = NAN, val_acc = NAN;
      const int64_t every = o_.evaluation.every;
      if (batches_->has_validation() && !stopping && (last || (every > 0 && (step + 1) % every == 0))) {
        std::tie(val, val_acc) = evaluate();
        m["val_loss"] = val;
        if (cfg_.classifier()) m["val_accuracy"] = val_acc;
        else val_acc = NAN;
      }
      ckpt_->after_step(step + 1, last, stopping, schedule_, m);
      if (step == start_step_) {  // what ran: a rate is never read without the kernels that made it
        m["blas"] = ops::blas_description();
        m["cpu"] = ops::cpu_features().describe();
        m["precision"] = name_of(o_.model.precision);
      }
      metrics.write(m);
      if (step == start_step_) cli::mark_launched(rank_);  // every rank is through a step: launched
      progress.update(step + 1, loss, val, lr, dt, val_acc);
      if (stopping) {
        end = step + 1;
        break;
      }
    }
    progress.done();
    if (o_.runtime.print_plan) fail("--print-plan: the plan was not final after {} steps", stop);
    if (!o_.checkpoint.save.empty()) ckpt_->save(o_.checkpoint.save, end, schedule_);
    std::fflush(stdout);
    if (end == stop) return 0;
    ckpt_->report_stop(end, stop);
    return cli::kExitStopped;
  }

 private:
  // Forward and backward over this rank's share of the step's global batch, gradients
  // aggregated; the loss stays on the device (loss_), the host does not wait for the GPU here.
  // The StreamTimer gives the device's times of the passes and of the synchronisation.
  void train_step(int64_t step) {
    par_->zero_grad();
    ops::fill(loss_, 0.0);
    correct_ = 0;
    timer_.start();
    batches_->train_step(step, [&](const nn::Batch& batch, int64_t k, bool last) {
      model_->forward(batch, loss_, static_cast<double>(k));
      correct_ += static_cast<double>(std::max<int64_t>(0, model_->correct()));
      if (last) par_->begin(step);  // its buckets start during this backward
      model_->backward(static_cast<double>(k) / static_cast<double>(o_.data.global_batch));
    });
    timer_.stop(&compute_s_);
    timer_.start();
    par_->finish();
    timer_.stop(&sync_s_);
  }

  // After the step's work: one all-reduce of the loss (and a classifier's correct predictions),
  // whether a stop signal reached any rank (every rank then stops after this step), and the
  // background checkpoint write's progress (Checkpointer::learn: the writer threads never
  // communicate). Returns the global-batch mean loss (the same on every rank).
  double agree(int64_t step) {
    const auto [done, failed] = ckpt_->progress();
    double v[5] = {loss_.item(), signals_.received() ? 1.0 : 0.0, correct_, done, failed};
    host_->all_reduce({v, 5, DType::f64, {}}, {v, 5, DType::f64, {}}, comm::ReduceOp::sum, comm::Mode::sync).wait();
    accuracy_ = cfg_.classifier() ? v[2] / static_cast<double>(o_.data.global_batch) : NAN;
    ckpt_->learn(v[3], v[4]);
    if (v[1] > 0 && !stop_requested_) {
      stop_requested_ = true;
      const int sig = signals_.received();
      spdlog::warn("{} received{}: finishing step {}, then writing a checkpoint (a second signal ends at once)",
                   sig ? signal_name(sig) : "a stop signal", sig ? "" : " by another rank", step + 1);
    }
    return v[0] / static_cast<double>(o_.data.global_batch);
  }

  // The validation loss and (classifiers) top-1 accuracy over eval_batches fixed global batches
  // (the same every time).
  std::pair<double, double> evaluate() {
    sync_buffers();
    par_->begin_evaluation();
    double v[2] = {0, 0};
    for (int64_t b = 0; b < o_.evaluation.batches; ++b)
      batches_->validation(b, [&](const nn::Batch& batch, int64_t k, bool) {
        v[0] += model_->evaluate(batch) * static_cast<double>(k);
        v[1] += static_cast<double>(std::max<int64_t>(0, model_->correct()));
      });
    par_->end_evaluation();
    host_->all_reduce({v, 2, DType::f64, {}}, {v, 2, DType::f64, {}}, comm::ReduceOp::sum, comm::Mode::sync).wait();
    const double n = static_cast<double>(o_.data.global_batch * o_.evaluation.batches);
    return {v[0] / n, v[1] / n};
  }

  // Rank 0's buffers on every rank, as DDP broadcasts them (broadcast_buffers): with per-rank
  // batch statistics each rank's running statistics follow its own batches, and rank 0's are the
  // model's. Before every evaluation and checkpoint; training forwards use batch statistics.
  void sync_buffers() {
    if (Tensor& b = model_->buffer_values(); b.defined() && world_ > 1)
      comm_->broadcast(comm::buffer_of(b), 0, comm::Mode::sync).wait();
  }

  std::vector<Component*> components() {
    std::vector<Component*> parts = par_->components();
    parts.push_back(optim_.get());
    return parts;
  }

  // ---- checkpoints (run_state.h, checkpointer.h)
  RunState run_state() { return {o_, s_, cfg_, *par_, optim_, *host_}; }

  void describe() {
    spdlog::info("{}: {} ({} parameters) on {} rank(s), {}, global batch {}, precision {}", s_.program, cfg_.preset,
                 cfg_.num_params(), world_, device_.str(), o_.data.global_batch, name_of(o_.model.precision));
    spdlog::info("data: {}", batches_->train().describe().dump());
    if (!device_.is_cuda()) log_cpu_kernel_warnings(*host_, rank_);
    const double opt = batches_->train().optimal_loss();
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
  std::unique_ptr<Batches> batches_;
  std::unique_ptr<optim::Optimizer> optim_;
  optim::Schedule schedule_;
  std::unique_ptr<parallel::Parallelism> par_;
  std::unique_ptr<Checkpointer> ckpt_;  // destroyed first: joins a background write's thread
  int64_t start_step_ = 0, resumed_at_ = -1;  // resumed_at_: the resumed checkpoint's step (-1: none)
  int64_t optim_state_bytes_ = 0;  // the largest over ranks
  double accuracy_ = NAN;          // the last step's training accuracy (classifiers)
  double compute_s_ = 0, sync_s_ = 0;  // of the last step: forward + backward, and what the sync added after it
  double correct_ = 0;                 // the last step's correct predictions on this rank (classifiers)
  Tensor loss_, grad_norm_;             // f64 [1] on the device: the step's loss (summed over micro-batches), gradient norm
  StreamTimer timer_{device_};         // the step's phases, in stream order
};

}  // namespace

int run(const ResolvedRun& r, const Strategy& s, comm::Runtime& rt) {
  if (run_complete(r.options, rt.rank())) return 0;  // a resubmitted job whose run already ended: success
  return Trainer(r, s, rt).run();
}

}  // namespace dtk::train
