// compress auto (compress/auto.h): the decision on fitted cost models (loopback: none; a slow
// link: PowerSGD), Accordion's detector, and the compressor in a world of one: its choice on the
// local link, its rank following a synthetic gradient whose norm changes regime, error feedback
// across rank changes and a switch to none, and its state across a restore.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "../common/compress_util.h"
#include "dtk/compress/auto.h"
#include "dtk/ops/ops.h"

namespace dtk::testing {
namespace {

using compress::BucketCost;
using compress::RankCost;
using compress::StepCosts;

// Measured-looking (bytes, seconds) pairs of a link of the given latency and bandwidth, fitted.
comm::CostModel fitted(double alpha_s, double bytes_per_s) {
  std::vector<comm::Sample> s;
  for (double b : {4096.0, 65536.0, 1048576.0, 4194304.0}) s.push_back({b, alpha_s + b / bytes_per_s});
  return comm::fit_cost(s);
}

// Two buckets of a 4 MB model (a ResNet-8's worth of matrices) that backward makes ready at
// 20 and 40 ms; PowerSGD sends 1/20 of it at rank 1 and 1/5 at rank 4 and costs 3 and 8 ms of
// compute per bucket.
StepCosts model_costs(const comm::CostModel& link) {
  StepCosts c;
  c.link = link;
  c.backward_s = 0.040;
  for (double ready : {0.020, 0.040}) {
    BucketCost b;
    b.ready_s = ready;
    b.none_bytes = 2e6;
    b.ranks = {{1, 0.05e6, 0.05e6, 0.001, 0.002}, {4, 0.2e6, 0.2e6, 0.003, 0.005}};
    c.buckets.push_back(b);
  }
  return c;
}

TEST(CompressAuto, PredictStep) {
  StepCosts c;
  c.link = {1e-3, 1e-6};  // 1 ms + 1 us per byte
  c.backward_s = 0.010;
  c.buckets = {{0.004, 1000, {{1, 100, 50, 0.0005, 0.002}}}, {0.010, 2000, {{1, 200, 100, 0.001, 0.003}}}};
  // none: bucket 0 on the link 4..6 ms, bucket 1 10..13 ms
  EXPECT_NEAR(compress::predict_step(c, {0, 0}), 0.013, 1e-12);
  // both compressed: backward delayed by 0.5 + 1 ms (to 11.5); P0 4.5..5.6, P1 11.5..12.7; then
  // bucket 0: 11.5 + 2 = 13.5, Q0 13.5..14.55; bucket 1: + 3 = 17.55, Q1 17.55..18.65
  EXPECT_NEAR(compress::predict_step(c, {1, 1}), 0.01865, 1e-12);
  // a hidden all-reduce: bucket 0's 2 ms end before backward's 10
  EXPECT_NEAR(compress::predict_step(c, {0, 1}), 0.0010 + 0.010 + 0.0012 + 0.003 + 0.0011, 1e-12);
  EXPECT_THROW(compress::predict_step(c, {0}), UsageError);
  EXPECT_THROW(compress::predict_step(c, {2, 0}), UsageError);
}

TEST(CompressAuto, LoopbackChoosesNone) {
  // Shared memory between ranks: 5 us, 5 GB/s. The 2 MB buckets' all-reduces (0.4 ms) hide
  // behind backward, or cost less than compressing them.
  const StepCosts c = model_costs(fitted(5e-6, 5e9));
  for (const std::vector<int>& want : {std::vector<int>{1, 1}, std::vector<int>{4, 4}})
    EXPECT_EQ(compress::choose(c, want, {0, 0}), std::vector<int>({0, 0}));
  // and leaves compression when it was compressing
  EXPECT_EQ(compress::choose(c, {1, 1}, {1, 1}), std::vector<int>({0, 0}));
}

TEST(CompressAuto, SlowLinkCompresses) {
  // 100 Mbit/s: every bucket (an all-reduce takes 160 ms)
  StepCosts c = model_costs(fitted(50e-6, 12.5e6));
  EXPECT_NEAR(c.link.beta_s_per_byte * 12.5e6, 1.0, 1e-6);
  EXPECT_EQ(compress::choose(c, {1, 1}, {0, 0}), std::vector<int>({1, 1}));
  EXPECT_EQ(compress::choose(c, {4, 4}, {0, 0}), std::vector<int>({4, 4}));
  // Accordion's rank per bucket is taken as asked; a bucket without matrices stays plain
  EXPECT_EQ(compress::choose(c, {4, 1}, {1, 1}), std::vector<int>({4, 1}));
  EXPECT_EQ(compress::choose(c, {0, 1}, {0, 0}), std::vector<int>({0, 1}));
  // 1 Gbit/s: the first bucket's 16 ms all-reduce hides behind the 20 ms of backward after it,
  // the last one's does not
  c = model_costs(fitted(50e-6, 125e6));
  EXPECT_EQ(compress::choose(c, {1, 1}, {0, 0}), std::vector<int>({0, 1}));
  EXPECT_EQ(compress::choose(c, {4, 4}, {4, 4}), std::vector<int>({0, 4}));
}

TEST(CompressAuto, SwitchNeedsAMargin) {
  // A link where compressing saves about 1% of the step: whatever runs now stays.
  StepCosts c;
  c.link = {0, 1e-9};
  c.backward_s = 0;
  c.buckets = {{0, 1e6, {{1, 0.5e6, 0.3e6, 0.00019, 0}}}};
  const double none = compress::predict_step(c, {0}), psgd = compress::predict_step(c, {1});
  ASSERT_LT(psgd, none);
  ASSERT_GT(psgd, none * (1 - compress::kSwitchMargin));
  EXPECT_EQ(compress::choose(c, {1}, {0}), std::vector<int>{0});
  EXPECT_EQ(compress::choose(c, {1}, {1}), std::vector<int>{1});
}

TEST(CompressAuto, AccordionDetector) {
  EXPECT_TRUE(compress::accordion_critical(0, 1, 0.5));  // no previous interval
  EXPECT_FALSE(compress::accordion_critical(1, 1.4, 0.5));
  EXPECT_TRUE(compress::accordion_critical(1, 1.5, 0.5));
  EXPECT_TRUE(compress::accordion_critical(1, 0.5, 0.5));
  EXPECT_FALSE(compress::accordion_critical(1, 0.6, 0.5));
  compress::Accordion a;
  std::vector<bool> regimes;
  // intervals of 3 steps: norms steady, steady, a jump (x4), steady at the new level, a fall
  for (double level : {1.0, 1.0, 4.0, 4.0, 1.0}) {
    for (int s = 0; s < 3; ++s) a.add(level * (1 + 0.05 * s));
    a.end_interval(0.5);
    regimes.push_back(a.critical);
  }
  EXPECT_EQ(regimes, std::vector<bool>({true, false, true, false, true}));
  a.end_interval(0.5);  // an empty interval changes nothing
  EXPECT_TRUE(a.critical);
}

// The compressor in a world of one.
class AutoLink {  // DTK_AUTO_LINK for the scope
 public:
  explicit AutoLink(const char* v) { set(v); }
  ~AutoLink() { unsetenv(compress::kAutoLinkEnv); }
  void set(const char* v) { setenv(compress::kAutoLinkEnv, v, 1); }
};
constexpr const char* kSlow = "50,0.000125";  // 1 Mbit/s: compression wins by 80 ms, more than any compute timing here
constexpr const char* kFast = "0,1000";

compress::Config auto_cfg() {
  compress::Config c;
  c.kind = compress::Kind::auto_;
  c.start_iter = 2;
  c.auto_interval = 3;
  c.auto_refresh = 3;
  c.seed = 7;
  return c;
}
const std::vector<std::pair<std::string, Shape>> kShapes = {{"w", {64, 48}}, {"b", {48}}};
std::vector<int> ranks(const compress::Compressor& c) { return c.plan()["ranks"].get<std::vector<int>>(); }

// A rank-1 gradient s u v^T (PowerSGD recovers it exactly) and a small bias.
void feed_low_rank(Grads& g, double s) {
  Vec w(64 * 48);
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 48; ++j) w[i * 48 + j] = s * std::cos(0.1 * i) * std::sin(0.2 * j + 0.3);
  set(g.params[0], w);
  set(g.params[1], Vec(48, 0.01 * s));
}

TEST(CompressAuto, LocalLinkChoosesNone) {
  unsetenv(compress::kAutoLinkEnv);
  auto g = make_grads(kShapes);
  auto c = make_compressor(auto_cfg(), *local(), g.params);
  for (int step = 0; step < 6; ++step) {
    feed_low_rank(g, 1);
    c->aggregate(g.params, step);
  }
  const nlohmann::json p = c->plan();
  EXPECT_EQ(p["link"]["source"], "measured");
  EXPECT_EQ(ranks(*c), std::vector<int>{0}) << p.dump(1);
  EXPECT_EQ(c->last_bytes().sent, c->last_bytes().uncompressed);
}

TEST(CompressAuto, RankFollowsTheGradientsRegime) {
  AutoLink link(kSlow);
  auto g = make_grads(kShapes);
  auto c = make_compressor(auto_cfg(), *local(), g.params);
  // decisions at steps 2 (the first interval: critical), 5 (steady: regular), 8 (the norm x10
  // over steps 5-7: critical), 11 (steady at the new level: regular)
  const std::vector<int> expected = {0, 0, 4, 4, 4, 1, 1, 1, 4, 4, 4, 1, 1, 1};
  for (int step = 0; step < 14; ++step) {
    const double s = step < 5 ? 1.0 : 10.0;
    feed_low_rank(g, s);
    const Vec in = get(g.flat);
    c->aggregate(g.params, step);
    EXPECT_EQ(ranks(*c), std::vector<int>{expected[static_cast<size_t>(step)]}) << "step " << step;
    const Vec out = get(g.flat);
    for (size_t i = 0; i < in.size(); ++i) ASSERT_NEAR(out[i], in[i], 1e-5 * s) << "step " << step << " element " << i;
  }
  const nlohmann::json p = c->plan();
  EXPECT_EQ(p["link"]["source"], compress::kAutoLinkEnv);
  EXPECT_EQ(p["from_step"], 12);
  EXPECT_EQ(p["buckets"][0]["critical"], false);
}

// sum of the inputs == sum of the aggregates + the error buffer, through a rank change (carried
// error) and a switch to none (the error flushed into the next step).
TEST(CompressAuto, ErrorFeedbackLosesNothing) {
  AutoLink link(kSlow);
  auto g = make_grads(kShapes);
  auto c = make_compressor(auto_cfg(), *local(), g.params);
  const int64_t n = g.flat.numel();
  Vec in_sum(static_cast<size_t>(n), 0.0), out_sum(static_cast<size_t>(n), 0.0);
  std::vector<std::vector<int>> seen;
  for (int step = 0; step < 11; ++step) {
    if (step == 8) link.set(kFast);  // measured again at step 8 (auto_refresh 3): none pays now
    const Vec in = as_f32(random_vec(n, 100 + static_cast<uint64_t>(step)));
    g.flat.copy_from(Tensor::from_doubles(in, {n}, DType::f32));
    c->aggregate(g.params, step);
    const Vec out = get(g.flat);
    for (int64_t i = 0; i < n; ++i) in_sum[i] += in[i], out_sum[i] += out[i];
    seen.push_back(ranks(*c));
    const Vec err = get(state_of(*c, "error/w"));
    double worst = 0;
    for (int64_t i = 0; i < 64 * 48; ++i) worst = std::max(worst, std::abs(in_sum[i] - out_sum[i] - err[i]));
    EXPECT_LT(worst, 1e-4) << "step " << step;
    for (int64_t i = 64 * 48; i < n; ++i) EXPECT_NEAR(in_sum[i], out_sum[i], 1e-4) << "bias, step " << step;
  }
  // random gradients of one scale: critical only in the first interval
  EXPECT_EQ(seen, std::vector<std::vector<int>>({{0}, {0}, {4}, {4}, {4}, {1}, {1}, {1}, {0}, {0}, {0}}));
  EXPECT_EQ(get(state_of(*c, "error/w")), Vec(64 * 48, 0.0));
}

TEST(CompressAuto, StateRestoresExactly) {
  AutoLink link(kSlow);
  auto ga = make_grads(kShapes), gb = make_grads(kShapes);
  auto a = make_compressor(auto_cfg(), *local(), ga.params);
  auto b = make_compressor(auto_cfg(), *local(), gb.params);
  auto feed = [](Grads& g, int step) {
    const int64_t n = g.flat.numel();
    g.flat.copy_from(Tensor::from_doubles(random_vec(n, 300 + static_cast<uint64_t>(step), step < 5 ? 1.0 : 5.0), {n}, DType::f32));
  };
  for (int step = 0; step < 7; ++step) {
    feed(ga, step);
    a->aggregate(ga.params, step);
  }
  auto sa = a->state(), sb = b->state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    ASSERT_EQ(sa[i].name, sb[i].name);
    sb[i].value.copy_from(sa[i].value);
  }
  EXPECT_EQ(ranks(*a), std::vector<int>{1});
  for (int step = 7; step < 13; ++step) {  // the norm x5 from step 5: critical at step 8, regular at 11
    feed(ga, step);
    feed(gb, step);
    a->aggregate(ga.params, step);
    b->aggregate(gb.params, step);
    EXPECT_EQ(get(ga.flat), get(gb.flat)) << "step " << step;
    EXPECT_EQ(ranks(*a), ranks(*b)) << "step " << step;
  }
  EXPECT_EQ(ranks(*a), std::vector<int>{1});
  sa = a->state();
  sb = b->state();
  for (size_t i = 0; i < sa.size(); ++i) {
    if (sa[i].name != "auto/costs" && sa[i].name != "auto/overhead") {
      EXPECT_EQ(get(sa[i].value), get(sb[i].value)) << sa[i].name;
    }
  }
}

TEST(CompressAuto, Config) {
  compress::Config c = auto_cfg();
  c.auto_ranks = {4, 1};
  EXPECT_THROW(c.validate(), UsageError);
  c.auto_ranks = {2};
  EXPECT_THROW(c.validate(), UsageError);
  c = auto_cfg();
  c.accordion_eta = 0;
  EXPECT_THROW(c.validate(), UsageError);
  c = auto_cfg();
  c.auto_interval = 0;
  EXPECT_THROW(c.validate(), UsageError);
  AutoLink bad("1e3");  // no bandwidth
  comm::CostModel m;
  EXPECT_THROW(compress::auto_link_from_env(m), UsageError);
  bad.set("2.5,0.5");
  ASSERT_TRUE(compress::auto_link_from_env(m));
  EXPECT_DOUBLE_EQ(m.alpha_s, 2.5e-6);
  EXPECT_DOUBLE_EQ(m.gbps(), 0.5);
}

}  // namespace
}  // namespace dtk::testing
