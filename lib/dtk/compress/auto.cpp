// --compressor auto (auto.h): the compressor that measures, decides (auto_decision.cpp) and
// drives one sub-compressor per bucket.
#include "dtk/compress/auto.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>

#include <spdlog/spdlog.h>

#include "dtk/compress/internal.h"
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"

namespace dtk::compress {

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Columns [0, min) of src [m, rs] into dst [m, rd] (Q at another rank), the rest of dst kept or
// zeroed, through the host: only when a rank changes or state moves.
void copy_cols(Tensor& dst, const Tensor& src, bool zero_rest = false) {
  const int64_t m = dst.shape()[0], rd = dst.shape()[1], rs = src.shape()[1], c = std::min(rd, rs);
  const std::vector<double> a = src.to_doubles();
  std::vector<double> d = zero_rest ? std::vector<double>(static_cast<size_t>(dst.numel()), 0.0) : dst.to_doubles();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < c; ++j) d[static_cast<size_t>(i * rd + j)] = a[static_cast<size_t>(i * rs + j)];
  dst.copy_from(Tensor::from_doubles(d, dst.shape(), DType::f32, dst.device()));
}

Tensor clone(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), t.device());
  c.copy_from(t);
  return c;
}

std::map<std::string, Tensor> by_name(std::vector<PlacedTensor> s) {
  std::map<std::string, Tensor> m;
  for (PlacedTensor& t : s) m.emplace(t.name, t.value);
  return m;
}

// The decision's inputs, flattened for checkpoints and the max over ranks.
// valid, alpha, beta, link step, link from the environment, backward, decided at, the measured
// overheads of none and of compressing (-1: not measured)
constexpr size_t kHead = 9;
constexpr size_t kPerRank = 5, kPerBucket = 2 + 2 * kPerRank;

class Auto final : public Compressor {
 public:
  Auto(const Config& cfg, comm::Communicator& comm, const std::vector<nn::Param>& params, size_t bucket_bytes,
       const Topology& topology)
      : cfg_(cfg), comm_(comm), world_(comm.size()), params0_(params), topo_(topology), shard_(topology.shard) {
    cfg_.validate();
    {  // the buckets (given, or by size) and the parameters' checks (their rows) of the plain all-reduce
      Config c = cfg_;
      c.kind = Kind::none;
      buckets_ = make_none(c, comm, params, bucket_bytes, topology)->buckets();
    }
    lead_ = comm.rank() == 0 && (!shard_ || shard_->rank() == 0);
    if (!params.empty()) device_ = params[0].grad.device();
    for (size_t i = 0; i < params.size(); ++i) {
      index_[params[i].name] = i;
      total_ += params[i].grad.numel();
    }
    const size_t K = buckets_.size();
    subs_.resize(K);
    acc_.resize(K);
    for (size_t k = 0; k < K; ++k) subs_[k].c = make_sub(k, 0);
    costs_.buckets.resize(K);
    for (size_t k = 0; k < K; ++k) {
      BucketCost& b = costs_.buckets[k];
      for (size_t i = buckets_[k].first; i < buckets_[k].last; ++i) b.none_bytes += 4.0 * static_cast<double>(params[i].grad.numel());
      for (int r : cfg_.auto_ranks) {
        RankCost rc;
        rc.rank = r;
        for (size_t i = buckets_[k].first; i < buckets_[k].last; ++i) {
          const auto [cr, n, m] = compressed(i, r);
          if (cr > 0) {  // P: this rank's rows (sharded: the shard group's padded row count); Q: whole
            rc.p_bytes += static_cast<double>(local_rows(i) * cr) * static_cast<double>(dtype_size(cfg_.comm_dtype));
            rc.q_bytes += static_cast<double>(m * cr) * static_cast<double>(dtype_size(cfg_.comm_dtype));
          } else {
            rc.p_bytes += 4.0 * static_cast<double>(params[i].grad.numel());
          }
        }
        b.ranks.push_back(rc);
      }
    }
    step_ = Tensor::zeros({1}, DType::i64);
    choice_t_ = Tensor::zeros({static_cast<int64_t>(K)}, DType::i64);
    acc_t_ = Tensor::zeros({static_cast<int64_t>(K), 4}, DType::f64);
    costs_t_ = Tensor::zeros({static_cast<int64_t>(kHead + K * kPerBucket)}, DType::f64);
    ready_now_.assign(K, 0);
    norms_ = Tensor::zeros({static_cast<int64_t>(params.size())}, DType::f32, device_);
    ovh_t_ = Tensor::zeros({2}, DType::f64);
  }

