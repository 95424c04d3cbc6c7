// data-pack's parts: its command line as parsed (Args), the helpers its subcommands share, and
// the packers of token ids (tokens.cpp): ids that other tools wrote, and SentencePiece.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "dtk/core/enums.h"
#include "dtk/data/token_array.h"

namespace dtk::pack {

enum class Command { text, tokens, mnist, cifar10, synthetic };
enum class SynthKind { tokens, classes };
DTK_ENUM_NAMES(SynthKind, {SynthKind::tokens, "tokens"}, {SynthKind::classes, "classes"})

struct Args {
  Command command = Command::text;  // the subcommand given
  std::string output, val_output;
  bool force = false;
  double val_fraction = 0;
  std::vector<std::string> inputs;  // text, tokens: files; mnist: images, labels; cifar10: batches
  std::string images, labels;
  int64_t classes = 10;
  // text: a SentencePiece model, documents per line, BOS and EOS around each document
  std::string sentencepiece;
  bool split_lines = false, no_bos = false, eos = false;
  // tokens: raw files of this type (else .npy and llm.c .bin by their headers), the vocabulary
  std::optional<data::TokenType> raw_dtype;
  int64_t token_vocab = 0;  // 0: the largest id + 1
  // synthetic
  SynthKind kind = SynthKind::tokens;
  int64_t samples = 10000, vocab = 256, seq_len = 64, input_dim = 64, synth_classes = 10;
  uint64_t seed = 0;
  bool validation = false;
};

// The attributes every output carries: its source and the program's version.
nlohmann::json base_attrs(const std::string& source);
void print_path(const std::string& p);
// A file's whole content, gzip-compressed or not.
std::vector<uint8_t> read_all(const std::string& p);
// Tokens [0, n_train) and the rest of `n` (the last --val-fraction) to -o and --val-output.
void split_counts(const Args& a, int64_t n, int64_t& n_train, int64_t& n_val);

// data-pack tokens: the inputs' ids, streamed into -o (and --val-output).
int run_tokens(const Args& a);
// data-pack text --sentencepiece: the inputs' ids under the model, its vocabulary size and the
// attributes that describe the tokenization.
std::vector<uint32_t> encode_sentencepiece(const Args& a, int64_t& vocab, nlohmann::json& attrs);

}  // namespace dtk::pack
