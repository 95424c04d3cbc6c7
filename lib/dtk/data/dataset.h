// dtk::data — datasets and the sampler. A dataset is a random-access set of samples that
// assembles batches on the host; the sampler decides, from (seed, step) alone, which samples
// make each step's global batch, the same whatever the world size, and which rows of it each
// rank takes. Because the sampler is stateless, the data position of a run is its step.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dtk/nn/model.h"

namespace dtk::data {

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;  // number of samples
  // The samples with these indices (each in [0, size())) as one host batch, in this order
  // (layout of nn::Batch for the dataset's kind). Safe to call from several threads (a
  // prefetching thread); files read only the rows asked for. A token file whose window holds a
  // token >= its vocab_size throws UsageError naming the file and the position.
  virtual nn::Batch get(std::span<const int64_t> indices) const = 0;
  // {"source": "synthetic-markov" | path, "kind": "tokens" | "classification", "samples": N,
  //  "tokens": ..., "vocab_size" | "classes": ..., "entropy_rate": nats/token (synthetic only)}
  virtual nlohmann::json describe() const = 0;
  // The optimum of the mean loss (nats) a model can reach on this data when it is known
  // (synthetic data: the entropy rate of the chain; the Bayes loss of the mixture); NaN otherwise.
  // The entropy rate is exact and is the exact optimum of the windowed loss too (sequences start
  // in the stationary distribution; the first target has its predecessor as context). The Bayes
  // loss is a deterministic Monte Carlo estimate (describe(): optimal_loss_stderr, ~0.003). Files
  // report their `optimal_loss` attribute (data-pack writes it for synthetic data).
  virtual double optimal_loss() const;
};

// Opens a training or validation dataset for a model:
//   spec "synthetic": llama -> the sparse Markov-chain language over the model's vocab and
//   seq_len; classifiers (mlp, resnet) -> the Gaussian mixture over their input size
//   (ModelConfig::sample_numel) and classes. validation selects a disjoint stream of the same
//   distribution. seed (the run's --seed) picks the chain / mixture.
//   spec FILE.h5: a token file (1-D `tokens` u16/u32, attribute vocab_size; samples are windows
//   of seq_len + 1 tokens) or a classification file (`images` u8 [N,H,W,C], given as f32
//   [B, C, H, W] scaled to [0,1], PyTorch's layout; or `features` f32 [N,D], given as [B, D];
//   `labels` integer [N]). Checked against the model (vocab_size <= vocab, a sample's size ==
//   sample_numel, a resnet's input_shape == the images' C, H, W, labels < classes): UsageError naming the
//   file and the mismatch. `validation` and `seed` matter only for "synthetic" (a file is what
//   it is: pass the validation file itself). Synthetic datasets have 2^40 samples.
std::unique_ptr<Dataset> open_dataset(const std::string& spec, const nn::ModelConfig& model, bool validation,
                                      uint64_t seed);

// C, H, W of the images of a classification file; empty when spec is not a readable file of
// images (open_dataset then says why). How a resnet's input_shape defaults to its data's.
std::vector<int64_t> image_shape(const std::string& spec);

// A token file written in pieces (data-pack's packers stream corpora larger than memory):
// `tokens` ids in all, stored as u16 when vocab_size <= 65536, else u32, appended in order, each
// checked below vocab_size (UsageError naming its position). It is written under a temporary
// name that commit() renames into place; without commit() nothing is left.
class TokenWriter {
 public:
  TokenWriter(const std::string& path, int64_t tokens, int64_t vocab_size,
              const nlohmann::json& attrs = nlohmann::json::object());
  ~TokenWriter();
  TokenWriter(const TokenWriter&) = delete;
  TokenWriter& operator=(const TokenWriter&) = delete;
  void append(std::span<const uint32_t> tokens);
  void commit();  // every announced token written

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes the datasets that data-pack produces (atomically: temporary name, then rename).
void write_token_file(const std::string& path, std::span<const uint32_t> tokens, int64_t vocab_size,
                      const nlohmann::json& attrs = nlohmann::json::object());
void write_image_file(const std::string& path, std::span<const uint8_t> images, const Shape& shape /*N,H,W,C*/,
                      std::span<const int32_t> labels, int64_t classes,
                      const nlohmann::json& attrs = nlohmann::json::object());

// Like write_image_file for vector data: `features` f32 [N, D] (data-pack synthetic --kind classes).
void write_feature_file(const std::string& path, std::span<const float> features, const Shape& shape /*N,D*/,
                        std::span<const int32_t> labels, int64_t classes,
                        const nlohmann::json& attrs = nlohmann::json::object());

// The language of open_dataset("synthetic") for token models: a sparse Markov chain over `vocab`
// tokens, chosen by `seed`. Each state has `successors` distinct next states: the first is its
// successor on a random cycle through all states (so the chain is irreducible), the others are
// drawn at random; their probabilities are Dirichlet(1, ..., 1) draws (normalised exponentials).
// The stationary distribution is computed by power iteration of the lazy chain 0.1 I + 0.9 P,
// the entropy rate exactly from it: H = -sum_i pi_i sum_j P_ij log P_ij (nats per token).
// Every number comes from Philox, so the chain and every sequence are the same on every rank.
class MarkovChain {
 public:
  static constexpr int kSuccessors = 8;
  // Streams of sequences: open_dataset's training and validation samples, and the long
  // sequences that data-pack writes to files.
  static constexpr int kTrain = 0, kValidation = 1, kFileTrain = 2, kFileValidation = 3;

  MarkovChain(int64_t vocab, uint64_t seed, int successors = kSuccessors);
  int64_t vocab() const { return vocab_; }
  int successors() const { return k_; }
  // State s's successors and their transition probabilities (successors() of each).
  std::span<const int32_t> next(int64_t s) const;
  std::span<const double> probs(int64_t s) const;
  const std::vector<double>& stationary() const { return pi_; }
  double entropy_rate() const { return entropy_; }
  // Sequence `index` of `stream`: out[0] drawn from the stationary distribution, each later
  // token from its predecessor's row, so every position is stationary. Any length.
  void sample(int stream, uint64_t index, std::span<int32_t> out) const;

 private:
  int64_t vocab_;
  int k_;
  uint64_t seed_;
  std::vector<int32_t> next_;   // [vocab, k]
  std::vector<double> prob_;    // [vocab, k]
  std::vector<double> cdf_;     // [vocab, k], last of each row exactly 1
  std::vector<double> pi_, pi_cdf_;
  double entropy_ = 0;
};

// Which samples make each step's global batch.
class Sampler {
 public:
  Sampler(int64_t dataset_size, int64_t global_batch, uint64_t seed);
  // The global batch of a step: global_batch indices, a function of (seed, step) only. Epochs
  // are permutations of the dataset (every sample once per epoch when global_batch divides it).
  std::vector<int64_t> global_indices(int64_t step) const;
  // Rank r's rows [begin, end) of the global batch: contiguous, sizes differ by at most one.
  static std::pair<int64_t, int64_t> shard(int64_t global_batch, int rank, int world_size);
  int64_t global_batch() const { return global_batch_; }

 private:
  int64_t size_, global_batch_;
  uint64_t seed_;
};

}  // namespace dtk::data
