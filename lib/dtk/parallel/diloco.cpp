#include "dtk/parallel/diloco.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <cmath>
#include <string>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "dtk/compress/auto.h"
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"
#include "dtk/parallel/data_parallel.h"

namespace dtk::parallel {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

void OuterConfig::validate(int world) const {
  if (sync == Sync::every_step) return;
  const std::string s(name_of(sync));
  if (every < 0) fail_usage("--sync-every must be at least 1 (or auto), got {}", every);
  if (!(lr > 0)) fail_usage("--outer-lr must be positive, got {}", lr);
  if (!(momentum >= 0 && momentum < 1)) fail_usage("--outer-momentum must be in [0, 1), got {}", momentum);
  if (!(mix >= 0 && mix <= 1)) fail_usage("--outer-mix must be in [0, 1], got {}", mix);
  if (group < 1 || world % group != 0)
    fail_usage("--sync-groups {} does not divide the {} ranks into groups", group, world);
  if (sync == Sync::diloco) {
    if (fragments != 1) fail_usage("--fragments {}: fragments need --sync streaming", fragments);
    if (every > 0 && delay >= every) fail_usage("--sync-delay {} must be below --sync-every {}", delay, every);
    return;
  }
  if (every == 0) {  // auto: H chosen among the multiples of F that fit tau, and F with it when 0
    if (fragments == 1 || fragments < 0)
      fail_usage("--sync streaming needs --fragments of at least 2, got {}", fragments);
    return;
  }
  if (fragments < 2) fail_usage("--sync streaming needs --fragments of at least 2, got {}", fragments);
  if (every % fragments != 0)
    fail_usage("--sync-every {} is not a multiple of --fragments {} (one fragment every H / F steps)", every, fragments);
  if (delay >= every / fragments)
    fail_usage("--sync-delay {} must be below --sync-every / --fragments = {} (one fragment in flight at a time)",
               delay, every / fragments);
}

void validate_sync(const OuterConfig& cfg, compress::Kind compressor, bool shampoo, int world) {
  if (cfg.sync == Sync::every_step) return;
  const std::string sync(name_of(cfg.sync));
  if (shampoo)
    fail_usage("--sync {}: the inner optimizer is --optimizer sgd or adamw (Shampoo splits its blocks over every "
               "rank, the replicas' steps differ)", sync);
  if (compressor == compress::Kind::auto_)
    fail_usage("--sync {} with --compressor auto: auto chooses from each step's backward, which the outer "
               "exchange does not overlap; give a kind (powersgd, ...) or none", sync);
  if (compressor != compress::Kind::none && cfg.wire != compress::Wire::f32)
    fail_usage("--outer-dtype {} is the plain exchange's (--compressor none); --compressor {} sends its own (PowerSGD: --comm-dtype)",
               name_of(cfg.wire), name_of(compressor));
  if (cfg.every == 0 && compressor != compress::Kind::none)
    fail_usage("--sync-every auto plans the mean's exchange (--compressor none), not --compressor {}'s", name_of(compressor));
  cfg.validate(world);
}

// ------------------------------------------------------------------------------- the schedule

int OuterSchedule::applied_after(int64_t n) const {
  if (n < 1) return -1;
  const int64_t s = every / fragments, r = n % every;
  if (r % s != 0) return -1;
  const int64_t k = r / s;
  return static_cast<int>((k == 0 ? fragments : k) - 1);
}

int OuterSchedule::sent_after(int64_t n) const { return n < 1 ? -1 : applied_after(n + delay); }

std::pair<int, int64_t> OuterSchedule::in_flight(int64_t n) const {
  for (int64_t d = 0; d < delay; ++d)
    if (const int p = sent_after(n - d); p >= 0) return {p, n - d + delay};
  return {-1, 0};
}

int64_t OuterSchedule::round(int p, int64_t n_applied) const {
  return (n_applied - (p + 1) * (every / fragments)) / every;
}

std::vector<std::vector<size_t>> balanced_fragments(const std::vector<nn::Param>& params, int fragments) {
  const auto elements = [&](size_t i) {
    int64_t n = 1;
    for (int64_t d : params[i].shape) n *= d;
    return n;
  };
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return elements(a) > elements(b); });
  std::vector<std::vector<size_t>> out(static_cast<size_t>(fragments));
  std::vector<int64_t> load(out.size(), 0);
  for (size_t i : order) {
    const size_t f = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    out[f].push_back(i);
    load[f] += elements(i);
  }
  for (std::vector<size_t>& f : out) std::sort(f.begin(), f.end());
  return out;
}

