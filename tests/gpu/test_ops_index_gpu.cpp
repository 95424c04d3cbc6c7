// The indexed ops on the GPU against the CPU: gather, scatter_add, embedding_forward and
// embedding_backward, on what ops.h accepts (gather and scatter_add: f32 / f64 values, i64
// indices; the embedding: f32 / f64 tables, i32 ids), and the same UsageError on both devices for
// what it does not (i32 indices, 1- and 2-byte elements, i64 token ids), with the outputs left
// as they were. Indices are always in range: the CPU validates them, the GPU kernels do not, and
// an out-of-range index on the GPU is an illegal memory access that would end the process.
//
// Every comparison here is exact (tol 0), by construction:
//   gather and embedding_forward copy elements (NaN, -0, infinities and subnormals included);
//   scatter_add and embedding_backward add, on the CPU, the values into their destination in
//   increasing position order (a serial loop; per column block for the embedding); the GPU sorts
//   the positions by destination with a stable radix sort and one thread adds each destination's
//   values in that same order, starting from the destination's value. The same additions in the
//   same order, each rounded to nearest, give the same bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/core/philox.h"
#include "dtk/core/tensor.h"
#include "dtk/nn/model.h"
#include "dtk/ops/ops.h"
#include "../common/gpu_check.h"

namespace dtk {
namespace {

using namespace gpu_test;

// Philox normals with special values every 97 elements: NaN, -0, +-Inf and a subnormal, which a
// copy must move unchanged.
Tensor values_with_specials(int64_t n, DType t, uint64_t seed) {
  Vec v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = philox::normal(seed, uint64_t(i));
  const double specials[] = {std::nan(""), -0.0, INFINITY, -INFINITY,
                             t == DType::f32 ? double(std::numeric_limits<float>::denorm_min())
                                             : std::numeric_limits<double>::denorm_min()};
  for (int64_t i = 0; i < n; i += 97) v[size_t(i)] = specials[(i / 97) % 5];
  return Tensor::from_doubles(v, {n}, t);
}

// Index patterns into [0, n): the two ends, a reversed sweep, one index repeated, Philox draws.
std::vector<int64_t> index_pattern(int pattern, int64_t n, int64_t m, uint64_t seed) {
  std::vector<int64_t> idx(static_cast<size_t>(m));
  for (int64_t j = 0; j < m; ++j) {
    const auto draw = static_cast<int64_t>(philox::uniform(seed, uint64_t(j)) * double(n));
    switch (pattern) {
      case 0: idx[size_t(j)] = j % 2 ? n - 1 : 0; break;
      case 1: idx[size_t(j)] = n - 1 - j % n; break;
      case 2: idx[size_t(j)] = n / 2; break;
      default: idx[size_t(j)] = std::min(draw, n - 1); break;
    }
  }
  return idx;
}

// A tensor of i64 indices, at an offset of one element in its buffer on device d when `shifted`.
Tensor index_tensor(const std::vector<int64_t>& idx, Device d, bool shifted) {
  std::vector<int64_t> padded(idx);
  if (shifted) padded.insert(padded.begin(), 0);
  const int64_t m = static_cast<int64_t>(idx.size()), s = shifted ? 1 : 0;
  return Tensor::from_host(padded.data(), {m + s}, DType::i64, d).slice(s, m + s);
}

TEST(GpuIndex, GatherMatchesCpuExactly) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{1, 1}, {1, 5}, {7, 3}, {7, 0}, {4097, 10000},
                                                          {(1 << 20) + 3, 4099}, {1000, (1 << 20) + 3}};
  for (DType t : kFloatTypes) {
    double err = 0;
    std::string first;
    for (const auto& [n, m] : sizes)
      for (int pattern = 0; pattern < 4; ++pattern)
        for (bool shifted : {false, true}) {
          // x, the indices and out all views one element into their buffers when shifted
          const int64_t s = shifted ? 1 : 0;
          const Tensor xbuf = values_with_specials(n + s, t, 40 + uint64_t(n));
          const Tensor x = xbuf.slice(s, n + s), xg = xbuf.to(kGpu).slice(s, n + s);
          const std::vector<int64_t> idx = index_pattern(pattern, n, m, 41);
          Tensor want = Tensor::empty({m + s}, t).slice(s, m + s);
          Tensor got = Tensor::empty({m + s}, t, kGpu).slice(s, m + s);
          ops::gather(x, index_tensor(idx, Device::cpu(), shifted), want);
          ops::gather(xg, index_tensor(idx, kGpu, shifted), got);
          err = std::max(err, exact_err(got, want, first.empty() ? &first : nullptr));
        }
    report("gather(i64 indices)", std::string(dtype_name(t)), err, 0);
    EXPECT_EQ(first, "") << "gather " << dtype_name(t) << ", the first difference (GPU against CPU)";
  }
}

