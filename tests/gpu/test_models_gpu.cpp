// Models and compressors on the GPU against the CPU (skipped without a GPU): the same init, the
// loss and gradients to f32 rounding, activation checkpointing bit-identical on the GPU too, the
// compressors' steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

#include "../common/compress_util.h"
#include "../common/nn_util.h"
#include "../common/test_util.h"
#include "dtk/core/device.h"
#include "dtk/nn/model.h"
#include "dtk/ops/ops.h"

namespace dtk::nn {
namespace {

using test_util::Vec;
using namespace test_models;

TEST(NnLlama, CudaMatchesCpu) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU";
  const Device gpu = Device::cuda(0);
  const ModelConfig c = small_llama();
  auto cpu_m = make_model(c, Device::cpu()), gpu_m = make_model(c, gpu);
  cpu_m->init(17);
  gpu_m->init(17);
  EXPECT_EQ(cpu_m->values().to_doubles(), gpu_m->values().to_doubles());  // init is device-independent
  const Batch b = tiny_batch(3, 11, 13, 18, true);
  cpu_m->zero_grad();
  gpu_m->zero_grad();
  const double lc = cpu_m->forward(b);
  const double lg = gpu_m->forward(b.to(gpu));
  EXPECT_NEAR(lg, lc, 1e-5 * std::fabs(lc));
  cpu_m->backward(1.0);
  gpu_m->backward(1.0);
  const Vec gc = cpu_m->grads().to_doubles(), gg = gpu_m->grads().to_doubles();
  double gmax = 0, diff = 0;
  for (size_t i = 0; i < gc.size(); ++i) {
    gmax = std::max(gmax, std::fabs(gc[i]));
    diff = std::max(diff, std::fabs(gc[i] - gg[i]));
  }
  EXPECT_LE(diff, 1e-4 * gmax);
  EXPECT_EQ(gpu_m->evaluate(b.to(gpu)), lg);
  // The trainer's forward: the loss left on the GPU (acc += 2 * loss), the host's copies checked.
  Tensor acc = Tensor::zeros({1}, DType::f64, gpu);
  const Batch up = b.to(gpu);
  ASSERT_TRUE(up.host_targets.defined());
  gpu_m->zero_grad();
  gpu_m->forward(up, acc, 2.0);
  gpu_m->backward(1.0);
  EXPECT_NEAR(acc.item(), 2 * lg, 1e-15 * std::fabs(lg));
  EXPECT_EQ(gpu_m->grads().to_doubles(), gg) << "accumulating forward";
  gpu_m->zero_grad();
  // Checkpointing is bit-identical on the GPU too.
  for (Checkpointing mode : {Checkpointing::full, Checkpointing::selective}) {
    gpu_m->set_activation_checkpointing(mode);
    gpu_m->zero_grad();
    EXPECT_EQ(gpu_m->forward(b.to(gpu)), lg) << mode_str(mode);
    gpu_m->backward(1.0);
    EXPECT_EQ(gpu_m->grads().to_doubles(), gg) << mode_str(mode);
  }
  // The mlp too.
  auto mc = make_model(tiny_mlp(), Device::cpu()), mg = make_model(tiny_mlp(), gpu);
  mc->init(5);
  mg->init(5);
  const Batch mb = mlp_batch(6, DType::f32, 6);
  EXPECT_NEAR(mg->forward(mb.to(gpu)), mc->forward(mb), 1e-5);
}

// --precision bf16 on the GPU against the CPU: the same rounding points, f32 arithmetic in
// another order (a bf16 rounding may move by a step): the loss within 1e-2, the gradients within
// 5e-2 (L2, relative), and two GPU runs bit-identical. Head dim 64 (the bf16 flash attention)
// and 4 (f32 attention on widened copies).
TEST(NnLlama, CudaMatchesCpuInBf16) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU";
  const Device gpu = Device::cuda(0);
  for (const int64_t hd : {4, 64}) {
    ModelConfig c = small_llama();
    if (hd == 64) c.dim = 128, c.n_heads = 2, c.n_kv_heads = 1, c.ffn_hidden = 96;
    auto cpu_m = make_model(c, Device::cpu()), gpu_m = make_model(c, gpu);
    cpu_m->init(17);
    gpu_m->init(17);
    cpu_m->set_precision(Precision::bf16);
    gpu_m->set_precision(Precision::bf16);
    const Batch b = tiny_batch(3, 11, 13, 18, true);
    const auto step = [&](Model& m, const Batch& batch) {
      m.zero_grad();
      const double loss = m.forward(batch);
      m.backward(1.0);
      return std::make_pair(loss, m.grads().to_doubles());
    };
    const auto [lc, gc] = step(*cpu_m, b);
    const auto [lg, gg] = step(*gpu_m, b.to(gpu));
    const auto [lg2, gg2] = step(*gpu_m, b.to(gpu));
    EXPECT_NEAR(lg, lc, 1e-2 * std::fabs(lc)) << "head dim " << hd;
    double diff = 0, norm = 0;
    for (size_t i = 0; i < gc.size(); ++i) {
      diff += (gg[i] - gc[i]) * (gg[i] - gc[i]);
      norm += gc[i] * gc[i];
    }
    std::printf("gpu-check: llama bf16 hd %ld: loss cpu %.6f gpu %.6f, gradient rel diff %.3g\n", static_cast<long>(hd),
                lc, lg, std::sqrt(diff / norm));
    EXPECT_LT(std::sqrt(diff / norm), 5e-2) << "head dim " << hd;
    EXPECT_EQ(lg2, lg) << "head dim " << hd;
    EXPECT_EQ(gg2, gg) << "head dim " << hd;
  }
}

