// Sharded states written by every rank together: the index presents whole tensors over the rank
// files (HDF5 virtual datasets), a full checkpoint of the same tensors reads the same, and a
// crash before commit leaves the previous state in place.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>

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
  world->barrier().wait();
  // A writer that is destroyed before commit (a crash) leaves the committed state untouched.
  {
    ShardedWriter w(state, *world);
    const auto& s = specs[0];
    std::vector<int64_t> off, len;
    split_rows(s.shape[0], n, off, len);
    w.write_shard(s.name, s.shape, Tensor::zeros({len[r], 8}, DType::f32), off, len);
  }
  world->barrier().wait();
  if (r == 0) {
    Reader rd(state);
    EXPECT_EQ(rd.read(specs[0].name).to_doubles(), full_tensor(specs[0].shape, specs[0].dtype, 0).to_doubles());
    fs::remove_all(dir);
  }
  world->barrier().wait();
}

// A directory of this process alone (these tests run in every process of the job independently).
fs::path own_tmpdir() {
  std::string tmpl = "/tmp/dtk-own-XXXXXX";
  return mkdtemp(tmpl.data());
}

void write_serial(const fs::path& dir, int n) {
  SerialShardedWriter w(dir, n);
  TensorInfo t{"model/w", {6, 2}, DType::f32, {}, {}, -1};
  even_split(6, n, t.shard_offsets, t.shard_lengths);
  w.create(t);
  w.write_rows("model/w", 0, full_tensor({6, 2}, DType::f32, 1));
  w.set_metadata(Metadata{});
  w.commit();
}

void drop_state_id(const fs::path& file) {
  const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0) << file;
  EXPECT_GE(H5Adelete(f, "state_id"), 0) << file;
  H5Fclose(f);
}

std::string refusal(const fs::path& state) {
  try {
    Reader r(state);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

// Every rank file carries the index's state_id; a rank file of another write is refused, naming
// it. States written before state_id existed (no file has one) are read as before.
TEST(ShardedState, RankFilesOfAnotherWriteAreRefused) {
  const fs::path dir = own_tmpdir();
  write_serial(dir / "a", 2);
  write_serial(dir / "b", 2);
  EXPECT_EQ(refusal(dir / "a"), "");
  fs::copy_file(dir / "b" / rank_file_name(1), dir / "a" / rank_file_name(1), fs::copy_options::overwrite_existing);
  const std::string m = refusal(dir / "a");
  EXPECT_NE(m.find(rank_file_name(1)), std::string::npos) << m;
  EXPECT_NE(m.find("another sharded state"), std::string::npos) << m;
  // Old files: none carries an id (accepted); only the index lacks one (refused: a mix).
  for (const char* f : {"index.h5", "rank-00000.h5", "rank-00001.h5"}) drop_state_id(dir / "b" / f);
  EXPECT_EQ(refusal(dir / "b"), "");
  write_serial(dir / "c", 2);
  drop_state_id(dir / "c" / "index.h5");
  EXPECT_NE(refusal(dir / "c").find(rank_file_name(0)), std::string::npos);
  fs::remove_all(dir);
}

// The next writer into a directory removes the temporaries that dead writers of this host left
// (files and sharded states' directories), and leaves a live writer's and another host's alone.
TEST(Temporaries, DeadWritersAreRemovedLiveOnesAndOtherHostsKept) {
  const fs::path dir = own_tmpdir();
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);  // a pid that no longer runs
  const std::string h = host, dead = std::to_string(child), live = std::to_string(getpid());
  const std::vector<std::string> dead_names = {".a.h5.tmp-" + h + "-" + dead + "-0", ".latest.tmp-" + h + "-" + dead + "-3",
                                               ".step-00000002.tmp-" + h + "-" + dead + "-1"};
  const std::vector<std::string> kept = {".a.h5.tmp-" + h + "-" + live + "-0", ".a.h5.tmp-elsewhere-" + dead + "-0",
                                         ".a.h5.tmp-" + dead, "notes.txt"};
  for (const auto& n : dead_names) std::ofstream(dir / n) << "x";
  fs::remove(dir / dead_names[2]);
  fs::create_directories(dir / dead_names[2] / "sub");
  for (const auto& n : kept) std::ofstream(dir / n) << "x";
  {
    FileWriter w(dir / "b.h5");
    w.write("x", Tensor::zeros({2}, DType::f32));
    w.set_metadata(Metadata{});
    w.commit();
  }
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  std::vector<std::string> want = kept;
  want.push_back("b.h5");
  std::sort(want.begin(), want.end());
  EXPECT_EQ(left, want);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace dtk::ckpt