  void begin(std::vector<nn::Param>& params, int64_t step) override {
    if (params_) fail("compressor: begin() called again before finish()");
    if (params.size() != params0_.size())
      fail_usage("compressor: built for {} parameters, called with {}", params0_.size(), params.size());
    if (step < 0) fail_usage("compressor: step must be >= 0, got {}", step);
    if (!checked_) {
      check_agreement();
      checked_ = true;
    }
    if (dirty_) restore();
    if (step >= cfg_.start_iter && (step - cfg_.start_iter) % cfg_.auto_interval == 0) decide(step);
    params_ = &params;
    step_now_ = step;
    next_ = 0;
    inside_ = 0;
    for (size_t k = 0; k < subs_.size(); ++k) {
      Sub& s = subs_[k];
      s.params.assign(params.begin() + static_cast<std::ptrdiff_t>(buckets_[k].first),
                      params.begin() + static_cast<std::ptrdiff_t>(buckets_[k].last));
      s.c->begin(s.params, step);
    }
    t0_ = Clock::now();
  }

  void bucket_ready(size_t k) override {
    if (!params_) fail("compressor: bucket_ready() outside begin() and finish()");
    if (k != next_ || k >= buckets_.size())
      fail("compressor: bucket {} ready out of order (expected {} of {})", k, next_, buckets_.size());
    ready_now_[k] = since(t0_) - inside_;
    const auto t = Clock::now();
    ++next_;
    Sub& s = subs_[k];
    for (size_t i = buckets_[k].first; i < buckets_[k].last; ++i) {  // Accordion's norms, read in finish()
      Tensor out = norms_.slice(static_cast<int64_t>(i), static_cast<int64_t>(i) + 1);
      ops::reduce(ops::Reduce::norm2, ops::Axis::all, (*params_)[i].grad.flatten(), out);
    }
    for (auto& [i, err] : s.flush) {  // what left compression: its error, into this step's contribution
      Tensor g = (*params_)[i].grad;
      ops::axpy(1.0 / world_, err.reshape(g.shape()), g);
    }
    s.flush.clear();
    s.c->bucket_ready(0);
    inside_ += since(t);
  }

  void progress() override {
    for (size_t k = 0; k < next_; ++k) subs_[k].c->progress();
  }

  void finish() override {
    if (!params_) fail("compressor: finish() without begin()");
    backward_now_ = since(t0_) - inside_;
    while (next_ < buckets_.size()) bucket_ready(next_);
    for (Sub& s : subs_) s.c->finish();
    measured_ = true;
    if (step_now_ > 0) {  // what aggregation added to backward (step 0 sets connections up)
      ovh_sum_ += since(t0_) - backward_now_;
      ovh_count_ += 1;
    }
    // Accordion: the norm of this rank's estimate of the mean gradient, W grad_r, per bucket
    // (one device-to-host copy a step). Sharded: of the whole tensors, their squares summed over
    // the shard group (one small collective a step), so that it does not depend on the shard count.
    const std::vector<double> norms = norms_.to_doubles();
    std::vector<double> sq(subs_.size(), 0.0);
    for (size_t k = 0; k < subs_.size(); ++k)
      for (size_t i = buckets_[k].first; i < buckets_[k].last; ++i) sq[k] += norms[i] * norms[i];
    if (shard_ && shard_->size() > 1 && !sq.empty()) {
      Tensor t = Tensor::from_doubles(sq, {static_cast<int64_t>(sq.size())}, DType::f64, device_);
      shard_->all_reduce(comm::buffer_of(t), comm::buffer_of(t), comm::ReduceOp::sum, comm::Mode::sync).wait();
      sq = t.to_doubles();
    }
    for (size_t k = 0; k < subs_.size(); ++k) acc_[k].add(world_ * std::sqrt(sq[k]));
    params_ = nullptr;
    step_.ptr<int64_t>()[0] = step_now_ + 1;
  }

  const std::vector<ParamRange>& buckets() const override { return buckets_; }

  Bytes last_bytes() const override {
    Bytes b;
    for (const Sub& s : subs_) b.sent += s.c->last_bytes().sent;
    b.uncompressed = total_ * 4;
    return b;
  }