// The loss of each sample of `inputs` against each class c (row-major [B, classes]), from
// evaluations of the whole batch with one counted target (the rest -1, ignored): the mean loss is
// then that one sample's, logsumexp(z_i) - z_ic, for the logits z an evaluation of this batch
// computes whatever its targets. Lower loss, larger logit.
Vec per_class_losses(Model& m, const Tensor& inputs, int64_t classes) {
  const int64_t B = inputs.dim(0);
  Vec out(static_cast<size_t>(B * classes));
  for (int64_t i = 0; i < B; ++i)
    for (int64_t c = 0; c < classes; ++c) {
      std::vector<int32_t> t(static_cast<size_t>(B), -1);
      t[static_cast<size_t>(i)] = static_cast<int32_t>(c);
      out[static_cast<size_t>(i * classes + c)] = m.evaluate({inputs, ids_tensor(t, {B}).to(m.device())});
    }
  return out;
}

TEST(NnResNet, CudaMatchesCpu) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU";
  const Device gpu = Device::cuda(0);
  // Per-sample losses on the two devices differ by f32 rounding in another order (convolutions
  // of at most 98 products, the imagenet stem's 2 x 7 x 7; batch statistics, pooling, the fc
  // layer: a few 1e-6 on values of order 1); 1e-4 is the bound, as for the mean evaluation loss.
  constexpr double kLossTol = 1e-4;
  for (const char* stem : {"cifar", "imagenet"}) {
    const ModelConfig c = tiny_resnet(stem);
    auto cpu_m = make_model(c, Device::cpu()), gpu_m = make_model(c, gpu);
    cpu_m->init(17);
    gpu_m->init(17);
    EXPECT_EQ(cpu_m->values().to_doubles(), gpu_m->values().to_doubles()) << stem;
    const Batch b = image_batch(c, 6, 18, DType::f32);
    const double lc = cpu_m->forward(b), lg = gpu_m->forward(b.to(gpu));
    EXPECT_NEAR(lg, lc, 1e-5 * std::fabs(lc)) << stem;
    cpu_m->zero_grad();
    gpu_m->zero_grad();
    cpu_m->forward(b);
    gpu_m->forward(b.to(gpu));
    cpu_m->backward(1.0);
    gpu_m->backward(1.0);
    for (const auto& [want, got] : {std::pair{cpu_m->grads().to_doubles(), gpu_m->grads().to_doubles()},
                                    std::pair{cpu_m->buffer_values().to_doubles(), gpu_m->buffer_values().to_doubles()}}) {
      double most = 0, diff = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        most = std::max(most, std::fabs(want[i]));
        diff = std::max(diff, std::fabs(want[i] - got[i]));
      }
      EXPECT_LE(diff, 1e-4 * most) << stem;
    }
    EXPECT_NEAR(gpu_m->evaluate(b.to(gpu)), cpu_m->evaluate(b), kLossTol) << stem;
    const int64_t correct_gpu = gpu_m->correct(), correct_cpu = cpu_m->correct();
    // A sample's argmax can differ between the devices only where the CPU's two largest logits
    // are close: z_a - z_b = loss_b - loss_a on each device (logsumexp cancels), so the GPU's
    // margin is the CPU's less at most 2 kLossTol, and less the rounding of the f32 losses (a few
    // 1e-7), which the third kLossTol covers. Each such near tie can move the count by one.
    const int64_t classes = c.classes;
    const Vec pc = per_class_losses(*cpu_m, b.inputs, classes);
    const Vec pg = per_class_losses(*gpu_m, b.inputs.to(gpu), classes);
    double worst = 0;
    int64_t near_ties = 0;
    for (int64_t i = 0; i < b.samples(); ++i) {
      Vec row(pc.begin() + i * classes, pc.begin() + (i + 1) * classes);
      std::sort(row.begin(), row.end());
      near_ties += row[1] - row[0] <= 3 * kLossTol;
      for (int64_t k = i * classes; k < (i + 1) * classes; ++k)
        worst = std::max(worst, std::fabs(pg[static_cast<size_t>(k)] - pc[static_cast<size_t>(k)]));
    }
    EXPECT_LE(worst, kLossTol) << stem << ": the per-sample, per-class losses";
    EXPECT_LE(std::abs(correct_gpu - correct_cpu), near_ties)
        << stem << ": " << correct_gpu << " correct on the GPU, " << correct_cpu << " on the CPU, " << near_ties
        << " near ties";
  }
}

}  // namespace
}  // namespace dtk::nn

