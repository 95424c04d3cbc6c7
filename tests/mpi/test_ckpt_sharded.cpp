// Sharded states written by every rank together: the index presents whole tensors over the rank
// files (HDF5 virtual datasets), a full checkpoint of the same tensors reads the same, and a
// crash before commit leaves the previous state in place.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/comm/comm.h"
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"
#include "../common/shared_tmpdir.h"

namespace dtk::ckpt {
namespace {
namespace fs = std::filesystem;
using comm::Runtime;

using test::shared_tmpdir;

// Rows of dim 0 split as evenly as possible, the first ranks taking the extra rows.
void split_rows(int64_t rows, int n, std::vector<int64_t>& off, std::vector<int64_t>& len) {
  off.assign(n, 0);
  len.assign(n, 0);
  for (int r = 0; r < n; ++r) {
    len[r] = rows / n + (r < rows % n ? 1 : 0);
    off[r] = r ? off[r - 1] + len[r - 1] : 0;
  }
}

Tensor full_tensor(const Shape& s, DType t, uint64_t seed) {
  Tensor x = Tensor::empty(s, t);
  ops::normal_(x, seed, 0);
  return x;
}

TEST(ShardedState, IndexPresentsWholeTensors) {
  auto& rt = Runtime::get();
  auto world = rt.world(comm::Backend::automatic);
  const int n = world->size(), r = world->rank();
  const fs::path dir = shared_tmpdir();
  struct Spec {
    std::string name;
    Shape shape;
    DType dtype;
  };
  const std::vector<Spec> specs = {{"model/tok_embeddings.weight", {37, 8}, DType::f32},
                                   {"model/layers.0.w", {3, 5, 2}, DType::bf16},
                                   {"model/norm.weight", {1}, DType::f64},  // fewer rows than ranks
                                   {"optim/m.x", {1000}, DType::f16}};
  Metadata m;
  m.program = "test";
  m.step = 7;
  m.world_size = n;
  const fs::path state = dir / "step-00000007";
  {
    ShardedWriter w(state, *world);
    for (size_t i = 0; i < specs.size(); ++i) {
      const auto& s = specs[i];
      const Tensor full = full_tensor(s.shape, s.dtype, i);
      std::vector<int64_t> off, len;
      split_rows(s.shape[0], n, off, len);
      w.write_shard(s.name, s.shape, full.slice(off[r], off[r] + len[r]), off, len);
    }
    Tensor step = Tensor::from_doubles({7}, {}, DType::i64);
    w.write_whole("optim/step", {}, DType::i64, n - 1, step);
    w.set_metadata(m);
    w.commit();
  }
  if (r == 0) {
    EXPECT_TRUE(fs::exists(state / "index.h5"));
    EXPECT_FALSE(fs::exists(dir / ".step-00000007.tmp"));
    Reader rd(state);
    EXPECT_TRUE(rd.sharded());
    EXPECT_EQ(rd.shard_files().size(), static_cast<size_t>(n));
    EXPECT_EQ(rd.metadata().step, 7);
    for (size_t i = 0; i < specs.size(); ++i) {
      const TensorInfo& ti = rd.info(specs[i].name);
      EXPECT_EQ(ti.shape, specs[i].shape);
      EXPECT_TRUE(ti.sharded());
      EXPECT_EQ(rd.read(specs[i].name).to_doubles(), full_tensor(specs[i].shape, specs[i].dtype, i).to_doubles())
          << specs[i].name;
    }
    EXPECT_EQ(rd.read("optim/step").item(), 7);
    // HDF5's own tools see whole tensors through the index.
    const std::string cmd = "h5dump -d /model/norm.weight " + (state / "index.h5").string() + " > /dev/null";
    EXPECT_EQ(std::system(cmd.c_str()), 0);
    // A missing shard is named.
    if (n > 1) {
      fs::rename(state / rank_file_name(1), dir / "moved.h5");
      try {
        Reader bad(state);
        ADD_FAILURE() << "no error for a missing shard";
      } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("rank-00001.h5"), std::string::npos) << e.what();
      }
      fs::rename(dir / "moved.h5", state / rank_file_name(1));
    }
  }
  world->barrier();
  // A writer that is destroyed before commit (a crash) leaves the committed state untouched.
  {
    ShardedWriter w(state, *world);
    const auto& s = specs[0];
    std::vector<int64_t> off, len;
    split_rows(s.shape[0], n, off, len);
    w.write_shard(s.name, s.shape, Tensor::zeros({len[r], 8}, DType::f32), off, len);
  }
  world->barrier();
  if (r == 0) {
    Reader rd(state);
    EXPECT_EQ(rd.read(specs[0].name).to_doubles(), full_tensor(specs[0].shape, specs[0].dtype, 0).to_doubles());
    fs::remove_all(dir);
  }
  world->barrier();
}

}  // namespace
}  // namespace dtk::ckpt
