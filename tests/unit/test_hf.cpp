// The Hugging Face Llama layout (nn/hf.h): every llama parameter's name, the rotary row order of
// wq and wk checked against transformers' rotate_half RoPE written here in f64 (not from dtk),
// and config.json both ways: written, and read back as transformers 4 and 5 write it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "../common/nn_util.h"
#include "../common/test_util.h"
#include "dtk/core/error.h"
#include "dtk/nn/hf.h"
#include "dtk/nn/model.h"
#include "dtk/ops/ops.h"

namespace dtk::nn {
namespace {

using test_util::randn;
using test_util::Vec;

TEST(HfLayout, EveryLlamaParameterHasOneName) {
  const ModelConfig c = test_models::small_llama();
  auto m = make_model(c, Device::cpu());
  std::set<std::string> seen;
  for (const Param& p : m->params()) {
    const std::string n = hf::tensor_name(p.name);
    EXPECT_TRUE(seen.insert(n).second) << n;
    EXPECT_TRUE(n == "lm_head.weight" || n.starts_with("model.")) << n;
  }
  EXPECT_EQ(hf::tensor_name("layers.2.attention.wq.weight"), "model.layers.2.self_attn.q_proj.weight");
  EXPECT_EQ(hf::tensor_name("layers.0.feed_forward.w1.weight"), "model.layers.0.mlp.gate_proj.weight");
  EXPECT_EQ(hf::tensor_name("layers.0.feed_forward.w2.weight"), "model.layers.0.mlp.down_proj.weight");
  EXPECT_EQ(hf::tensor_name("layers.0.feed_forward.w3.weight"), "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(hf::tensor_name("layers.1.ffn_norm.weight"), "model.layers.1.post_attention_layernorm.weight");
  EXPECT_EQ(hf::tensor_name("tok_embeddings.weight"), "model.embed_tokens.weight");
  EXPECT_THROW(hf::tensor_name("layers.0.bias"), UsageError);
  EXPECT_THROW(hf::tensor_name("fc.weight"), UsageError);
  EXPECT_EQ(hf::rope_heads("layers.1.attention.wq.weight", c), c.n_heads);
  EXPECT_EQ(hf::rope_heads("layers.1.attention.wk.weight", c), c.n_kv_heads);
  EXPECT_EQ(hf::rope_heads("layers.1.attention.wv.weight", c), 0);
}

// transformers' RoPE on x [T, H, hd] (f64): for i < hd/2 the pair (i, i + hd/2) rotated by
// t theta^(-2i/hd): x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1).
Vec hf_rope(const Vec& x, int64_t T, int64_t H, int64_t hd, double theta) {
  Vec y(x.size());
  const int64_t half = hd / 2;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const double a = static_cast<double>(t) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
        const size_t b = static_cast<size_t>((t * H + h) * hd);
        const double x1 = x[b + i], x2 = x[b + half + i];
        y[b + i] = x1 * std::cos(a) - x2 * std::sin(a);
        y[b + half + i] = x2 * std::cos(a) + x1 * std::sin(a);
      }
  return y;
}

// q = rope(x W^T) in dtk's order and in transformers' from the permuted W hold the same numbers,
// q_hf[t, h, c hd/2 + i] = q_dtk[t, h, 2i + c], so every dot product of a query and a key head,
// hence attention, is the same; and the permutation goes back exactly.
TEST(HfLayout, RotaryRowOrderMatchesTransformers) {
  const int64_t T = 7, D = 12, H = 3, hd = 8;
  const double theta = 5e5;
  const Tensor x = Tensor::from_doubles(randn(T * D, 31), {T, D}, DType::f64);
  const Tensor w = Tensor::from_doubles(randn(H * hd * D, 32), {H * hd, D}, DType::f64);
  const Tensor w_hf = hf::permute_rope_rows(w, H, true);
  EXPECT_EQ(hf::permute_rope_rows(w_hf, H, false).to_doubles(), w.to_doubles());
  EXPECT_NE(w_hf.to_doubles(), w.to_doubles());
  Tensor q = Tensor::empty({1, T, H, hd}, DType::f64), q_hf = Tensor::empty({T, H * hd}, DType::f64);
  Tensor q2 = q.reshape({T, H * hd});
  ops::gemm(false, true, 1.0, x, w, 0.0, q2);
  ops::rope(q, theta, 0, false, q);
  ops::gemm(false, true, 1.0, x, w_hf, 0.0, q_hf);
  const Vec ours = q.to_doubles(), theirs = hf_rope(q_hf.to_doubles(), T, H, hd, theta);
  double worst = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < hd / 2; ++i)
        for (int64_t c = 0; c < 2; ++c) {
          const size_t b = static_cast<size_t>((t * H + h) * hd);
          worst = std::max(worst, std::fabs(theirs[b + c * hd / 2 + i] - ours[b + 2 * i + c]));
        }
  EXPECT_LT(worst, 1e-12);
  // Dtypes are moved as bytes: bf16 too.
  Tensor w16 = Tensor::empty(w.shape(), DType::bf16);
  ops::cast(w, w16);
  Tensor w16_hf = hf::permute_rope_rows(w16, H, true), back = Tensor::empty(w.shape(), DType::f64);
  ops::cast(w16_hf, back);
  EXPECT_EQ(back.to_doubles(), test_util::rounded(w_hf.to_doubles(), DType::bf16));
  EXPECT_THROW(hf::permute_rope_rows(w, 5, true), UsageError);  // 24 rows are not 5 heads
}

TEST(HfLayout, Config) {
  const nlohmann::ordered_json j = hf::config(preset("llama3-1b"), DType::bf16);
  EXPECT_EQ(j["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(j["hidden_size"], 2048);
  EXPECT_EQ(j["intermediate_size"], 8192);
  EXPECT_EQ(j["num_hidden_layers"], 16);
  EXPECT_EQ(j["num_attention_heads"], 32);
  EXPECT_EQ(j["num_key_value_heads"], 8);
  EXPECT_EQ(j["vocab_size"], 128256);
  EXPECT_EQ(j["rope_theta"], 500000.0);
  EXPECT_EQ(j["tie_word_embeddings"], false);
  EXPECT_EQ(j["torch_dtype"], "bfloat16");
  EXPECT_THROW(hf::config(preset("mlp-small"), DType::f32), UsageError);
  EXPECT_THROW(hf::config(preset("llama-tiny"), DType::f64), UsageError);
}

// config.json read back: the config dtk writes gives the model it came from; transformers 5's
// rope_parameters and 4's rope_theta; LlamaConfig's defaults; what dtk's llama is not refused.
TEST(HfLayout, ReadConfig) {
  const auto dir = std::filesystem::temp_directory_path() / ("dtk-hf-config-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto read = [&](const nlohmann::json& j) {
    std::ofstream(dir / "config.json") << j.dump();
    return hf::read_config(dir);
  };
  ModelConfig c = preset("llama3-1b");
  c.seq_len = 512;
  ModelConfig back = read(hf::config(c, DType::bf16));
  back.preset = c.preset;
  EXPECT_EQ(back, c);

  const nlohmann::json v5 = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"hidden_size", 64},
                             {"intermediate_size", 128}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                             {"vocab_size", 256}, {"rope_parameters", {{"rope_theta", 50000.0}, {"rope_type", "default"}}},
                             {"max_position_embeddings", 131072}, {"head_dim", 16}};
  const ModelConfig m = read(v5);
  EXPECT_EQ(m.rope_theta, 50000.0);
  EXPECT_EQ(m.n_kv_heads, 4);                    // num_key_value_heads defaults to the heads
  EXPECT_EQ(m.norm_eps, 1e-6);                   // LlamaConfig's rms_norm_eps
  EXPECT_EQ(m.seq_len, hf::kImportSeqLen);       // 131072 positions: trained at 2048 unless --seq-len
  nlohmann::json v4 = v5;
  v4.erase("rope_parameters");
  v4["rope_theta"] = 123.0;
  v4["rope_scaling"] = nullptr;
  EXPECT_EQ(read(v4).rope_theta, 123.0);
  v4.erase("rope_theta");
  EXPECT_EQ(read(v4).rope_theta, 10000.0);

  const auto refused = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json j = v5;
    j[key] = value;
    EXPECT_THROW(read(j), UsageError) << key << " " << value.dump();
  };
  refused("model_type", "mistral");
  refused("architectures", {"LlamaForSequenceClassification"});
  refused("rope_parameters", {{"rope_theta", 500000.0}, {"rope_type", "llama3"}, {"factor", 32.0}});
  refused("rope_scaling", {{"type", "linear"}, {"factor", 2.0}});
  refused("attention_bias", true);
  refused("mlp_bias", true);
  refused("hidden_act", "gelu");
  refused("head_dim", 32);
  refused("hidden_size", 66);
  refused("num_hidden_layers", 0);
  refused("vocab_size", "256");
  std::ofstream(dir / "config.json") << "{not json";
  EXPECT_THROW(hf::read_config(dir), UsageError);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dtk::nn