  std::vector<PlacedTensor> state() override {
    const bool ef = cfg_.error_feedback;
    if (err_.empty())  // the mirrors, for every matrix that a candidate rank compresses
      for (size_t i = 0; i < params0_.size(); ++i) {
        const auto [cr, n, m] = compressed(i, cfg_.auto_ranks[1]);
        const auto [lo, n2, m2] = compressed(i, cfg_.auto_ranks[0]);
        (void)n2, (void)m2;
        if (lo == 0) continue;
        mats_.push_back(i);
        if (ef) err_[i] = Tensor::zeros(params0_[i].grad.shape(), DType::f32, device_);
        q_[i] = Tensor::zeros({m, std::max<int64_t>(cr, lo)}, DType::f32, device_);
      }
    for (size_t k = 0; k < subs_.size(); ++k) {
      const std::map<std::string, Tensor> st = subs_[k].rank > 0 ? by_name(subs_[k].c->state()) : std::map<std::string, Tensor>{};
      for (size_t i = buckets_[k].first; i < buckets_[k].last; ++i) {
        const std::string& name = params0_[i].name;
        if (auto e = err_.find(i); e != err_.end()) {
          if (auto s = st.find("error/" + name); s != st.end()) e->second.copy_from(s->second);
          else ops::fill(e->second, 0.0);
        }
        if (auto q = q_.find(i); q != q_.end()) {  // Q at its width, zero beyond (and for none)
          if (auto s = st.find("q/" + name); s != st.end()) copy_cols(q->second, s->second, true);
          else ops::fill(q->second, 0.0);
        }
      }
    }
    save_decision();
    dirty_ = true;  // restored into the sub-compressors before the next step (a load writes these)
    // Accordion's sums are each rank's own until a decision takes their maximum: per rank (on
    // another number of ranks, their mean: approximate). Sharded (one shard group writes):
    // replicated, as before_save() made them identical on every rank.
    const Placement own = shard_ ? Placement::replicated : Placement::per_rank;
    std::vector<PlacedTensor> out = {{"auto/choice", choice_t_},
                                     {"auto/accordion", acc_t_, own, -1, false, Rows{}, Resize::mean_approximate},
                                     {"auto/costs", costs_t_},
                                     {"auto/overhead", ovh_t_, own, -1, false, Rows{}, Resize::mean_approximate}};
    for (size_t i : mats_) {
      if (ef) {  // per rank, or (sharded) by rows as PowerSGD's own (Base::error_state)
        PlacedTensor e{"error/" + params0_[i].name, err_.at(i), Placement::per_rank, -1, false, Rows{}, Resize::mean};
        if (shard_) e.placement = Placement::sharded, e.rows = topo_.rows[i];
        out.push_back(std::move(e));
      }
      out.push_back({"q/" + params0_[i].name, q_.at(i)});
    }
    out.push_back({"step", step_});
    return out;
  }

  // Sharded (fsdp-train's HSDP, one shard group writes): the per-rank sums that a decision takes
  // the maximum of (Accordion's norms, the measured overhead) made identical on every rank, their
  // maximum, in place, so that the run and a resume continue alike. Collective over every rank.
  void before_save() override {
    if (!shard_) return;
    std::vector<double> v;
    for (const Accordion& a : acc_) v.push_back(a.sum);
    v.push_back(ovh_sum_);
    max_over_ranks(v);
    for (size_t k = 0; k < acc_.size(); ++k) acc_[k].sum = v[k];
    ovh_sum_ = v.back();
  }

  std::string restore_note(Restored outcome, const RestoreSource& from) const override {
    return error_feedback_note(Kind::auto_, shard_ != nullptr, outcome, from);
  }
  bool plan_final() const override { return plan().contains("buckets"); }  // its first decisions made

