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
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

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

}  // namespace dtk::nn::hf
