// compress: PowerSGD and the baselines in a world of one (the local backend). The properties
// that need several ranks (linearity over ranks, majority vote, shared coordinates) are in
// tests/mpi/test_compress_mpi.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "../common/compress_util.h"
#include "../common/test_util.h"
#include "dtk/ops/ops.h"

namespace dtk::testing {
namespace {

using compress::Config;
using test_util::from_json;
using compress::make_compressor;


// Orthonormal DCT-II basis vector k of length n.
Vec dct(int64_t n, int64_t k) {
  Vec v(static_cast<size_t>(n));
  const double s = k == 0 ? std::sqrt(1.0 / n) : std::sqrt(2.0 / n);
  for (int64_t j = 0; j < n; ++j) v[j] = s * std::cos(M_PI * (j + 0.5) * k / n);
  return v;
}
// sum_i sigma_i u_i v_i^T with orthonormal u_i, v_i.
Vec low_rank(int64_t n, int64_t m, const Vec& sigma) {
  Vec g(static_cast<size_t>(n * m), 0.0);
  for (size_t i = 0; i < sigma.size(); ++i) {
    const Vec u = dct(n, static_cast<int64_t>(i) + 1), v = dct(m, static_cast<int64_t>(i) + 2);
    for (int64_t a = 0; a < n; ++a)
      for (int64_t b = 0; b < m; ++b) g[a * m + b] += sigma[i] * u[a] * v[b];
  }
  return g;
}

TEST(Compress, ConfigJsonAndValidation) {
  Config c = psgd(4, 3);
  c.comm_dtype = DType::bf16;
  c.error_mode = compress::ErrorMode::full;
  const Config d = from_json<Config>(nlohmann::json(c));
  EXPECT_EQ(nlohmann::json(d), nlohmann::json(c));
  EXPECT_EQ(nlohmann::json(from_json<Config>(nlohmann::json::object())), nlohmann::json(Config()));
  auto bad = [](const char* key, nlohmann::json v) {
    nlohmann::json j = nlohmann::json(Config());
    j[key] = v;
    EXPECT_THROW(from_json<Config>(j), UsageError) << key << " = " << v.dump();
  };
  bad("kind", "bogus");
  bad("rank", 0);
  bad("start_iter", -1);
  bad("error_mode", "half");
  bad("orthogonalize", "svd");
  bad("comm_dtype", "f16");
  bad("ratio", 0.0);
  bad("ratio", 1.5);
  bad("rank", "two");
}

TEST(Compress, LayoutBytesAndExactUncompressed) {
  // a, e: [64, 32] batched together; d: [16, 8, 2] viewed as [16, 16]; b (1-D) and c (too
  // small to pay: (4 + 4) * 2 * 2 >= 16) travel uncompressed.
  auto g = make_grads({{"a", {64, 32}}, {"b", {32}}, {"c", {4, 4}}, {"d", {16, 8, 2}}, {"e", {64, 32}}});
  auto c = make_compressor(psgd(), *local(), g.params);
  std::vector<Vec> in;
  for (size_t i = 0; i < g.params.size(); ++i) {
    in.push_back(as_f32(random_vec(g.params[i].grad.numel(), 100 + i)));
    set(g.params[i], in.back());
  }
  c->aggregate(g.params, 0);
  const int64_t want = 2 * (2 * (64 + 32) * 4) + 2 * (16 + 16) * 4 + (32 + 16) * 4;
  EXPECT_EQ(c->last_bytes().sent, want);
  EXPECT_EQ(c->last_bytes().uncompressed, (2 * 64 * 32 + 32 + 16 + 256) * 4);
  EXPECT_EQ(get(g.params[1]), in[1]);
  EXPECT_EQ(get(g.params[2]), in[2]);
  std::vector<std::string> names;
  for (const PlacedTensor& t : c->state()) {
    names.push_back(t.name);
    // error feedback is each rank's own; Q and the step are the same on every rank
    EXPECT_EQ(t.placement, t.name.rfind("error/", 0) == 0 ? Placement::per_rank : Placement::replicated) << t.name;
  }
  const std::vector<std::string> expected = {"q/a", "q/d", "q/e", "error/a", "error/d", "error/e", "step"};
  EXPECT_EQ(names, expected);
  EXPECT_EQ(state_of(*c, "q/d").shape(), (Shape{16, 2}));
  EXPECT_EQ(state_of(*c, "error/d").shape(), (Shape{16, 8, 2}));
  EXPECT_EQ(state_of(*c, "step").item(), 1);
  // The rank is clamped to min(n, m): [3, 40] at rank 4 is compressed at rank 3 when the rate allows.
  auto h = make_grads({{"t", {3, 40}}});
  Config cfg = psgd(4);
  cfg.min_compression_rate = 0;
  auto ct = make_compressor(cfg, *local(), h.params);
  set(h.params[0], random_vec(120, 5));
  ct->aggregate(h.params, 0);
  EXPECT_EQ(ct->last_bytes().sent, 3 * (3 + 40) * 4);
  EXPECT_EQ(state_of(*ct, "q/t").shape(), (Shape{40, 3}));
}

// In a world of one both error modes keep update + new error == grad + old error.
TEST(Compress, ErrorFeedbackInvariant) {
  for (const char* mode : {"full", "projection"})
    for (int rank : {1, 2, 4}) {
      SCOPED_TRACE(std::string(mode) + " rank " + std::to_string(rank));
      auto g = make_grads({{"w", {24, 40}}, {"v", {24, 40}}, {"x", {30, 20}}});
      Config cfg = psgd(rank);
      cfg.error_mode = parse_enum<compress::ErrorMode>(mode, "error_mode");
      auto c = make_compressor(cfg, *local(), g.params);
      for (int step = 0; step < 4; ++step) {
        std::vector<Vec> old_err, in;
        for (size_t i = 0; i < g.params.size(); ++i) {
          old_err.push_back(get(state_of(*c, "error/" + g.params[i].name)));
          in.push_back(as_f32(random_vec(g.params[i].grad.numel(), 1000 * step + i)));
          set(g.params[i], in.back());
        }
        c->aggregate(g.params, step);
        for (size_t i = 0; i < g.params.size(); ++i) {
          const Vec lhs = add(get(g.params[i]), get(state_of(*c, "error/" + g.params[i].name)));
          const Vec rhs = add(in[i], old_err[i]);
          EXPECT_LT(max_abs_diff(lhs, rhs), 1e-5 * (1 + norm(rhs))) << g.params[i].name << " step " << step;
          EXPECT_TRUE(all_finite(lhs));
        }
      }
    }
}

TEST(Compress, FullRankIsExact) {
  for (const char* orth : {"mgs", "qr"})
    for (auto [n, m, r] : {std::tuple<int64_t, int64_t, int>{3, 40, 4}, {40, 2, 2}, {5, 5, 5}, {6, 9, 8}}) {
      SCOPED_TRACE(std::string(orth) + " [" + std::to_string(n) + ", " + std::to_string(m) + "] r " + std::to_string(r));
      auto g = make_grads({{"w", {n, m}}});
      Config cfg = psgd(r);
      cfg.min_compression_rate = 0;
      cfg.orthogonalize = parse_enum<compress::Orthogonalize>(orth, "orthogonalize");
      auto c = make_compressor(cfg, *local(), g.params);
      for (int step = 0; step < 2; ++step) {
        const Vec in = as_f32(random_vec(n * m, 77 + step));
        set(g.params[0], in);
        c->aggregate(g.params, step);
        EXPECT_LT(max_abs_diff(get(g.params[0]), in), 1e-5);
        EXPECT_LT(norm(get(state_of(*c, "error/w"))), 1e-5);
      }
    }
}

// P^ recovered from the update and the aggregated Q (in a world of one Q = M^T P^).
TEST(Compress, POrthonormal) {
  for (auto [r, orth] : {std::pair<int, const char*>{1, "auto"}, {2, "mgs"}, {4, "qr"}, {4, "mgs"}, {3, "auto"}}) {
    SCOPED_TRACE(std::string(orth) + " rank " + std::to_string(r));
    const int64_t n = 50, m = 30;
    auto g = make_grads({{"w", {n, m}}});
    Config cfg = psgd(r);
    cfg.orthogonalize = parse_enum<compress::Orthogonalize>(orth, "orthogonalize");
    auto c = make_compressor(cfg, *local(), g.params);
    for (int step = 0; step < 3; ++step) {
      set(g.params[0], as_f32(random_vec(n * m, 300 + step)));
      c->aggregate(g.params, step);
      const Vec p = recover_p(get(g.params[0]), get(state_of(*c, "q/w")), n, m, r);
      const Vec ptp = matmul(p, p, r, n, r, true, false);
      for (int i = 0; i < r; ++i)
        for (int j = 0; j < r; ++j) EXPECT_NEAR(ptp[i * r + j], i == j ? 1.0 : 0.0, 1e-3) << i << "," << j;
    }
  }
}

TEST(Compress, LowRankGradientRecovered) {
  for (int r : {1, 2, 3}) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const int64_t n = 40, m = 30;
    Vec sigma(static_cast<size_t>(r));
    for (int i = 0; i < r; ++i) sigma[i] = 3.0 / (i + 1);
    const Vec grad = as_f32(low_rank(n, m, sigma));
    auto g = make_grads({{"w", {n, m}}});
    auto c = make_compressor(psgd(r), *local(), g.params);
    for (int step = 0; step < 4; ++step) {
      set(g.params[0], grad);
      c->aggregate(g.params, step);
    }
    EXPECT_LT(max_abs_diff(get(g.params[0]), grad), 1e-5);
    EXPECT_LT(norm(get(state_of(*c, "error/w"))), 1e-5 * norm(grad));
  }
}

// Without error feedback, warm-started power iteration converges to the best rank-r
// approximation of a fixed gradient (spectrum 10, 5, 1, 0.5 at r = 2: error sqrt(1.25)).
TEST(Compress, WarmStartConverges) {
  const int64_t n = 48, m = 36;
  const Vec grad = as_f32(low_rank(n, m, {10, 5, 1, 0.5}));
  const double best = std::sqrt(1.25);
  double err[2];
  for (bool warm : {true, false}) {
    auto g = make_grads({{"w", {n, m}}});
    Config cfg = psgd(2);
    cfg.error_feedback = false;
    cfg.warm_start = warm;
    auto c = make_compressor(cfg, *local(), g.params);
    for (int step = 0; step < 12; ++step) {
      set(g.params[0], grad);
      c->aggregate(g.params, step);
    }
    err[warm] = norm(sub(get(g.params[0]), grad));
    EXPECT_EQ(c->state().size(), 2u);  // q/w and step: no error buffer
  }
  EXPECT_LT(err[1], best * 1.001);
  EXPECT_GE(err[1], best * 0.999);
  EXPECT_GT(err[0], err[1]);
}

TEST(Compress, ZeroGradientNoNaNAndRecovery) {
  for (auto [r, orth] : {std::pair<int, const char*>{2, "mgs"}, {3, "qr"}, {1, "auto"}}) {
    SCOPED_TRACE(std::string(orth) + " rank " + std::to_string(r));
    const int64_t n = 20, m = 16;
    auto g = make_grads({{"w", {n, m}}, {"b", {n}}});
    Config cfg = psgd(r);
    cfg.orthogonalize = parse_enum<compress::Orthogonalize>(orth, "orthogonalize");
    auto c = make_compressor(cfg, *local(), g.params);
    for (int step = 0; step < 2; ++step) {
      ops::fill(g.flat, 0.0);
      c->aggregate(g.params, step);
      EXPECT_TRUE(all_finite(get(g.flat)));
      EXPECT_EQ(norm(get(g.flat)), 0.0);
      EXPECT_TRUE(all_finite(get(state_of(*c, "q/w"))));
      EXPECT_GT(norm(get(state_of(*c, "q/w"))), 0.0);  // redrawn: warm start cannot stall
    }
    const Vec grad = as_f32(low_rank(n, m, Vec(static_cast<size_t>(r), 2.0)));
    for (int step = 2; step < 5; ++step) {
      set(g.params[0], grad);
      c->aggregate(g.params, step);
    }
    EXPECT_LT(max_abs_diff(get(g.params[0]), grad), 1e-5);
  }
}

// A zero column of Q (here restored so) would stay zero under warm start: it is redrawn, and
// only it.
TEST(Compress, ZeroColumnOfQRedrawn) {
  const int64_t n = 20, m = 16;
  auto g = make_grads({{"w", {n, m}}});
  Config cfg = psgd(2);
  cfg.orthogonalize = compress::Orthogonalize::mgs;
  cfg.error_feedback = false;
  auto c = make_compressor(cfg, *local(), g.params);
  Tensor q = state_of(*c, "q/w");
  Vec qv = get(q);
  for (int64_t k = 0; k < m; ++k) qv[k * 2 + 1] = 0;
  q.copy_from(Tensor::from_doubles(qv, {m, 2}, DType::f32));
  const Vec grad = as_f32(low_rank(n, m, {3, 2}));
  set(g.params[0], grad);
  c->aggregate(g.params, 0);
  const Vec q1 = get(state_of(*c, "q/w"));
  double col0 = 0, col1 = 0;
  for (int64_t k = 0; k < m; ++k) col0 += std::abs(q1[k * 2]), col1 += std::abs(q1[k * 2 + 1]);
  EXPECT_GT(col0, 0.0);
  EXPECT_GT(col1, 0.0);
  // The update was rank 1 (one live column); with both columns back, the next is exact.
  EXPECT_GT(max_abs_diff(get(g.params[0]), grad), 1e-2);
  set(g.params[0], grad);
  c->aggregate(g.params, 1);
  EXPECT_LT(max_abs_diff(get(g.params[0]), grad), 1e-5);
}

TEST(Compress, StartIter) {
  auto g = make_grads({{"w", {32, 24}}, {"b", {24}}});
  Config cfg = psgd(2, 3);
  cfg.error_mode = compress::ErrorMode::full;
  auto c = make_compressor(cfg, *local(), g.params);
  for (int step = 0; step < 5; ++step) {
    const Vec in = as_f32(random_vec(g.flat.numel(), 40 + step));
    g.flat.copy_from(Tensor::from_doubles(in, {g.flat.numel()}, DType::f32));
    if (step == 1) {  // junk in the error buffer before compression begins: reset at step 3
      Tensor e = state_of(*c, "error/w");
      e.copy_from(Tensor::from_doubles(random_vec(e.numel(), 9), e.shape(), DType::f32));
    }
    const Vec w_in(in.begin(), in.begin() + 32 * 24);
    c->aggregate(g.params, step);
    if (step < 3) {
      EXPECT_EQ(get(g.flat), in);
      EXPECT_EQ(c->last_bytes().sent, c->last_bytes().uncompressed);
    } else {
      EXPECT_EQ(c->last_bytes().sent, 2 * (32 + 24) * 4 + 24 * 4);
      if (step == 3) {  // old error was zero: update + new error == grad
        const Vec lhs = add(get(g.params[0]), get(state_of(*c, "error/w")));
        EXPECT_LT(max_abs_diff(lhs, w_in), 1e-5);
      }
    }
  }
}

// Buckets: ranges of parameters from the last one backwards, each closed once it reaches the
// bucket size, covering every parameter once.
TEST(Compress, Buckets) {
  auto g = make_grads({{"a", {8, 8}}, {"b", {8}}, {"c", {16, 4}}, {"d", {2}}, {"e", {4, 4}}});
  Config cfg = psgd();
  using R = std::vector<std::pair<size_t, size_t>>;
  auto ranges = [&](size_t bucket_bytes) {
    R out;
    const auto c = make_compressor(cfg, *local(), g.params, bucket_bytes);
    for (auto b : c->buckets()) out.emplace_back(b.first, b.last);
    return out;
  };
  EXPECT_EQ(ranges(SIZE_MAX), (R{{0, 5}}));
  EXPECT_EQ(ranges(1), (R{{4, 5}, {3, 4}, {2, 3}, {1, 2}, {0, 1}}));
  // e + d = 72 bytes < 300, + c = 328: closed; b + a = 288, the rest.
  EXPECT_EQ(ranges(300), (R{{2, 5}, {0, 2}}));
  EXPECT_THROW(make_compressor(cfg, *local(), g.params, 0), UsageError);
  // Buckets start in order, between begin() and finish().
  auto c = make_compressor(cfg, *local(), g.params, 1);
  EXPECT_THROW(c->bucket_ready(0), Error);
  c->begin(g.params, 0);
  EXPECT_THROW(c->bucket_ready(1), Error);
  c->bucket_ready(0);
  c->finish();
  EXPECT_THROW(c->finish(), Error);
}

// Every kind gives the same grads and state bit for bit however the grads are bucketed and
// whether the buckets are started one by one or by finish(), on plain steps (before
// start_iter) and compressed ones, with contiguous grads or not.
TEST(Compress, BucketingDoesNotChangeTheResult) {
  const std::vector<std::pair<std::string, Shape>> shapes = {
      {"wq", {32, 24}}, {"norm", {24}}, {"wk", {32, 24}}, {"w1", {40, 24}}, {"tiny", {3, 3}}, {"w2", {24, 40}}};
  std::vector<std::pair<std::string, Config>> cfgs;
  for (const char* kind : {"none", "powersgd", "topk", "randomk", "signum"}) {
    Config c = psgd(2, 2);
    c.kind = parse_enum<compress::Kind>(kind, "kind");
    cfgs.emplace_back(kind, c);
  }
  for (const char* mode : {"full", "projection"})
    for (DType wire : {DType::f32, DType::bf16}) {
      Config c = psgd(3, 1);
      c.error_mode = parse_enum<compress::ErrorMode>(mode, "error_mode");
      c.comm_dtype = wire;
      cfgs.emplace_back(std::string("powersgd ") + mode + " " + std::string(dtype_name(wire)), c);
    }
  Config cold = psgd(2, 0);
  cold.warm_start = false;
  cfgs.emplace_back("powersgd cold", cold);
  for (const auto& [what, cfg] : cfgs)
    for (bool contiguous : {true, false}) {
      SCOPED_TRACE(what + (contiguous ? " contiguous" : " separate"));
      std::vector<Vec> results;
      for (size_t bucket_bytes : {SIZE_MAX, size_t{1}, size_t{4000}, size_t{1}})  // the last: started by finish()
      {
        const bool incremental = results.size() != 3;
        auto g = make_grads(shapes, Device::cpu(), contiguous);
        auto c = make_compressor(cfg, *local(), g.params, bucket_bytes);
        Vec out;
        for (int step = 0; step < 4; ++step) {
          for (size_t i = 0; i < g.params.size(); ++i) set(g.params[i], as_f32(random_vec(g.params[i].grad.numel(), 50 * step + i)));
          c->begin(g.params, step);
          if (incremental)
            for (size_t k = 0; k < c->buckets().size(); ++k) {
              c->bucket_ready(k);
              c->progress();
            }
          c->finish();
          for (auto& p : g.params) {
            const Vec v = get(p);
            out.insert(out.end(), v.begin(), v.end());
          }
        }
        for (const PlacedTensor& t : c->state()) {
          const Vec v = t.value.to_doubles();
          out.insert(out.end(), v.begin(), v.end());
        }
        results.push_back(out);
      }
      for (size_t r = 1; r < results.size(); ++r) EXPECT_EQ(results[r], results[0]) << "run " << r;
    }
}

// bf16 on the wire: P and Q rounded to 8 bits of mantissa.
TEST(Compress, Bf16Wire) {
  const int64_t n = 64, m = 48;
  Vec out[2];
  int64_t bytes[2];
  for (int b = 0; b < 2; ++b) {
    auto g = make_grads({{"w", {n, m}}, {"b", {m}}});
    Config cfg = psgd(4);
    cfg.comm_dtype = b ? DType::bf16 : DType::f32;
    auto c = make_compressor(cfg, *local(), g.params);
    g.flat.copy_from(Tensor::from_doubles(random_vec(g.flat.numel(), 5), {g.flat.numel()}, DType::f32));
    c->aggregate(g.params, 0);
    out[b] = get(g.flat);
    bytes[b] = c->last_bytes().sent;
  }
  EXPECT_EQ(bytes[0], 4 * (n + m) * 4 + m * 4);
  EXPECT_EQ(bytes[1], 4 * (n + m) * 2 + m * 4);
  const Vec w0(out[0].begin(), out[0].begin() + n * m), w1(out[1].begin(), out[1].begin() + n * m);
  EXPECT_GT(max_abs_diff(w0, w1), 0.0);
  EXPECT_LT(norm(sub(w0, w1)), 2e-2 * norm(w0));  // bf16's unit roundoff is 2^-8 = 3.9e-3
  EXPECT_EQ(Vec(out[0].begin() + n * m, out[0].end()), Vec(out[1].begin() + n * m, out[1].end()));  // f32, exact
}

// Restoring state() into a fresh compressor continues bit-identically.
TEST(Compress, StateRoundTrip) {
  std::vector<Config> cfgs = one_of_each_kind();
  Config c = psgd(3, 1);
  c.error_mode = compress::ErrorMode::full;
  c.comm_dtype = DType::bf16;
  cfgs.push_back(c);
  c.warm_start = false;
  cfgs.push_back(c);
  for (const Config& cfg : cfgs) {
    SCOPED_TRACE(nlohmann::json(cfg).dump());
    const std::vector<std::pair<std::string, Shape>> shapes = {{"w", {24, 20}}, {"b", {20}}, {"v", {24, 20}}, {"u", {12, 30}}};
    auto ga = make_grads(shapes), gb = make_grads(shapes);
    auto a = make_compressor(cfg, *local(), ga.params);
    auto b = make_compressor(cfg, *local(), gb.params);
    auto feed = [&](Grads& g, int step) {
      g.flat.copy_from(Tensor::from_doubles(random_vec(g.flat.numel(), 500 + step), {g.flat.numel()}, DType::f32));
    };
    for (int step = 0; step < 4; ++step) {
      feed(ga, step);
      a->aggregate(ga.params, step);
    }
    auto sa = a->state(), sb = b->state();
    ASSERT_EQ(sa.size(), sb.size());
    for (size_t i = 0; i < sa.size(); ++i) {
      EXPECT_EQ(sa[i].name, sb[i].name);
      sb[i].value.copy_from(sa[i].value);
    }
    for (int step = 4; step < 7; ++step) {
      feed(ga, step);
      feed(gb, step);
      a->aggregate(ga.params, step);
      b->aggregate(gb.params, step);
      EXPECT_EQ(get(ga.flat), get(gb.flat)) << "step " << step;
    }
    sa = a->state();
    sb = b->state();
    for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(get(sa[i].value), get(sb[i].value)) << sa[i].name;
  }
}

TEST(Compress, None) {
  for (bool contiguous : {true, false}) {
    auto g = make_grads({{"w", {8, 6}}, {"b", {6}}}, Device::cpu(), contiguous);
    Config cfg;
    cfg.kind = compress::Kind::none;
    auto c = make_compressor(cfg, *local(), g.params);
    const Vec w = random_vec(48, 1), b = random_vec(6, 2);
    set(g.params[0], w);
    set(g.params[1], b);
    c->aggregate(g.params, 0);
    EXPECT_EQ(get(g.params[0]), as_f32(w));
    EXPECT_EQ(get(g.params[1]), as_f32(b));
    EXPECT_EQ(c->last_bytes().sent, 54 * 4);
    EXPECT_EQ(c->last_bytes().uncompressed, 54 * 4);
    EXPECT_EQ(c->state().size(), 1u);
  }
}

TEST(Compress, TopK) {
  for (bool ef : {true, false}) {
    auto g = make_grads({{"w", {10, 20}}, {"b", {100}}});
    Config cfg;
    cfg.kind = compress::Kind::topk;
    cfg.ratio = 0.05;  // k = 10 and 5
    cfg.start_iter = 0;
    cfg.error_feedback = ef;
    auto c = make_compressor(cfg, *local(), g.params);
    Vec err(300, 0.0);
    for (int step = 0; step < 3; ++step) {
      const Vec in = as_f32(random_vec(300, 60 + step));
      g.flat.copy_from(Tensor::from_doubles(in, {300}, DType::f32));
      c->aggregate(g.params, step);
      EXPECT_EQ(c->last_bytes().sent, 15 * (4 + 4));
      const Vec out = get(g.flat);
      const Vec mv = as_f32(add(in, err));
      for (auto [off, n, k] : {std::tuple<int, int, int>{0, 200, 10}, {200, 100, 5}}) {
        std::vector<int> order(n);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(),
                         [&](int x, int y) { return std::abs(mv[off + x]) > std::abs(mv[off + y]); });
        Vec want(n, 0.0);
        for (int j = 0; j < k; ++j) want[order[j]] = mv[off + order[j]];
        EXPECT_EQ(Vec(out.begin() + off, out.begin() + off + n), want) << "step " << step;
      }
      if (ef) {
        const Vec e = get(state_of(*c, "error/w"));
        const Vec eb = get(state_of(*c, "error/b"));
        Vec new_err(e);
        new_err.insert(new_err.end(), eb.begin(), eb.end());
        EXPECT_EQ(add(new_err, out), mv);  // exact: the sent coordinates moved out of the error
        err = new_err;
      }
    }
  }
}

