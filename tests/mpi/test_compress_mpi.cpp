// compress under mpiexec -n 1, 2 and 4 (mpi backend, host tensors): PowerSGD's linearity over
// ranks (W ranks equal one rank on the summed contributions, with the same Q), the error
// invariants of both modes, identical results on every rank, exact bytes, and the baselines'
// multi-rank properties (topk's gathered aggregate, randomk's shared coordinates, signum's
// majority vote), and PowerSGD over sharded gradients (compress::Topology) equal to the whole
// matrices'; the quantized mean of DiLoCo's pseudo-gradients (compress/quantize.h). Every rank runs the same collectives whatever it finds (EXPECT, never ASSERT).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "../common/compress_util.h"
#include "dtk/compress/quantize.h"
#include "dtk/ops/ops.h"

namespace dtk::testing {
namespace {

using compress::Config;
using compress::make_compressor;
using comm::Backend;
using comm::Runtime;

comm::Communicator& world() {
  static auto c = Runtime::get().world(Backend::mpi);
  return *c;
}
// A world of one for the reference runs.
comm::Communicator& self() {
  static auto c = world().split(world().rank(), 0);
  return *c;
}
int W() { return world().size(); }
int R() { return world().rank(); }

// Sum over ranks of a host vector (f64 all-reduce).
Vec sum_over_ranks(Vec v) {
  Tensor t = Tensor::from_doubles(v, {static_cast<int64_t>(v.size())}, DType::f64);
  comm::Buffer b{t.data(), v.size(), DType::f64, Device::cpu()};
  world().all_reduce(b, b, comm::ReduceOp::sum, comm::Mode::sync).wait();
  return t.to_doubles();
}
// Is v the same (bitwise) on every rank?
bool same_on_all_ranks(const Vec& v) {
  Vec both(v);
  for (double x : v) both.push_back(-x);
  Tensor t = Tensor::from_doubles(both, {static_cast<int64_t>(both.size())}, DType::f64);
  comm::Buffer b{t.data(), both.size(), DType::f64, Device::cpu()};
  world().all_reduce(b, b, comm::ReduceOp::max, comm::Mode::sync).wait();
  const Vec r = t.to_doubles();
  for (size_t i = 0; i < v.size(); ++i)
    if (r[i] != -r[v.size() + i]) return false;
  return true;
}

const std::vector<std::pair<std::string, Shape>> kShapes = {
    {"wq", {32, 24}}, {"norm", {24}}, {"wk", {32, 24}}, {"w1", {40, 24}}, {"tiny", {3, 3}}};

// Rank s's raw gradient at a step: a shared low-rank part plus rank-specific noise. Its
// contribution (what the grads hold) is raw / W, so the contributions sum to the mean.
Vec raw(int s, int step, int64_t total, double noise = 0.3) {
  Vec v = random_vec(total, 10000 + 17 * step);  // shared
  const Vec e = random_vec(total, 20000 + 131 * step + 7 * s);
  for (size_t i = 0; i < v.size(); ++i) v[i] = v[i] * (1 + 0.1 * (i % 7)) + noise * e[i];
  return v;
}
Vec contribution(int s, int step, int64_t total, double noise = 0.3) {
  return as_f32(scaled(raw(s, step, total, noise), 1.0 / W()));
}
Vec summed(int step, int64_t total, double noise = 0.3) {
  Vec sum(static_cast<size_t>(total), 0.0);
  for (int s = 0; s < W(); ++s) sum = add(sum, contribution(s, step, total, noise));
  return sum;
}
void load(Grads& g, const Vec& v) { g.flat.copy_from(Tensor::from_doubles(v, {g.flat.numel()}, DType::f32)); }

Config psgd(int rank, const char* mode, DType wire = DType::f32) {
  Config c;
  c.kind = compress::Kind::powersgd;
  c.rank = rank;
  c.start_iter = 0;
  c.error_mode = parse_enum<compress::ErrorMode>(mode, "error_mode");
  c.comm_dtype = wire;
  c.seed = 11;
  return c;
}

Vec errors(compress::Compressor& c) {
  Vec out;
  for (const PlacedTensor& t : c.state())
    if (t.placement == Placement::per_rank) {
      const Vec v = t.value.to_doubles();
      out.insert(out.end(), v.begin(), v.end());
    }
  return out;
}

// W ranks aggregate what one rank aggregates from the summed contributions (with the same seed,
// hence the same Q), step after step with error feedback; the mean of the ranks' errors is the
// reference's error; every rank ends with the same bits.
TEST(CompressMpi, PowerSgdLinearity) {
  for (const char* mode : {"projection", "full"})
    for (int rank : {2, 3}) {
      SCOPED_TRACE(std::string(mode) + " rank " + std::to_string(rank));
      auto g = make_grads(kShapes), ref = make_grads(kShapes);
      const int64_t total = g.flat.numel();
      auto c = make_compressor(psgd(rank, mode), world(), g.params);
      auto cr = make_compressor(psgd(rank, mode), self(), ref.params);
      for (int step = 0; step < 5; ++step) {
        load(g, contribution(R(), step, total));
        load(ref, summed(step, total));
        c->aggregate(g.params, step);
        cr->aggregate(ref.params, step);
        const Vec out = get(g.flat), want = get(ref.flat);
        EXPECT_LT(norm(sub(out, want)), 1e-4 * norm(want)) << "step " << step;
        EXPECT_TRUE(same_on_all_ranks(out)) << "step " << step;
        const Vec mean_err = scaled(sum_over_ranks(errors(*c)), 1.0 / W());
        const Vec ref_err = errors(*cr);
        EXPECT_LT(norm(sub(mean_err, ref_err)), 1e-4 * (1 + norm(ref_err))) << "step " << step;
        int64_t bytes = (2 * rank * (32 + 24) + rank * (40 + 24)) * 4 + (24 + 9) * 4;
        EXPECT_EQ(c->last_bytes().sent, bytes);
      }
      EXPECT_TRUE(same_on_all_ranks(get(state_of(*c, "q/wq"))));
    }
}

// Bucket by bucket (each parameter its own bucket, started as backward would start them, with
// progress() between), PowerSGD gives what one bucket gives, on every rank alike: the
// collectives of different buckets interleave (P of bucket k beside Q of k - 1) in the same
// order on every rank. The same for plain steps (before start_iter) and bf16 on the wire (up to
// its rounding).
TEST(CompressMpi, BucketByBucketMatchesOneBucket) {
  for (DType wire : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(std::string(dtype_name(wire)));
    Config cfg = psgd(2, "projection", wire);
    cfg.start_iter = 1;
    auto g = make_grads(kShapes), ref = make_grads(kShapes);
    const int64_t total = g.flat.numel();
    auto c = make_compressor(cfg, world(), g.params, 1);
    auto cr = make_compressor(cfg, world(), ref.params);
    EXPECT_EQ(c->buckets().size(), kShapes.size());
    for (int step = 0; step < 4; ++step) {
      load(g, contribution(R(), step, total));
      load(ref, contribution(R(), step, total));
      c->begin(g.params, step);
      for (size_t k = 0; k < c->buckets().size(); ++k) {
        c->bucket_ready(k);
        c->progress();
      }
      c->finish();
      cr->aggregate(ref.params, step);
      // Buffers of other sizes may sum the ranks in another order (MPI picks by size): f32 rounding,
      // and bf16 sums round every partial sum to 8 bits (2^-8 = 3.9e-3).
      const double tol = wire == DType::bf16 ? 2e-2 : 1e-6;
      const Vec out = get(g.flat), want = get(ref.flat);
      EXPECT_LT(norm(sub(out, want)), tol * (1 + norm(want))) << "step " << step;
      EXPECT_TRUE(same_on_all_ranks(out)) << "step " << step;
      EXPECT_EQ(c->last_bytes().sent, cr->last_bytes().sent);
      const Vec e = errors(*c), er = errors(*cr);
      EXPECT_LT(norm(sub(e, er)), tol * (1 + norm(er))) << "step " << step;
    }
  }
}

// Full: update + new error_r == W grad_r + old error_r on every rank. Projection: the same holds
// for the mean over ranks.
TEST(CompressMpi, ErrorInvariants) {
  for (const char* mode : {"full", "projection"}) {
    SCOPED_TRACE(mode);
    auto g = make_grads(kShapes);
    const int64_t total = g.flat.numel();
    auto c = make_compressor(psgd(2, mode), world(), g.params);
    const std::vector<size_t> compressed = {0, 2, 3};
    for (int step = 0; step < 4; ++step) {
      std::vector<Vec> old_err, m;
      const Vec in = contribution(R(), step, total);
      load(g, in);
      for (size_t i : compressed) {
        old_err.push_back(get(state_of(*c, "error/" + g.params[i].name)));
        m.push_back(add(scaled(get(g.params[i]), W()), old_err.back()));
      }
      c->aggregate(g.params, step);
      for (size_t j = 0; j < compressed.size(); ++j) {
        const nn::Param& p = g.params[compressed[j]];
        const Vec upd = get(p), err = get(state_of(*c, "error/" + p.name));
        if (std::string(mode) == "full") {
          EXPECT_LT(max_abs_diff(add(upd, err), m[j]), 1e-5 * (1 + norm(m[j]))) << p.name;
        } else {
          const Vec lhs = add(upd, scaled(sum_over_ranks(err), 1.0 / W()));
          const Vec rhs = scaled(sum_over_ranks(m[j]), 1.0 / W());
          EXPECT_LT(max_abs_diff(lhs, rhs), 1e-5 * (1 + norm(rhs))) << p.name;
        }
      }
    }
  }
}

// Both modes give the same updates; the projection keeps the ranks' deviations from the mean
// error bounded while full mode's accumulate (with one rank there is no deviation).
TEST(CompressMpi, ModesSameUpdatesProjectionBounded) {
  const std::vector<std::pair<std::string, Shape>> shapes = {{"w", {24, 20}}};
  auto gf = make_grads(shapes), gp = make_grads(shapes);
  auto cf = make_compressor(psgd(2, "full"), world(), gf.params);
  auto cp = make_compressor(psgd(2, "projection"), world(), gp.params);
  for (int step = 0; step < 60; ++step) {
    const Vec in = contribution(R(), step, 480, 2.0);
    load(gf, in);
    load(gp, in);
    cf->aggregate(gf.params, step);
    cp->aggregate(gp.params, step);
    if (step < 8) {
      EXPECT_LT(norm(sub(get(gf.flat), get(gp.flat))), 1e-4 * norm(get(gf.flat))) << "step " << step;
    }
  }
  auto deviation = [](compress::Compressor& c) {
    const Vec e = errors(c);
    const Vec mean = scaled(sum_over_ranks(e), 1.0 / W());
    const Vec d = sub(e, mean);
    return std::sqrt(sum_over_ranks({norm(d) * norm(d)})[0]);
  };
  const double df = deviation(*cf), dp = deviation(*cp);
  if (W() == 1) {
    EXPECT_EQ(df, 0.0);
    EXPECT_EQ(dp, 0.0);
  } else {
    EXPECT_LT(dp, 0.7 * df) << "projection " << dp << ", full " << df;
  }
}

TEST(CompressMpi, FullRankExactAndUncompressedExact) {
  const std::vector<std::pair<std::string, Shape>> shapes = {{"a", {3, 30}}, {"b", {30, 2}}, {"c", {17}}};
  auto g = make_grads(shapes);
  Config cfg = psgd(4, "projection");
  cfg.min_compression_rate = 0;
  auto c = make_compressor(cfg, world(), g.params);
  for (int step = 0; step < 3; ++step) {
    load(g, contribution(R(), step, g.flat.numel()));
    c->aggregate(g.params, step);
    const Vec want = summed(step, g.flat.numel());
    const Vec out = get(g.flat);
    EXPECT_LT(max_abs_diff(out, want), 1e-5 * (1 + norm(want)));
    // 1-D: the exact sum of the contributions, in f32.
    EXPECT_LT(max_abs_diff(Vec(out.end() - 17, out.end()), Vec(want.end() - 17, want.end())), 1e-6);
  }
  EXPECT_EQ(c->last_bytes().sent, (3 * (3 + 30) + 2 * (30 + 2)) * 4 + 17 * 4);
}

TEST(CompressMpi, Bf16Wire) {
  auto g = make_grads(kShapes), h = make_grads(kShapes);
  auto c = make_compressor(psgd(3, "projection", DType::bf16), world(), g.params);
  auto d = make_compressor(psgd(3, "projection"), world(), h.params);
  const Vec in = contribution(R(), 0, g.flat.numel());
  load(g, in);
  load(h, in);
  c->aggregate(g.params, 0);
  d->aggregate(h.params, 0);
  const Vec x = get(g.flat), y = get(h.flat);
  EXPECT_LT(norm(sub(x, y)), 3e-2 * norm(y));
  EXPECT_TRUE(same_on_all_ranks(x));
  EXPECT_EQ(c->last_bytes().sent, (3 * (2 * (32 + 24) + 40 + 24)) * 2 + (24 + 9) * 4);
}

// A Q that differs between ranks is found at the first call, on every rank alike.
TEST(CompressMpi, DisagreementFails) {
  auto g = make_grads(kShapes);
  Config cfg = psgd(2, "projection");
  cfg.seed = 5;
  auto c = make_compressor(cfg, world(), g.params);
  if (R() == W() - 1) {
    Tensor q = state_of(*c, "q/wq");
    ops::scale(q, W() > 1 ? 2.0 : 1.0, q);
  }
  load(g, contribution(R(), 0, g.flat.numel()));
  if (W() > 1)
    EXPECT_THROW(c->aggregate(g.params, 0), UsageError);
  else
    EXPECT_NO_THROW(c->aggregate(g.params, 0));
  // Different seeds for randomk: the same.
  Config rk;
  rk.kind = compress::Kind::randomk;
  rk.seed = static_cast<uint64_t>(R() == 0 ? 1 : 2);
  auto r = make_compressor(rk, world(), g.params);
  if (W() > 1)
    EXPECT_THROW(r->aggregate(g.params, 0), UsageError);
  else
    EXPECT_NO_THROW(r->aggregate(g.params, 0));
}

// One step from zero error: the aggregate is the sum over ranks of each rank's top-k of
// M_s = W * contribution_s, scattered, / W.
TEST(CompressMpi, TopK) {
  const std::vector<std::pair<std::string, Shape>> shapes = {{"w", {10, 20}}, {"b", {50}}};
  auto g = make_grads(shapes);
  Config cfg;
  cfg.kind = compress::Kind::topk;
  cfg.ratio = 0.1;  // k = 20 and 5
  cfg.start_iter = 0;
  auto c = make_compressor(cfg, world(), g.params);
  load(g, contribution(R(), 0, 250));
  const Vec mine = scaled(get(g.flat), W());
  c->aggregate(g.params, 0);
  Vec want(250, 0.0);
  for (int s = 0; s < W(); ++s) {
    const Vec ms = as_f32(scaled(contribution(s, 0, 250), W()));
    for (auto [off, n, k] : {std::tuple<int, int, int>{0, 200, 20}, {200, 50, 5}}) {
      std::vector<int> order(n);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return std::abs(ms[off + x]) > std::abs(ms[off + y]); });
      for (int j = 0; j < k; ++j) want[off + order[j]] += ms[off + order[j]] / W();
    }
  }
  EXPECT_LT(max_abs_diff(get(g.flat), want), 1e-6);
  EXPECT_TRUE(same_on_all_ranks(get(g.flat)));
  EXPECT_EQ(c->last_bytes().sent, 25 * 8);
  // Error feedback: this rank's M with its own top-k removed.
  Vec err = get(state_of(*c, "error/w"));
  const Vec eb = get(state_of(*c, "error/b"));
  err.insert(err.end(), eb.begin(), eb.end());
  int zeroed = 0;
  for (size_t i = 0; i < 250; ++i) {
    if (err[i] == 0)
      ++zeroed;
    else
      EXPECT_EQ(err[i], mine[i]);
  }
  EXPECT_EQ(zeroed, 25);
}