// gather takes f32 / f64 values and i64 indices only: i32 indices, and 1-, 2-byte and integer
// elements, are a UsageError on both devices (the CUDA backend could move any element size with
// either index type, but ops.h does not offer it and the CPU backend has no such path).
TEST(GpuIndex, GatherRejectsWhatOpsDoesNotOffer) {
  SKIP_WITHOUT_GPU();
  for (Device d : {Device::cpu(), kGpu}) {
    const int64_t n = 9, m = 4;
    const std::vector<int64_t> idx = {0, 8, 3, 3};
    const Tensor i64 = Tensor::from_host(idx.data(), {m}, DType::i64, d);
    Tensor i32 = Tensor::empty({m}, DType::i32, d);
    ops::cast(i64, i32);
    for (DType xt : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::u8, DType::u16, DType::i32}) {
      Tensor x = Tensor::zeros({n}, xt, d), out = Tensor::empty({m}, xt, d);
      ops::fill(out, 5);
      if (xt != DType::f32 && xt != DType::f64) {
        EXPECT_THROW(ops::gather(x, i64, out), UsageError) << d.str() << " " << dtype_name(xt);
      }
      EXPECT_THROW(ops::gather(x, i32, out), UsageError) << d.str() << " " << dtype_name(xt) << " with i32 indices";
      for (double v : out.to_doubles()) EXPECT_EQ(v, 5) << d.str() << " " << dtype_name(xt) << ": out was written";
    }
  }
  std::printf("gpu-check: gather(rejects) all max_rel_err=0 tol=0 %s\n",
              ::testing::Test::HasFailure() ? "FAIL" : "PASS");
}

// scatter_add is the one public user of the GPU's index-add with i64 keys (embedding_backward
// uses i32 keys): long runs of one destination (7 destinations for a million values), every
// destination once, and random duplicates, onto an out that is not zero.
TEST(GpuIndex, ScatterAddI64MatchesCpuExactly) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{1, 1}, {7, (1 << 20) + 3}, {4097, 4097},
                                                          {(1 << 20) + 3, 100003}, {50, 0}};
  for (DType t : kFloatTypes) {
    double err = 0;
    std::string first;
    for (const auto& [n, m] : sizes)
      for (int pattern = 0; pattern < 4; ++pattern) {
        const std::vector<int64_t> idx = index_pattern(pattern, n, m, 50 + uint64_t(pattern));
        const Tensor vals = Tensor::from_doubles(random_values(size_t(m), 51), {m}, t);
        Tensor want = Tensor::from_doubles(random_values(size_t(n), 52), {n}, t), got = want.to(kGpu);
        ops::scatter_add(index_tensor(idx, Device::cpu(), false), vals, want);
        ops::scatter_add(index_tensor(idx, kGpu, false), vals.to(kGpu), got);
        err = std::max(err, exact_err(got, want, first.empty() ? &first : nullptr));
      }
    report("scatter_add(i64 indices)", std::string(dtype_name(t)), err, 0);
    EXPECT_EQ(first, "") << "scatter_add " << dtype_name(t) << ", the first difference (GPU against CPU)";
  }
}