  nlohmann::json plan() const override {
    nlohmann::json j;
    j["ranks"] = nlohmann::json::array();
    for (const Sub& s : subs_) j["ranks"].push_back(s.rank);
    if (!decided_) return j;
    j["from_step"] = decided_at_ + 1;
    j["link"] = {{"alpha_us", costs_.link.alpha_s * 1e6},
                 {"algbw_gbps", costs_.link.gbps()},
                 {"source", link_env_ ? kAutoLinkEnv : "measured"}};
    j["backward_ms"] = costs_.backward_s * 1e3;
    auto ms = [](double s) { return s >= 0 ? nlohmann::json(s * 1e3) : nlohmann::json(nullptr); };
    j["measured_overhead_ms"] = {{"none", ms(measured_none_)}, {"powersgd", ms(measured_psgd_)}};
    nlohmann::json buckets = nlohmann::json::array();
    for (size_t k = 0; k < subs_.size(); ++k) {
      const BucketCost& b = costs_.buckets[k];
      nlohmann::json cands = nlohmann::json::array();
      for (const RankCost& r : b.ranks)
        cands.push_back({{"rank", r.rank}, {"bytes", r.p_bytes + r.q_bytes}, {"compress_ms", (r.send_s + r.finish_s) * 1e3}});
      buckets.push_back({{"params", {buckets_[k].first, buckets_[k].last}},
                         {"first", params0_[buckets_[k].first].name},
                         {"last", params0_[buckets_[k].last - 1].name},
                         {"choice", subs_[k].rank > 0 ? "powersgd" : "none"},
                         {"rank", subs_[k].rank},
                         {"critical", acc_[k].critical},
                         {"bytes", b.none_bytes},
                         {"ready_ms", b.ready_s * 1e3},
                         {"powersgd", cands}});
    }
    j["buckets"] = buckets;
    std::vector<int> choice, none(subs_.size(), 0), low(subs_.size()), high(subs_.size());
    for (size_t k = 0; k < subs_.size(); ++k) {
      choice.push_back(subs_[k].rank);
      low[k] = cfg_.auto_ranks[0];
      high[k] = cfg_.auto_ranks[1];
    }
    j["predicted"] = {{"step_ms", predict_step(costs_, choice) * 1e3},
                      {"none_step_ms", predict_step(costs_, none) * 1e3},
                      {"low_rank_step_ms", predict_step(costs_, low) * 1e3},
                      {"high_rank_step_ms", predict_step(costs_, high) * 1e3}};
    return j;
  }

 private:
  struct Sub {
    int rank = 0;  // 0: none
    std::unique_ptr<Compressor> c;
    std::vector<nn::Param> params;                  // the bucket's, for the step in progress
    std::vector<std::pair<size_t, Tensor>> flush;   // error buffers to add to this step's grads
  };

  // PowerSGD's rule (powersgd.cpp): parameter i's matrix [n, m] (sharded: the whole tensor's) at
  // rank min(r, n, m), compressed when (n + m) r * min_compression_rate < n m; {0, n, m} when not.
  std::tuple<int64_t, int64_t, int64_t> compressed(size_t i, int r) const {
    const Shape& w = shard_ ? topo_.rows[i].shape : params0_[i].grad.shape();
    if (w.size() < 2 || shape_numel(w) == 0) return {0, 0, 0};
    const int64_t n = w[0], m = shape_numel(w) / n, cr = std::min<int64_t>({r, n, m});
    if (static_cast<double>(n + m) * static_cast<double>(cr) * cfg_.min_compression_rate >= static_cast<double>(n) * static_cast<double>(m))
      return {0, n, m};
    return {cr, n, m};
  }

  // The rows of parameter i's matrix that this rank's P holds: all, or (sharded) the shard
  // group's padded row count (powersgd.cpp).
  int64_t local_rows(size_t i) const {
    if (!shard_) return std::get<1>(compressed(i, 1));
    const std::vector<int64_t>& l = topo_.rows[i].lengths;
    return *std::max_element(l.begin(), l.end());
  }

  // The maximum of each value over every rank (both communicators when sharded): what every rank
  // decides from.
  void max_over_ranks(std::vector<double>& v) const {
    for (comm::Communicator* c : {&comm_, shard_}) {
      if (!c) continue;
      const std::vector<comm::Range> r = comm::min_max_over_ranks(*c, v, device_);
      for (size_t i = 0; i < v.size(); ++i) v[i] = r[i].max;
    }
  }

  std::unique_ptr<Compressor> make_sub(size_t k, int rank) const {
    Config c = cfg_;
    c.kind = rank > 0 ? Kind::powersgd : Kind::none;
    c.rank = std::max(rank, 1);
    c.start_iter = 0;
    c.seed = cfg_.seed + 0x9E3779B97F4A7C15ull * (k + 1);  // each bucket its own Q stream
    const auto first = static_cast<std::ptrdiff_t>(buckets_[k].first), last = static_cast<std::ptrdiff_t>(buckets_[k].last);
    const std::vector<nn::Param> ps(params0_.begin() + first, params0_.begin() + last);
    Topology t;  // sharded: the bucket's rows over the same shard group, one bucket
    if (shard_) {
      t.shard = shard_;
      t.rows.assign(topo_.rows.begin() + first, topo_.rows.begin() + last);
    }
    return make_compressor(c, comm_, ps, SIZE_MAX, t);
  }