// ------------------------------------------------------------------------------------ DiLoCo

DiLoCo::DiLoCo(nn::Model& model, const OuterConfig& cfg, const std::optional<compress::Config>& outer_compressor,
               comm::Communicator& world, comm::Communicator& host, const InnerPlacement& inner)
    : model_(model),
      cfg_(cfg),
      schedule_{cfg.every, cfg.delay, cfg.fragments},
      world_rank_(world.rank()),
      world_size_(world.size()),
      host_(host) {
  cfg.validate(world_size_);
  const int g = cfg.group;
  group_ = world.split(world_rank_ / g, world_rank_);
  group_host_ = host.split(world_rank_ / g, world_rank_);
  cross_ = host.split(world_rank_ % g, world_rank_ / g);
  inner_ = inner(*group_, *group_host_);
  sharded_ = inner_->sharded();
  split_ = !sharded_ && g > 1;

  if (cfg.fragments > static_cast<int>(model.params().size()))
    fail_usage("--fragments {}: the model has {} parameters, and a fragment is one or more of them", cfg.fragments,
               model.params().size());
  const std::vector<nn::Param>& ps = inner_->params();  // as this rank holds them
  int64_t n = 0;
  for (const nn::Param& p : ps) n += p.value.numel();
  for (Tensor* t : {&outer_, &momentum_, &delta_, &mean_, &local_}) *t = Tensor::zeros({n}, DType::f32);
  if (!outer_compressor && cfg.wire != compress::Wire::f32) error_ = Tensor::zeros({n}, DType::f32);
  // F chosen with H (--sync-every auto, streaming without --fragments): until then the largest
  // it weighs (no exchange happens before the choice; the state moves with its parameters).
  layout(candidates().back());
  restored_ = Tensor::zeros({1}, DType::i64);
  every_ = Tensor::zeros({1}, DType::i64);
  every_.ptr<int64_t>()[0] = cfg.every;
  fragments_ = Tensor::zeros({1}, DType::i64);
  fragments_.ptr<int64_t>()[0] = schedule_.fragments;
  pending_info_ = Tensor::zeros({2}, DType::i64);
  pending_info_.ptr<int64_t>()[0] = -1;
  if (outer_compressor) {
    for (Fragment& f : frags_) {
      compress::Topology t;  // sharded: whole matrices compressed over the group's rows
      if (sharded_) t.shard = group_host_.get();
      for (size_t i : f.params) {
        const Tensor v = view(delta_, i);
        f.shadows.push_back({ps[i].name, v, v, ps[i].block, ps[i].shape, nn::Init::by_name, 0, {}});
        if (sharded_) t.rows.push_back(*inner_->rows(i));
      }
      f.compressor = compress::make_compressor(*outer_compressor, *cross_, f.shadows, SIZE_MAX, t);
    }
  } else {
    exchange_ = std::make_unique<compress::QuantizedMean>(*cross_, cfg.wire);
  }
}

std::vector<int> DiLoCo::candidates() const {
  if (cfg_.fragments > 0) return {cfg_.fragments};
  std::vector<int> fs;
  for (int f = 2; f <= std::min<int>(kAutoFragmentsMax, static_cast<int>(model_.params().size())); f *= 2) fs.push_back(f);
  if (fs.empty()) fail_usage("--sync streaming: the model has {} parameter, and fragments are 2 or more of them", model_.params().size());
  return fs;
}

std::vector<std::vector<size_t>> DiLoCo::parts(int fragments) const {
  // Balanced by the whole parameters' sizes: the same fragments on every rank, sharded or not.
  return balanced_fragments(model_.params(), fragments);
}

