// dtk::data: the synthetic language (determinism, chain edges, the entropy rate against an
// independent computation and against sampling), the Gaussian mixture, token and classification
// files (windows, scaling, every kind of bad file, u16 and u32 tokens), atomic writes, and the
// sampler (epochs are permutations, world-size invariance, determinism).
#include <gtest/gtest.h>
#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <set>
#include <string>
#include <tuple>

#include "dtk/core/error.h"
#include "dtk/data/augment.h"
#include "dtk/data/dataset.h"

namespace dtk::data {
namespace {
namespace fs = std::filesystem;

nn::ModelConfig llama(int64_t vocab, int64_t seq) {
  nn::ModelConfig m;
  m.arch = nn::Arch::llama;
  m.vocab = vocab;
  m.seq_len = seq;
  return m;
}

nn::ModelConfig mlp(int64_t dim, int64_t classes) {
  nn::ModelConfig m;
  m.arch = nn::Arch::mlp;
  m.input_dim = dim;
  m.classes = classes;
  return m;
}

std::vector<int32_t> ints(const Tensor& t) {
  std::vector<int32_t> v(static_cast<size_t>(t.numel()));
  std::copy(t.ptr<int32_t>(), t.ptr<int32_t>() + t.numel(), v.begin());
  return v;
}

std::vector<float> floats(const Tensor& t) { return {t.ptr<float>(), t.ptr<float>() + t.numel()}; }

// P[s][t] of a chain, dense.
std::vector<std::vector<double>> dense(const MarkovChain& c) {
  const size_t V = static_cast<size_t>(c.vocab());
  std::vector<std::vector<double>> P(V, std::vector<double>(V, 0.0));
  for (size_t s = 0; s < V; ++s) {
    auto nx = c.next(static_cast<int64_t>(s));
    auto pr = c.probs(static_cast<int64_t>(s));
    for (size_t j = 0; j < nx.size(); ++j) P[s][static_cast<size_t>(nx[j])] += pr[j];
  }
  return P;
}

// The stationary distribution by solving pi (P - I) = 0, sum pi = 1 (Gaussian elimination with
// partial pivoting): an independent check of the power iteration.
std::vector<double> solve_stationary(const std::vector<std::vector<double>>& P) {
  const size_t V = P.size();
  std::vector<std::vector<double>> A(V, std::vector<double>(V + 1, 0.0));
  for (size_t i = 0; i < V; ++i)      // equation i: sum_s pi_s (P[s][i] - delta)
    for (size_t s = 0; s < V; ++s) A[i][s] = P[s][i] - (s == i ? 1.0 : 0.0);
  for (size_t s = 0; s < V; ++s) A[V - 1][s] = 1.0;  // replace the last equation by sum = 1
  A[V - 1][V] = 1.0;
  for (size_t c = 0; c < V; ++c) {
    size_t p = c;
    for (size_t r = c + 1; r < V; ++r)
      if (std::abs(A[r][c]) > std::abs(A[p][c])) p = r;
    std::swap(A[c], A[p]);
    for (size_t r = 0; r < V; ++r) {
      if (r == c) continue;
      const double f = A[r][c] / A[c][c];
      for (size_t k = c; k <= V; ++k) A[r][k] -= f * A[c][k];
    }
  }
  std::vector<double> pi(V);
  for (size_t i = 0; i < V; ++i) pi[i] = A[i][V] / A[i][i];
  return pi;
}

class DataFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/dtk-data-XXXXXX";
    dir_ = mkdtemp(tmpl);
    open_ids_ = H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL);
  }
  void TearDown() override {
    // Every HDF5 file, dataset and attribute opened, including on the error paths, was closed.
    EXPECT_EQ(H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL), open_ids_);
    fs::remove_all(dir_);
  }
  ssize_t open_ids_ = 0;
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

// Expects open_dataset to throw a UsageError whose message names the file and contains `what`.
void expect_bad(const std::string& file, const nn::ModelConfig& m, const std::string& what) {
  try {
    open_dataset(file, m, false, 0);
    ADD_FAILURE() << file << ": no error (expected '" << what << "')";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  }
}