  // Bucket k to `rank`: a new sub-compressor carrying the old one's error buffers, Q's common
  // columns and step; errors that no longer have a home go into the next step's gradient.
  void rebuild(size_t k, int rank) {
    Sub& s = subs_[k];
    const std::map<std::string, Tensor> old = s.rank > 0 ? by_name(s.c->state()) : std::map<std::string, Tensor>{};
    std::unique_ptr<Compressor> fresh = make_sub(k, rank);
    std::map<std::string, Tensor> kept;
    if (rank > 0 && s.rank > 0)
      for (PlacedTensor& t : fresh->state()) {
        const auto o = old.find(t.name);
        if (o == old.end()) continue;
        if (t.name.rfind("q/", 0) == 0) copy_cols(t.value, o->second);
        else t.value.copy_from(o->second);
        kept.emplace(t.name, t.value);
      }
    for (const auto& [name, t] : old)
      if (name.rfind("error/", 0) == 0 && !kept.count(name)) s.flush.emplace_back(index_.at(name.substr(6)), clone(t));
    s.c = std::move(fresh);
    s.rank = rank;
  }

  // After state() was handed out (a checkpoint written, or loaded into): the sub-compressors
  // from the mirrors.
  void restore() {
    dirty_ = false;
    load_decision();
    for (size_t k = 0; k < subs_.size(); ++k) {
      Sub& s = subs_[k];
      s.rank = static_cast<int>(choice_t_.ptr<int64_t>()[k]);
      s.c = make_sub(k, s.rank);
      if (s.rank == 0) continue;
      for (PlacedTensor& t : s.c->state()) {
        if (t.name == "step") {
          t.value.copy_from(step_);
        } else if (t.name.rfind("error/", 0) == 0) {
          t.value.copy_from(err_.at(index_.at(t.name.substr(6))));
        } else if (t.name.rfind("q/", 0) == 0) {
          copy_cols(t.value, q_.at(index_.at(t.name.substr(2))));
        }
      }
    }
  }

  void check_agreement() {
    const std::vector<double> v = {static_cast<double>(buckets_.size()), static_cast<double>(cfg_.auto_ranks[0]),
                                   static_cast<double>(cfg_.auto_ranks[1]), cfg_.accordion_eta,
                                   static_cast<double>(cfg_.auto_interval), static_cast<double>(cfg_.auto_refresh),
                                   static_cast<double>(cfg_.start_iter)};
    std::vector<comm::Range> all = comm::min_max_over_ranks(comm_, v, device_);
    if (shard_)
      for (const comm::Range& r : comm::min_max_over_ranks(*shard_, v, device_)) all.push_back(r);
    for (const comm::Range& r : all)
      if (r.min != r.max)
        fail_usage("compressor 'auto': the ranks disagree on its buckets or options (from {} to {}); every rank must "
                   "build the same model and compressor options",
                   r.min, r.max);
  }

