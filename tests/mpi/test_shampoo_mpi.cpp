// Distributed Shampoo over 1, 2 and 4 ranks: the blocks spread over the ranks (each held once),
// the same weights as a world of one (bit for bit) and as the f64 reference, for trainer groups,
// bf16 directions and every preconditioner of the family too; the state saved by block with its
// owner (ckpt::save_state) restores on another world size and continues exactly; a NaN factor
// stops every rank with the same error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "../common/dion_reference.h"
#include "../common/shampoo_reference.h"
#include "../common/shared_tmpdir.h"
#include "dtk/ckpt/state.h"
#include "dtk/comm/comm.h"
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"
#include "dtk/optim/shampoo.h"

namespace dtk::optim {
namespace {
namespace fs = std::filesystem;
using comm::Runtime;
using shampoo_ref::Vec;

const std::vector<std::pair<std::string, Shape>> kSpecs = {
    {"tok_embeddings.weight", {12, 7}}, {"layers.0.attention_norm.weight", {8}}, {"layers.0.w", {6, 4}},
    {"layers.0.conv", {3, 4, 5}},       {"layers.0.scale", {1}},                  {"output.weight", {20, 3}}};

struct RunState {
  std::vector<nn::Param> params;
  std::vector<Shape> shapes;
  std::vector<Vec> start;
};

RunState make_run() {
  RunState r;
  uint64_t seed = 1;
  for (const auto& [name, shape] : kSpecs) {
    const Vec v = shampoo_ref::random_values(static_cast<size_t>(shape_numel(shape)), seed++);
    nn::Param& p = r.params.emplace_back();
    p.name = name, p.value = Tensor::from_doubles(v, shape, DType::f32), p.grad = Tensor::zeros(shape, DType::f32);
    r.shapes.push_back(shape);
    r.start.push_back(v);
  }
  return r;
}

std::vector<Vec> grads_at(const std::vector<Shape>& shapes, int step) {
  std::vector<Vec> g;
  for (size_t i = 0; i < shapes.size(); ++i)
    g.push_back(shampoo_ref::random_values(static_cast<size_t>(shape_numel(shapes[i])), 7000 + 100 * step + i, 0.5));
  return g;
}

void steps(Optimizer& opt, RunState& r, int from, int to) {
  for (int s = from; s < to; ++s) {
    const auto g = grads_at(r.shapes, s);
    for (size_t i = 0; i < r.params.size(); ++i) r.params[i].grad.copy_from(Tensor::from_doubles(g[i], r.shapes[i], DType::f32));
    opt.step(r.params, 0.05);
  }
}

ShampooConfig base_config() {
  ShampooConfig c;
  c.max_preconditioner_dim = 5;  // many blocks: 3 x 2, 2, 2 x 1, 1, 1, 4 x 1
  c.precondition_frequency = 2;
  c.start_preconditioning_step = 2;
  c.epsilon = 1e-3;
  c.momentum = 0.5;
  c.nesterov = true;
  c.weight_decay = 0.01;
  return c;
}

std::vector<Vec> values(const RunState& r) {
  std::vector<Vec> v;
  for (const auto& p : r.params) v.push_back(p.value.to_doubles());
  return v;
}

using test::shared_tmpdir;

// A label as a file name: spaces as underscores.
std::string file_tag(std::string label) {
  std::replace(label.begin(), label.end(), ' ', '_');
  return label;
}

int sum_over_ranks(comm::Communicator& c, int v) {
  c.all_reduce({&v, 1, DType::i32, {}}, {&v, 1, DType::i32, {}}, comm::ReduceOp::sum, comm::Mode::sync).wait();
  return v;
}

std::vector<ckpt::StateEntry> entries(Optimizer& opt, RunState& r) {
  std::vector<ckpt::StateEntry> e;
  for (auto& p : r.params) e.push_back({"model/" + p.name, p.value, ckpt::kReplicated});
  for (const PlacedTensor& t : prefixed("optim/", opt.state())) e.push_back(ckpt::entry(t));
  return e;
}

// ---------------------------------------------------------------------------- invariance

TEST(ShampooMpi, WorldSizeInvariance) {
  auto world = Runtime::get().world();
  auto local = comm::make_local_communicator();
  const int n = world->size();
  struct Variant {
    std::string label;
    int group;
    std::string dtype;
    std::string root = "eigh";
    int64_t spread = 1;
    void (*tweak)(ShampooConfig&) = nullptr;
    // Against the f64 reference too (not qr, nor eigenvalue-corrected: their first bases, at step
    // 2, eigendecompose factors of low rank, whose null-space basis is the solver's choice;
    // Shampoo.SeveralStepsMatchReference and Shampoo.FamilyMatchesReference check them from
    // factors of full rank).
    bool against_reference = true;
    double tol = 1e-5;  // relative to the distance moved
  };
  auto ec = [](ShampooConfig& c) { c.preconditioner = Preconditioner::eigenvalue_corrected; };
  auto spectral = [](ShampooConfig& c) {
    c.preconditioner = Preconditioner::spectral;
    c.precondition_frequency = 100;
    c.start_preconditioning_step = -1;
  };
  std::vector<Variant> variants = {
      {"one group", 0, "f32"},
      {"bf16 directions", 0, "bf16"},
      {"groups of 1", 1, "f32"},
      {"qr roots, spread 2", 0, "f32", "qr", 2, nullptr, false},
      {"eigenvalue-corrected", 0, "f32", "eigh", 1, ec, false},
      {"eigenvalue-corrected, qr, spread 2, bf16", 0, "bf16", "qr", 2, ec, false},
      {"eigenvalue-corrected, groups of 1", 1, "f32", "eigh", 1, ec, false},
      // Muon's use: embeddings and the output layer diagonal (AdamW-like), the rest spectral.
      {"spectral, diagonal embeddings and output", 0, "f32", "eigh", 1, [](ShampooConfig& c) {
         c.preconditioner = Preconditioner::spectral; c.precondition_frequency = 100; c.start_preconditioning_step = -1;
         c.diagonal_params = {"embeddings", "output"}; }},
      {"spectral exact, bf16", 0, "bf16", "eigh", 1, [](ShampooConfig& c) {
         c.preconditioner = Preconditioner::spectral; c.precondition_frequency = 1; c.start_preconditioning_step = -1;
         c.spectral_method = SpectralMethod::exact; }},
      {"spectral, groups of 1", 1, "f32", "eigh", 1, spectral},
      {"pseudo-inverse roots", 0, "f32", "pseudo-inverse", 1, [](ShampooConfig& c) { c.epsilon = 0; }},
      // Roots at 2 and 4 of factors updated at 1 and 4 only: rank-deficient, their null spaces
      // eps plus f32 rounding, amplified by eps^(-1/4): 1.1e-5 measured.
      {"factor update every 3, diagonal conv", 0, "f32", "eigh", 1, [](ShampooConfig& c) {
         c.factor_update_every = 3; c.diagonal_params = {"conv"}; }, true, 5e-5},
  };
  if (n == 4) {
    variants.push_back({"groups of 2", 2, "f32"});
    variants.push_back({"eigenvalue-corrected, groups of 2", 2, "f32", "eigh", 1, ec, false});
  }
  std::vector<std::string> names;
  for (const auto& sp : kSpecs) names.push_back(sp.first);
  for (const auto& v : variants) {
    ShampooConfig c = base_config();
    c.trainers_per_group = v.group;
    c.communication_dtype = parse_enum<DType>(v.dtype, "communication_dtype");
    c.root_method = parse_enum<RootMethod>(v.root, "root_method");
    c.root_spread = v.spread;
    if (v.tweak) v.tweak(c);
    RunState a = make_run(), b = make_run();
    auto dist = make_shampoo(c, a.params, *world);
    ShampooConfig cl = c;
    cl.trainers_per_group = 0;
    auto one = make_shampoo(cl, b.params, *local);
    steps(*dist, a, 0, 6);
    steps(*one, b, 0, 6);
    EXPECT_EQ(values(a), values(b)) << v.label << " on " << n << " ranks";
    if (v.dtype == "f32" && v.against_reference) {
      shampoo_ref::Reference ref(c, a.shapes, names);
      std::vector<Vec> want = a.start;
      for (int s = 0; s < 6; ++s) ref.step(want, grads_at(a.shapes, s), 0.05);
      double err = 0, moved = 0;
      const auto got = values(a);
      for (size_t i = 0; i < got.size(); ++i)
        for (size_t e = 0; e < got[i].size(); ++e) {
          err = std::max(err, std::fabs(got[i][e] - want[i][e]));
          moved = std::max(moved, std::fabs(want[i][e] - a.start[i][e]));
        }
      EXPECT_LT(err / moved, v.tol) << v.label;
    }
    // Each block is held by one rank of each group; group 0 writes it (every block has a graft).
    auto is_graft = [](const std::string& name) { return name.size() > 6 && name.substr(name.size() - 6) == "/graft"; };
    int held = 0, written = 0;
    for (const PlacedTensor& t : dist->state())
      if (is_graft(t.name)) {
        ++held;
        if (t.placement == Placement::owned && t.owner == world->rank()) ++written;
        else EXPECT_EQ(t.placement, Placement::replicated) << t.name;  // a copy in another group
      }
    int blocks = 0;
    for (const PlacedTensor& t : one->state()) blocks += is_graft(t.name);
    const int groups = v.group == 0 ? 1 : n / v.group;
    EXPECT_EQ(sum_over_ranks(*world, held), blocks * groups) << v.label;
    EXPECT_EQ(sum_over_ranks(*world, written), blocks) << v.label;
    if (v.group == 0 && n > 1) {
      EXPECT_GT(held, 0) << "rank " << world->rank() << " owns no block (" << v.label << ")";
    }
  }
}

// ---------------------------------------------------------------------------- sharded

// This rank's rows of dim 0 of a run's parameters, split as Fsdp::layout splits them (ceil(rows /
// n) each, the last ranks possibly none).
struct Shards {
  std::vector<nn::Param> params;
  std::vector<Rows> rows;
  int rank;
  Shards(const RunState& full, int rank_, int n) : rank(rank_) {
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      const Shape& s = kSpecs[i].second;
      Rows r{s, {}, {}, rank};
      const int64_t pad = (s[0] + n - 1) / n;
      for (int q = 0; q < n; ++q) {
        const int64_t o = std::min(s[0], q * pad);
        r.offsets.push_back(o);
        r.lengths.push_back(std::min(s[0], o + pad) - o);
      }
      rows.push_back(r);
      Shape ss = s;
      ss[0] = r.lengths[size_t(rank)];
      nn::Param& p = params.emplace_back();
      p.name = kSpecs[i].first, p.value = Tensor::from_doubles(mine(full.start[i], i), ss, DType::f32), p.grad = Tensor::zeros(ss, DType::f32);
    }
  }
  // This rank's rows of the values v of parameter i.
  Vec mine(const Vec& v, size_t i) const {
    const Rows& r = rows[i];
    const int64_t cols = shape_numel(r.shape) / r.shape[0], o = r.offsets[size_t(rank)], len = r.lengths[size_t(rank)];
    return Vec(v.begin() + o * cols, v.begin() + (o + len) * cols);
  }
  // Steps [from, to) of opt on these rows, with the gradients' rows of grads_at (as steps()).
  void steps(Optimizer& opt, const RunState& full, int from, int to) {
    for (int t = from; t < to; ++t) {
      const auto g = grads_at(full.shapes, t);
      for (size_t i = 0; i < params.size(); ++i)
        params[i].grad.copy_from(Tensor::from_doubles(mine(g[i], i), params[i].value.shape(), DType::f32));
      opt.step(params, 0.05);
    }
  }
};

// fsdp-train's placement: each rank holds dim-0 rows of every parameter (split as Fsdp splits
// them: ceil(rows / n) each, the last ranks possibly none), and the optimizer over the shard group
// gathers the gradients (and weights) so that its blocks are the whole parameters'. Every rank's
// rows after 6 steps: bit for bit those of the replicated optimizer in a world of one, for every
// preconditioner; its state is the replicated optimizer's, each block written once.
TEST(ShampooMpi, ShardedParametersEqualReplicated) {
  auto world = Runtime::get().world();
  auto local = comm::make_local_communicator();
  const int rank = world->rank(), n = world->size();
  auto ec = [](ShampooConfig& c) { c.preconditioner = Preconditioner::eigenvalue_corrected; };
  auto spectral = [](ShampooConfig& c) {
    c.preconditioner = Preconditioner::spectral;
    c.precondition_frequency = 100;
    c.start_preconditioning_step = -1;
  };
  const std::vector<std::pair<std::string, void (*)(ShampooConfig&)>> variants = {
      {"roots", [](ShampooConfig&) {}},
      {"roots, qr, spread 2, bf16", [](ShampooConfig& c) {
         c.root_method = RootMethod::qr; c.root_spread = 2; c.communication_dtype = DType::bf16; }},
      {"eigenvalue-corrected", ec},
      {"eigenvalue-corrected qr, l2 wd", [](ShampooConfig& c) {
         c.preconditioner = Preconditioner::eigenvalue_corrected; c.root_method = RootMethod::qr;
         c.weight_decay_type = WeightDecayType::l2; }},
      {"spectral", spectral},
      {"spectral exact, diagonal embeddings", [](ShampooConfig& c) {
         c.preconditioner = Preconditioner::spectral; c.precondition_frequency = 100; c.start_preconditioning_step = -1;
         c.spectral_method = SpectralMethod::exact; c.diagonal_params = {"embeddings"}; }},
      {"pseudo-inverse, factor update every 2", [](ShampooConfig& c) {
         c.root_method = RootMethod::pseudo_inverse; c.epsilon = 0; c.factor_update_every = 2; }},
  };
  for (const auto& [label, tweak] : variants) {
    ShampooConfig c = base_config();
    tweak(c);
    RunState full = make_run();
    auto one = make_shampoo(c, full.params, *local);
    steps(*one, full, 0, 6);
    Shards sh(full, rank, n);
    auto dist = make_shampoo(c, sh.params, *world, sh.rows);
    sh.steps(*dist, full, 0, 6);
    const auto want = values(full);
    for (size_t i = 0; i < sh.params.size(); ++i)
      EXPECT_EQ(sh.params[i].value.to_doubles(), sh.mine(want[i], i)) << label << ": " << kSpecs[i].first << " on rank "
                                                                      << rank << " of " << n;
    // The replicated optimizer's state: every tensor written once, by its owner.
    std::map<std::string, Shape> names;
    for (const PlacedTensor& t : one->state()) names[t.name] = t.value.shape();
    int written = 0;
    for (const PlacedTensor& t : dist->state()) {
      EXPECT_TRUE(names.count(t.name)) << label << ": " << t.name;
      if (names.count(t.name)) {
        EXPECT_EQ(t.value.shape(), names.at(t.name)) << label << ": " << t.name;
      }
      if (t.name != "step") written += t.placement == Placement::owned && t.owner == rank;
    }
    EXPECT_EQ(sum_over_ranks(*world, written), static_cast<int>(names.size()) - 1) << label;
  }
}

// ---------------------------------------------------------------------------- state

// N ranks save after 4 steps; a world of one restores and continues: the same weights as a world
// of one that never stopped. Then the reverse: a world of one saves, N ranks (in one group, and
// in groups of one) restore and continue. For the root preconditioner, eigenvalue-corrected
// Shampoo with qr bases (saved after its first bases, at 2 and 4: eigvecs and the corrected
// second moment travel) and spectral descent.
TEST(ShampooMpi, StateRestoresOnAnotherWorldSize) {
  auto world = Runtime::get().world();
  auto local = comm::make_local_communicator();
  const int rank = world->rank(), n = world->size();
  const fs::path dir = shared_tmpdir();
  std::vector<std::pair<std::string, ShampooConfig>> configs(3, {"roots", base_config()});
  configs[1].first = "eigenvalue-corrected qr";
  configs[1].second.preconditioner = Preconditioner::eigenvalue_corrected;
  configs[1].second.root_method = RootMethod::qr;
  configs[2].first = "spectral";
  configs[2].second.preconditioner = Preconditioner::spectral;
  configs[2].second.precondition_frequency = 100;
  configs[2].second.start_preconditioning_step = -1;
  for (const auto& [label, c] : configs) {
    RunState ref = make_run();
    auto oref = make_shampoo(c, ref.params, *local);
    steps(*oref, ref, 0, 7);
    const auto want = values(ref);

    for (int group : {0, 1}) {
      ShampooConfig cd = c;
      cd.trainers_per_group = group;
      // N ranks -> 1.
      {
        RunState a = make_run();
        auto od = make_shampoo(cd, a.params, *world);
        steps(*od, a, 0, 4);
        ckpt::Metadata meta;
        meta.world_size = n;
        meta.step = 4;
        const fs::path file = dir / (file_tag(label) + "_n" + std::to_string(group) + ".h5");
        ckpt::save_state(file, entries(*od, a), meta, *world);
        RunState b = make_run();
        for (auto& p : b.params) ops::fill(p.value, 0.0);
        auto o1 = make_shampoo(c, b.params, *local);
        auto e = entries(*o1, b);
        ckpt::Reader r(file);
        ckpt::load_state(r, e, 0, 1);
        steps(*o1, b, 4, 7);
        EXPECT_EQ(values(b), want) << label << ": saved on " << n << " ranks (groups " << group << "), restored on 1";
      }
      // 1 -> N.
      {
        const fs::path file = dir / (file_tag(label) + "_one" + std::to_string(group) + ".h5");
        RunState a = make_run();
        auto o1 = make_shampoo(c, a.params, *local);
        steps(*o1, a, 0, 4);
        if (rank == 0) {
          ckpt::Metadata meta;
          meta.world_size = 1;
          meta.step = 4;
          ckpt::save_state(file, entries(*o1, a), meta, *local);
        }
        world->barrier().wait();
        RunState b = make_run();
        for (auto& p : b.params) ops::fill(p.value, 0.0);
        auto od = make_shampoo(cd, b.params, *world);
        auto e = entries(*od, b);
        ckpt::Reader r(file);
        ckpt::load_state(r, e, rank, n);
        steps(*od, b, 4, 7);
        EXPECT_EQ(values(b), want) << label << ": saved on 1 rank, restored on " << n << " (groups " << group << ")";
      }
    }
  }
  world->barrier().wait();
  if (rank == 0) fs::remove_all(dir);
}

// ---------------------------------------------------------------------------- Dion

ShampooConfig dion_config() {
  ShampooConfig c = base_config();
  c.preconditioner = Preconditioner::dion;
  c.precondition_frequency = 100;
  c.start_preconditioning_step = -1;
  c.momentum = 0;
  c.nesterov = false;
  c.dion_rank_fraction = 0.5;  // layers.0.w [6, 4]: r 2; layers.0.conv as [3, 20], transposed: r 2
  c.diagonal_params = {"embeddings", "output"};
  return c;
}

double max_rel(const std::vector<Vec>& got, const std::vector<Vec>& want, const std::vector<Vec>& start) {
  double err = 0, moved = 0;
  for (size_t i = 0; i < got.size(); ++i)
    for (size_t e = 0; e < got[i].size(); ++e) {
      err = std::max(err, std::fabs(got[i][e] - want[i][e]));
      moved = std::max(moved, std::fabs(want[i][e] - start[i][e]));
    }
  return err / moved;
}

// Dion with dion_sync factors over N ranks, each rank stepping with its own contribution to the
// gradient of Dion's matrices (rank q's share (q + 1) / (1 + ... + N) of the gradient g; the other
// parameters' gradients aggregated, as GradSync leaves them): the weights equal a world of one
// fed g, and the f64 re-derivation fed the N replicas' estimates N share_q g, within f32 rounding
// (the products are averaged, not the gradients). Each rank's own buffer is checkpointed: saved
// on N ranks and restored on N, the run continues bit for bit; restored on 1 (their mean), it
// continues as the world of one within rounding.
TEST(ShampooMpi, DionFactorsOverRanks) {
  auto world = Runtime::get().world();
  auto local = comm::make_local_communicator();
  const int rank = world->rank(), n = world->size();
  const ShampooConfig c = dion_config();
  auto share = [&](int q) { return 2.0 * (q + 1) / (n * (n + 1.0)); };
  auto dion_param = [](size_t i) { return kSpecs[i].first == "layers.0.w" || kSpecs[i].first == "layers.0.conv"; };
  auto run = [&](Optimizer& opt, RunState& r, int from, int to, bool own_share) {
    for (int t = from; t < to; ++t) {
      const auto g = grads_at(r.shapes, t);
      for (size_t i = 0; i < r.params.size(); ++i) {
        Vec gi = g[i];
        if (own_share && dion_param(i))
          for (double& x : gi) x *= share(rank);
        r.params[i].grad.copy_from(Tensor::from_doubles(gi, r.shapes[i], DType::f32));
      }
      opt.step(r.params, 0.05);
    }
  };
  RunState a = make_run(), b = make_run();
  auto dist = make_shampoo(c, a.params, *world, {}, world.get());
  auto one = make_shampoo(c, b.params, *local, {}, local.get());
  // The f64 reference of the two matrices, from the same initial Q.
  std::map<size_t, dion_ref::Matrix> ref;
  std::vector<Vec> want = a.start;
  for (size_t i = 0; i < kSpecs.size(); ++i)
    if (dion_param(i)) {
      const Shape& s = kSpecs[i].second;
      const int m = int(s[0]), cols = int(shape_numel(s) / s[0]);
      Vec q0;
      for (const PlacedTensor& t : dist->state())
        if (t.name == "dion/" + kSpecs[i].first + "/q") q0 = t.value.to_doubles();
      ref.emplace(i, dion_ref::Matrix(m, cols, 2, q0, c.beta1, std::sqrt(double(m) / cols)));
    }
  ASSERT_EQ(ref.size(), 2u);
  run(*dist, a, 0, 4, true);
  run(*one, b, 0, 4, false);
  // Saved here on N ranks.
  const fs::path dir = shared_tmpdir(), file = dir / "dion_factors.h5";
  ckpt::Metadata meta;
  meta.world_size = n;
  meta.step = 4;
  ckpt::save_state(file, entries(*dist, a), meta, *world);
  run(*dist, a, 4, 7, true);
  run(*one, b, 4, 7, false);
  for (int t = 0; t < 7; ++t) {
    const auto g = grads_at(a.shapes, t);
    for (auto& [i, mat] : ref) {
      std::vector<Vec> est;
      for (int q = 0; q < n; ++q) {
        Vec e = g[i];
        for (double& x : e) x *= n * share(q);
        est.push_back(e);
      }
      mat.step(want[i], est, 0.05, c.weight_decay, true);
    }
  }
  const auto got = values(a), single = values(b);
  EXPECT_LT(max_rel(got, single, a.start), 1e-5) << n << " ranks against one";
  std::vector<Vec> got_d, want_d, start_d;
  for (auto& [i, mat] : ref) got_d.push_back(got[i]), want_d.push_back(want[i]), start_d.push_back(a.start[i]);
  EXPECT_LT(max_rel(got_d, want_d, start_d), 2e-5) << "against the f64 reference";
  // Restored on N ranks: bit for bit; on 1: the mean buffer, within rounding.
  {
    RunState r = make_run();
    auto o = make_shampoo(c, r.params, *world, {}, world.get());
    auto e = entries(*o, r);
    ckpt::Reader rd(file);
    ckpt::load_state(rd, e, rank, n);
    run(*o, r, 4, 7, true);
    EXPECT_EQ(values(r), got) << "restored on " << n << " ranks";
  }
  {
    RunState r = make_run();
    auto o = make_shampoo(c, r.params, *local, {}, local.get());
    auto e = entries(*o, r);
    ckpt::Reader rd(file);
    ckpt::load_state(rd, e, 0, 1);
    run(*o, r, 4, 7, false);
    EXPECT_LT(max_rel(values(r), single, a.start), 1e-5) << "saved on " << n << " ranks, restored on 1";
  }
  world->barrier().wait();
  if (rank == 0) fs::remove_all(dir);
}

// Dion over sharded parameters (fsdp-train's rows; N = 4 leaves rank 3 no row of the [3, 20]
// matrix): the products summed or gathered over the shard group, every rank's rows equal the
// replicated world of one's within rounding; the state is the replicated one's, sharded by rows.
TEST(ShampooMpi, DionShardedEqualsReplicated) {
  auto world = Runtime::get().world();
  auto local = comm::make_local_communicator();
  const int rank = world->rank(), n = world->size();
  for (DionSync sync : {DionSync::factors, DionSync::gradients}) {
    ShampooConfig c = dion_config();
    c.dion_sync = sync;
    c.weight_decay_type = sync == DionSync::gradients ? WeightDecayType::l2 : WeightDecayType::decoupled;
    RunState full = make_run();
    auto one = make_shampoo(c, full.params, *local);
    steps(*one, full, 0, 6);
    Shards sh(full, rank, n);
    auto dist = make_shampoo(c, sh.params, *world, sh.rows);
    sh.steps(*dist, full, 0, 6);
    const auto want = values(full);
    double err = 0, moved = 0;
    for (size_t i = 0; i < sh.params.size(); ++i) {
      const Vec x = sh.params[i].value.to_doubles(), w = sh.mine(want[i], i), s0 = sh.mine(full.start[i], i);
      for (size_t e = 0; e < x.size(); ++e) {
        err = std::max(err, std::fabs(x[e] - w[e]));
        moved = std::max(moved, std::fabs(w[e] - s0[e]));
      }
    }
    EXPECT_LT(err, 1e-5 * std::max(moved, 1e-3)) << name_of(sync) << ", rank " << rank << " of " << n;
    for (const PlacedTensor& t : dist->state())
      if (t.name.rfind("dion/", 0) == 0 && t.name.find("/momentum") != std::string::npos) {
        EXPECT_EQ(t.placement, Placement::sharded) << t.name;
        EXPECT_EQ(t.rows.shape[1], t.value.dim(1)) << t.name;
      }
  }
}

// ---------------------------------------------------------------------------- errors

// A NaN in one parameter's gradient: every rank, owner or not, raises the error naming it, and
// the ranks stay in step (the next collective still matches).
TEST(ShampooMpi, NanStopsEveryRankWithTheSameError) {
  auto world = Runtime::get().world();
  ShampooConfig c = base_config();
  c.start_preconditioning_step = 1;
  c.precondition_frequency = 1;
  RunState a = make_run();
  auto opt = make_shampoo(c, a.params, *world);
  auto g = grads_at(a.shapes, 0);
  g[3][7] = NAN;  // layers.0.conv
  for (size_t i = 0; i < a.params.size(); ++i) a.params[i].grad.copy_from(Tensor::from_doubles(g[i], a.shapes[i], DType::f32));
  int raised = 0;
  try {
    opt->step(a.params, 0.05);
  } catch (const Error& e) {
    raised = std::string(e.what()).find("layers.0.conv") != std::string::npos;
    EXPECT_TRUE(raised) << e.what();
  }
  EXPECT_EQ(sum_over_ranks(*world, raised), world->size());
}

}  // namespace
}  // namespace dtk::optim
