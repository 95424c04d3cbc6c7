// Small models and batches shared by the model tests (tests/unit/test_nn.cpp) and their CUDA
// comparison (tests/gpu/test_models_gpu.cpp).
#pragma once
#include <string>
#include <vector>

#include "dtk/core/philox.h"
#include "dtk/core/tensor.h"
#include "dtk/nn/model.h"
#include "dtk/ops/ops.h"
#include "test_util.h"

namespace dtk::nn::test_models {

using test_util::randn;

inline Tensor rand_tensor(const Shape& s, uint64_t seed, double scale = 1.0, double mean = 0.0) {
  return Tensor::from_doubles(randn(shape_numel(s), seed, scale, mean), s, DType::f64);
}

inline Tensor ids_tensor(const std::vector<int32_t>& v, const Shape& s) {
  return Tensor::from_host(v.data(), s, DType::i32);
}

inline ModelConfig tiny_llama() { return nn::llama_config(8, 2, 2, 1, 12, 11, 8); }

inline Batch tiny_batch(int64_t B, int64_t T, int64_t vocab, uint64_t seed, bool with_ignored = false) {
  std::vector<int32_t> x(static_cast<size_t>(B * T)), y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<int32_t>(philox::uniform(seed, i) * static_cast<double>(vocab));
    y[i] = static_cast<int32_t>(philox::uniform(seed + 1, i) * static_cast<double>(vocab));
  }
  if (with_ignored) y[1] = -1;
  return {ids_tensor(x, {B, T}), ids_tensor(y, {B, T})};
}

inline ModelConfig small_llama() {
  ModelConfig c = tiny_llama();
  c.dim = 16;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_hidden = 24;
  c.vocab = 13;
  c.seq_len = 12;
  return c;
}

inline constexpr Checkpointing kModes[] = {Checkpointing::none, Checkpointing::full, Checkpointing::selective};

inline std::string mode_str(Checkpointing c) { return "checkpointing " + std::string(name_of(c)); }

inline ModelConfig tiny_mlp() {
  ModelConfig c;
  c.arch = Arch::mlp;
  c.input_dim = 6;
  c.hidden = {7, 5};
  c.classes = 4;
  return c;
}

inline Batch mlp_batch(int64_t B, DType t, uint64_t seed) {
  std::vector<int32_t> y(static_cast<size_t>(B));
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<int32_t>(philox::uniform(seed, i) * 4);
  Tensor x = Tensor::from_doubles(randn(B * 6, seed + 1), {B, 6}, t);
  return {x, ids_tensor(y, {B})};
}

// Two stages: a block without and blocks with a downsample shortcut, and one of each kind after
// a stride; 6x6 images of 2 channels, 3 classes.
inline // Two stages: a block without and blocks with a downsample shortcut, and one of each kind after
// a stride; 6x6 images of 2 channels, 3 classes.
ModelConfig tiny_resnet(const std::string& stem = "cifar") {
  ModelConfig c = preset("resnet-8");
  c.input_shape = stem == "cifar" ? std::vector<int64_t>{2, 6, 6} : std::vector<int64_t>{2, 11, 11};
  c.stage_widths = {3, 4};
  c.stage_blocks = {1, 2};
  c.classes = 3;
  c.stem = stem;
  return c;
}

inline Batch image_batch(const ModelConfig& c, int64_t B, uint64_t seed, DType t = DType::f64) {
  std::vector<int32_t> y(static_cast<size_t>(B));
  for (int64_t i = 0; i < B; ++i) y[static_cast<size_t>(i)] = static_cast<int32_t>(i % c.classes);
  Tensor x = rand_tensor({B, c.input_shape[0], c.input_shape[1], c.input_shape[2]}, seed);
  if (t != DType::f64) {
    Tensor x2 = Tensor::empty(x.shape(), t);
    ops::cast(x, x2);
    x = x2;
  }
  return {x, ids_tensor(y, {B})};
}

}  // namespace dtk::nn::test_models
