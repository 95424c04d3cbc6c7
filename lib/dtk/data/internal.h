// Internal to dtk::data: the dataset kinds behind open_dataset (their keys: core/streams.h).
#pragma once
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dtk/data/dataset.h"

namespace dtk::data::detail {

// Uniform in [0, 1) with 53 bits from two words.
double unit(uint32_t a, uint32_t b);

// The synthetic datasets (validation selects the disjoint validation stream).
std::unique_ptr<Dataset> make_markov_dataset(const nn::ModelConfig& model, bool validation, uint64_t seed);
std::unique_ptr<Dataset> make_mixture_dataset(const nn::ModelConfig& model, bool validation, uint64_t seed);
// The index of the first value of x[0, n) that is NaN or infinite; n when all are finite. One
// branch-free pass per block (the common case, all finite, costs a read and a compare).
size_t first_non_finite(const float* x, size_t n);

// A token or classification file, checked against the model.
std::unique_ptr<Dataset> open_file_dataset(const std::string& path, const nn::ModelConfig& model);

// Runs check() unless the file, as it is now (path, size, modification time), passed it before in
// this process: programs open their data once to validate the options and again to train.
void check_once(const std::string& path, const std::function<void()>& check);

// A file of token ids that a token dataset reads: a dtk token file (HDF5), or .npy, llm.c .bin
// or raw ids (TokenArray).
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  virtual const std::string& path() const = 0;
  virtual int64_t size() const = 0;
  virtual int64_t vocab() const = 0;  // the file's vocab_size; 0 when it records none (npy, bin, raw)
  virtual std::string dtype() const = 0;
  virtual double optimal_loss() const { return std::numeric_limits<double>::quiet_NaN(); }
  // Tokens [begin, begin + out.size()); safe from several threads.
  virtual void read(int64_t begin, std::span<uint32_t> out) const = 0;
};
// A dtk token file (files.cpp).
std::unique_ptr<TokenSource> open_token_source(const std::string& path);

// The files of a --data spec that names token shards (stream.cpp): a glob ('dir/train-*.bin',
// sorted by name), a list file (*.txt or *.list: one path a line, relative to the list's
// folder; blank lines and # comments skipped), or one .npy or llm.c .bin file. Empty: the spec
// is one HDF5 data file (open_file_dataset).
std::vector<std::string> token_shards(const std::string& spec);
// The token dataset of token_shards' files (stream.cpp).
std::unique_ptr<Dataset> open_token_shards(const std::string& spec, const std::vector<std::string>& files,
                                           const nn::ModelConfig& model);
// The token dataset over `sources` concatenated (stream.cpp), checked against the model.
std::unique_ptr<Dataset> make_token_dataset(std::string spec, std::vector<std::unique_ptr<TokenSource>> sources,
                                            const nn::ModelConfig& model);

// The number of samples a synthetic dataset has: a fixed large number (2^40).
inline constexpr int64_t kSyntheticSamples = int64_t{1} << 40;

}  // namespace dtk::data::detail
