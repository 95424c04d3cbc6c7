// The Hugging Face Llama layout (hf.h).
#include "dtk/nn/hf.h"

#include <spdlog/spdlog.h>

#include <cstring>
#include <fstream>
#include <regex>

#include "dtk/ckpt/safetensors.h"
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"

namespace fs = std::filesystem;

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

namespace {

// Row r of dtk's wq or wk (head h, pair i, element c of the pair) is row h hd + c hd/2 + i of HF's.
int64_t hf_row(int64_t r, int64_t hd) { return r / hd * hd + r % 2 * (hd / 2) + r % hd / 2; }

}  // namespace

Tensor permute_rope_rows(const Tensor& w, int64_t heads, bool to_hf) {
  if (w.ndim() != 2 || heads < 1 || w.dim(0) % heads != 0 || (w.dim(0) / heads) % 2 != 0)
    fail_usage("permute_rope_rows: {} is not [heads * head_dim, cols] with {} heads of an even head_dim", w.str(), heads);
  if (w.is_cuda()) fail_usage("permute_rope_rows: a host tensor, got " + w.str());
  const int64_t hd = w.dim(0) / heads;
  const size_t row = static_cast<size_t>(w.dim(1)) * dtype_size(w.dtype());
  Tensor out = Tensor::empty(w.shape(), w.dtype());
  const auto* src = static_cast<const char*>(w.data());
  auto* dst = static_cast<char*>(out.data());
  for (int64_t ours = 0; ours < w.dim(0); ++ours) {
    const int64_t theirs = hf_row(ours, hd);
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

bool is_folder(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec) && fs::is_regular_file(p / "config.json", ec) &&
         (fs::exists(p / "model.safetensors", ec) || fs::exists(p / "model.safetensors.index.json", ec));
}

namespace {

nlohmann::json read_json(const fs::path& f) {
  std::ifstream in(f);
  if (!in) fail_usage("{}: cannot read it", f.string());
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object()) fail_usage("{}: not a JSON object", f.string());
  return j;
}

}  // namespace

ModelConfig read_config(const fs::path& dir) {
  const fs::path file = dir / "config.json";
  const nlohmann::json j = read_json(file);
  const auto bad = [&](const std::string& why) { fail_usage("{}: {}", file.string(), why); };
  const std::string type = j.value("model_type", "");
  if (type != "llama")
    bad(fmt::format("model_type \"{}\": dtk imports Llama models (LlamaForCausalLM)", type.empty() ? "(none)" : type));
  if (j.contains("architectures") &&
      (!j["architectures"].is_array() || j["architectures"] != nlohmann::json::array({"LlamaForCausalLM"})))
    bad("architectures " + j["architectures"].dump() + ": dtk imports LlamaForCausalLM");
  const auto size = [&](const char* key, std::optional<int64_t> fallback = std::nullopt) -> int64_t {
    if (!j.contains(key) && fallback) return *fallback;
    if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() < 1) bad(fmt::format("{}: a positive integer wanted", key));
    return j[key].get<int64_t>();
  };
  const auto number = [&](const nlohmann::json& o, const char* key, double fallback) {
    if (!o.contains(key)) return fallback;
    if (!o[key].is_number() || !(o[key].get<double>() > 0)) bad(fmt::format("{}: a positive number wanted", key));
    return o[key].get<double>();
  };
  const auto off = [&](const char* key) {
    if (j.contains(key) && j[key] != false) bad(fmt::format("{} {}: dtk's llama has no biases", key, j[key].dump()));
  };
  off("attention_bias");
  off("mlp_bias");
  if (j.value("hidden_act", "silu") != "silu") bad("hidden_act " + j["hidden_act"].dump() + ": dtk's llama uses silu");
  // RoPE: transformers 5 writes rope_parameters, 4 rope_theta and rope_scaling.
  // Either may say how positions are scaled; dtk rotates without scaling.
  const nlohmann::json rope = j.contains("rope_parameters") && j["rope_parameters"].is_object() ? j["rope_parameters"] : j;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    const nlohmann::json s = j.value(key, nlohmann::json());
    const std::string kind = s.is_object() ? s.value("rope_type", s.value("type", "default")) : "?";
    if (!s.is_null() && kind != "default")
      bad(fmt::format("{} {}: RoPE scaling{}; dtk's llama rotates without scaling", key, s.dump(),
                      kind == "?" ? "" : " of type " + kind));
  }
  const int64_t dim = size("hidden_size"), heads = size("num_attention_heads");
  if (dim % heads != 0) bad(fmt::format("hidden_size {} is not a multiple of num_attention_heads {}", dim, heads));
  if (j.contains("head_dim") && !j["head_dim"].is_null() && j["head_dim"] != dim / heads)
    bad(fmt::format("head_dim {}: dtk's llama has hidden_size / num_attention_heads = {}", j["head_dim"].dump(), dim / heads));
  ModelConfig c = llama_config(dim, size("num_hidden_layers"), heads, size("num_key_value_heads", heads),
                               size("intermediate_size"), size("vocab_size"),
                               std::min(size("max_position_embeddings", kImportSeqLen), kImportSeqLen),
                               number(rope, "rope_theta", 10000.0));
  c.norm_eps = number(j, "rms_norm_eps", 1e-6);  // LlamaConfig's default
  c.preset = "hf";
  try {
    c.validate();
  } catch (const UsageError& e) {
    bad(e.what());
  }
  return c;
}

