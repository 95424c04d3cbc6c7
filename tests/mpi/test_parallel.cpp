// parallel::GradSync and parallel::Fsdp under mpiexec -n 1, 2 and 4, with a real model's
// forward and backward driving them. GradSync: the bucketed sums equal one plain all-reduce of
// the whole gradient for every bucket size, and buckets start in block order, each as soon as
// (and not before) the blocks it covers are final. Fsdp: for every bucket plan, reshard policy,
// prefetch depth, overlap on and off, HSDP and activation checkpointing, each block computes
// with exactly the replicated model's parameters (f32 gathers), the loss is the same bits, and
// the shard gradients are the rows of the all-reduced gradient; without overlap each bucket's
// gradient is final as soon as its first block's backward ends, in block order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/compress/compressor.h"
#include "dtk/core/error.h"
#include "dtk/core/philox.h"
#include "dtk/nn/model.h"
#include "dtk/ops/ops.h"
#include "dtk/parallel/data_parallel.h"
#include "dtk/parallel/fsdp.h"

namespace dtk::testing {
namespace {

using comm::Backend;
using comm::Runtime;

comm::Communicator& world() {
  static auto c = Runtime::get().world(Backend::mpi);
  return *c;
}

nn::ModelConfig tiny_llama() { return nn::llama_config(16, 3, 2, 1, 24, 13, 8); }

// Rank r's batch: its own tokens, so every rank has its own gradient.
nn::Batch batch_of(int rank, int64_t vocab) {
  const int64_t B = 2, T = 8;
  std::vector<int32_t> x(static_cast<size_t>(B * T)), y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<int32_t>(philox::uniform(100 + rank, i) * static_cast<double>(vocab));
    y[i] = static_cast<int32_t>(philox::uniform(200 + rank, i) * static_cast<double>(vocab));
  }
  return {Tensor::from_host(x.data(), {B, T}, DType::i32), Tensor::from_host(y.data(), {B, T}, DType::i32)};
}

std::unique_ptr<nn::Model> model() {
  auto m = nn::make_model(tiny_llama(), Device::cpu());
  m->init(7);
  return m;
}

// A compressor that forwards to another and records which bucket started after which block.
class Recorder final : public compress::Compressor {
 public:
  explicit Recorder(compress::Compressor& inner, const int& last_block) : inner_(inner), last_block_(last_block) {}
  void begin(std::vector<nn::Param>& params, int64_t step) override { inner_.begin(params, step); }
  void bucket_ready(size_t k) override {
    started.emplace_back(k, last_block_);
    inner_.bucket_ready(k);
  }
  void progress() override { inner_.progress(); }
  void finish() override { inner_.finish(); }
  const std::vector<compress::ParamRange>& buckets() const override { return inner_.buckets(); }
  compress::Bytes last_bytes() const override { return inner_.last_bytes(); }
  std::vector<PlacedTensor> state() override { return inner_.state(); }
  std::vector<std::pair<size_t, int>> started;  // (bucket, the last block reported ready then)