// embedding_forward and embedding_backward (i32 ids: the index-add with i32 keys and rows of D),
// exact, with every id repeated many times (a vocabulary of 3) as well as random ids, rows of one
// element and rows longer than a thread block.
TEST(GpuIndex, EmbeddingMatchesCpuExactly) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int64_t N, V, D;
  };
  const Case cases[] = {{1, 1, 1}, {(1 << 16) + 3, 3, 64}, {4097, 1000, 1}, {1000, 50, 300}, {5, 7, 0}};
  for (DType t : kFloatTypes) {
    double ferr = 0, berr = 0;
    for (const Case& c : cases)
      for (int pattern = 0; pattern < 4; ++pattern) {
        std::vector<int64_t> idx = index_pattern(pattern, c.V, c.N, 60 + uint64_t(pattern));
        const Tensor ids = Tensor::from_doubles(Vec(idx.begin(), idx.end()), {c.N}, DType::i32);
        const Tensor table = Tensor::from_doubles(random_values(size_t(c.V * c.D), 61), {c.V, c.D}, t);
        const Tensor dout = Tensor::from_doubles(random_values(size_t(c.N * c.D), 62), {c.N, c.D}, t);
        Tensor oc = Tensor::empty({c.N, c.D}, t), og = Tensor::empty({c.N, c.D}, t, kGpu);
        ops::embedding_forward(table, ids, oc);
        ops::embedding_forward(table.to(kGpu), ids.to(kGpu), og);
        Tensor dc = table.clone(), dg = table.to(kGpu);  // backward accumulates onto the table's values
        ops::embedding_backward(ids, dout, dc);
        ops::embedding_backward(ids.to(kGpu), dout.to(kGpu), dg);
        ferr = std::max(ferr, exact_err(og, oc));
        berr = std::max(berr, exact_err(dg, dc));
      }
    report("embedding_forward(i32 ids)", std::string(dtype_name(t)), ferr, 0);
    report("embedding_backward(i32 ids)", std::string(dtype_name(t)), berr, 0);
  }
}

// Token ids are i32 everywhere (ops.h, nn/model.h): i64 ids are a UsageError on both devices, for
// the embedding ops and for a llama batch, and nothing is written.
TEST(GpuIndex, EmbeddingRejectsI64Ids) {
  SKIP_WITHOUT_GPU();
  const std::vector<int64_t> idx = {0, 4, 2, 2};
  for (Device d : {Device::cpu(), kGpu}) {
    const Tensor ids = Tensor::from_host(idx.data(), {4}, DType::i64, d);
    const Tensor table = Tensor::zeros({5, 3}, DType::f32, d), dout = Tensor::zeros({4, 3}, DType::f32, d);
    Tensor out = Tensor::empty({4, 3}, DType::f32, d), dtable = Tensor::empty({5, 3}, DType::f32, d);
    ops::fill(out, 5);
    ops::fill(dtable, 5);
    EXPECT_THROW(ops::embedding_forward(table, ids, out), UsageError) << d.str();
    EXPECT_THROW(ops::embedding_backward(ids, dout, dtable), UsageError) << d.str();
    for (const Tensor* t : {&out, &dtable})
      for (double v : t->to_doubles()) EXPECT_EQ(v, 5) << d.str() << ": written despite the error";

    auto m = nn::make_model(nn::llama_config(16, 1, 2, 1, 32, 11, 8), d);
    m->init(3);
    const Tensor tokens = Tensor::from_host(idx.data(), {1, 4}, DType::i64, d);
    try {
      m->forward(nn::Batch{tokens, tokens});
      ADD_FAILURE() << "llama on " << d.str() << " took i64 token ids";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("i32"), std::string::npos) << e.what();
    }
  }
  std::printf("gpu-check: embedding(rejects i64 ids) all max_rel_err=0 tol=0 %s\n",
              ::testing::Test::HasFailure() ? "FAIL" : "PASS");
}

}  // namespace
}  // namespace dtk
