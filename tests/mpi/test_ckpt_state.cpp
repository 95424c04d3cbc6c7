// Training state spread over ranks (replicated, owned by one rank, per rank) saved to one full
// checkpoint by rank 0 and restored: every rank gets its own values back; owned state can be
// restored by another owner; per-rank state is restored as it was on the same world size, and
// on another as its Resize says (the mean over the ranks that wrote it, or left alone). Sharded
// states: every rank writes its rows and its own per-rank tensors (names and shapes differing
// between ranks, as Shampoo's blocks cut from shards do); a reader of any shard count gets its rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "dtk/ckpt/state.h"
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"
#include "../common/shared_tmpdir.h"

namespace dtk::ckpt {
namespace {
namespace fs = std::filesystem;
using comm::Runtime;

using test::shared_tmpdir;

Tensor filled(const Shape& s, DType t, uint64_t seed) {
  Tensor x = Tensor::empty(s, t);
  ops::normal_(x, seed, 0);
  return x;
}

void expect_same(const Tensor& a, const Tensor& b) {
  ASSERT_EQ(a.shape(), b.shape());
  EXPECT_EQ(a.to_doubles(), b.to_doubles());
}

TEST(CkptState, SaveAndLoadAcrossRanks) {
  auto& rt = Runtime::get();
  auto comm = rt.world();
  const int rank = comm->rank(), n = comm->size();
  const fs::path dir = shared_tmpdir(), path = dir / "state.h5";

  std::vector<StateEntry> mine;
  mine.push_back({"model/w", filled({5, 3}, DType::f32, 1), kReplicated});
  mine.push_back({"compress/error/w", filled({5, 3}, DType::f32, 100 + rank), kPerRank});
  // Block b is owned by rank b % n; only the owner lists it.
  for (int b = 0; b < 3; ++b)
    if (b % n == rank) mine.push_back({"optim/block" + std::to_string(b), filled({b + 1, 2}, DType::f64, 10 + b), b % n});
  Metadata meta;
  meta.program = "test";
  meta.step = 7;
  meta.world_size = n;
  save_state(path, mine, meta, *comm);

  Reader r(path);
  EXPECT_EQ(r.metadata().step, 7);
  EXPECT_TRUE(r.contains("ranks/" + std::to_string(n - 1) + "/compress/error/w"));
  for (int b = 0; b < 3; ++b) EXPECT_TRUE(r.contains("optim/block" + std::to_string(b)));

  // Restore into zeroed tensors: each rank gets its own per-rank values back.
  std::vector<StateEntry> back;
  back.push_back({"model/w", Tensor::zeros({5, 3}, DType::f32), kReplicated});
  back.push_back({"compress/error/w", Tensor::zeros({5, 3}, DType::f32), kPerRank});
  // Ownership reassigned: rank (b + 1) % n now owns block b.
  for (int b = 0; b < 3; ++b)
    if ((b + 1) % n == rank) back.push_back({"optim/block" + std::to_string(b), Tensor::zeros({b + 1, 2}, DType::f64), (b + 1) % n});
  EXPECT_EQ(load_state(r, back, rank, n), Restored::exact);
  expect_same(back[0].tensor, filled({5, 3}, DType::f32, 1));
  expect_same(back[1].tensor, filled({5, 3}, DType::f32, 100 + rank));
  for (size_t i = 2; i < back.size(); ++i) {
    const int b = std::stoi(back[i].name.substr(std::string("optim/block").size()));
    expect_same(back[i].tensor, filled({b + 1, 2}, DType::f64, 10 + b));
  }

  // Another world size: per-rank state is not restored (and says so), the rest is.
  std::vector<StateEntry> other{{"model/w", Tensor::zeros({5, 3}, DType::f32), kReplicated},
                                {"compress/error/w", Tensor::zeros({5, 3}, DType::f32), kPerRank}};
  EXPECT_EQ(load_state(r, other, 0, n + 1), Restored::fresh);
  expect_same(other[0].tensor, filled({5, 3}, DType::f32, 1));
  EXPECT_EQ(ops::reduce_all(ops::Reduce::absmax, other[1].tensor), 0.0);
  // ... unless it says how: the mean over the ranks that wrote it, on every rank of any count,
  // reported as approximate where the owner says so.
  std::vector<double> mean(15, 0.0);
  for (int q = 0; q < n; ++q) {
    const std::vector<double> v = filled({5, 3}, DType::f32, 100 + q).to_doubles();
    for (size_t i = 0; i < mean.size(); ++i) mean[i] += v[i] / n;
  }
  for (const int m : {1, n + 1, 2 * n}) {
    for (const Resize how : {Resize::mean, Resize::mean_approximate}) {
      StateEntry e{"compress/error/w", Tensor::zeros({5, 3}, DType::f32), kPerRank};
      e.resize = how;
      std::vector<StateEntry> resized{e};
      const Restored got = load_state(r, resized, std::min(rank, m - 1), m);
      EXPECT_EQ(got, m == n ? Restored::exact : how == Resize::mean ? Restored::exact : Restored::approximate) << m;
      const std::vector<double> v = resized[0].tensor.to_doubles();
      for (size_t i = 0; i < mean.size(); ++i) {
        if (m == n) continue;
        EXPECT_NEAR(v[i], mean[i], 1e-6 * (1 + std::abs(mean[i]))) << "m=" << m << " i=" << i;
      }
    }
  }

  // A shape that does not match is an error naming the tensor.
  std::vector<StateEntry> wrong{{"model/w", Tensor::zeros({3, 5}, DType::f32), kReplicated}};
  try {
    load_state(r, wrong, rank, n);
    ADD_FAILURE() << "no error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("model/w"), std::string::npos) << e.what();
  }
  comm->barrier().wait();
  if (rank == 0) fs::remove_all(dir);
}

// A symmetric matrix of side d with distinct entries above the diagonal.
Tensor symmetric(int64_t d, DType t, uint64_t seed) {
  Tensor a = filled({d, d}, t, seed);
  std::vector<double> v = a.to_doubles();
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j < i; ++j) v[static_cast<size_t>(i * d + j)] = v[static_cast<size_t>(j * d + i)];
  Tensor s = Tensor::from_doubles(v, {d, d}, t);
  return s;
}

// Symmetric matrices (Shampoo's factors and roots) are stored as their upper triangle, row by
// row, in full checkpoints (owned by any rank) and in sharded states (per rank); they come back
// whole, bit for bit; a matrix stored whole (before packing) still loads.
TEST(CkptState, SymmetricMatricesStoredPacked) {
  auto comm = Runtime::get().world();
  const int rank = comm->rank(), n = comm->size();
  const fs::path dir = shared_tmpdir();
  auto entry = [&](int b, bool zero, int owner) {
    const int64_t d = 3 + b;
    StateEntry e{"optim/f" + std::to_string(b), zero ? Tensor::zeros({d, d}, DType::f64) : symmetric(d, DType::f64, 20 + b), owner};
    e.symmetric = true;
    return e;
  };
  // Full checkpoint: block b owned by rank b % n; restored by rank (b + 1) % n.
  std::vector<StateEntry> mine, back;
  for (int b = 0; b < 3; ++b) {
    if (b % n == rank) mine.push_back(entry(b, false, b % n));
    if ((b + 1) % n == rank) back.push_back(entry(b, true, (b + 1) % n));
  }
  Metadata meta;
  meta.program = "test";
  meta.world_size = n;
  save_state(dir / "full.h5", mine, meta, *comm);
  Reader r(dir / "full.h5");
  for (int b = 0; b < 3; ++b) EXPECT_EQ(r.info("optim/f" + std::to_string(b)).shape, (Shape{(3 + b) * (4 + b) / 2}));
  // Packed row by row from the diagonal: the first row whole, then the second from column 1.
  const std::vector<double> stored = r.read("optim/f0").to_doubles(), want = symmetric(3, DType::f64, 20).to_doubles();
  EXPECT_EQ(stored, (std::vector<double>{want[0], want[1], want[2], want[4], want[5], want[8]}));
  EXPECT_EQ(load_state(r, back, rank, n), Restored::exact);
  for (const auto& e : back) expect_same(e.tensor, symmetric(e.tensor.dim(0), DType::f64, 20 + e.tensor.dim(0) - 3));

  // Sharded state: each rank's own matrix, per rank.
  std::vector<StateEntry> own{entry(rank, false, kPerRank)}, own_back{entry(rank, true, kPerRank)};
  save_sharded_state(dir / "sharded", own, meta, *comm);
  Reader rs(dir / "sharded");
  EXPECT_EQ(rs.info("ranks/" + std::to_string(rank) + "/optim/f" + std::to_string(rank)).shape,
            (Shape{(3 + rank) * (4 + rank) / 2}));
  EXPECT_EQ(load_state(rs, own_back, rank, n), Restored::exact);
  expect_same(own_back[0].tensor, symmetric(3 + rank, DType::f64, 20 + rank));

  // Stored whole (not packed): read as it is.
  comm->barrier().wait();
  if (rank == 0) {
    std::vector<StateEntry> whole{entry(0, false, 0)};
    whole[0].symmetric = false;
    auto local = comm::make_local_communicator();
    save_state(dir / "whole.h5", whole, meta, *local);
    std::vector<StateEntry> in{entry(0, true, 0)};
    EXPECT_EQ(load_state(Reader(dir / "whole.h5"), in, 0, 1), Restored::exact);
    expect_same(in[0].tensor, symmetric(3, DType::f64, 20));
  }
  comm->barrier().wait();
  if (rank == 0) fs::remove_all(dir);
}

TEST(CkptState, ShardedStateWithPerRankEntriesOfDifferentShapes) {
  auto& rt = Runtime::get();
  auto comm = rt.world();
  const int rank = comm->rank(), n = comm->size();
  const fs::path dir = shared_tmpdir(), path = dir / "state";
  const Tensor whole = filled({7, 3}, DType::f32, 5);
  std::vector<int64_t> off, len;
  even_split(7, n, off, len);
  auto entries = [&](int r, bool zero) {
    std::vector<StateEntry> e;
    const Tensor rows = whole.slice(off[r], off[r] + len[r]);
    e.push_back({"model/w", zero ? Tensor::zeros({len[r], 3}, DType::f32) : rows.clone(), kSharded, {7, 3}, off, len});
    e.push_back({"optim/step", zero ? Tensor::zeros({1}, DType::i64) : Tensor::from_doubles({9}, {1}, DType::i64), kReplicated});
    // Rank r holds r + 1 blocks of shape [r + 1, r + 2].
    for (int b = 0; b <= r; ++b)
      e.push_back({"optim/block" + std::to_string(b),
                   zero ? Tensor::zeros({r + 1, r + 2}, DType::f32) : filled({r + 1, r + 2}, DType::f32, 50 + 10 * r + b),
                   kPerRank});
    return e;
  };
  Metadata meta;
  meta.world_size = n;
  meta.extra["state_ranks"] = n;
  save_sharded_state(path, entries(rank, false), meta, *comm);

  Reader r(path);
  ASSERT_TRUE(r.sharded());
  for (int q = 0; q < n; ++q)
    for (int b = 0; b <= q; ++b) {
      const TensorInfo& ti = r.info("ranks/" + std::to_string(q) + "/optim/block" + std::to_string(b));
      EXPECT_EQ(ti.shape, (Shape{q + 1, q + 2}));
      EXPECT_EQ(ti.owner, q);
    }
  auto back = entries(rank, true);
  EXPECT_EQ(load_state(r, back, rank, n), Restored::exact);
  const auto want = entries(rank, false);
  for (size_t i = 0; i < back.size(); ++i) expect_same(back[i].tensor, want[i].tensor);

  // Another shard count: the rows are read, per-rank state is left alone and reported.
  std::vector<int64_t> off1, len1;
  even_split(7, 1, off1, len1);
  std::vector<StateEntry> one{{"model/w", Tensor::zeros({7, 3}, DType::f32), kSharded, {7, 3}, off1, len1},
                              {"optim/block0", Tensor::zeros({1, 2}, DType::f32), kPerRank}};
  if (n > 1) {
    EXPECT_EQ(load_state(r, one, 0, 1), Restored::fresh);
    expect_same(one[0].tensor, whole);
    EXPECT_EQ(ops::reduce_all(ops::Reduce::absmax, one[1].tensor), 0.0);
  }
  comm->barrier().wait();
  if (rank == 0) fs::remove_all(dir);
}

// Runs f, which must end this rank with an AgreedError of exit code 1; returns its message.
template <class F>
std::string agreed_error_of(F&& f, int rank) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const AgreedError& x) {
    EXPECT_EQ(x.exit_code(), 1);
    return x.what();
  } catch (const std::exception& x) {
    ADD_FAILURE() << "not an AgreedError on rank " << rank << ": " << x.what();
  }
  return "";
}

