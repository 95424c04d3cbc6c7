// Token datasets: one token file or many shards as one stream of tokens, of any size. Samples
// are windows of seq_len + 1 tokens starting at multiples of seq_len of the concatenation (a
// window may span two shards), so a sample's index names the same tokens on every rank, at any
// world size, and after a resume. Batches read only their windows (pread, or HDF5 hyperslabs):
// nothing is loaded whole; opening checks every token once per process, a chunk at a time.
#include <glob.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "dtk/core/error.h"
#include "dtk/data/internal.h"
#include "dtk/data/token_array.h"

namespace dtk::data::detail {
namespace {
namespace fs = std::filesystem;

// .npy, llm.c .bin (TokenArray) as a source.
class ArraySource final : public TokenSource {
 public:
  explicit ArraySource(const std::string& path) : a_(path) { a_.advise_sequential(false); }
  const std::string& path() const override { return a_.path(); }
  int64_t size() const override { return a_.size(); }
  int64_t vocab() const override { return 0; }
  std::string dtype() const override { return std::string(name_of(a_.dtype())); }
  void read(int64_t begin, std::span<uint32_t> out) const override { a_.read(begin, out); }

 private:
  TokenArray a_;
};

bool is_hdf5(const std::string& path) {
  char sig[8] = {};
  std::ifstream(path, std::ios::binary).read(sig, 8);
  return std::memcmp(sig, "\x89HDF\r\n\x1a\n", 8) == 0;
}

class TokenStream final : public Dataset {
 public:
  TokenStream(std::string spec, std::vector<std::unique_ptr<TokenSource>> sources, const nn::ModelConfig& m)
      : spec_(std::move(spec)), sources_(std::move(sources)), seq_(m.seq_len) {
    if (seq_ < 1) fail_usage(spec_ + ": the model's seq_len must be positive");
    for (const auto& s : sources_) {
      if (s->vocab() > m.vocab)
        fail_usage("{}: vocab_size {} is larger than the model's vocab {} (use a model with --vocab {} or more)",
                   s->path(), s->vocab(), m.vocab, s->vocab());
      limits_.push_back(s->vocab() > 0 ? s->vocab() : m.vocab);
      vocab_ = std::max(vocab_, limits_.back());
      starts_.push_back(n_);
      n_ += s->size();
    }
    if (n_ < seq_ + 1)
      fail_usage("{}: {} tokens are too short for one window of seq_len + 1 = {} tokens", spec_, n_, seq_ + 1);
    samples_ = (n_ - 1) / seq_;
    for (size_t k = 0; k < sources_.size(); ++k) check_once(sources_[k]->path(), [&] { check_tokens(k); });
  }
  int64_t size() const override { return samples_; }
  nn::Batch get(std::span<const int64_t> indices) const override {
    const int64_t B = static_cast<int64_t>(indices.size()), T = seq_;
    Tensor in = Tensor::empty({B, T}, DType::i32), tg = Tensor::empty({B, T}, DType::i32);
    std::vector<uint32_t> w(static_cast<size_t>(T + 1));
    int32_t* pin = in.ptr<int32_t>();
    int32_t* ptg = tg.ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t i = indices[static_cast<size_t>(b)];
      DTK_CHECK(i >= 0 && i < samples_, spec_ + ": sample index out of range");
      read_window(i * T, w);
      for (int64_t t = 0; t < T; ++t) {
        pin[b * T + t] = static_cast<int32_t>(w[static_cast<size_t>(t)]);
        ptg[b * T + t] = static_cast<int32_t>(w[static_cast<size_t>(t + 1)]);
      }
    }
    return {in, tg};
  }
  nlohmann::json describe() const override {
    std::string dtype = sources_.front()->dtype();
    for (const auto& s : sources_)
      if (s->dtype() != dtype) dtype = "mixed";
    nlohmann::json j = {{"source", spec_},  {"kind", "tokens"},          {"samples", samples_},
                        {"seq_len", seq_},  {"tokens", samples_ * seq_}, {"file_tokens", n_},
                        {"dtype", dtype},   {"vocab_size", vocab_}};
    if (sources_.size() > 1) j["files"] = sources_.size();
    if (const double o = optimal_loss(); !std::isnan(o)) j["optimal_loss"] = o;
    return j;
  }
  // A file's own optimum (data-pack synthetic writes it); of several files, none.
  double optimal_loss() const override {
    return sources_.size() == 1 ? sources_.front()->optimal_loss() : std::numeric_limits<double>::quiet_NaN();
  }

