// The synthetic datasets: a sparse Markov-chain language (token models) and a Gaussian mixture
// (classifiers). Both are functions of (seed, stream, sample index) through Philox, so sample i
// is the same on every rank, every run and every world size, and need no storage.
#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>

#include "dtk/core/error.h"
#include "dtk/core/philox.h"
#include "dtk/core/streams.h"
#include "dtk/data/internal.h"

namespace dtk::data {
namespace detail {

double unit(uint32_t a, uint32_t b) { return philox::to_unit(a, b); }

}  // namespace detail

namespace {
using streams::data_key;
using detail::unit;

// Philox of a 128-bit counter (a, b, c, d) under a 64-bit key.
philox::U4 draw(uint64_t key, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return philox::philox4x32_10(philox::U4{{a, b, c, d}}, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
}
uint32_t lo(uint64_t x) { return static_cast<uint32_t>(x); }
uint32_t hi(uint64_t x) { return static_cast<uint32_t>(x >> 32); }

// Two independent standard normals from one Philox block (Box-Muller, both branches; the
// exact-operation log and cos of philox.h, so every machine draws the same numbers).
void normal_pair(const philox::U4& w, double* a, double* b) {
  const double u1 = 1.0 - unit(w.x[0], w.x[1]);
  const double u2 = unit(w.x[2], w.x[3]);
  const double r = std::sqrt(-2.0 * philox::log_unit(u1));
  double t = u2 - 0.25;  // sin(2 pi u2) = cos(2 pi (u2 - 1/4)); both steps exact
  if (t < 0) t += 1.0;
  *a = r * philox::cos_turns(u2);
  *b = r * philox::cos_turns(t);
}

// n standard normals, element k from block (k / 2, tag, index): the same for any n' >= n.
void normals(uint64_t key, uint32_t tag, uint64_t index, int64_t n, double* out) {
  for (int64_t k = 0; k < n; k += 2) {
    double a, b;
    normal_pair(draw(key, static_cast<uint32_t>(k / 2), tag, lo(index), hi(index)), &a, &b);
    out[k] = a;
    if (k + 1 < n) out[k + 1] = b;
  }
}

}  // namespace

// ------------------------------------------------------------------------------ Markov chain
MarkovChain::MarkovChain(int64_t vocab, uint64_t seed, int successors) : vocab_(vocab), seed_(seed) {
  if (vocab < 2) fail_usage("synthetic language: the vocabulary needs at least 2 tokens (vocab {})", vocab);
  if (vocab > (int64_t{1} << 31) - 1) fail_usage("synthetic language: vocab {} is too large", vocab);
  if (successors < 1) fail_usage("synthetic language: successors must be at least 1");
  k_ = static_cast<int>(std::min<int64_t>(successors, vocab));
  const size_t V = static_cast<size_t>(vocab), K = static_cast<size_t>(k_);
  const uint64_t key = data_key(seed, streams::kChain);

  // A random cycle through every state (Fisher-Yates with Philox draws): irreducibility.
  std::vector<int32_t> perm(V), cycle_next(V);
  for (size_t i = 0; i < V; ++i) perm[i] = static_cast<int32_t>(i);
  for (size_t i = V - 1; i > 0; --i) {
    const philox::U4 w = draw(key, static_cast<uint32_t>(i), 0, 0, 1);
    const size_t j = static_cast<size_t>(unit(w.x[0], w.x[1]) * static_cast<double>(i + 1));
    std::swap(perm[i], perm[std::min(j, i)]);
  }
  for (size_t i = 0; i < V; ++i) cycle_next[static_cast<size_t>(perm[i])] = perm[(i + 1) % V];

  next_.resize(V * K);
  prob_.resize(V * K);
  cdf_.resize(V * K);
  for (size_t s = 0; s < V; ++s) {
    int32_t* row = &next_[s * K];
    row[0] = cycle_next[s];
    size_t have = 1;
    for (uint32_t c = 0; have < K; ++c) {  // distinct random successors (self-loops allowed)
      const philox::U4 w = draw(key, c, static_cast<uint32_t>(s), 0, 2);
      const auto cand = static_cast<int32_t>(
          std::min<double>(unit(w.x[0], w.x[1]) * static_cast<double>(V), static_cast<double>(V - 1)));
      if (std::find(row, row + have, cand) == row + have) row[have++] = cand;
    }
    // Dirichlet(1, ..., 1): normalised exponentials (floored so that no edge vanishes).
    double sum = 0;
    for (size_t j = 0; j < K; ++j) {
      const philox::U4 w = draw(key, static_cast<uint32_t>(j), static_cast<uint32_t>(s), 0, 3);
      const double e = -philox::log_unit(1.0 - unit(w.x[0], w.x[1])) + 1e-3;
      prob_[s * K + j] = e;
      sum += e;
    }
    double c = 0;
    for (size_t j = 0; j < K; ++j) {
      prob_[s * K + j] /= sum;
      c += prob_[s * K + j];
      cdf_[s * K + j] = c;
    }
    cdf_[s * K + K - 1] = 1.0;
  }

  // Stationary distribution: power iteration of the lazy chain 0.1 I + 0.9 P (same stationary
  // distribution, aperiodic, so it converges for any irreducible P).
  pi_.assign(V, 1.0 / static_cast<double>(V));
  std::vector<double> nxt(V);
  for (int it = 0; it < 1000000; ++it) {
    for (size_t s = 0; s < V; ++s) nxt[s] = 0.1 * pi_[s];
    for (size_t s = 0; s < V; ++s) {
      const double m = 0.9 * pi_[s];
      for (size_t j = 0; j < K; ++j) nxt[static_cast<size_t>(next_[s * K + j])] += m * prob_[s * K + j];
    }
    double total = 0;
    for (double x : nxt) total += x;
    double diff = 0;
    for (size_t s = 0; s < V; ++s) {
      nxt[s] /= total;
      diff += std::abs(nxt[s] - pi_[s]);
    }
    pi_.swap(nxt);
    if (diff < 1e-14) break;
  }
  pi_cdf_.resize(V);
  double c = 0;
  for (size_t s = 0; s < V; ++s) pi_cdf_[s] = (c += pi_[s]);
  pi_cdf_[V - 1] = 1.0;

  double h = 0;
  for (size_t s = 0; s < V; ++s) {
    double hs = 0;
    for (size_t j = 0; j < K; ++j) hs -= prob_[s * K + j] * std::log(prob_[s * K + j]);
    h += pi_[s] * hs;
  }
  entropy_ = h;
}

std::span<const int32_t> MarkovChain::next(int64_t s) const {
  DTK_CHECK(s >= 0 && s < vocab_, "MarkovChain::next: state out of range");
  return {next_.data() + s * k_, static_cast<size_t>(k_)};
}

std::span<const double> MarkovChain::probs(int64_t s) const {
  DTK_CHECK(s >= 0 && s < vocab_, "MarkovChain::probs: state out of range");
  return {prob_.data() + s * k_, static_cast<size_t>(k_)};
}

void MarkovChain::sample(int stream, uint64_t index, std::span<int32_t> out) const {
  const uint64_t key = data_key(seed_, streams::kChainStream + static_cast<uint32_t>(stream));
  const size_t K = static_cast<size_t>(k_);
  philox::U4 w{};
  for (size_t t = 0; t < out.size(); ++t) {
    const uint64_t pair = t / 2;
    if (t % 2 == 0) w = draw(key, lo(pair), hi(pair), lo(index), hi(index));
    const double u = t % 2 ? unit(w.x[2], w.x[3]) : unit(w.x[0], w.x[1]);
    if (t == 0) {
      const size_t s = static_cast<size_t>(std::upper_bound(pi_cdf_.begin(), pi_cdf_.end(), u) - pi_cdf_.begin());
      out[0] = static_cast<int32_t>(std::min(s, pi_cdf_.size() - 1));
    } else {
      const size_t s = static_cast<size_t>(out[t - 1]);
      const double* c = &cdf_[s * K];
      size_t j = 0;
      while (j + 1 < K && u >= c[j]) ++j;
      out[t] = next_[s * K + j];
    }
  }
}

namespace {

// ------------------------------------------------------------------------------ datasets
// Samples are sequences of seq_len + 1 tokens of the chain; the optimum of the mean next-token
// loss over a window is exactly the entropy rate: every sequence starts in the stationary
// distribution and the first target already has its predecessor (inputs[0]) as context, which
// is all a first-order chain's next token depends on.
class MarkovDataset final : public Dataset {
 public:
  MarkovDataset(const nn::ModelConfig& m, bool validation, uint64_t seed)
      : chain_(m.vocab, seed), seq_(m.seq_len), validation_(validation), seed_(seed) {}
  int64_t size() const override { return detail::kSyntheticSamples; }
  nn::Batch get(std::span<const int64_t> indices) const override {
    const int64_t B = static_cast<int64_t>(indices.size()), T = seq_;
    for (int64_t i : indices) DTK_CHECK(i >= 0 && i < size(), "synthetic language: sample index out of range");
    Tensor in = Tensor::empty({B, T}, DType::i32), tg = Tensor::empty({B, T}, DType::i32);
    int32_t* pin = in.ptr<int32_t>();
    int32_t* ptg = tg.ptr<int32_t>();
    const int stream = validation_ ? MarkovChain::kValidation : MarkovChain::kTrain;
#pragma omp parallel for schedule(static) if (B * T >= 65536)
    for (int64_t b = 0; b < B; ++b) {
      std::vector<int32_t> seq(static_cast<size_t>(T + 1));
      chain_.sample(stream, static_cast<uint64_t>(indices[static_cast<size_t>(b)]), seq);
      std::copy(seq.begin(), seq.end() - 1, pin + b * T);
      std::copy(seq.begin() + 1, seq.end(), ptg + b * T);
    }
    return {in, tg};
  }
  nlohmann::json describe() const override {
    return {{"source", "synthetic-markov"},
            {"kind", "tokens"},
            {"split", validation_ ? "validation" : "train"},
            {"samples", size()},
            {"seq_len", seq_},
            {"tokens", static_cast<double>(size()) * static_cast<double>(seq_)},
            {"vocab_size", chain_.vocab()},
            {"successors", chain_.successors()},
            {"seed", seed_},
            {"entropy_rate", chain_.entropy_rate()},
            {"optimal_loss", chain_.entropy_rate()}};
  }
  double optimal_loss() const override { return chain_.entropy_rate(); }