// A small state: one replicated tensor and one per rank.
std::vector<StateEntry> small_state(int rank) {
  return {{"model/w", filled({4}, DType::f32, 3), kReplicated},
          {"compress/e", filled({2}, DType::f32, 4 + rank), kPerRank}};
}

TEST(CkptState, FailedWriteLeavesThePreviousFileAndFailsEveryRank) {
  auto& rt = Runtime::get();
  auto comm = rt.world();
  const fs::path dir = shared_tmpdir();
  const std::vector<StateEntry> e = small_state(comm->rank());
  Metadata meta;
  meta.world_size = comm->size();
  save_state(dir / "a.h5", e, meta, *comm);
  const auto size = fs::file_size(dir / "a.h5");
  // A destination whose directory does not exist: rank 0 cannot write; every rank throws.
  EXPECT_THROW(save_state(dir / "missing" / "a.h5", e, meta, *comm), Error);
  EXPECT_EQ(fs::file_size(dir / "a.h5"), size);
  comm->barrier().wait();
  if (comm->rank() == 0) fs::remove_all(dir);
}

// The entries of `dir` whose names start with '.': temporaries left behind.
std::vector<std::string> hidden_entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().starts_with(".")) out.push_back(e.path().filename().string());
  return out;
}

// Every rank must hold the same message: rank 0's, broadcast, compared on each.
void expect_same_everywhere(comm::Communicator& comm, const std::string& msg) {
  int64_t n = static_cast<int64_t>(msg.size());
  comm.broadcast({&n, 1, DType::i64, {}}, 0, comm::Mode::sync).wait();
  std::string root(static_cast<size_t>(n), '\0');
  if (comm.rank() == 0) root = msg;
  if (n > 0) comm.broadcast({root.data(), root.size(), DType::u8, {}}, 0, comm::Mode::sync).wait();
  EXPECT_EQ(msg, root) << "rank " << comm.rank();
}