void DiLoCo::layout(int fragments) {
  const std::vector<nn::Param>& ps = inner_->params();
  const std::vector<int64_t> old = pos_;
  std::vector<Fragment> frags(static_cast<size_t>(fragments));
  const std::vector<std::vector<size_t>> ps_of = parts(fragments);
  pos_.assign(ps.size(), 0);
  int64_t n = 0;
  for (size_t p = 0; p < frags.size(); ++p) {
    Fragment& f = frags[p];
    f.params = ps_of[p];
    f.begin = n;
    for (size_t i : f.params) pos_[i] = n, n += ps[i].value.numel();
    f.end = n;
  }
  if (!old.empty())  // the state so far, parameter by parameter, into the new order
    for (Tensor* t : {&outer_, &momentum_, &mean_, &error_}) {
      if (!t->defined()) continue;
      Tensor moved = Tensor::zeros({n}, DType::f32);
      for (size_t i = 0; i < ps.size(); ++i) {
        const int64_t len = ps[i].value.numel();
        moved.slice(pos_[i], pos_[i] + len).copy_from(t->slice(old[i], old[i] + len));
      }
      *t = moved;
    }
  frags_ = std::move(frags);
  schedule_.fragments = fragments;
}

DiLoCo::~DiLoCo() = default;

Tensor DiLoCo::view(const Tensor& t, size_t i) const {
  const nn::Param& p = inner_->params()[i];
  return t.slice(pos_[i], pos_[i] + p.value.numel()).reshape(p.shape);
}

PlacedTensor DiLoCo::placed(std::string name, const Tensor& t, size_t i) const {
  PlacedTensor x{std::move(name), view(t, i)};
  if (sharded_) {
    x.placement = Placement::sharded;
    x.rows = *inner_->rows(i);
    x.rows.replicas = cross_->size();
  }
  return x;
}

int64_t DiLoCo::exchanged(int64_t len) const {
  return split_ ? (len + cfg_.group - 1) / cfg_.group : len;
}

void DiLoCo::to_host(int p, Tensor& dst) {
  for (size_t i : frags_[static_cast<size_t>(p)].params) view(dst, i).copy_from(inner_->params()[i].value);
}

void DiLoCo::from_host(int p, const Tensor& src) {
  for (size_t i : frags_[static_cast<size_t>(p)].params) inner_->params()[i].value.copy_from(view(src, i));
}

std::vector<PlacedTensor> DiLoCo::state() {
  std::vector<PlacedTensor> s;
  const std::vector<nn::Param>& ps = inner_->params();
  for (size_t i = 0; i < ps.size(); ++i) s.push_back(placed("model/" + ps[i].name, outer_, i));
  for (nn::NamedTensor& b : model_.buffers()) s.push_back({"model/" + b.name, b.value});
  return s;
}

std::vector<PlacedTensor> DiLoCo::sync_state() {
  std::vector<PlacedTensor> s;
  const std::vector<nn::Param>& ps = inner_->params();
  const auto per_rank = [](std::string name, Tensor t, Resize r) {
    return PlacedTensor{std::move(name), std::move(t), Placement::per_rank, -1, false, {}, r};
  };
  for (size_t i = 0; i < ps.size(); ++i) s.push_back(per_rank("diloco/local/" + ps[i].name, ps[i].value, Resize::fresh));
  s.push_back(per_rank("diloco/restored", restored_, Resize::fresh));
  for (size_t i = 0; i < ps.size(); ++i) s.push_back(placed("diloco/momentum/" + ps[i].name, momentum_, i));
  // The error feedback, each rank's own: on another number of ranks the mean of the old ones'
  // (a shard's rows differ with the layout: afresh).
  if (error_.defined())
    for (size_t i = 0; i < ps.size(); ++i)
      s.push_back(per_rank("diloco/error/" + ps[i].name, view(error_, i), sharded_ ? Resize::fresh : Resize::mean_approximate));
  if (cfg_.every == 0) s.push_back({"diloco/every", every_});  // auto: the H chosen (0: not yet)
  if (cfg_.fragments == 0) s.push_back({"diloco/fragments", fragments_});  // and F with it
  if (cfg_.delay > 0) {
    s.push_back({"diloco/pending", pending_info_});
    // By parameter where the layout is not fixed at construction (F chosen with H; a resume lays
    // the buffers out again, moving each parameter's part) and where they are rows; else the
    // whole buffer in fragment order, as the first checkpoints with DiLoCo hold it.
    if (sharded_ || cfg_.fragments == 0)
      for (size_t i = 0; i < ps.size(); ++i) s.push_back(placed("diloco/pending_mean/" + ps[i].name, mean_, i));
    else
      s.push_back({"diloco/pending_mean", mean_});
  }
  for (size_t p = 0; p < frags_.size(); ++p)
    if (frags_[p].compressor)
      for (PlacedTensor& t : prefixed("diloco/compress/" + std::to_string(p) + "/", frags_[p].compressor->state())) {
        if (t.placement == Placement::sharded)  // a replica's error rows: its ranks' own
          t.placement = Placement::per_rank, t.resize = Resize::fresh;
        s.push_back(std::move(t));
      }
  return s;
}