  // At step start_iter, then every auto_interval steps: Accordion's regimes, the costs, the choice.
  void decide(int64_t step) {
    if (!link_measured_ || (cfg_.auto_refresh > 0 && step - link_step_ >= cfg_.auto_refresh)) {
      measure_link(step);
      measure_compute();
      measured_none_ = measured_psgd_ = -1;  // conditions may have changed: the model tries again
    }
    if (measured_) {  // the last step's timeline
      costs_.backward_s = backward_now_;
      for (size_t k = 0; k < subs_.size(); ++k) costs_.buckets[k].ready_s = ready_now_[k];
    }
    // Every rank decides from the same numbers: the maximum over ranks of each.
    save_decision();
    std::vector<double> v = costs_t_.to_doubles(), a = acc_t_.to_doubles();
    v.insert(v.end(), a.begin(), a.end());
    v.push_back(ovh_count_ > 0 ? ovh_sum_ / ovh_count_ : -1);  // the interval's measured overhead
    max_over_ranks(v);
    costs_t_.copy_from(Tensor::from_doubles({v.begin(), v.begin() + costs_t_.numel()}, costs_t_.shape(), DType::f64));
    acc_t_.copy_from(Tensor::from_doubles({v.begin() + costs_t_.numel(), v.end() - 1}, acc_t_.shape(), DType::f64));
    load_decision();
    // What the last interval's choice measured (not with DTK_AUTO_LINK: that link is not the one
    // measured). Once both none and compression have been measured under the same link, the
    // measurement decides between them: the model's prediction rests on a link model that a
    // shaped link can defeat (netlab's token bucket lets a 312 KB all-reduce through in 5 ms
    // where its rate predicts 26).
    bool compressing = false;
    for (const Sub& s : subs_) compressing = compressing || s.rank > 0;
    if (v.back() >= 0 && !link_env_) (compressing ? measured_psgd_ : measured_none_) = v.back();
    ovh_sum_ = ovh_count_ = 0;

    std::vector<int> want(subs_.size()), current(subs_.size());
    for (size_t k = 0; k < subs_.size(); ++k) {
      acc_[k].end_interval(cfg_.accordion_eta);
      const int r = cfg_.auto_ranks[acc_[k].critical ? 1 : 0];
      bool any = false;
      for (size_t i = buckets_[k].first; i < buckets_[k].last; ++i) any = any || std::get<0>(compressed(i, r)) > 0;
      want[k] = any ? r : 0;
      current[k] = subs_[k].rank;
    }
    std::vector<int> ch = choose(costs_, want, current);
    if (measured_none_ >= 0 && measured_psgd_ >= 0) {
      const bool pays = measured_psgd_ < measured_none_ - kSwitchMargin * (costs_.backward_s + measured_none_);
      bool any = false;
      for (int x : ch) any = any || x > 0;
      if (!pays) std::fill(ch.begin(), ch.end(), 0);
      else if (!any) ch = want;
    }
    for (size_t k = 0; k < subs_.size(); ++k)
      if (ch[k] != subs_[k].rank) rebuild(k, ch[k]);
    decided_ = true;
    decided_at_ = step;
    save_decision();
    if (lead_) {
      const nlohmann::json p = plan();
      spdlog::info("auto: step {}: ranks {} (predicted {:.2f} ms, none {:.2f}; measured overhead none {}, powersgd {} ms)",
                   step + 1, p["ranks"].dump(), p["predicted"]["step_ms"].get<double>(),
                   p["predicted"]["none_step_ms"].get<double>(), p["measured_overhead_ms"]["none"].dump(),
                   p["measured_overhead_ms"]["powersgd"].dump());
    }
  }

  // The link: a DTK_AUTO_LINK override, or measure_link's timed all-reduces.
  void measure_link(int64_t step) {
    link_measured_ = true;
    link_step_ = step;
    link_env_ = auto_link_from_env(costs_.link);
    if (link_env_) return;
    costs_.link = compress::measure_link(comm_, device_);
    // This rank's replica group's (the decision takes the maximum over every rank: the plan's "link").
    spdlog::info("auto: the link measured at step {}: {:.1f} us + {:.4g} GB/s{}", step, costs_.link.alpha_s * 1e6,
                 costs_.link.gbps(), shard_ && shard_->size() > 1 ? " (this shard rank's replica group)" : "");
  }

