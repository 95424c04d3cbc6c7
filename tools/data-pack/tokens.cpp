// data-pack's token packers: ids that other tools wrote (.npy, llm.c .bin, raw), streamed from
// memory-mapped inputs into dtk token files, and text tokenized by a SentencePiece model
// (libsentencepiece, the library Llama 2's, Mistral's and Gemma's tokenizers are models of).
#include <sentencepiece_processor.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string_view>

#include "dtk/core/error.h"
#include "dtk/data/dataset.h"
#include "pack.h"

namespace dtk::pack {

namespace {
// Tokens a pass holds at once: 4 Mi (16 MiB as u32).
constexpr int64_t kChunk = int64_t{4} << 20;
}  // namespace

int run_tokens(const Args& a) {
  std::vector<std::unique_ptr<data::TokenArray>> in;
  int64_t n = 0;
  std::vector<std::string> formats;
  for (const std::string& f : a.inputs) {
    in.push_back(std::make_unique<data::TokenArray>(f, a.raw_dtype));
    n += in.back()->size();
    formats.push_back(in.back()->describe());
  }
  int64_t n_train = 0, n_val = 0;
  split_counts(a, n, n_train, n_val);
  // Pass 1: every id readable (no negative ones), below --vocab, and the largest.
  std::vector<uint32_t> buf(static_cast<size_t>(kChunk));
  uint32_t largest = 0;
  for (const auto& t : in) {
    t->advise_sequential(true);
    for (int64_t r = 0; r < t->size(); r += kChunk) {
      const std::span<uint32_t> s(buf.data(), static_cast<size_t>(std::min(kChunk, t->size() - r)));
      t->read(r, s);
      const uint32_t top = *std::max_element(s.begin(), s.end());
      if (a.token_vocab > 0 && top >= a.token_vocab) {
        const auto bad = std::find_if(s.begin(), s.end(), [&](uint32_t v) { return v >= a.token_vocab; });
        fail_usage("{}: token {} at position {} is not below --vocab {}", t->path(), *bad, r + (bad - s.begin()),
                   a.token_vocab);
      }
      largest = std::max(largest, top);
    }
  }
  const int64_t vocab = a.token_vocab > 0 ? a.token_vocab : int64_t{largest} + 1;
  nlohmann::json attrs = base_attrs("tokens");
  attrs["inputs"] = nlohmann::json(a.inputs).dump();
  attrs["input_formats"] = nlohmann::json(formats).dump();
  attrs["vocab_size_from"] = a.token_vocab > 0 ? "--vocab" : "the largest id + 1";
  // Pass 2: the first n_train tokens to -o, the rest to --val-output.
  attrs["split"] = "train";
  auto train = std::make_unique<data::TokenWriter>(a.output, n_train, vocab, attrs);
  std::unique_ptr<data::TokenWriter> val;
  if (n_val > 0) {
    attrs["split"] = "validation";
    val = std::make_unique<data::TokenWriter>(a.val_output, n_val, vocab, attrs);
  }
  int64_t at = 0;
  for (const auto& t : in)
    for (int64_t r = 0; r < t->size(); r += kChunk) {
      const std::span<uint32_t> s(buf.data(), static_cast<size_t>(std::min(kChunk, t->size() - r)));
      t->read(r, s);
      const auto k = static_cast<size_t>(std::clamp<int64_t>(n_train - at, 0, static_cast<int64_t>(s.size())));
      train->append(s.first(k));
      if (k < s.size()) val->append(s.subspan(k));
      at += static_cast<int64_t>(s.size());
    }
  // Both outputs or neither.
  if (val) val->commit();
  try {
    train->commit();
  } catch (...) {
    std::error_code ec;
    if (val) std::filesystem::remove(a.val_output, ec);
    throw;
  }
  spdlog::info("{} tokens of vocabulary {} from {} file(s): {} training, {} validation", n, vocab, in.size(), n_train,
               n_val);
  print_path(a.output);
  if (n_val > 0) print_path(a.val_output);
  return 0;
}

std::vector<uint32_t> encode_sentencepiece(const Args& a, int64_t& vocab, nlohmann::json& attrs) {
  sentencepiece::SentencePieceProcessor sp;
  if (const auto st = sp.Load(a.sentencepiece); !st.ok())
    fail_usage("{}: not a SentencePiece model ({})", a.sentencepiece, st.ToString());
  vocab = sp.GetPieceSize();
  const int bos = a.no_bos ? -1 : sp.bos_id(), eos = a.eos ? sp.eos_id() : -1;
  if (a.eos && eos < 0) fail_usage("--eos: {} has no end-of-sequence piece", a.sentencepiece);
  std::vector<uint32_t> out;
  std::vector<int> ids;
  int64_t documents = 0, bytes = 0;
  const auto encode = [&](std::string_view doc) {
    if (bos >= 0) out.push_back(static_cast<uint32_t>(bos));
    if (const auto st = sp.Encode(doc, &ids); !st.ok()) fail("SentencePiece: {}", st.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
    if (eos >= 0) out.push_back(static_cast<uint32_t>(eos));
    ++documents;
  };
  for (const std::string& f : a.inputs) {
    const std::vector<uint8_t> raw = read_all(f);
    bytes += static_cast<int64_t>(raw.size());
    const std::string_view text(reinterpret_cast<const char*>(raw.data()), raw.size());
    if (!a.split_lines) {
      encode(text);
      continue;
    }
    for (size_t at = 0; at < text.size();) {
      const size_t end = std::min(text.find('\n', at), text.size());
      if (end > at) encode(text.substr(at, end - at));  // empty lines are no documents
      at = end + 1;
    }
  }
  spdlog::info("{} documents ({} bytes) as {} tokens of {}'s {} pieces", documents, bytes, out.size(), a.sentencepiece,
               vocab);
  attrs["tokenizer"] = "sentencepiece";
  attrs["tokenizer_model"] = a.sentencepiece;
  attrs["documents"] = a.split_lines ? "lines" : "files";
  attrs["bos"] = bos;
  attrs["eos"] = eos;
  return out;
}

}  // namespace dtk::pack