std::vector<PlacedTensor> DiLoCo::saved_sync_state() {
  if (pending_ >= 0) complete();  // its mean is saved, and a resume applies it when due
  int64_t* info = pending_info_.ptr<int64_t>();
  info[0] = pending_, info[1] = pending_at_;
  return sync_state();
}

std::vector<PlacedTensor> DiLoCo::optimizer_state(std::vector<PlacedTensor> s) {
  for (PlacedTensor& t : s)
    if (t.placement == Placement::replicated || t.placement == Placement::sharded)
      t.placement = Placement::per_rank, t.resize = Resize::fresh;
  return s;
}

std::string DiLoCo::restore_note(Restored outcome, const RestoreSource& from) const {
  if (outcome == Restored::fresh)
    return from.sizes() + ": every replica starts a new round from the outer weights, with fresh inner optimizer "
                          "state (the inner steps since each fragment's last synchronisation are dropped)" +
           (!error_.defined() ? ""
            : sharded_       ? "; the outer exchange's error feedback starts afresh"
                             : "; the outer exchange's error feedback is the mean of the old ranks'");
  return from.sizes() + ": the outer exchange's error feedback is the mean of the old ranks' (not exact)";
}

void DiLoCo::init(uint64_t seed) {
  inner_->init(seed);
  for (int p = 0; p < schedule_.fragments; ++p) to_host(p, outer_);
  restored_.ptr<int64_t>()[0] = 0;
}

void DiLoCo::loaded() {
  // auto: F as chosen before a resume (the state was read in the order of the F it was built with)
  if (const int f = static_cast<int>(fragments_.ptr<int64_t>()[0]); f != schedule_.fragments) layout(f);
  if (restored_.ptr<int64_t>()[0] == 0)  // a fresh run, --init-from, or another world size: from the outer weights
    for (int p = 0; p < schedule_.fragments; ++p) from_host(p, outer_);
  inner_->loaded();  // replicated: the group's ranks hold the same local weights
  check_replicated(outer_, sharded_ ? *cross_ : host_, "the outer weights");
  restored_.ptr<int64_t>()[0] = 1;
  schedule_.every = every_.ptr<int64_t>()[0];  // auto: as chosen before a resume, or still 0
  const int64_t* info = pending_info_.ptr<int64_t>();
  if (info[0] >= 0) {  // a checkpoint written with a fragment in flight: its mean was saved
    pending_ = static_cast<int>(info[0]), pending_at_ = info[1], completed_ = true;
  }
}

void DiLoCo::finish() {
  inner_->finish();
  // The group summed contributions scaled for the whole world: its own mean is R times that.
  const double replicas = cross_->size();
  if (replicas > 1)
    for (nn::Param& p : inner_->params()) ops::scale(p.grad, replicas, p.grad);
}