// Every rank picks the same coordinates; the aggregate there is the exact mean.
TEST(CompressMpi, RandomKSharedCoordinates) {
  const std::vector<std::pair<std::string, Shape>> shapes = {{"w", {10, 20}}, {"b", {50}}};
  auto g = make_grads(shapes);
  Config cfg;
  cfg.kind = compress::Kind::randomk;
  cfg.ratio = 0.1;
  cfg.start_iter = 0;
  cfg.seed = 3;
  auto c = make_compressor(cfg, world(), g.params);
  for (int step = 0; step < 3; ++step) {
    const Vec old_err = errors(*c);
    load(g, contribution(R(), step, 250));
    const Vec m = add(scaled(get(g.flat), W()), old_err);
    c->aggregate(g.params, step);
    const Vec err = errors(*c), out = get(g.flat);
    Vec mask(250, 0.0);
    for (size_t i = 0; i < 250; ++i) mask[i] = err[i] == 0 && m[i] != 0;
    EXPECT_TRUE(same_on_all_ranks(mask));
    EXPECT_EQ(std::accumulate(mask.begin(), mask.end(), 0.0), 25.0);
    const Vec mean_m = scaled(sum_over_ranks(m), 1.0 / W());
    for (size_t i = 0; i < 250; ++i) {
      if (mask[i])
        EXPECT_NEAR(out[i], mean_m[i], 1e-5);
      else
        EXPECT_EQ(out[i], 0.0);
    }
    EXPECT_EQ(c->last_bytes().sent, 25 * 4);
  }
}