// A raw HDF5 file with one dataset of the given type and shape (zeros, written, unless data is
// given: a dataset never written is refused as truncated).
void raw_file(const std::string& p, const char* name, hid_t type, std::vector<hsize_t> dims,
              const void* data = nullptr, hid_t mem = -1) {
  hid_t f = H5Fcreate(p.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  hid_t s = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  hid_t d = H5Dcreate2(f, name, type, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  size_t n = 1;
  for (hsize_t x : dims) n *= x;
  const std::vector<unsigned char> zeros(n * H5Tget_size(type), 0);
  H5Dwrite(d, data ? mem : type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data ? data : zeros.data());
  H5Dclose(d);
  H5Sclose(s);
  H5Fclose(f);
}

void add_int_attr(const std::string& p, const char* name, int64_t v) {
  hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  hid_t s = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(f, name, H5T_STD_I64LE, s, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(a, H5T_NATIVE_INT64, &v);
  H5Aclose(a);
  H5Sclose(s);
  H5Fclose(f);
}

// ---------------------------------------------------------------------------- synthetic language
TEST(SyntheticMarkov, SameIndexSameSampleAndSplitsDiffer) {
  const auto m = llama(64, 16);
  auto a = open_dataset("synthetic", m, false, 7), b = open_dataset("synthetic", m, false, 7);
  auto v = open_dataset("synthetic", m, true, 7), other = open_dataset("synthetic", m, false, 8);
  EXPECT_EQ(a->size(), int64_t{1} << 40);
  const std::vector<int64_t> idx = {5, 9, 5, (int64_t{1} << 40) - 1};
  nn::Batch x = a->get(idx), y = b->get(idx), z = v->get(idx), w = other->get(idx);
  ASSERT_EQ(x.inputs.shape(), (Shape{4, 16}));
  ASSERT_EQ(x.targets.shape(), (Shape{4, 16}));
  EXPECT_EQ(x.inputs.dtype(), DType::i32);
  EXPECT_EQ(ints(x.inputs), ints(y.inputs));
  EXPECT_EQ(ints(x.targets), ints(y.targets));
  const auto xi = ints(x.inputs), xt = ints(x.targets);
  EXPECT_TRUE(std::equal(xi.begin(), xi.begin() + 16, xi.begin() + 32));  // rows 0 and 2: index 5 twice
  EXPECT_NE(ints(x.inputs), ints(z.inputs));                              // validation: another stream
  EXPECT_NE(ints(x.inputs), ints(w.inputs));                              // another seed: another chain
  for (int b2 = 0; b2 < 4; ++b2)                                          // targets are the next tokens
    for (int t = 0; t + 1 < 16; ++t) EXPECT_EQ(xi[b2 * 16 + t + 1], xt[b2 * 16 + t]);
  // A batch is its samples: get({9}) is row 1.
  const auto one = ints(a->get(std::vector<int64_t>{9}).inputs);
  EXPECT_TRUE(std::equal(one.begin(), one.end(), xi.begin() + 16));
}

TEST(SyntheticMarkov, EveryStepIsAnEdgeOfTheChain) {
  const auto m = llama(50, 32);
  MarkovChain c(50, 3);
  EXPECT_EQ(c.successors(), MarkovChain::kSuccessors);
  auto d = open_dataset("synthetic", m, false, 3);
  std::vector<int64_t> idx(64);
  std::iota(idx.begin(), idx.end(), 1000);
  nn::Batch b = d->get(idx);
  const auto in = ints(b.inputs), tg = ints(b.targets);
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_GE(in[i], 0);
    ASSERT_LT(in[i], 50);
    auto nx = c.next(in[i]);
    EXPECT_NE(std::find(nx.begin(), nx.end(), tg[i]), nx.end()) << in[i] << " -> " << tg[i];
  }
  for (int64_t s = 0; s < 50; ++s) {  // distinct successors, probabilities summing to 1
    auto nx = c.next(s);
    EXPECT_EQ(std::set<int32_t>(nx.begin(), nx.end()).size(), nx.size());
    auto pr = c.probs(s);
    EXPECT_NEAR(std::accumulate(pr.begin(), pr.end(), 0.0), 1.0, 1e-12);
  }
}

TEST(SyntheticMarkov, TwoStateChainEntropyRateInClosedForm) {
  MarkovChain c(2, 11);  // two states, both successors each: P = [[1-a, a], [b, 1-b]]
  const auto P = dense(c);
  const double a = P[0][1], b = P[1][0];
  const double pi0 = b / (a + b), pi1 = a / (a + b);
  auto h = [](double p) { return -(p * std::log(p) + (1 - p) * std::log(1 - p)); };
  EXPECT_NEAR(c.stationary()[0], pi0, 1e-12);
  EXPECT_NEAR(c.stationary()[1], pi1, 1e-12);
  EXPECT_NEAR(c.entropy_rate(), pi0 * h(a) + pi1 * h(b), 1e-12);
}

TEST(SyntheticMarkov, EntropyRateMatchesIndependentSolveAndSampling) {
  MarkovChain c(12, 5, 3);
  const auto P = dense(c);
  const auto pi = solve_stationary(P);
  double H = 0;
  for (size_t s = 0; s < P.size(); ++s) {
    EXPECT_NEAR(c.stationary()[s], pi[s], 1e-12) << s;
    for (double p : P[s])
      if (p > 0) H -= pi[s] * p * std::log(p);
  }
  EXPECT_NEAR(c.entropy_rate(), H, 1e-12);

  // Brute force: the mean of -log P(x_{t+1} | x_t) along one long sampled sequence, and the
  // visit frequencies, converge to H and pi (ergodic theorem).
  const size_t n = 2000000;
  std::vector<int32_t> seq(n);
  c.sample(MarkovChain::kTrain, 42, seq);
  double nll = 0;
  std::vector<double> freq(12, 0.0);
  for (size_t t = 0; t + 1 < n; ++t) {
    nll -= std::log(P[static_cast<size_t>(seq[t])][static_cast<size_t>(seq[t + 1])]);
    freq[static_cast<size_t>(seq[t])] += 1.0 / static_cast<double>(n - 1);
  }
  nll /= static_cast<double>(n - 1);
  EXPECT_NEAR(nll, H, 0.005) << "H " << H;
  for (size_t s = 0; s < 12; ++s) EXPECT_NEAR(freq[s], pi[s], 0.005) << s;
}

TEST(SyntheticMarkov, WindowOptimumIsTheEntropyRate) {
  // Each sample starts in the stationary distribution and the first target has its predecessor
  // as context, so the expected loss of the true conditional at every position, the first
  // included, is H: optimal_loss() is exact for windows.
  const auto m = llama(16, 4);
  auto d = open_dataset("synthetic", m, false, 9);
  MarkovChain c(16, 9);
  const auto P = dense(c);
  EXPECT_DOUBLE_EQ(d->optimal_loss(), c.entropy_rate());
  EXPECT_DOUBLE_EQ(d->describe()["entropy_rate"].get<double>(), c.entropy_rate());
  EXPECT_EQ(d->describe()["source"], "synthetic-markov");
  const int64_t n = 200000;
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  nn::Batch b = d->get(idx);
  const auto in = ints(b.inputs), tg = ints(b.targets);
  double nll0 = 0;
  std::vector<double> start(16, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    nll0 -= std::log(P[static_cast<size_t>(in[static_cast<size_t>(i * 4)])][static_cast<size_t>(tg[static_cast<size_t>(i * 4)])]);
    start[static_cast<size_t>(in[static_cast<size_t>(i * 4)])] += 1.0 / static_cast<double>(n);
  }
  EXPECT_NEAR(nll0 / static_cast<double>(n), c.entropy_rate(), 0.01);
  for (size_t s = 0; s < 16; ++s) EXPECT_NEAR(start[s], c.stationary()[s], 0.005) << s;
}

TEST(SyntheticMarkov, LlamaTinySizes) {
  MarkovChain c(256, 0);
  EXPECT_GT(c.entropy_rate(), 1.0);
  EXPECT_LT(c.entropy_rate(), std::log(8.0));
  std::printf("entropy rate (vocab 256, seed 0): %.6f nats/token\n", c.entropy_rate());
}

TEST(SyntheticMarkov, BadConfigs) {
  EXPECT_THROW(open_dataset("synthetic", llama(1, 8), false, 0), UsageError);
  EXPECT_THROW(open_dataset("synthetic", llama(8, 0), false, 0), UsageError);
  nn::ModelConfig none;
  EXPECT_THROW(open_dataset("synthetic", none, false, 0), UsageError);
  EXPECT_THROW(open_dataset("", llama(8, 8), false, 0), UsageError);
}

// ---------------------------------------------------------------------------- synthetic mixture
TEST(SyntheticMixture, DeterministicLabelsInRangeAndBayesLoss) {
  const auto m = mlp(20, 5);
  auto a = open_dataset("synthetic", m, false, 1), b = open_dataset("synthetic", m, false, 1);
  auto v = open_dataset("synthetic", m, true, 1);
  std::vector<int64_t> idx(500);
  std::iota(idx.begin(), idx.end(), 0);
  nn::Batch x = a->get(idx), y = b->get(idx), z = v->get(idx);
  ASSERT_EQ(x.inputs.shape(), (Shape{500, 20}));
  ASSERT_EQ(x.targets.shape(), (Shape{500}));
  EXPECT_EQ(x.inputs.dtype(), DType::f32);
  EXPECT_EQ(floats(x.inputs), floats(y.inputs));
  EXPECT_EQ(ints(x.targets), ints(y.targets));
  EXPECT_NE(floats(x.inputs), floats(z.inputs));
  std::vector<int> count(5, 0);
  for (int32_t l : ints(x.targets)) {
    ASSERT_GE(l, 0);
    ASSERT_LT(l, 5);
    ++count[static_cast<size_t>(l)];
  }
  for (int c : count) EXPECT_GT(c, 50);
  const double L = a->optimal_loss();
  EXPECT_GT(L, 0.05);
  EXPECT_LT(L, std::log(5.0));
  EXPECT_EQ(L, b->optimal_loss());
  const auto j = a->describe();
  EXPECT_EQ(j["kind"], "classification");
  EXPECT_EQ(j["optimal_loss_method"], "monte-carlo");
  EXPECT_LT(j["optimal_loss_stderr"].get<double>(), 0.02);
}

TEST(SyntheticMixture, BayesLossMatchesAPlugInEstimate) {
  // optimal_loss() works in the span of the means; check it against the full-dimensional data:
  // estimate the means from many samples, then average -log p(y | x) of the resulting (near-
  // Bayes) posterior over other samples. Both C > D and C < D.
  for (auto [D, C] : {std::pair<int64_t, int64_t>{6, 3}, {2, 5}}) {
    auto d = open_dataset("synthetic", mlp(D, C), false, 4);
    const int64_t n = 300000;
    std::vector<int64_t> idx(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), 0);
    nn::Batch b = d->get(idx);
    const auto x = floats(b.inputs);
    const auto y = ints(b.targets);
    std::vector<double> mu(static_cast<size_t>(C * D), 0.0), cnt(static_cast<size_t>(C), 0.0);
    for (int64_t i = 0; i < n / 2; ++i) {
      cnt[static_cast<size_t>(y[static_cast<size_t>(i)])] += 1;
      for (int64_t j = 0; j < D; ++j) mu[static_cast<size_t>(y[static_cast<size_t>(i)] * D + j)] += x[static_cast<size_t>(i * D + j)];
    }
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < D; ++j) mu[static_cast<size_t>(c * D + j)] /= cnt[static_cast<size_t>(c)];
    double loss = 0;
    for (int64_t i = n / 2; i < n; ++i) {
      std::vector<double> l(static_cast<size_t>(C));
      double mx = -1e300;
      for (int64_t c = 0; c < C; ++c) {
        double d2 = 0;
        for (int64_t j = 0; j < D; ++j) {
          const double v = x[static_cast<size_t>(i * D + j)] - mu[static_cast<size_t>(c * D + j)];
          d2 += v * v;
        }
        l[static_cast<size_t>(c)] = -0.5 * d2;
        mx = std::max(mx, l[static_cast<size_t>(c)]);
      }
      double se = 0;
      for (double v : l) se += std::exp(v - mx);
      loss += mx + std::log(se) - l[static_cast<size_t>(y[static_cast<size_t>(i)])];
    }
    loss /= static_cast<double>(n - n / 2);
    EXPECT_NEAR(d->optimal_loss(), loss, 0.015) << "D " << D << " C " << C;
  }
}