void DiLoCo::before_step(int64_t step) {
  inner_->before_step(step);
  step_start_ = Clock::now();
  outer_bytes_ = gather_bytes_ = 0, outer_comm_s_ = 0, outer_norm_ = -1, outer_fragment_ = -1;
  poll();
}

void DiLoCo::after_backward(int block) {
  inner_->after_backward(block);
  poll();
}

void DiLoCo::poll() {
  if (exchange_ && exchange_->in_flight()) exchange_->progress();
}

void DiLoCo::after_step(int64_t step) {
  inner_->after_step(step);
  const int64_t n = step + 1;
  if (schedule_.every == 0) {  // --sync-every auto, not chosen yet: the steps are timed first
    if (const auto& ps = inner_->params(); !ps.empty() && ps[0].value.is_cuda())  // the GPU's time, not the enqueue's
      cuda::stream_synchronize(cuda::current_stream(), "the step's work on the GPU (timing --sync-every auto)");
    step_s_.push_back(seconds_since(step_start_));
    if (static_cast<int64_t>(step_s_.size()) < kAutoEverySteps) return;
    choose_every();
  }
  if (const int p = schedule_.sent_after(n); p >= 0) send(p, n);
  if (pending_ >= 0 && pending_at_ == n) apply(pending_);
}

void DiLoCo::choose_every() {
  comm::CostModel link;
  const bool env = compress::auto_link_from_env(link);
  if (!env) link = compress::measure_link(*cross_, Device::cpu());  // every member's link at once, as they sync
  const std::vector<int> fs = candidates();  // for each, the bytes of its largest fragment's exchange
  // The step: the median of the timed ones but the first (a warm-up); the slowest rank's, and its link.
  std::vector<double> t(step_s_.begin() + 1, step_s_.end());
  std::sort(t.begin(), t.end());
  std::vector<double> in = {link.alpha_s, link.beta_s_per_byte, t[t.size() / 2]};
  for (int f : fs) {
    int64_t biggest = 0;
    for (const std::vector<size_t>& part : parts(f)) {
      int64_t len = 0;
      for (size_t i : part) len += inner_->params()[i].value.numel();
      biggest = std::max(biggest, exchanged(len));
    }
    in.push_back(static_cast<double>(compress::wire_bytes(cfg_.wire, biggest)));
  }
  const std::vector<comm::Range> r = comm::min_max_over_ranks(host_, in, Device::cpu());
  link = {r[0].max, r[1].max};
  const double step = r[2].max;
  // Per F: its exchange (the narrow formats' two collectives, all-to-all and all-gather, move what
  // one all-reduce of the payload would, at one more latency); per H steps F exchanges, each
  // held by what tau steps do not hide; the smallest H (F 2^k, H / F > tau) that holds the steps
  // at most kAutoEveryOverhead. The F with the smallest such H wins; a tie goes to the larger F
  // (the lower peak, Streaming DiLoCo's point).
  struct Choice {
    int f = 0;
    int64_t h = 0;
    double bytes = 0, exchange = 0, held = 0;
    bool fits = false;
  } best;
  nlohmann::json weighed = nlohmann::json::array();
  for (size_t k = 0; k < fs.size(); ++k) {
    Choice c{fs[k], fs[k], r[3 + k].max};
    c.exchange = link.seconds(c.bytes) + (cfg_.wire == compress::Wire::f32 ? 0.0 : link.alpha_s);
    c.held = static_cast<double>(c.f) * std::max(0.0, c.exchange - static_cast<double>(cfg_.delay) * step);
    const auto fits_at = [&](int64_t h) {
      return h / c.f > cfg_.delay && c.held <= kAutoEveryOverhead * static_cast<double>(h) * step;
    };
    while (!fits_at(c.h) && c.h * 2 <= kAutoEveryMax) c.h *= 2;
    c.fits = fits_at(c.h);
    const auto share = [&](const Choice& x) { return x.held / (static_cast<double>(x.h) * step); };
    weighed.push_back({{"fragments", c.f}, {"every", c.h}, {"exchange_bytes", c.bytes}, {"exchange_ms", c.exchange * 1e3},
                       {"overhead", share(c)}, {"fits", c.fits}});
    if (best.f == 0 || (c.fits && (!best.fits || c.h <= best.h)) || (!c.fits && !best.fits && share(c) <= share(best)))
      best = c;
  }
  const int64_t h = best.h;
  const double overhead = best.held / (static_cast<double>(h) * step);
  schedule_.every = h;
  every_.ptr<int64_t>()[0] = h;
  if (best.f != schedule_.fragments) layout(best.f);
  fragments_.ptr<int64_t>()[0] = best.f;
  auto_plan_ = {{"every", h},
                {"link", {{"alpha_us", link.alpha_s * 1e6}, {"algbw_gbps", link.gbps()},
                          {"source", env ? compress::kAutoLinkEnv : "measured"}}},
                {"step_ms", step * 1e3},
                {"exchange_bytes", best.bytes},
                {"exchange_ms", best.exchange * 1e3},
                {"held_per_step_ms", best.held / static_cast<double>(h) * 1e3},
                {"overhead", overhead}};
  if (cfg_.fragments == 0) auto_plan_["fragments"] = best.f, auto_plan_["weighed"] = weighed;
  const std::string f = cfg_.fragments == 0 ? fmt::format(", F = {}", best.f) : "";
  if (host_.rank() == 0) {
    if (best.fits)
      spdlog::info("--sync-every auto: H = {}{} (an exchange of {:.0f} B takes {:.1f} ms on {:.1f} us + {:.4g} GB/s; "
                   "{:.1f}% of {:.1f} ms steps held)", h, f, best.bytes, best.exchange * 1e3, link.alpha_s * 1e6,
                   link.gbps(), 100 * overhead, step * 1e3);
    else
      spdlog::warn("--sync-every auto: even H = {}{} holds the steps {:.1f}% (an exchange of {:.1f} ms, steps of {:.1f} ms)",
                   h, f, 100 * overhead, best.exchange * 1e3, step * 1e3);
  }
}