TEST(Compress, RandomK) {
  auto run = [](uint64_t seed, bool ef, std::vector<Vec>* outs, std::vector<Vec>* errs) {
    auto g = make_grads({{"w", {10, 20}}, {"b", {100}}});
    Config cfg;
    cfg.kind = compress::Kind::randomk;
    cfg.ratio = 0.05;
    cfg.start_iter = 0;
    cfg.seed = seed;
    cfg.error_feedback = ef;
    auto c = make_compressor(cfg, *local(), g.params);
    for (int step = 0; step < 3; ++step) {
      g.flat.copy_from(Tensor::from_doubles(as_f32(random_vec(300, 60 + step)), {300}, DType::f32));
      c->aggregate(g.params, step);
      EXPECT_EQ(c->last_bytes().sent, 15 * 4);
      outs->push_back(get(g.flat));
      if (ef) {
        Vec e = get(state_of(*c, "error/w"));
        const Vec eb = get(state_of(*c, "error/b"));
        e.insert(e.end(), eb.begin(), eb.end());
        errs->push_back(e);
      }
    }
  };
  std::vector<Vec> o1, e1, o2, e2, o3, e3, o4, e4;
  run(1, true, &o1, &e1);
  run(1, true, &o2, &e2);
  run(2, true, &o3, &e3);
  run(1, false, &o4, &e4);
  EXPECT_EQ(o1, o2);  // the same seed picks the same coordinates
  EXPECT_NE(o1, o3);
  Vec err(300, 0.0);
  for (int step = 0; step < 3; ++step) {
    const Vec mv = as_f32(add(as_f32(random_vec(300, 60 + step)), err));
    int nz_w = 0, nz_b = 0;
    for (int i = 0; i < 300; ++i)
      if (o1[step][i] != 0) {
        (i < 200 ? nz_w : nz_b)++;
        EXPECT_EQ(o1[step][i], mv[i]);
        EXPECT_EQ(e1[step][i], 0.0);
      } else {
        EXPECT_EQ(e1[step][i], mv[i]);
      }
    EXPECT_EQ(nz_w, 10);
    EXPECT_EQ(nz_b, 5);
    EXPECT_NE(o1[step], Vec(300, 0.0));
    // Without error feedback the same coordinates of the plain gradient.
    for (int i = 0; i < 300; ++i)
      EXPECT_EQ(o4[step][i] != 0, o1[step][i] != 0);
    err = e1[step];
  }
  // Different steps pick different coordinates.
  int same = 0;
  for (int i = 0; i < 300; ++i) same += (o1[0][i] != 0) && (o1[1][i] != 0);
  EXPECT_LT(same, 15);
}