// ---------------------------------------------------------------------------- files
TEST_F(DataFiles, TokenWindows) {
  std::vector<uint32_t> tok(100);
  std::iota(tok.begin(), tok.end(), 0u);
  const std::string p = path("t.h5");
  write_token_file(p, tok, 128, {{"note", "test"}, {"optimal_loss", 1.5}});
  auto d = open_dataset(p, llama(128, 8), false, 0);
  EXPECT_EQ(d->size(), 12);  // windows of 9 tokens at 0, 8, ..., 88: the last ends at 96
  EXPECT_EQ(d->optimal_loss(), 1.5);
  EXPECT_EQ(d->describe()["dtype"], "u16");
  EXPECT_EQ(d->describe()["file_tokens"], 100);
  nn::Batch b = d->get(std::vector<int64_t>{11, 0, 3, 11, 4});
  const auto in = ints(b.inputs), tg = ints(b.targets);
  const int64_t want[] = {11, 0, 3, 11, 4};
  for (int r = 0; r < 5; ++r)
    for (int t = 0; t < 8; ++t) {
      EXPECT_EQ(in[static_cast<size_t>(r * 8 + t)], want[r] * 8 + t);
      EXPECT_EQ(tg[static_cast<size_t>(r * 8 + t)], want[r] * 8 + t + 1);
    }
  // A model with a larger vocab reads it too; seq_len 99 has exactly one window.
  EXPECT_EQ(open_dataset(p, llama(1000, 99), false, 0)->size(), 1);
}