 private:
  // Tokens [begin, begin + out.size()) of the concatenation, each checked below its file's limit
  // (the file may change under a run).
  void read_window(int64_t begin, std::span<uint32_t> out) const {
    size_t k = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin()) - 1;
    for (size_t done = 0; done < out.size(); ++k) {
      const int64_t at = begin + static_cast<int64_t>(done) - starts_[k];
      const auto take = static_cast<size_t>(std::min<int64_t>(sources_[k]->size() - at, static_cast<int64_t>(out.size() - done)));
      if (take == 0) continue;  // an empty shard
      const std::span<uint32_t> piece = out.subspan(done, take);
      sources_[k]->read(at, piece);
      check_below(k, at, piece);
      done += take;
    }
  }
  void check_below(size_t k, int64_t at, std::span<const uint32_t> t) const {
    const auto limit = static_cast<uint64_t>(limits_[k]);
    const auto bad = std::find_if(t.begin(), t.end(), [&](uint32_t v) { return v >= limit; });
    if (bad == t.end()) return;
    const TokenSource& s = *sources_[k];
    fail_usage("{}: token {} at position {} is not below {} {}", s.path(), *bad, at + (bad - t.begin()),
               s.vocab() > 0 ? "vocab_size" : "the model's vocab", limits_[k]);
  }
  // Every token of source k below its limit: one pass in chunks of 4 Mi tokens.
  void check_tokens(size_t k) const {
    const TokenSource& s = *sources_[k];
    constexpr int64_t kChunk = int64_t{4} << 20;
    std::vector<uint32_t> buf(static_cast<size_t>(std::min(kChunk, s.size())));
    for (int64_t r = 0; r < s.size(); r += kChunk) {
      const std::span<uint32_t> c(buf.data(), static_cast<size_t>(std::min(kChunk, s.size() - r)));
      s.read(r, c);
      check_below(k, r, c);
    }
  }

  std::string spec_;
  std::vector<std::unique_ptr<TokenSource>> sources_;
  std::vector<int64_t> starts_, limits_;
  int64_t seq_ = 0, n_ = 0, samples_ = 0, vocab_ = 0;
};

}  // namespace

std::vector<std::string> token_shards(const std::string& spec) {
  std::error_code ec;
  if (spec.find_first_of("*?[") != std::string::npos && !fs::exists(spec, ec)) {
    glob_t g{};
    const int rc = ::glob(spec.c_str(), GLOB_ERR, nullptr, &g);
    std::vector<std::string> files(g.gl_pathv, g.gl_pathv + g.gl_pathc);  // sorted by name
    globfree(&g);
    if (rc == GLOB_NOMATCH || files.empty()) fail_usage("{}: no file matches", spec);
    if (rc != 0) fail_usage("{}: cannot list the files that match", spec);
    return files;
  }
  if (!fs::is_regular_file(spec, ec)) return {};
  const std::string ext = fs::path(spec).extension().string();
  if (ext == ".txt" || ext == ".list") {
    std::ifstream in(spec);
    std::vector<std::string> files;
    const fs::path dir = fs::path(spec).parent_path();
    for (std::string line; std::getline(in, line);) {
      line.erase(0, line.find_first_not_of(" \t"));
      line.erase(line.find_last_not_of(" \t\r") + 1);
      if (line.empty() || line.front() == '#') continue;
      const fs::path p(line);
      files.push_back((p.is_absolute() ? p : dir / p).string());
    }
    if (files.empty()) fail_usage("{}: a list of token files that names none", spec);
    for (const std::string& f : files)
      if (!fs::is_regular_file(f, ec)) fail_usage("{}: it names {}, which is not a file", spec, f);
    return files;
  }
  char head[8] = {};
  std::ifstream(spec, std::ios::binary).read(head, 8);
  int32_t magic = 0;
  std::memcpy(&magic, head, 4);
  if (std::memcmp(head, "\x93NUMPY", 6) == 0 || magic == 20240520) return {spec};
  return {};
}

std::unique_ptr<Dataset> make_token_dataset(std::string spec, std::vector<std::unique_ptr<TokenSource>> sources,
                                            const nn::ModelConfig& model) {
  return std::make_unique<TokenStream>(std::move(spec), std::move(sources), model);
}

// The sources of token_shards' files: dtk token files by HDF5's signature, the rest TokenArray's.
std::unique_ptr<Dataset> open_token_shards(const std::string& spec, const std::vector<std::string>& files,
                                           const nn::ModelConfig& model) {
  if (model.classifier())
    fail_usage("{}: token files, but the model ({}) is a classifier; it needs `images` or `features`", spec,
               name_of(model.arch));
  std::vector<std::unique_ptr<TokenSource>> sources;
  for (const std::string& f : files) {
    if (is_hdf5(f)) sources.push_back(open_token_source(f));
    else sources.push_back(std::make_unique<ArraySource>(f));
  }
  return make_token_dataset(spec, std::move(sources), model);
}

}  // namespace dtk::data::detail