void DiLoCo::send(int p, int64_t n) {
  const auto t0 = Clock::now();
  Fragment& f = frags_[static_cast<size_t>(p)];
  to_host(p, local_);
  float* d = delta_.ptr<float>();
  const float* o = outer_.ptr<float>();
  const float* l = local_.ptr<float>();
  for (int64_t i = f.begin; i < f.end; ++i) d[i] = o[i] - l[i];
  pending_ = p, pending_at_ = n + cfg_.delay;
  if (f.compressor) {
    // Contributions that sum to the mean (compress/compressor.h's convention); run whole now.
    const float inv = 1.0f / static_cast<float>(cross_->size());
    for (int64_t i = f.begin; i < f.end; ++i) d[i] *= inv;
    f.compressor->aggregate(f.shadows, schedule_.round(p, pending_at_));
    float* m = mean_.ptr<float>();
    for (int64_t i = f.begin; i < f.end; ++i) m[i] = d[i];
    outer_bytes_ = f.compressor->last_bytes().sent;
    completed_ = true;
  } else {
    const int64_t len = f.end - f.begin, j = split_ ? group_host_->rank() : 0, g = split_ ? group_host_->size() : 1;
    slice_lo_ = f.begin + len * j / g, slice_hi_ = f.begin + len * (j + 1) / g;
    exchange_->start(d + slice_lo_, error_.defined() ? error_.ptr<float>() + slice_lo_ : nullptr, slice_hi_ - slice_lo_);
    outer_bytes_ = exchange_->bytes();
    completed_ = false;
  }
  outer_comm_s_ += seconds_since(t0);
}

void DiLoCo::complete() {
  if (completed_) return;
  const auto t0 = Clock::now();
  const Fragment& f = frags_[static_cast<size_t>(pending_)];
  float* m = mean_.ptr<float>();
  exchange_->finish(m + slice_lo_);
  if (const int g = group_host_->size(); split_) {  // the group's slices, to every member
    const int64_t len = f.end - f.begin;
    std::vector<size_t> counts;
    for (int j = 0; j < g; ++j) counts.push_back(static_cast<size_t>(len * (j + 1) / g - len * j / g));
    const comm::Buffer all{m + f.begin, static_cast<size_t>(len), DType::f32, Device::cpu()};
    const comm::Buffer mine{m + slice_lo_, static_cast<size_t>(slice_hi_ - slice_lo_), DType::f32, Device::cpu()};
    group_host_->all_gather_v(mine, all, counts, comm::Mode::sync).wait();
    gather_bytes_ += (slice_hi_ - slice_lo_) * 4;
  }
  completed_ = true;
  outer_comm_s_ += seconds_since(t0);
}