 private:
  MarkovChain chain_;
  int64_t seq_;
  bool validation_;
  uint64_t seed_;
};

// A mixture of `classes` Gaussians N(mu_c, I) in input_dim dimensions with equal weights. The
// means are N(0, 4.5/D I) draws, so two means lie about 3 apart in any dimension (pairwise Bayes
// error about Phi(-1.5) = 6.7%): learnable, not trivial. The Bayes classifier is linear
// (logit_c = mu_c . x - |mu_c|^2 / 2), so an MLP can reach the Bayes loss.
//
// optimal_loss() is a Monte Carlo estimate of the Bayes loss E[-log p(y | x)], deterministic
// (a fixed stream of draws) and cheap in any dimension: with x = mu_y + z, the posterior depends
// on z only through its projection onto the span of the means (the rest adds the same |z_perp|^2
// to every class), so each draw needs r = rank of the means <= min(C, D) normals, not D. The
// classes are stratified (draw i has class i mod C). describe() gives its standard error.
class MixtureDataset final : public Dataset {
 public:
  MixtureDataset(const nn::ModelConfig& m, bool validation, uint64_t seed)
      : D_(m.sample_numel()), C_(m.classes), validation_(validation), seed_(seed) {
    if (D_ < 1) fail_usage("synthetic classification: the model's input size must be positive");
    if (C_ < 2) fail_usage("synthetic classification: the model needs at least 2 classes");
    if (C_ > (int64_t{1} << 20) || C_ * D_ > (int64_t{1} << 31))
      fail_usage("synthetic classification: classes x input_dim is too large");
    const uint64_t key = data_key(seed, streams::kMixtureMeans);
    const double scale = 3.0 / std::sqrt(2.0 * static_cast<double>(D_));
    means_.resize(static_cast<size_t>(C_ * D_));
    for (size_t i = 0; i < means_.size(); ++i) means_[i] = scale * philox::normal(key, i);
    key_ = data_key(seed, streams::kMixtureStream + (validation ? 1u : 0u));
  }
  int64_t size() const override { return detail::kSyntheticSamples; }
  nn::Batch get(std::span<const int64_t> indices) const override {
    const int64_t B = static_cast<int64_t>(indices.size());
    for (int64_t i : indices) DTK_CHECK(i >= 0 && i < size(), "synthetic classification: sample index out of range");
    Tensor x = Tensor::empty({B, D_}, DType::f32), y = Tensor::empty({B}, DType::i32);
    float* px = x.ptr<float>();
    int32_t* py = y.ptr<int32_t>();
    std::vector<double> row(static_cast<size_t>(D_));
#pragma omp parallel for schedule(static) firstprivate(row) if (B * D_ >= 65536)
    for (int64_t b = 0; b < B; ++b) {
      const uint64_t index = static_cast<uint64_t>(indices[static_cast<size_t>(b)]);
      const philox::U4 w = draw(key_, 0, 0, lo(index), hi(index));
      const auto label = static_cast<int32_t>(
          std::min<double>(unit(w.x[0], w.x[1]) * static_cast<double>(C_), static_cast<double>(C_ - 1)));
      normals(key_, 1, index, D_, row.data());
      const double* mu = &means_[static_cast<size_t>(label * D_)];
      for (int64_t j = 0; j < D_; ++j) px[b * D_ + j] = static_cast<float>(mu[j] + row[static_cast<size_t>(j)]);
      py[b] = label;
    }
    return {x, y};
  }
  nlohmann::json describe() const override {
    bayes();
    return {{"source", "synthetic-gaussian-mixture"},
            {"kind", "classification"},
            {"split", validation_ ? "validation" : "train"},
            {"samples", size()},
            {"input_dim", D_},
            {"classes", C_},
            {"seed", seed_},
            {"optimal_loss", bayes_},
            {"optimal_loss_method", "monte-carlo"},
            {"optimal_loss_stderr", bayes_stderr_},
            {"optimal_loss_samples", bayes_n_}};
  }
  double optimal_loss() const override {
    bayes();
    return bayes_;
  }