void load(const fs::path& dir, const ModelConfig& c, const std::vector<PlacedTensor>& state) {
  const ckpt::Safetensors st(dir);
  const nlohmann::json config = read_json(dir / "config.json");
  const bool tied = config.value("tie_word_embeddings", false);
  size_t used = 0;
  for (const PlacedTensor& t : state) {
    if (!t.name.starts_with("model/")) continue;
    const std::string ours = t.name.substr(6);
    std::string theirs = tensor_name(ours);
    if (theirs == "lm_head.weight" && tied && !st.contains(theirs)) theirs = "model.embed_tokens.weight";
    else ++used;
    if (!st.contains(theirs)) fail_usage("{}: no tensor {} (dtk's {})", dir.string(), theirs, ours);
    const ckpt::Safetensors::Info& info = st.info(theirs);
    const bool sharded = t.placement == Placement::sharded;
    const Shape& full = sharded ? t.rows.shape : t.value.shape();
    if (info.shape != full)
      fail_usage("{}: {} in {} is {}, where the model's {} is {}", dir.string(), theirs, info.file,
                 shape_str(info.shape), ours, shape_str(full));
    if (!dtype_is_float(info.dtype))
      fail_usage("{}: {} in {} holds {}, not floating-point values", dir.string(), theirs, info.file,
                 dtype_name(info.dtype));
    if (t.value.numel() == 0) continue;
    const auto rank = static_cast<size_t>(t.rows.rank);
    const int64_t row0 = sharded ? t.rows.offsets[rank] : 0;
    Tensor raw = Tensor::empty(t.value.shape(), info.dtype);
    if (const int64_t heads = rope_heads(ours, c); heads > 0) {
      const int64_t hd = full[0] / heads;
      for (int64_t r = 0; r < raw.dim(0); ++r) {
        Tensor row = raw.slice(r, r + 1);
        st.read_rows(theirs, hf_row(row0 + r, hd), row);
      }
    } else {
      st.read_rows(theirs, row0, raw);
    }
    if (raw.dtype() != t.value.dtype()) {
      Tensor cast = Tensor::empty(raw.shape(), t.value.dtype());
      ops::cast(raw, cast);
      raw = std::move(cast);
    }
    Tensor dst = t.value;
    dst.copy_from(raw);
  }
  if (st.tensors().size() > used)
    spdlog::info("{}: {} of its tensors are not the model's and were left out", dir.string(), st.tensors().size() - used);
}

}  // namespace dtk::nn::hf
