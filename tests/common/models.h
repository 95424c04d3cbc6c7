// Small llama configurations for tests that build models of their own sizes.
#pragma once
#include <cstdint>

#include "dtk/nn/model.h"

namespace dtk::test {

inline nn::ModelConfig llama_config(int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn_hidden,
                                    int64_t vocab, int64_t seq_len) {
  nn::ModelConfig c;
  c.arch = "llama";
  c.dim = dim;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.ffn_hidden = ffn_hidden;
  c.vocab = vocab;
  c.seq_len = seq_len;
  return c;
}

}  // namespace dtk::test