  // Compressing each bucket at each candidate rank: its matrices' operations timed on their
  // shapes (the fastest of five, after a warm-up: on loaded cores a median still caught
  // preemptions of 2 to 16 ms in 10 us of work; one timing per distinct shape). Sharded, on this
  // rank's rows (ns of the whole n) with the shard group's own collectives, which are synchronous
  // and so compute-side time: P's all-gather and the whole P's orthonormalisation, Q's sum over
  // the shards (every rank of the group times the same shapes in the same order). Batched
  // matrices of one shape are timed one by one (their collectives' latency counted per matrix).
  void measure_compute() {
    const bool split = shard_ && shard_->size() > 1;
    std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, std::pair<double, double>> timed;
    auto time_shape = [&](int64_t n, int64_t m, int64_t r, int64_t ns) {
      auto it = timed.find({n, m, r, ns});
      if (it != timed.end()) return it->second;
      Tensor M = Tensor::empty({ns, m}, DType::f32, device_), G = Tensor::empty({ns, m}, DType::f32, device_);
      Tensor P = Tensor::empty({ns, r}, DType::f32, device_), Q = Tensor::empty({m, r}, DType::f32, device_);
      Tensor Ql = Tensor::empty({m, r}, DType::f32, device_);
      Tensor all = split ? Tensor::empty({shard_->size() * ns * r}, DType::f32, device_) : Tensor{};
      Tensor W = split ? Tensor::empty({n, r}, DType::f32, device_) : P;  // the whole P
      ops::normal_(M, 1, 0);
      ops::normal_(G, 2, 0);
      ops::normal_(Q, 3, 0);
      const bool mgs = cfg_.orthogonalize == Orthogonalize::mgs || (cfg_.orthogonalize == Orthogonalize::auto_ && r <= 2);
      std::vector<double> send, fin;
      for (int rep = 0; rep < 6; ++rep) {
        auto t0 = Clock::now();
        ops::axpy(world_, G, M);
        ops::gemm(false, false, 1.0 / world_, M, Q, 0.0, P);
        (void)ops::reduce_all(ops::Reduce::sum, P.slice(0, 1));  // waits for the device
        const double s = since(t0);
        t0 = Clock::now();
        if (split) {
          shard_->all_gather(comm::buffer_of(P), comm::buffer_of(all), comm::Mode::sync).wait();
          copy(W, all.slice(0, n * r).reshape({n, r}));
        }
        if (mgs) ops::orthonormalize_mgs(W, 1e-16);
        else ops::orthonormalize_qr(W);
        if (split) copy(P, W.slice(0, ns));
        ops::gemm(true, false, 1.0, M, P, 0.0, Ql);
        if (split) shard_->all_reduce(comm::buffer_of(Ql), comm::buffer_of(Ql), comm::ReduceOp::sum, comm::Mode::sync).wait();
        if (cfg_.error_feedback && cfg_.error_mode == ErrorMode::projection) ops::gemm(false, true, -1.0, P, Ql, 1.0, M);
        ops::gemm(false, true, 1.0, P, Ql, 0.0, G);
        (void)ops::reduce_all(ops::Reduce::sum, G.slice(0, 1));
        if (rep > 0) send.push_back(s), fin.push_back(since(t0));
      }
      return timed[{n, m, r, ns}] = {*std::min_element(send.begin(), send.end()), *std::min_element(fin.begin(), fin.end())};
    };
    for (size_t k = 0; k < subs_.size(); ++k)
      for (RankCost& rc : costs_.buckets[k].ranks) {
        rc.send_s = rc.finish_s = 0;
        for (size_t i = buckets_[k].first; i < buckets_[k].last; ++i) {
          const auto [cr, n, m] = compressed(i, rc.rank);
          if (cr == 0) continue;
          const auto [s, f] = time_shape(n, m, cr, local_rows(i));
          rc.send_s += s;
          rc.finish_s += f;
        }
      }
  }

  // costs_, acc_ and the choices into their state tensors, and back.
  void save_decision() {
    double* c = costs_t_.ptr<double>();
    c[0] = decided_ || link_measured_ ? 1 : 0;
    c[1] = costs_.link.alpha_s;
    c[2] = costs_.link.beta_s_per_byte;
    c[3] = static_cast<double>(link_step_);
    c[4] = link_env_ ? 1 : 0;
    c[5] = costs_.backward_s;
    c[6] = decided_ ? static_cast<double>(decided_at_) : -1;
    c[7] = measured_none_;
    c[8] = measured_psgd_;
    ovh_t_.ptr<double>()[0] = ovh_sum_;
    ovh_t_.ptr<double>()[1] = ovh_count_;
    for (size_t k = 0; k < subs_.size(); ++k) {
      double* b = c + kHead + k * kPerBucket;
      const BucketCost& bc = costs_.buckets[k];
      b[0] = bc.ready_s;
      b[1] = bc.none_bytes;
      for (size_t j = 0; j < 2; ++j) {
        const RankCost& r = bc.ranks[j];
        double* x = b + 2 + j * kPerRank;
        x[0] = r.rank, x[1] = r.p_bytes, x[2] = r.q_bytes, x[3] = r.send_s, x[4] = r.finish_s;
      }
      double* a = acc_t_.ptr<double>() + 4 * k;
      a[0] = acc_[k].prev, a[1] = acc_[k].sum, a[2] = acc_[k].count, a[3] = acc_[k].critical ? 1 : 0;
      choice_t_.ptr<int64_t>()[k] = subs_[k].rank;
    }
  }