TEST_F(DataFiles, LargeVocabIsU32) {
  std::vector<uint32_t> tok = {69999, 1, 65536, 2, 3};
  const std::string p = path("t32.h5");
  write_token_file(p, tok, 70000);
  auto d = open_dataset(p, llama(70000, 2), false, 0);
  EXPECT_EQ(d->describe()["dtype"], "u32");
  EXPECT_EQ(ints(d->get(std::vector<int64_t>{0, 1}).inputs), (std::vector<int32_t>{69999, 1, 65536, 2}));
  EXPECT_THROW(write_token_file(path("bad.h5"), tok, 1000), UsageError);  // a token >= vocab_size
  EXPECT_FALSE(fs::exists(path("bad.h5")));
  // The width follows the vocabulary: u16 up to 65536 tokens (ids to 65535), u32 from 65537 (ids
  // above 65535, Llama 3's 128256), every id read back as written.
  const std::vector<uint32_t> edge = {65535, 0, 1, 65534, 32768, 65535, 7, 2, 65535};
  const std::vector<uint32_t> wide = {65536, 0, 65535, 128255, 70000, 99999, 65537, 1, 128255};
  for (const auto& [v, ids, dtype] : {std::tuple{int64_t{65536}, edge, "u16"}, std::tuple{int64_t{65537}, edge, "u32"},
                                      std::tuple{int64_t{128256}, wide, "u32"}}) {
    const std::string f = path("w" + std::to_string(v) + ".h5");
    write_token_file(f, ids, v);
    auto w = open_dataset(f, llama(v, 8), false, 0);
    EXPECT_EQ(w->describe()["dtype"], dtype) << v;
    EXPECT_EQ(w->describe()["vocab_size"], v);
    const nn::Batch b = w->get(std::vector<int64_t>{0});
    std::vector<int32_t> want(ids.begin(), ids.end());
    EXPECT_EQ(ints(b.inputs), std::vector<int32_t>(want.begin(), want.end() - 1)) << v;
    EXPECT_EQ(ints(b.targets), std::vector<int32_t>(want.begin() + 1, want.end())) << v;
  }
  // The synthetic language over Llama 3's vocabulary: the chain builds (its stationary
  // distribution and entropy rate), and its sequences use ids above 65535.
  const MarkovChain chain(128256, 0);
  EXPECT_TRUE(std::isfinite(chain.entropy_rate()));
  EXPECT_GT(chain.entropy_rate(), 0.0);
  std::vector<int32_t> s(4096);
  chain.sample(MarkovChain::kTrain, 0, s);
  EXPECT_GT(*std::max_element(s.begin(), s.end()), 65535);
  EXPECT_LT(*std::max_element(s.begin(), s.end()), 128256);
  EXPECT_GE(*std::min_element(s.begin(), s.end()), 0);
}