// Rank 0's failure to write a full checkpoint ends every rank alike: AgreedError with rank 0's
// message and exit code 1, so that the program ends normally on every rank.
TEST(CkptState, FailedFullWriteIsAnAgreedErrorOnEveryRank) {
  auto& rt = Runtime::get();
  auto comm = rt.world();
  const fs::path dir = shared_tmpdir();
  const std::vector<StateEntry> e = small_state(comm->rank());
  Metadata meta;
  meta.world_size = comm->size();
  const std::string msg =
      agreed_error_of([&] { save_state(dir / "missing" / "a.h5", e, meta, *comm); }, comm->rank());
  EXPECT_NE(msg.find("missing/a.h5"), std::string::npos) << msg;
  expect_same_everywhere(*comm, msg);
  comm->barrier().wait();
  if (comm->rank() == 0) fs::remove_all(dir);
}

// One rank's failed write of its part of a sharded state ends every rank with the same
// AgreedError (that rank's message), and no temporary directory is left.
TEST(CkptState, OneRanksFailedShardedWriteFailsEveryRankAlike) {
  auto& rt = Runtime::get();
  auto comm = rt.world();
  const int rank = comm->rank(), n = comm->size();
  const fs::path dir = shared_tmpdir();
  std::vector<int64_t> off, len;
  even_split(8, n, off, len);
  // The last rank passes rows of the wrong width: its write fails, the others' succeed.
  const int64_t width = rank == n - 1 ? 3 : 2;
  std::vector<StateEntry> e{{"model/w", filled({len[rank], width}, DType::f32, 1), kSharded, {8, 2}, off, len}};
  Metadata meta;
  const std::string msg = agreed_error_of([&] { save_sharded_state(dir / "state", e, meta, *comm); }, rank);
  EXPECT_NE(msg.find("model/w"), std::string::npos) << msg;
  expect_same_everywhere(*comm, msg);
  comm->barrier().wait();
  if (rank == 0) {
    EXPECT_FALSE(fs::exists(dir / "state"));
    EXPECT_EQ(hidden_entries(dir), std::vector<std::string>{});
    fs::remove_all(dir);
  }
}