TEST(Compress, Signum) {
  for (bool ef : {true, false}) {
    auto g = make_grads({{"w", {10, 20}}, {"b", {100}}});
    Config cfg;
    cfg.kind = compress::Kind::signum;
    cfg.start_iter = 0;
    cfg.error_feedback = ef;
    auto c = make_compressor(cfg, *local(), g.params);
    Vec err(300, 0.0);
    for (int step = 0; step < 3; ++step) {
      Vec in = as_f32(random_vec(300, 80 + step));
      in[3] = 0;  // sign 0: no vote
      g.flat.copy_from(Tensor::from_doubles(in, {300}, DType::f32));
      c->aggregate(g.params, step);
      EXPECT_EQ(c->last_bytes().sent, 300 * 1 + 2 * 4);
      const Vec out = get(g.flat);
      const Vec mv = as_f32(add(in, err));
      Vec new_err(300);
      for (auto [off, n] : {std::pair<int, int>{0, 200}, {200, 100}}) {
        double l1 = 0;
        for (int i = 0; i < n; ++i) l1 += std::abs(mv[off + i]);
        for (int i = 0; i < n; ++i) {
          const double s = mv[off + i] > 0 ? 1 : mv[off + i] < 0 ? -1 : 0;
          EXPECT_NEAR(out[off + i], s * l1 / n, 1e-6);
          new_err[off + i] = mv[off + i] - s * l1 / n;
        }
      }
      if (ef) {
        Vec e = get(state_of(*c, "error/w"));
        const Vec eb = get(state_of(*c, "error/b"));
        e.insert(e.end(), eb.begin(), eb.end());
        EXPECT_LT(max_abs_diff(e, new_err), 1e-6);
        err = e;
      } else {
        EXPECT_EQ(c->state().size(), 1u);
      }
    }
  }
}

TEST(Compress, BadCalls) {
  auto g = make_grads({{"w", {8, 6}}, {"b", {6}}});
  auto c = make_compressor(psgd(), *local(), g.params);
  auto h = make_grads({{"w", {8, 6}}});
  EXPECT_THROW(c->aggregate(h.params, 0), UsageError);
  auto k = make_grads({{"w", {6, 8}}, {"b", {6}}});
  EXPECT_THROW(c->aggregate(k.params, 0), UsageError);
  EXPECT_THROW(c->aggregate(g.params, -1), UsageError);
  std::vector<nn::Param> none;
  auto e = make_compressor(psgd(), *local(), none);
  e->aggregate(none, 0);
  EXPECT_EQ(e->last_bytes().sent, 0);
}

}  // namespace
}  // namespace dtk::testing