// Element j is positive on p_j = j mod (W + 1) ranks and negative on the others: the vote
// sum_r sign = 2 p_j - W decides the sign, 0 on a tie.
TEST(CompressMpi, SignumMajorityVote) {
  auto g = make_grads({{"w", {6, 10}}});
  Config cfg;
  cfg.kind = compress::Kind::signum;
  cfg.start_iter = 0;
  cfg.error_feedback = false;
  auto c = make_compressor(cfg, world(), g.params);
  auto value = [](int s, int j) {
    const double mag = 0.5 + 0.5 * std::abs(hashed(static_cast<uint64_t>(s), static_cast<uint64_t>(j)));
    return (s < j % (W() + 1) ? mag : -mag) / W();
  };
  Vec in(60);
  for (int j = 0; j < 60; ++j) in[j] = value(R(), j);
  load(g, in);
  c->aggregate(g.params, 0);
  double l1 = 0;
  for (int s = 0; s < W(); ++s)
    for (int j = 0; j < 60; ++j) l1 += std::abs(static_cast<double>(static_cast<float>(value(s, j))) * W());
  const double scale = l1 / W() / 60;
  const Vec out = get(g.flat);
  for (int j = 0; j < 60; ++j) {
    const int vote = 2 * (j % (W() + 1)) - W();
    EXPECT_NEAR(out[j], (vote > 0 ? scale : vote < 0 ? -scale : 0.0), 1e-5) << j;
  }
  EXPECT_EQ(c->last_bytes().sent, 60 + 4);
  EXPECT_TRUE(same_on_all_ranks(out));
}