  void load_decision() {
    const double* c = costs_t_.ptr<double>();
    link_measured_ = c[0] != 0;
    costs_.link = {c[1], c[2]};
    link_step_ = static_cast<int64_t>(c[3]);
    link_env_ = c[4] != 0;
    costs_.backward_s = c[5];
    decided_ = c[6] >= 0;
    decided_at_ = static_cast<int64_t>(c[6]);
    measured_none_ = c[7];
    measured_psgd_ = c[8];
    ovh_sum_ = ovh_t_.ptr<double>()[0];
    ovh_count_ = ovh_t_.ptr<double>()[1];
    for (size_t k = 0; k < subs_.size(); ++k) {
      const double* b = c + kHead + k * kPerBucket;
      BucketCost& bc = costs_.buckets[k];
      bc.ready_s = b[0];
      for (size_t j = 0; j < 2; ++j) {
        const double* x = b + 2 + j * kPerRank;
        bc.ranks[j].send_s = x[3];
        bc.ranks[j].finish_s = x[4];
      }
      const double* a = acc_t_.ptr<double>() + 4 * k;
      acc_[k].prev = a[0], acc_[k].sum = a[1], acc_[k].count = a[2], acc_[k].critical = a[3] != 0;
    }
  }

  Config cfg_;
  comm::Communicator& comm_;
  int world_ = 1;
  std::vector<nn::Param> params0_;  // the parameters it was built for (their shapes)
  Topology topo_;                   // sharded: the rows of each (compressor.h)
  comm::Communicator* shard_ = nullptr;  // sharded: the shard group
  bool lead_ = false;               // the rank that logs the decisions (rank 0 of both)
  std::map<std::string, size_t> index_;
  Device device_;
  int64_t total_ = 0;
  std::vector<ParamRange> buckets_;
  std::vector<Sub> subs_;
  std::vector<Accordion> acc_;
  StepCosts costs_;
  bool checked_ = false, link_measured_ = false, link_env_ = false, decided_ = false;
  int64_t link_step_ = 0, decided_at_ = 0;
  // The step in progress and its timeline (compression excluded).
  std::vector<nn::Param>* params_ = nullptr;
  int64_t step_now_ = 0;
  size_t next_ = 0;
  Clock::time_point t0_;
  double inside_ = 0, backward_now_ = 0;
  std::vector<double> ready_now_;
  bool measured_ = false;
  Tensor norms_;  // f32 [parameters]: each grad's norm before aggregation, this step
  // The time aggregation adds to backward: this interval's sum and steps (ovh_t_ in checkpoints),
  // and the last interval's mean under none and under compression (-1: not measured).
  double ovh_sum_ = 0, ovh_count_ = 0, measured_none_ = -1, measured_psgd_ = -1;
  Tensor ovh_t_;
  // State: the step counter, the decision, and (from the first state() call) the mirrors of the
  // sub-compressors' error buffers and Q.
  Tensor step_, choice_t_, acc_t_, costs_t_;
  std::vector<size_t> mats_;
  std::map<size_t, Tensor> err_, q_;
  bool dirty_ = false;
};

}  // namespace

std::unique_ptr<Compressor> make_auto(const Config& cfg, comm::Communicator& comm, const Params& params, size_t bucket_bytes,
                                      const Topology& topology) {
  return std::make_unique<Auto>(cfg, comm, params, bucket_bytes, topology);
}

}  // namespace detail

comm::CostModel measure_link(comm::Communicator& comm, Device device) {
  const std::vector<double> sizes = {4096, 512 * 1024, 1024 * 1024, 2048 * 1024};
  Tensor buf = Tensor::zeros({static_cast<int64_t>(sizes.back() / 4)}, DType::f32, device);
  constexpr int kReps = 3;
  std::vector<double> med;
  for (double bytes : sizes) {
    const auto n = static_cast<size_t>(bytes / 4);
    std::vector<double> t;
    for (int rep = 0; rep <= kReps; ++rep) {
      comm.barrier().wait();
      const auto t0 = std::chrono::steady_clock::now();
      const comm::Buffer b{buf.data(), n, DType::f32, device};
      comm.all_reduce(b, b, comm::ReduceOp::sum, comm::Mode::async).synchronize();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) t.push_back(s);  // the first is a warm-up
    }
    std::sort(t.begin(), t.end());
    med.push_back(t[t.size() / 2]);
  }
  const std::vector<comm::Range> r = comm::min_max_over_ranks(comm, med, device);
  std::vector<comm::Sample> large;
  for (size_t i = 1; i < sizes.size(); ++i) large.push_back({sizes[i], r[i].max});
  for (size_t i = 0; i < sizes.size(); ++i) spdlog::debug("link: all-reduce of {} B: {:.1f} us", sizes[i], r[i].max * 1e6);
  return {r[0].max, comm::fit_cost(large).beta_s_per_byte};
}
}  // namespace dtk::compress