void DiLoCo::apply(int p) {
  complete();
  const Fragment& f = frags_[static_cast<size_t>(p)];
  const float* m = mean_.ptr<float>();
  float* o = outer_.ptr<float>();
  float* b = momentum_.ptr<float>();
  const float eta = static_cast<float>(cfg_.lr), mu = static_cast<float>(cfg_.momentum);
  double norm = 0;
  for (int64_t i = f.begin; i < f.end; ++i) {
    const float g = m[i];
    norm += static_cast<double>(g) * g;
    if (mu != 0) {  // torch.optim.SGD(nesterov=True), dampening 0
      b[i] = mu * b[i] + g;
      o[i] -= eta * (g + mu * b[i]);
    } else {
      o[i] -= eta * g;
    }
  }
  if (cfg_.mix == 0) {
    from_host(p, outer_);
  } else {  // the inner steps taken while the exchange was in flight survive in proportion alpha
    to_host(p, local_);
    float* l = local_.ptr<float>();
    const float a = static_cast<float>(cfg_.mix);
    for (int64_t i = f.begin; i < f.end; ++i) l[i] = a * l[i] + (1 - a) * o[i];
    from_host(p, local_);
  }
  if (sharded_)  // the rows of the group's ranks
    group_host_->all_reduce({&norm, 1, DType::f64, {}}, {&norm, 1, DType::f64, {}}, comm::ReduceOp::sum, comm::Mode::sync).wait();
  outer_norm_ = std::sqrt(norm), outer_fragment_ = p;
  pending_ = -1, completed_ = false;
}

void DiLoCo::begin_evaluation() {
  for (int p = 0; p < schedule_.fragments; ++p) to_host(p, local_), from_host(p, outer_);
}

void DiLoCo::end_evaluation() {
  for (int p = 0; p < schedule_.fragments; ++p) from_host(p, local_);
}

void DiLoCo::metrics(nlohmann::ordered_json& m) const {
  inner_->metrics(m);
  const int64_t inner = group_->size() > 1 ? m.value("comm_bytes", int64_t{0}) : 0;
  m["comm_bytes"] = inner + outer_bytes_ + gather_bytes_;
  m["outer_bytes"] = outer_bytes_;
  m["outer_comm_ms"] = outer_comm_s_ * 1e3;
  if (outer_fragment_ >= 0) m["outer_grad_norm"] = outer_norm_;
}

std::vector<Component*> DiLoCo::components() {
  std::vector<Component*> c{this};
  for (Component* x : inner_->components()) c.push_back(x);
  return c;
}

nlohmann::json DiLoCo::plan() const {
  nlohmann::json frags = nlohmann::json::array();
  const std::vector<nn::Param>& ps = model_.params();
  for (const Fragment& f : frags_) {
    nlohmann::json names = nlohmann::json::array();
    int64_t n = 0;
    for (size_t i : f.params) names.push_back(ps[i].name), n += shape_numel(ps[i].shape);
    frags.push_back({{"elements", n},
                     {"params", names},
                     {"bytes_per_sync", f.compressor ? nlohmann::json(nullptr)
                                                     : nlohmann::json(compress::wire_bytes(cfg_.wire, exchanged(f.end - f.begin)))}});
  }
  nlohmann::json plan = {{"sync", cfg_}, {"replicas", cross_->size()}, {"ranks_per_replica", cfg_.group}, {"fragments", frags}};
  if (cfg_.every == 0) plan["sync_every_auto"] = auto_plan_;
  return plan;
}

}  // namespace dtk::parallel