// Restoring every rank's state (its own errors, the shared Q) continues bit-identically.
TEST(CompressMpi, StateRoundTrip) {
  for (const char* kind : {"powersgd", "topk", "randomk", "signum"}) {
    SCOPED_TRACE(kind);
    Config cfg = psgd(2, "projection");
    cfg.kind = parse_enum<compress::Kind>(kind, "kind");
    cfg.ratio = 0.1;
    auto ga = make_grads(kShapes), gb = make_grads(kShapes);
    const int64_t total = ga.flat.numel();
    auto a = make_compressor(cfg, world(), ga.params);
    auto b = make_compressor(cfg, world(), gb.params);
    for (int step = 0; step < 3; ++step) {
      load(ga, contribution(R(), step, total));
      a->aggregate(ga.params, step);
    }
    auto sa = a->state(), sb = b->state();
    for (size_t i = 0; i < sa.size(); ++i) sb[i].value.copy_from(sa[i].value);
    for (int step = 3; step < 5; ++step) {
      load(ga, contribution(R(), step, total));
      load(gb, contribution(R(), step, total));
      a->aggregate(ga.params, step);
      b->aggregate(gb.params, step);
      EXPECT_EQ(get(ga.flat), get(gb.flat));
    }
    EXPECT_EQ(errors(*a), errors(*b));
  }
}

