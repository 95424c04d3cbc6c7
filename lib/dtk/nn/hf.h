// dtk::nn::hf — the Hugging Face Llama layout (transformers' LlamaForCausalLM and the safetensors
// checkpoints its save_pretrained writes): tensor names, config.json, and the row order of
// q_proj and k_proj.
//
// Rotary order. dtk's llama rotates the interleaved pairs (2i, 2i + 1) of each head, as Meta's
// reference llama does; transformers rotates halves (i, i + hd/2) (rotate_half), both by the
// angle position * theta^(-2i/hd). Its own conversion of Meta's weights
// (convert_llama_weights_to_hf.py, `permute`) reorders the rows of wq and wk so that both give
// the same attention: row h hd + 2i + c of dtk's (c = 0, 1) is row h hd + c hd/2 + i of HF's.
// Every other tensor keeps its values and layout ([out, in], PyTorch's).
//
// Import (the trainers' --init-from DIR): a folder as transformers' save_pretrained writes it,
// whoever wrote it (dtk's export, transformers, a released model), read through ckpt::Safetensors.
#pragma once
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtk/core/placed.h"
#include "dtk/core/tensor.h"
#include "dtk/nn/model.h"

namespace dtk::nn::hf {

// HF's name of a llama parameter: "layers.3.attention.wq.weight" ->
// "model.layers.3.self_attn.q_proj.weight"; a UsageError for a name that is not a llama's.
std::string tensor_name(const std::string& dtk_name);

// The heads whose rows the rotary order permutes in parameter `dtk_name` of a model of config c:
// n_heads for wq, n_kv_heads for wk, 0 for every other parameter.
int64_t rope_heads(const std::string& dtk_name, const ModelConfig& c);

// The rows of w [heads * hd, cols] (a host tensor of any dtype) in HF's rotary order (to_hf), or
// back in dtk's; a new tensor.
Tensor permute_rope_rows(const Tensor& w, int64_t heads, bool to_hf);

// The config.json of a LlamaForCausalLM of config c whose tensors are stored in torch_dtype
// (f32 or bf16): a UsageError for a model that is not a llama.
nlohmann::ordered_json config(const ModelConfig& c, DType torch_dtype);

// A Hugging Face model folder: config.json beside model.safetensors or model.safetensors.index.json.
bool is_folder(const std::filesystem::path& p);

// The training sequence length of an imported model whose max_position_embeddings is larger
// (Llama 3's 131072): --seq-len sets another.
inline constexpr int64_t kImportSeqLen = 2048;

// The llama of a folder's config.json (transformers 4's rope_theta and rope_scaling, or 5's
// rope_parameters): sizes, rope theta, norm epsilon, seq_len max_position_embeddings capped at
// kImportSeqLen. A UsageError naming what dtk's llama is not: another architecture, RoPE
// scaling, biases, an activation other than silu, a head_dim other than hidden_size / heads.
ModelConfig read_config(const std::filesystem::path& dir);

// Sets the model's placed state (names "model/<dtk name>"; replicated, or sharded rows of dim 0,
// of which this rank reads only its own) from the folder's tensors, f32, bf16 or f16 converted to
// the state's dtype, q/k rows into dtk's rotary order. A missing tensor or one of another shape
// is a UsageError naming it. Without lm_head.weight and with tie_word_embeddings, the output
// starts from the embedding's values (dtk trains the two apart; its export writes both).
void load(const std::filesystem::path& dir, const ModelConfig& c, const std::vector<PlacedTensor>& state);

}  // namespace dtk::nn::hf