namespace dtk::testing {
namespace {

using compress::Config;
using compress::make_compressor;

// The same steps on CUDA and on the CPU agree to f32 rounding.
TEST(Compress, CudaMatchesCpu) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU";
  const std::vector<std::pair<std::string, Shape>> shapes = {
      {"w", {64, 48}}, {"v", {64, 48}}, {"b", {48}}, {"u", {40, 96}}, {"s", {4, 4}}};
  std::vector<Config> cfgs = one_of_each_kind();
  Config c = psgd(5, 0);
  c.comm_dtype = DType::bf16;
  c.error_mode = compress::ErrorMode::full;
  cfgs.push_back(c);
  for (const Config& cfg : cfgs) {
    SCOPED_TRACE(nlohmann::json(cfg).dump());
    auto gc = make_grads(shapes), gg = make_grads(shapes, Device::cuda());
    auto a = make_compressor(cfg, *local(), gc.params);
    auto b = make_compressor(cfg, *local(), gg.params);
    for (int step = 0; step < 4; ++step) {
      const Vec in = random_vec(gc.flat.numel(), 900 + step);
      gc.flat.copy_from(Tensor::from_doubles(in, {gc.flat.numel()}, DType::f32));
      gg.flat.copy_from(gc.flat);
      if (step == 2) ops::fill(gc.params[0].grad, 0.0), ops::fill(gg.params[0].grad, 0.0);
      a->aggregate(gc.params, step);
      b->aggregate(gg.params, step);
      const Vec x = get(gc.flat), y = get(gg.flat);
      EXPECT_TRUE(all_finite(y));
      if (name_of(cfg.kind) == "topk" || name_of(cfg.kind) == "signum") {
        // Ties in magnitude or sign flips at rounding level may pick other coordinates.
        int differ = 0;
        for (size_t i = 0; i < x.size(); ++i) differ += std::abs(x[i] - y[i]) > 1e-4 * (1 + std::abs(x[i]));
        EXPECT_LE(differ, 2) << "step " << step;
      } else {
        const double tol = cfg.comm_dtype == DType::bf16 ? 2e-2 : 1e-4;
        EXPECT_LT(norm(sub(x, y)), tol * (1 + norm(x))) << "step " << step;
      }
    }
  }
}

}  // namespace
}  // namespace dtk::testing