// Sharded gradients (compress::Topology, fsdp-train's HSDP): the world as R replica groups of S
// shard ranks (S = 2 from 2 ranks on; "tiny" [3, 3] splits 2 + 1 rows, padded), each rank
// holding its rows of its replica's gradient. PowerSGD over the replicas, with the shard group
// as its shard communicator, gives each rank the rows of what the unsharded PowerSGD over the
// replicas gives for the whole matrices (and its error buffers' rows), in both error modes and
// at a rank that takes QR: the result does not depend on the shard count.
TEST(CompressMpi, ShardedPowerSgdIsWholeMatrixPowerSgd) {
  const int S = W() >= 2 ? 2 : 1, Rg = W() / S, q = R() / S, s = R() % S;
  auto shapes = kShapes;
  shapes.push_back({"odd", {33, 20}});  // compressed, split 17 + 16 rows (the second shard padded)
  auto shard = world().split(q, R()), replica = world().split(s, R());
  std::vector<std::pair<std::string, Shape>> rows_specs;
  std::vector<Rows> rows;
  std::vector<int64_t> whole_off;  // per parameter: its offset in the whole flat buffer
  int64_t total = 0;
  for (const auto& [name, shape] : shapes) {
    const int64_t n = shape[0], cols = shape_numel(shape) / n, pad = (n + S - 1) / S;
    Rows r{shape, {}, {}, s};
    for (int k = 0; k < S; ++k) {
      const int64_t o = std::min(n, k * pad);
      r.offsets.push_back(o);
      r.lengths.push_back(std::min(n, o + pad) - o);
    }
    Shape mine = shape;
    mine[0] = r.lengths[static_cast<size_t>(s)];
    rows_specs.push_back({name, mine});
    rows.push_back(r);
    whole_off.push_back(total);
    total += n * cols;
  }
  // This rank's rows of a whole flat vector, in parameter order.
  auto my_rows = [&](const Vec& whole) {
    Vec out;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const int64_t cols = shape_numel(shapes[i].second) / shapes[i].second[0];
      const int64_t b = whole_off[i] + rows[i].offsets[static_cast<size_t>(s)] * cols;
      out.insert(out.end(), whole.begin() + b, whole.begin() + b + rows[i].lengths[static_cast<size_t>(s)] * cols);
    }
    return out;
  };
  // The error buffers: this rank's (sharded) and its rows of the reference's, by name.
  auto error_rows = [&](compress::Compressor& c, compress::Compressor& cr) {
    std::pair<Vec, Vec> out;
    for (const PlacedTensor& t : c.state()) {
      if (t.name.rfind("error/", 0) != 0) continue;
      const Vec v = t.value.to_doubles(), w = state_of(cr, t.name).to_doubles();
      const int64_t cols = shape_numel(t.rows.shape) / t.rows.shape[0], o = t.rows.offsets[static_cast<size_t>(s)] * cols;
      out.first.insert(out.first.end(), v.begin(), v.end());
      out.second.insert(out.second.end(), w.begin() + o, w.begin() + o + static_cast<int64_t>(v.size()));
    }
    return out;
  };
  for (const char* mode : {"projection", "full"})
    for (int rank : {2, 3}) {
      SCOPED_TRACE(std::string(mode) + " rank " + std::to_string(rank));
      auto g = make_grads(rows_specs), ref = make_grads(shapes);
      compress::Topology topo;
      topo.shard = shard.get();
      topo.rows = rows;
      auto c = make_compressor(psgd(rank, mode), *replica, g.params, 1, topo);
      auto cr = make_compressor(psgd(rank, mode), *replica, ref.params);
      for (const PlacedTensor& t : c->state())
        if (t.name.rfind("error/", 0) == 0) {
          EXPECT_EQ(t.placement, Placement::sharded) << t.name;
        }
      for (int step = 0; step < 5; ++step) {
        const Vec whole = as_f32(scaled(raw(q, step, total), 1.0 / Rg));  // replica q's contribution
        load(g, my_rows(whole));
        load(ref, whole);
        c->aggregate(g.params, step);
        cr->aggregate(ref.params, step);
        const Vec out = get(g.flat), want = my_rows(get(ref.flat));
        EXPECT_LT(norm(sub(out, want)), 1e-4 * (1 + norm(want))) << "step " << step;
        const auto [e, er] = error_rows(*c, *cr);
        EXPECT_FALSE(e.empty());
        EXPECT_LT(norm(sub(e, er)), 1e-4 * (1 + norm(er))) << "step " << step;
        EXPECT_EQ(c->last_bytes().uncompressed, static_cast<int64_t>(out.size()) * 4);
      }
      EXPECT_LT(norm(sub(get(state_of(*c, "q/wq")), get(state_of(*cr, "q/wq")))), 1e-4);
    }
}