 private:
  compress::Compressor& inner_;
  const int& last_block_;
};

const std::vector<size_t> kBucketBytes = {1, 700, 4000, std::numeric_limits<size_t>::max()};

TEST(GradSync, BucketedSumsEqualOnePlainAllReduce) {
  auto ref = model();
  ref->zero_grad();
  ref->forward(batch_of(world().rank(), 13));
  ref->backward(1.0);
  Tensor want = ref->grads().clone();
  comm::Buffer b{want.data(), static_cast<size_t>(want.numel()), DType::f32, Device::cpu()};
  world().all_reduce(b, b, comm::ReduceOp::sum, comm::Mode::sync).wait();
  const std::vector<double> w = want.to_doubles();
  double scale = 0;
  for (double v : w) scale = std::max(scale, std::abs(v));

  for (size_t bytes : kBucketBytes) {
    SCOPED_TRACE("bucket bytes " + std::to_string(bytes));
    auto m = model();
    parallel::GradSync sync(*m, world(), bytes);
    m->set_hooks(&sync);
    for (int step = 0; step < 2; ++step) {  // the second step reuses everything
      m->zero_grad();
      m->forward(batch_of(world().rank(), 13));
      sync.begin(step);
      m->backward(1.0);
      sync.finish();
      const std::vector<double> got = m->grads().to_doubles();
      double err = 0;
      for (size_t i = 0; i < got.size(); ++i) err = std::max(err, std::abs(got[i] - w[i]));
      // 2 ranks: the same sums; more: MPI may add in another order for other sizes.
      EXPECT_LE(err, world().size() <= 2 ? 0.0 : 1e-6 * scale) << "step " << step;
      EXPECT_EQ(sync.bytes().sent, static_cast<int64_t>(m->grads().bytes()));
    }
  }
}

TEST(GradSync, BucketsStartInBlockOrderAsSoonAsReady) {
  for (size_t bytes : kBucketBytes) {
    SCOPED_TRACE("bucket bytes " + std::to_string(bytes));
    auto m = model();
    compress::Config cfg;
    cfg.kind = compress::Kind::none;
    auto inner = compress::make_compressor(cfg, world(), m->params(), bytes);
    int last_block = std::numeric_limits<int>::max();
    std::vector<int> reported;
    Recorder rec(*inner, last_block);
    parallel::GradSync sync(*m, world(), rec);
    // Between the model and the sync: note each block reported ready, then pass it on.
    struct Tap final : nn::BlockHooks {
      std::function<void(int)> f;
      void after_backward(int b) override { f(b); }
    } tap;
    tap.f = [&](int block) {
      reported.push_back(block);
      last_block = block;
      sync.after_backward(block);
    };
    m->set_hooks(&tap);
    m->zero_grad();
    m->forward(batch_of(world().rank(), 13));
    sync.begin(0);
    m->backward(1.0);
    sync.finish();

    const auto& buckets = inner->buckets();
    ASSERT_EQ(rec.started.size(), buckets.size());
    for (size_t i = 1; i < reported.size(); ++i) EXPECT_LT(reported[i], reported[i - 1]);  // decreasing blocks
    for (size_t k = 0; k < buckets.size(); ++k) {
      EXPECT_EQ(rec.started[k].first, k);
      int lo = std::numeric_limits<int>::max();
      for (size_t i = buckets[k].first; i < buckets[k].last; ++i) lo = std::min(lo, m->params()[i].block);
      const int at = rec.started[k].second;
      EXPECT_LE(at, lo) << "bucket " << k << " started before block " << lo << " was final";
      // ...and as soon as it was: the block reported before `at` had not finished the bucket.
      const auto pos = std::find(reported.begin(), reported.end(), at);
      ASSERT_NE(pos, reported.end());
      if (pos != reported.begin()) {
        EXPECT_GT(*(pos - 1), lo) << "bucket " << k << " started late";
      }
    }
    EXPECT_GT(buckets.size(), bytes == 1 ? static_cast<size_t>(m->num_blocks()) : 0);
  }
}

// The replicated reference: rank r's loss and the all-reduced gradient.
struct Reference {
  std::unique_ptr<nn::Model> m;
  double loss = 0, eval = 0;
  std::vector<double> grad;  // the sum over ranks, flat
  double scale = 0;
};
Reference reference(nn::Checkpointing checkpointing) {
  Reference r;
  r.m = model();
  r.m->set_activation_checkpointing(checkpointing);
  r.m->zero_grad();
  r.eval = r.m->evaluate(batch_of(world().rank(), 13));
  r.loss = r.m->forward(batch_of(world().rank(), 13));
  r.m->backward(1.0);
  Tensor g = r.m->grads().clone();
  comm::Buffer b{g.data(), static_cast<size_t>(g.numel()), DType::f32, Device::cpu()};
  world().all_reduce(b, b, comm::ReduceOp::sum, comm::Mode::sync).wait();
  r.grad = g.to_doubles();
  for (double v : r.grad) r.scale = std::max(r.scale, std::abs(v));
  return r;
}

TEST(Fsdp, EveryPlanGathersTheFullTensorsAndScattersTheSums) {
  struct Case {
    std::string buckets;
    parallel::Reshard reshard;
    int prefetch;
    bool overlap;
    nn::Checkpointing checkpointing;
    int replicate;
  };
  std::vector<Case> cases = {
      {"block", parallel::Reshard::default_, 1, true, nn::Checkpointing::none, 1},  {"param", parallel::Reshard::default_, 1, true, nn::Checkpointing::none, 1},
      {"2", parallel::Reshard::always, 2, true, nn::Checkpointing::none, 1},        {"100", parallel::Reshard::never, 1, true, nn::Checkpointing::none, 1},
      {"param", parallel::Reshard::always, 0, true, nn::Checkpointing::full, 1},    {"block", parallel::Reshard::default_, 3, true, nn::Checkpointing::selective, 1},
      {"block", parallel::Reshard::default_, 1, false, nn::Checkpointing::none, 1}, {"param", parallel::Reshard::never, 1, false, nn::Checkpointing::selective, 1},
  };
  if (world().size() % 2 == 0) cases.push_back({"2", parallel::Reshard::default_, 1, true, nn::Checkpointing::full, 2});
  for (nn::Checkpointing ckpt : {nn::Checkpointing::none, nn::Checkpointing::full, nn::Checkpointing::selective}) {
    const Reference ref = reference(ckpt);
    for (const Case& c : cases) {
      if (c.checkpointing != ckpt) continue;
      SCOPED_TRACE("buckets " + c.buckets + " reshard " + std::to_string(static_cast<int>(c.reshard)) + " prefetch " +
                   std::to_string(c.prefetch) + (c.overlap ? "" : " no overlap") + " checkpointing " + std::string(name_of(ckpt)) +
                   " replicate " + std::to_string(c.replicate));
      parallel::FsdpConfig cfg;
      cfg.param_dtype = cfg.reduce_dtype = DType::f32;
      cfg.buckets = c.buckets;
      cfg.reshard_after_forward = c.reshard;
      cfg.prefetch = c.prefetch;
      cfg.overlap = c.overlap;
      cfg.replicate = c.replicate;
      auto m = nn::make_model(tiny_llama(), Device::cpu(), DType::f32, nn::Storage::external);
      m->set_activation_checkpointing(ckpt);
      parallel::Fsdp fsdp(*m, world(), world(), cfg);
      fsdp.init(7);
      // Between the model and Fsdp: after each gather the block's parameters must be the
      // replicated model's bits; without overlap, after each block's backward the buckets that
      // start at it are final and the earlier ones still zero.
      struct Tap final : nn::BlockHooks {
        parallel::Fsdp* f;
        nn::Model *m, *ref;
        std::function<void(int)> after_bwd;
        int mismatches = 0;
        void check(int b) {
          for (int i : m->block_params(b)) {
            const Tensor& got = m->params()[static_cast<size_t>(i)].value;
            const Tensor& want = ref->params()[static_cast<size_t>(i)].value;
            if (!got.defined() || got.shape() != want.shape() || std::memcmp(got.data(), want.data(), want.bytes()) != 0)
              ++mismatches;
          }
        }
        void before_forward(int b, nn::Pass p) override {
          f->before_forward(b, p);
          if (p != nn::Pass::recompute) check(b);
        }
        void after_forward(int b, nn::Pass p) override { f->after_forward(b, p); }
        void before_backward(int b) override {
          f->before_backward(b);
          check(b);
        }
        void after_backward(int b) override {
          f->after_backward(b);
          after_bwd(b);
        }
      } tap;
      tap.f = &fsdp, tap.m = m.get(), tap.ref = ref.m.get();
      auto& shards = fsdp.params();
      auto shard_err = [&](size_t i) {  // max |shard grad - reference rows|
        const parallel::Rows& r = *fsdp.rows(i);
        const int64_t row = shape_numel(r.shape) / r.shape[0];
        size_t base = 0;
        for (size_t j = 0; j < i; ++j) base += static_cast<size_t>(shape_numel(m->params()[j].shape));
        base += static_cast<size_t>(r.offsets[static_cast<size_t>(r.rank)] * row);
        const std::vector<double> got = shards[i].grad.to_doubles();
        double err = 0;
        for (size_t k = 0; k < got.size(); ++k) err = std::max(err, std::abs(got[k] - ref.grad[base + k]));
        return err;
      };
      int order_errors = 0;
      tap.after_bwd = [&](int b) {
        if (c.overlap || c.replicate > 1) return;
        for (size_t i = 0; i < shards.size(); ++i) {
          const bool final = fsdp.bucket_plan().end() != std::find_if(fsdp.bucket_plan().begin(), fsdp.bucket_plan().end(), [&](const parallel::Bucket& k) {
            return i >= k.first && i < k.end && k.first_block >= b;
          });
          const double err = shard_err(i);
          if (final ? err > 1e-6 * ref.scale : shards[i].grad.numel() > 0 && ops::reduce_all(ops::Reduce::absmax, shards[i].grad) != 0)
            ++order_errors;
        }
      };
      m->set_hooks(&tap);
      for (int step = 0; step < 2; ++step) {  // the second step reuses every buffer
        fsdp.zero_grad();
        EXPECT_EQ(m->evaluate(batch_of(world().rank(), 13)), ref.eval);
        EXPECT_EQ(m->forward(batch_of(world().rank(), 13)), ref.loss);
        fsdp.begin(step);
        m->backward(1.0);
        fsdp.finish();
        for (size_t i = 0; i < shards.size(); ++i)
          EXPECT_LE(shard_err(i), (world().size() <= 2 ? 1e-7 : 1e-6) * ref.scale) << m->params()[i].name;
      }
      EXPECT_EQ(tap.mismatches, 0) << "gathered parameters differ from the full tensors";
      EXPECT_EQ(order_errors, 0) << "gradients final out of block order";
    }
  }
}

TEST(Fsdp, PlansCoverTheModelAndFilesAreChecked) {
  auto m = nn::make_model(tiny_llama(), Device::cpu(), DType::f32, nn::Storage::external);
  EXPECT_EQ(parallel::plan_per_param(*m).size(), m->params().size());
  EXPECT_EQ(parallel::plan_blocks(*m, 1).size(), static_cast<size_t>(m->num_blocks()));
  EXPECT_EQ(parallel::plan_blocks(*m, 2).size(), static_cast<size_t>((m->num_blocks() + 1) / 2));
  const auto p = parallel::plan_from_json(nlohmann::json::parse(R"({"buckets": [{"blocks": [0, 1]}, {"params": [10, 15]},
                                                                              {"params": [15, 19]}, {"blocks": [3, 4]}]})"),
                                          *m);
  ASSERT_EQ(p.size(), 4u);
  EXPECT_EQ(p[1].first_block, 2);
  for (const char* bad : {R"({"buckets": [{"blocks": [0, 3]}]})", R"({"buckets": [{"params": [0, 5]}]})",
                          R"({"buckets": [{"blocks": [1, 4]}, {"blocks": [0, 0]}]})", R"({"plan": []})"})
    EXPECT_THROW(parallel::plan_from_json(nlohmann::json::parse(bad), *m), UsageError) << bad;
  // The automatic plan merges blocks when latency dominates and keeps them apart when the
  // merged gather could not hide behind compute.
  parallel::Costs slow_latency{{1e-3, 0}, {1e-3, 0}, std::vector<double>(5, 1e-3), std::vector<double>(5, 2e-3)};
  const parallel::WireBytes bytes{std::vector<double>(m->params().size(), 1e3), std::vector<double>(m->params().size(), 1e3)};
  parallel::FsdpConfig cfg;
  EXPECT_LT(parallel::plan_auto(*m, bytes, slow_latency, cfg).size(), static_cast<size_t>(m->num_blocks()));
  parallel::Costs bandwidth{{0, 1e-7}, {0, 1e-7}, std::vector<double>(5, 1e-3), std::vector<double>(5, 2e-3)};
  EXPECT_EQ(parallel::plan_auto(*m, bytes, bandwidth, cfg).size(), static_cast<size_t>(m->num_blocks()));
  cfg.bucket_memory = 1;  // nothing fits two blocks
  EXPECT_EQ(parallel::plan_auto(*m, bytes, slow_latency, cfg).size(), static_cast<size_t>(m->num_blocks()));
}

}  // namespace
}  // namespace dtk::testing
