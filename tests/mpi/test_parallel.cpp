// parallel::GradSync under mpiexec -n 1, 2 and 4, with a real model's backward driving it: the
// bucketed sums equal one plain all-reduce of the whole gradient for every bucket size, and
// buckets start in block order, each as soon as (and not before) the blocks it covers are final.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/compress/compressor.h"
#include "dtk/core/philox.h"
#include "dtk/nn/model.h"
#include "dtk/ops/ops.h"
#include "dtk/parallel/data_parallel.h"

namespace dtk::testing {
namespace {

using comm::Backend;
using comm::Runtime;

comm::Communicator& world() {
  static auto c = Runtime::get().world(Backend::mpi);
  return *c;
}

nn::ModelConfig tiny_llama() {
  nn::ModelConfig c;
  c.arch = "llama";
  c.dim = 16;
  c.n_layers = 3;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.ffn_hidden = 24;
  c.vocab = 13;
  c.seq_len = 8;
  return c;
}

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
  std::vector<std::pair<std::string, Tensor>> state() override { return inner_.state(); }
  bool per_rank(const std::string& n) const override { return inner_.per_rank(n); }
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
  world().all_reduce(b, b, comm::ReduceOp::sum, comm::Mode::sync);
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
    cfg.kind = "none";
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
      if (pos != reported.begin()) EXPECT_GT(*(pos - 1), lo) << "bucket " << k << " started late";
    }
    EXPECT_GT(buckets.size(), bytes == 1 ? static_cast<size_t>(m->num_blocks()) : 0);
  }
}

}  // namespace
}  // namespace dtk::testing