 private:
  void bayes() const {
    std::call_once(bayes_once_, [this] {
      // An orthonormal basis of the span of the means (Gram-Schmidt, twice; dependent means
      // dropped) and each mean's coordinates in it.
      const size_t D = static_cast<size_t>(D_), C = static_cast<size_t>(C_);
      std::vector<std::vector<double>> basis;
      for (size_t c = 0; c < C && basis.size() < D; ++c) {
        std::vector<double> v(means_.begin() + static_cast<std::ptrdiff_t>(c * D),
                              means_.begin() + static_cast<std::ptrdiff_t>((c + 1) * D));
        double n0 = 0;
        for (double e : v) n0 += e * e;
        for (int pass = 0; pass < 2; ++pass)
          for (const auto& q : basis) {
            double dot = 0;
            for (size_t j = 0; j < D; ++j) dot += q[j] * v[j];
            for (size_t j = 0; j < D; ++j) v[j] -= dot * q[j];
          }
        double n = 0;
        for (double e : v) n += e * e;
        if (n <= 1e-20 * n0 || n == 0) continue;
        for (double& e : v) e /= std::sqrt(n);
        basis.push_back(std::move(v));
      }
      const size_t r = basis.size();
      std::vector<double> coord(C * r);
      for (size_t c = 0; c < C; ++c)
        for (size_t k = 0; k < r; ++k) {
          double dot = 0;
          for (size_t j = 0; j < D; ++j) dot += basis[k][j] * means_[c * D + j];
          coord[c * r + k] = dot;
        }
      const double work = static_cast<double>(C) * static_cast<double>(r + 1);
      bayes_n_ = static_cast<int64_t>(std::clamp(2e8 / work, 2000.0, 200000.0));
      const uint64_t key = data_key(seed_, streams::kMixtureBayes);
      std::vector<double> loss(static_cast<size_t>(bayes_n_));
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < bayes_n_; ++i) {
        std::vector<double> e(r), logit(C);
        normals(key, 0, static_cast<uint64_t>(i), static_cast<int64_t>(r), e.data());
        const size_t y = static_cast<size_t>(i) % C;
        double mx = -std::numeric_limits<double>::infinity();
        for (size_t c = 0; c < C; ++c) {
          double d2 = 0;
          for (size_t k = 0; k < r; ++k) {
            const double d = coord[y * r + k] - coord[c * r + k] + e[k];
            d2 += d * d;
          }
          logit[c] = -0.5 * d2;
          mx = std::max(mx, logit[c]);
        }
        double se = 0;
        for (double l : logit) se += std::exp(l - mx);
        loss[static_cast<size_t>(i)] = mx + std::log(se) - logit[y];
      }
      double m = 0, m2 = 0;
      for (double l : loss) m += l;
      m /= static_cast<double>(bayes_n_);
      for (double l : loss) m2 += (l - m) * (l - m);
      bayes_ = m;
      bayes_stderr_ = std::sqrt(m2 / static_cast<double>(bayes_n_ - 1) / static_cast<double>(bayes_n_));
    });
  }

  int64_t D_, C_;
  bool validation_;
  uint64_t seed_, key_ = 0;
  std::vector<double> means_;  // [C, D]
  mutable std::once_flag bayes_once_;
  mutable double bayes_ = 0, bayes_stderr_ = 0;
  mutable int64_t bayes_n_ = 0;
};

}  // namespace

namespace detail {

std::unique_ptr<Dataset> make_markov_dataset(const nn::ModelConfig& model, bool validation, uint64_t seed) {
  if (model.seq_len < 1) fail_usage("synthetic language: the model's seq_len must be positive");
  return std::make_unique<MarkovDataset>(model, validation, seed);
}

std::unique_ptr<Dataset> make_mixture_dataset(const nn::ModelConfig& model, bool validation, uint64_t seed) {
  return std::make_unique<MixtureDataset>(model, validation, seed);
}

}  // namespace detail
}  // namespace dtk::data