// Images are stored H, W, C bytes and given as C, H, W floats in [0, 1] (PyTorch's layout); a
// resnet must take the images' C, H, W exactly, an mlp only their number of values.
TEST_F(DataFiles, ImagesScaledAndGivenAsCHW) {
  const int64_t H = 2, W = 2, C = 3;
  const Shape s = {3, H, W, C};
  std::vector<uint8_t> img(36);
  for (size_t i = 0; i < img.size(); ++i) img[i] = static_cast<uint8_t>(i * 7);
  img[0] = 255;
  const std::vector<int32_t> lab = {2, 0, 1};
  const std::string p = path("i.h5");
  write_image_file(p, img, s, lab, 3);
  auto d = open_dataset(p, mlp(12, 10), false, 0);
  EXPECT_EQ(d->size(), 3);
  EXPECT_TRUE(std::isnan(d->optimal_loss()));
  EXPECT_EQ(d->describe()["image_shape"], (std::vector<int64_t>{3, 2, 2}));
  nn::Batch b = d->get(std::vector<int64_t>{2, 0});
  ASSERT_EQ(b.inputs.shape(), (Shape{2, C, H, W}));
  const auto x = floats(b.inputs);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t w = 0; w < W; ++w) {
        const size_t out = static_cast<size_t>((c * H + h) * W + w), in = static_cast<size_t>((h * W + w) * C + c);
        EXPECT_FLOAT_EQ(x[out], static_cast<float>(img[24 + in]) / 255.0f);
        EXPECT_FLOAT_EQ(x[12 + out], static_cast<float>(img[in]) / 255.0f);
      }
  EXPECT_FLOAT_EQ(x[12], 1.0f);
  EXPECT_EQ(ints(b.targets), (std::vector<int32_t>{1, 2}));
  nn::ModelConfig r = nn::preset("resnet-8");
  r.input_shape = {3, 2, 2};
  EXPECT_EQ(open_dataset(p, r, false, 0)->get(std::vector<int64_t>{1}).inputs.shape(), (Shape{1, 3, 2, 2}));
  r.input_shape = {1, 3, 4};  // 12 values, but not these images
  expect_bad(p, r, "the images are [3, 2, 2] (C, H, W), but the model's input_shape is [1, 3, 4]");
}

TEST_F(DataFiles, FeaturesRoundTrip) {
  const std::vector<float> f = {0.5f, -1.0f, 2.0f, 3.0f, 4.0f, -5.5f};
  const std::string p = path("f.h5");
  write_feature_file(p, f, {3, 2}, std::vector<int32_t>{0, 1, 1}, 2);
  auto d = open_dataset(p, mlp(2, 2), false, 0);
  nn::Batch b = d->get(std::vector<int64_t>{1, 2, 0});
  EXPECT_EQ(floats(b.inputs), (std::vector<float>{2.0f, 3.0f, 4.0f, -5.5f, 0.5f, -1.0f}));
  EXPECT_EQ(ints(b.targets), (std::vector<int32_t>{1, 1, 0}));
}