// A commit that fails on one rank (its rank file cannot be renamed into place) does not hang
// the others: every rank throws the same AgreedError, and no temporary is left.
TEST(CkptState, OneRanksFailedCommitFailsEveryRankWithoutHanging) {
  auto& rt = Runtime::get();
  auto comm = rt.world();
  const int rank = comm->rank(), n = comm->size();
  const fs::path dir = shared_tmpdir();
  std::vector<int64_t> off, len;
  even_split(8, n, off, len);
  const std::string msg = agreed_error_of([&] {
    ShardedWriter w(dir / "state", *comm);
    w.write_shard("model/w", {8, 2}, filled({len[rank], 2}, DType::f32, 1), off, len);
    w.set_metadata(Metadata{});
    if (rank == n - 1) {  // a directory where this rank's file goes: its rename fails
      for (const auto& d : fs::directory_iterator(dir))
        if (d.path().filename().string().starts_with(".state.tmp")) fs::create_directories(d.path() / rank_file_name(rank) / "x");
    }
    w.commit();
  }, rank);
  EXPECT_NE(msg.find(rank_file_name(n - 1)), std::string::npos) << msg;
  expect_same_everywhere(*comm, msg);
  comm->barrier().wait();
  if (rank == 0) {
    EXPECT_FALSE(fs::exists(dir / "state"));
    EXPECT_EQ(hidden_entries(dir), std::vector<std::string>{});
    fs::remove_all(dir);
  }
}

}  // namespace
}  // namespace dtk::ckpt
