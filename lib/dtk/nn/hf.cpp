// The Hugging Face Llama layout (hf.h).
#include "dtk/nn/hf.h"

#include <cstring>
#include <regex>

#include "dtk/core/error.h"

namespace dtk::nn::hf {

std::string tensor_name(const std::string& n) {
  static const std::pair<const char*, const char*> kLayer[] = {
      {"attention_norm.weight", "input_layernorm.weight"},
      {"attention.wq.weight", "self_attn.q_proj.weight"},
      {"attention.wk.weight", "self_attn.k_proj.weight"},
      {"attention.wv.weight", "self_attn.v_proj.weight"},
      {"attention.wo.weight", "self_attn.o_proj.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
      {"feed_forward.w2.weight", "mlp.down_proj.weight"},
      {"feed_forward.w3.weight", "mlp.up_proj.weight"},
  };
  if (n == "tok_embeddings.weight") return "model.embed_tokens.weight";
  if (n == "norm.weight") return "model.norm.weight";
  if (n == "output.weight") return "lm_head.weight";
  static const std::regex layer(R"(layers\.(\d+)\.(.+))");
  std::smatch m;
  if (std::regex_match(n, m, layer))
    for (const auto& [dtk, theirs] : kLayer)
      if (m[2] == dtk) return "model.layers." + m[1].str() + "." + theirs;
  fail_usage("{} is not a llama parameter (the Hugging Face layout is llama's)", n);
}

int64_t rope_heads(const std::string& n, const ModelConfig& c) {
  if (n.ends_with(".attention.wq.weight")) return c.n_heads;
  if (n.ends_with(".attention.wk.weight")) return c.n_kv_heads;
  return 0;
}

Tensor permute_rope_rows(const Tensor& w, int64_t heads, bool to_hf) {
  if (w.ndim() != 2 || heads < 1 || w.dim(0) % heads != 0 || (w.dim(0) / heads) % 2 != 0)
    fail_usage("permute_rope_rows: {} is not [heads * head_dim, cols] with {} heads of an even head_dim", w.str(), heads);
  if (w.is_cuda()) fail_usage("permute_rope_rows: a host tensor, got " + w.str());
  const int64_t hd = w.dim(0) / heads, half = hd / 2;
  const size_t row = static_cast<size_t>(w.dim(1)) * dtype_size(w.dtype());
  Tensor out = Tensor::empty(w.shape(), w.dtype());
  const auto* src = static_cast<const char*>(w.data());
  auto* dst = static_cast<char*>(out.data());
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t c = 0; c < 2; ++c) {
        const int64_t ours = h * hd + 2 * i + c, theirs = h * hd + c * half + i;
        const int64_t from = to_hf ? ours : theirs, to = to_hf ? theirs : ours;
        std::memcpy(dst + static_cast<size_t>(to) * row, src + static_cast<size_t>(from) * row, row);
      }
  return out;
}

nlohmann::ordered_json config(const ModelConfig& c, DType torch_dtype) {
  if (c.arch != Arch::llama)
    fail_usage("the Hugging Face layout is for llama models; this checkpoint holds a {}", name_of(c.arch));
  if (torch_dtype != DType::f32 && torch_dtype != DType::bf16)
    fail_usage("the Hugging Face export writes f32 or bf16, not {}", dtype_name(torch_dtype));
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", c.dim},
          {"intermediate_size", c.ffn_hidden},
          {"num_hidden_layers", c.n_layers},
          {"num_attention_heads", c.n_heads},
          {"num_key_value_heads", c.n_kv_heads},
          {"head_dim", c.head_dim()},
          {"hidden_act", "silu"},
          {"max_position_embeddings", c.seq_len},
          {"rms_norm_eps", c.norm_eps},
          {"rope_theta", c.rope_theta},
          {"rope_scaling", nullptr},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"attention_dropout", 0.0},
          {"initializer_range", 0.02},
          {"tie_word_embeddings", false},
          {"vocab_size", c.vocab},
          {"use_cache", true},
          {"torch_dtype", torch_dtype == DType::bf16 ? "bfloat16" : "float32"}};
}

}  // namespace dtk::nn::hf