TEST_F(DataFiles, AnyIntegerLabelType) {
  const std::string p = path("u8labels.h5");
  raw_file(p, "features", H5T_IEEE_F32LE, {4, 3});
  const uint8_t lab[4] = {0, 3, 2, 1};
  hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  hsize_t n = 4;
  hid_t s = H5Screate_simple(1, &n, nullptr);
  hid_t dd = H5Dcreate2(f, "labels", H5T_STD_U8LE, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Dwrite(dd, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, lab);
  H5Dclose(dd);
  H5Sclose(s);
  H5Fclose(f);
  auto d = open_dataset(p, mlp(3, 4), false, 0);
  EXPECT_EQ(ints(d->get(std::vector<int64_t>{0, 1, 2, 3}).targets), (std::vector<int32_t>{0, 3, 2, 1}));
  expect_bad(p, mlp(3, 3), "label 3 of sample 1 is out of range [0, 3)");
}

TEST_F(DataFiles, BadFilesNameTheFileAndTheProblem) {
  const auto lm = llama(256, 8);
  expect_bad(path("missing.h5"), lm, "no such file");
  { std::ofstream(path("text.h5")) << "this is not HDF5\n"; }
  expect_bad(path("text.h5"), lm, "not an HDF5 file");
  expect_bad(dir_.string(), lm, "directory");

  raw_file(path("other.h5"), "something", H5T_STD_U16LE, {100});
  expect_bad(path("other.h5"), lm, "no `tokens`, `images` or `features`");

  raw_file(path("f32tokens.h5"), "tokens", H5T_IEEE_F32LE, {100});
  add_int_attr(path("f32tokens.h5"), "vocab_size", 256);
  expect_bad(path("f32tokens.h5"), lm, "`tokens` must be u16 or u32 (it is f32)");
  raw_file(path("i32tokens.h5"), "tokens", H5T_STD_I32LE, {100});
  add_int_attr(path("i32tokens.h5"), "vocab_size", 256);
  expect_bad(path("i32tokens.h5"), lm, "(it is i32)");
  raw_file(path("2d.h5"), "tokens", H5T_STD_U16LE, {10, 10});
  add_int_attr(path("2d.h5"), "vocab_size", 256);
  expect_bad(path("2d.h5"), lm, "must be 1-D");
  raw_file(path("novocab.h5"), "tokens", H5T_STD_U16LE, {100});
  expect_bad(path("novocab.h5"), lm, "vocab_size is missing");

  write_token_file(path("short.h5"), std::vector<uint32_t>(8, 1u), 256);
  expect_bad(path("short.h5"), lm, "8 tokens are too short for one window of seq_len + 1 = 9 tokens");
  write_token_file(path("big.h5"), std::vector<uint32_t>(100, 1u), 50257);
  expect_bad(path("big.h5"), lm, "vocab_size 50257 is larger than the model's vocab 256");
  expect_bad(path("big.h5"), mlp(4, 2), "a token file, but the model");

  // A token >= vocab_size is caught when the file is opened (every rank opens it), wherever it lies.
  raw_file(path("badtok.h5"), "tokens", H5T_STD_U16LE, {20});
  {
    std::vector<uint16_t> t(20, 1);
    t[13] = 300;
    hid_t f = H5Fopen(path("badtok.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t dd = H5Dopen2(f, "tokens", H5P_DEFAULT);
    H5Dwrite(dd, H5T_NATIVE_UINT16, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.data());
    H5Dclose(dd);
    H5Fclose(f);
    add_int_attr(path("badtok.h5"), "vocab_size", 256);
  }
  expect_bad(path("badtok.h5"), lm, "badtok.h5: token 300 at position 13 is not below vocab_size 256");

  const Shape s = {2, 2, 2, 1};
  write_image_file(path("img.h5"), std::vector<uint8_t>(8, 9), s, std::vector<int32_t>{0, 4}, 5);
  expect_bad(path("img.h5"), mlp(4, 4), "the file has 5 classes, but the model has 4");
  expect_bad(path("img.h5"), mlp(9, 5), "has 4 values, but the model takes 9 (its input_dim)");
  expect_bad(path("img.h5"), lm, "a classification file, but the model");
  raw_file(path("nolabels.h5"), "images", H5T_STD_U8LE, {2, 2, 2, 1});
  expect_bad(path("nolabels.h5"), mlp(4, 2), "`labels` is missing");
  raw_file(path("i16img.h5"), "images", H5T_STD_I16LE, {2, 2, 2, 1});
  expect_bad(path("i16img.h5"), mlp(4, 2), "`images` must be u8");
  raw_file(path("flabels.h5"), "features", H5T_IEEE_F32LE, {2, 4});
  {
    hid_t f = H5Fopen(path("flabels.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    hsize_t n = 2;
    hid_t sp = H5Screate_simple(1, &n, nullptr);
    hid_t dd = H5Dcreate2(f, "labels", H5T_IEEE_F32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dclose(dd);
    H5Sclose(sp);
    H5Fclose(f);
  }
  expect_bad(path("flabels.h5"), mlp(4, 2), "`labels` must be integers");
  // Labels out of the model's range (no classes attribute).
  {
    raw_file(path("lab.h5"), "features", H5T_IEEE_F32LE, {2, 4});
    hid_t f = H5Fopen(path("lab.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    hsize_t n = 2;
    const int64_t lab[2] = {1, -1};
    hid_t sp = H5Screate_simple(1, &n, nullptr);
    hid_t dd = H5Dcreate2(f, "labels", H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(dd, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, lab);
    H5Dclose(dd);
    H5Sclose(sp);
    H5Fclose(f);
  }
  expect_bad(path("lab.h5"), mlp(4, 2), "label -1 of sample 1 is out of range [0, 2) (the model's classes)");
}

// NaN or an infinity in `features` would train silently (the loss of the other samples stays
// finite): the writer refuses them, and opening a file that holds them (written by another tool)
// fails, naming the file and the first such sample, whichever chunk of the file it is in.
TEST_F(DataFiles, NonFiniteFeaturesAreRefused) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> f = {0, 1, 2, 3, 4, 5};
  for (float bad : {nan, inf, -inf}) {
    f[3] = bad;
    EXPECT_THROW(write_feature_file(path("w.h5"), f, {3, 2}, std::vector<int32_t>{0, 1, 1}, 2), UsageError);
    EXPECT_FALSE(fs::exists(path("w.h5")));
  }
  // A file with labels and these features ([N, D] of `type`, given as `mem`).
  const auto file = [&](const std::string& name, hid_t type, std::vector<hsize_t> dims, const void* data, hid_t mem) {
    const std::string p = path(name);
    raw_file(p, "features", type, dims, data, mem);
    const std::vector<int32_t> lab(dims[0], 0);
    hid_t h = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t sp = H5Screate_simple(1, dims.data(), nullptr);
    hid_t dd = H5Dcreate2(h, "labels", H5T_STD_I32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(dd, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, lab.data());
    H5Dclose(dd);
    H5Sclose(sp);
    H5Fclose(h);
    return p;
  };
  f = {0, 1, 2, 3, 4, 5, 6, 7};
  f[5] = nan;
  f[6] = inf;
  expect_bad(file("nan.h5", H5T_IEEE_F32LE, {4, 2}, f.data(), H5T_NATIVE_FLOAT), mlp(2, 2),
             "sample 2 of `features` holds NaN (column 1); features must be finite");
  f[5] = 5;
  expect_bad(file("inf.h5", H5T_IEEE_F32LE, {4, 2}, f.data(), H5T_NATIVE_FLOAT), mlp(2, 2),
             "sample 3 of `features` holds +inf (column 0)");
  // f64 features are read as the model sees them, f32: 1e300 is an infinity there.
  const std::vector<double> g = {0, 1, -1e300, 3};
  expect_bad(file("f64.h5", H5T_IEEE_F64LE, {2, 2}, g.data(), H5T_NATIVE_DOUBLE), mlp(2, 2),
             "sample 1 of `features` holds -inf (column 0)");
  // Rows of 2^20 features: the check reads 4 rows at a time; the NaN is in the second chunk.
  const hsize_t D = hsize_t{1} << 20;
  std::vector<float> big(6 * D, 0.5f);
  big[5 * D + 7] = nan;
  expect_bad(file("big.h5", H5T_IEEE_F32LE, {6, D}, big.data(), H5T_NATIVE_FLOAT), mlp(static_cast<int64_t>(D), 2),
             "sample 5 of `features` holds NaN (column 7)");
  big[5 * D + 7] = 0.5f;
  EXPECT_EQ(open_dataset(file("good.h5", H5T_IEEE_F32LE, {6, D}, big.data(), H5T_NATIVE_FLOAT),
                         mlp(static_cast<int64_t>(D), 2), false, 0)->size(), 6);
}

TEST_F(DataFiles, WritesAreAtomic) {
  const std::string p = path("a.h5");
  write_token_file(p, std::vector<uint32_t>(50, 3u), 10);
  // A failing write (a label out of range) leaves the old file and no temporary file.
  EXPECT_THROW(write_image_file(p, std::vector<uint8_t>(4, 0), {1, 2, 2, 1}, std::vector<int32_t>{7}, 3), UsageError);
  EXPECT_THROW(write_image_file(p, std::vector<uint8_t>(3, 0), {1, 2, 2, 1}, std::vector<int32_t>{0}, 3), UsageError);
  EXPECT_THROW(write_token_file(path("nodir/x.h5"), std::vector<uint32_t>(5, 1u), 10), UsageError);
  EXPECT_EQ(open_dataset(p, llama(10, 7), false, 0)->size(), 7);
  // Overwriting replaces the file whole.
  write_token_file(p, std::vector<uint32_t>(9, 2u), 10);
  EXPECT_EQ(open_dataset(p, llama(10, 4), false, 0)->size(), 2);
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir_)) n += e.path().filename().string().rfind(".a.h5.tmp", 0) == 0;
  EXPECT_EQ(n, 0);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
}

// ---------------------------------------------------------------------------- sampler
TEST(Sampler, ShardIsContiguousBalancedFirstRanksLarger) {
  for (int64_t g : {0, 1, 7, 8, 10, 33})
    for (int ws = 1; ws <= 5; ++ws) {
      int64_t next = 0, prev_size = INT64_MAX;
      for (int r = 0; r < ws; ++r) {
        auto [b, e] = Sampler::shard(g, r, ws);
        EXPECT_EQ(b, next);
        EXPECT_LE(e - b, prev_size);
        EXPECT_GE(e - b, g / ws);
        EXPECT_LE(e - b, g / ws + 1);
        prev_size = e - b;
        next = e;
      }
      EXPECT_EQ(next, g);
    }
  EXPECT_THROW(Sampler::shard(8, 4, 4), UsageError);
  EXPECT_THROW(Sampler::shard(8, 0, 0), UsageError);
}

TEST(Sampler, ShardsOverRanksConcatenateToTheGlobalBatch) {
  const auto m = llama(32, 8);
  auto d = open_dataset("synthetic", m, false, 0);
  for (int ws = 1; ws <= 4; ++ws)
    for (int64_t step : {0, 1, 17}) {
      const Sampler ref(1000, 10, 5);
      const auto global = ref.global_indices(step);
      const auto all = ints(d->get(global).inputs);
      std::vector<int64_t> cat;
      std::vector<int32_t> cat_tokens;
      for (int r = 0; r < ws; ++r) {
        const Sampler mine(1000, 10, 5);  // each rank its own sampler: (seed, step) is enough
        const auto g = mine.global_indices(step);
        auto [b, e] = Sampler::shard(10, r, ws);
        const std::vector<int64_t> rows(g.begin() + b, g.begin() + e);
        cat.insert(cat.end(), rows.begin(), rows.end());
        if (!rows.empty()) {
          const auto t = ints(d->get(rows).inputs);
          cat_tokens.insert(cat_tokens.end(), t.begin(), t.end());
        }
      }
      EXPECT_EQ(cat, global) << "world size " << ws;
      EXPECT_EQ(cat_tokens, all) << "world size " << ws;
    }
}

TEST(Sampler, EpochsArePermutations) {
  for (int64_t n : {1, 2, 3, 37, 64, 1000, 4097}) {
    const int64_t g = std::min<int64_t>(n, 7);
    const Sampler s(n, g, 123);
    std::vector<int64_t> seq;
    for (int64_t step = 0; static_cast<int64_t>(seq.size()) < 3 * n; ++step) {
      const auto b = s.global_indices(step);
      ASSERT_EQ(static_cast<int64_t>(b.size()), g);
      seq.insert(seq.end(), b.begin(), b.end());
    }
    std::vector<int64_t> first;
    for (int e = 0; e < 3; ++e) {
      std::vector<int64_t> ep(seq.begin() + e * n, seq.begin() + (e + 1) * n);
      if (e == 0) first = ep;
      if (e == 1 && n > 3) {
        EXPECT_NE(ep, first) << "epochs should be reshuffled, n " << n;
      }
      std::sort(ep.begin(), ep.end());
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(ep[static_cast<size_t>(i)], i) << "n " << n << " epoch " << e;
    }
  }
}

TEST(Sampler, DeterministicAndSeeded) {
  const Sampler a(100000, 64, 1), b(100000, 64, 1), c(100000, 64, 2);
  EXPECT_EQ(a.global_indices(5), b.global_indices(5));
  EXPECT_NE(a.global_indices(5), c.global_indices(5));
  EXPECT_NE(a.global_indices(5), a.global_indices(6));
  const auto x = a.global_indices(3);
  EXPECT_EQ(std::set<int64_t>(x.begin(), x.end()).size(), x.size());
  // Not the identity: a shuffled order.
  const Sampler small(64, 64, 9);
  const auto y = small.global_indices(0);
  std::vector<int64_t> id(64);
  std::iota(id.begin(), id.end(), 0);
  EXPECT_NE(y, id);
  // Synthetic-sized datasets: 2^40 samples, indices in range and distinct.
  const Sampler huge(int64_t{1} << 40, 512, 0);
  const auto h = huge.global_indices(1000000);
  EXPECT_EQ(std::set<int64_t>(h.begin(), h.end()).size(), h.size());
  for (int64_t i : h) {
    EXPECT_GE(i, 0);
    EXPECT_LT(i, int64_t{1} << 40);
  }
  EXPECT_THROW(Sampler(0, 4, 0), UsageError);
  EXPECT_THROW(Sampler(10, 0, 0), UsageError);
  EXPECT_THROW(a.global_indices(-1), UsageError);
}

// ---------------------------------------------------------------------------- augmentation

// Crop-flip: every augmented image is its original shifted by some (dy, dx) in [-4, 4], flipped
// or not, zeros where the shift uncovers the border: found by trying every candidate. The draw
// depends on (seed, step, index) only; offsets cover the whole range and flips are about half.
TEST(Augment, CropFlipShiftsFlipsAndZeroFills) {
  const int64_t H = 7, W = 6, C = 2, B = 40, D = H * W * C;
  std::vector<float> orig(static_cast<size_t>(B * D));
  for (size_t i = 0; i < orig.size(); ++i) orig[i] = 1.0f + static_cast<float>(i % 997);  // no zeros
  nn::Batch batch{Tensor::from_host(orig.data(), {B, C, H, W}, DType::f32), Tensor::zeros({B}, DType::i32)};
  std::vector<int64_t> idx(static_cast<size_t>(B));
  std::iota(idx.begin(), idx.end(), 1000);
  augment(batch, Augment::crop_flip, C, H, W, idx, 7, 3);
  const float* got = batch.inputs.ptr<float>();
  const auto at = [&](int64_t b, int64_t c, int64_t h, int64_t w) { return static_cast<size_t>(((b * C + c) * H + h) * W + w); };
  int flips = 0;
  for (int64_t b = 0; b < B; ++b) {
    const CropFlip d = draw_crop_flip(7, 3, idx[static_cast<size_t>(b)], 4);
    EXPECT_TRUE(d.dy >= -4 && d.dy <= 4 && d.dx >= -4 && d.dx <= 4);
    flips += d.flip;
    int matches = 0;
    for (int fl = 0; fl < 2; ++fl)
      for (int64_t dy = -4; dy <= 4; ++dy)
        for (int64_t dx = -4; dx <= 4; ++dx) {
          bool same = true;
          for (int64_t h = 0; h < H && same; ++h)
            for (int64_t w = 0; w < W && same; ++w)
              for (int64_t c = 0; c < C && same; ++c) {
                const int64_t sh = h + dy, sw = w + dx;
                const bool inside = sh >= 0 && sh < H && sw >= 0 && sw < W;
                const int64_t ow = fl ? W - 1 - sw : sw;
                const float want = inside ? orig[at(b, c, sh, ow)] : 0.0f;
                same = got[at(b, c, h, w)] == want;
              }
          if (same) {
            ++matches;
            EXPECT_TRUE(dy == d.dy && dx == d.dx && fl == d.flip) << "sample " << b;
          }
        }
    EXPECT_EQ(matches, 1) << "sample " << b;
  }
  EXPECT_GT(flips, 0);
  EXPECT_LT(flips, B);
  // The same (seed, step, index): the same draw; the range is covered.
  std::set<int64_t> dys, dxs;
  int changed = 0;
  for (int64_t i = 0; i < 2000; ++i) {
    const CropFlip a = draw_crop_flip(7, 3, i, 4), b = draw_crop_flip(7, 3, i, 4), c = draw_crop_flip(7, 4, i, 4);
    EXPECT_TRUE(a.dy == b.dy && a.dx == b.dx && a.flip == b.flip);
    changed += a.dy != c.dy || a.dx != c.dx || a.flip != c.flip;
    dys.insert(a.dy);
    dxs.insert(a.dx);
  }
  EXPECT_EQ(dys.size(), 9u);
  EXPECT_EQ(dxs.size(), 9u);
  EXPECT_GT(changed, 1900);  // another step, another draw
  // none leaves the batch alone; bad names are usage errors.
  nn::Batch same{Tensor::from_host(orig.data(), {B, D}, DType::f32), Tensor::zeros({B}, DType::i32)};
  augment(same, Augment::none, C, H, W, idx, 7, 3);
  EXPECT_EQ(std::vector<float>(same.inputs.ptr<float>(), same.inputs.ptr<float>() + B * D), orig);
  EXPECT_EQ(parse_enum<Augment>("crop-flip", "--augment"), Augment::crop_flip);
  EXPECT_THROW(parse_enum<Augment>("mixup", "--augment"), UsageError);
}

}  // namespace
}  // namespace dtk::data