// DiLoCo's exchange (compress::QuantizedMean) on every format: every rank ends with the same bits,
// within the format's rounding of the true mean (two roundings: each rank's, then the mean's),
// and with error feedback the roundings are kept: mean_r(x_r + e_r) before == the result +
// mean_r(e_r) after (both roundings of the owner's chunk are in its buffer, W times the mean's).
TEST(CompressMpi, QuantizedMeanOverRanks) {
  using compress::Wire;
  const int64_t n = 1000;  // not a multiple of W * 128: padded chunks
  for (Wire w : {Wire::f32, Wire::bf16, Wire::int8, Wire::e3m0}) {
    std::vector<float> x(n), e(n, 0.0f), mean(n);
    for (int64_t i = 0; i < n; ++i) x[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(R())) * 0.01f;
    for (int64_t i = 0; i < n; ++i) e[i] = w == Wire::f32 ? 0.0f : 1e-4f * std::cos(static_cast<float>(i * (R() + 1)));
    Vec before(n), after(n);
    for (int64_t i = 0; i < n; ++i) before[i] = static_cast<double>(x[i]) + e[i];
    compress::QuantizedMean q(world(), w);
    q.start(x.data(), w == Wire::f32 ? nullptr : e.data(), n);
    for (int k = 0; k < 1000 && !q.progress(); ++k) {
    }
    q.finish(mean.data());
    for (int64_t i = 0; i < n; ++i) after[i] = e[i];
    before = sum_over_ranks(before), after = sum_over_ranks(after);
    // The same bits on every rank.
    Vec bits(n);
    for (int64_t i = 0; i < n; ++i) bits[i] = mean[i];
    const Vec total = sum_over_ranks(bits);
    double worst = 0, kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(total[i], static_cast<double>(W()) * mean[i]) << name_of(w) << " " << i;
      worst = std::max(worst, std::fabs(mean[i] - before[i] / W()));
      kept = std::max(kept, std::fabs(mean[i] + after[i] / W() - before[i] / W()));
    }
    // |x + e| <= 0.0101 = s; two roundings of at most: bf16 s 2^-8 (half its 7-bit mantissa's step), int8 s / 254, e3m0 s / 3.
    const double s = 0.0101, bound = w == Wire::f32 ? 1e-9 : 2 * s * (w == Wire::bf16 ? 0x1p-8 : w == Wire::int8 ? 1.0 / 254 : 1.0 / 3);
    EXPECT_LE(worst, bound) << name_of(w);
    EXPECT_LE(kept, 1e-7) << name_of(w);
    EXPECT_EQ(q.bytes(), w == Wire::f32 ? n * 4 : W() * compress::wire_bytes(w, (n + W() * 128 - 1) / (W() * 128) * 128));
  }
}

}  // namespace
}  // namespace dtk::testing
