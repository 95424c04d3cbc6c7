// The checkpoint schema in one process: round trips of every dtype and shape, metadata, atomic
// writes, retention, and every kind of bad input named precisely.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/ckpt/state.h"
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"

namespace dtk::ckpt {
namespace {
namespace fs = std::filesystem;

class Ckpt : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/dtk-ckpt-XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

Tensor random(const Shape& s, DType t, uint64_t seed) {
  Tensor x = Tensor::empty(s, t);
  if (dtype_is_float(t)) {
    ops::normal_(x, seed, 0);
  } else {
    Tensor f = Tensor::empty(s, DType::f64);
    ops::uniform_(f, seed, 0, 0, 200);
    ops::cast(f, x);
  }
  return x;
}

Metadata meta(int64_t step) {
  Metadata m;
  m.program = "test";
  m.program_version = "0";
  m.step = step;
  m.world_size = 3;
  m.model_config = {{"dim", 64}, {"name", "llama-tiny"}};
  m.data_position = {{"step", step}};
  return m;
}

TEST_F(Ckpt, RoundTripEveryDtypeAndShape) {
  const fs::path p = dir_ / "a.h5";
  std::vector<std::pair<std::string, Tensor>> ts;
  int k = 0;
  for (DType t : kAllDTypes)
    for (const Shape& s : {Shape{}, Shape{0}, Shape{1}, Shape{7}, Shape{1003}, Shape{3, 0}, Shape{33, 17}, Shape{2, 3, 5}}) {
      ++k;
      ts.emplace_back("model/t" + std::to_string(k - 1) + "." + std::string(dtype_name(t)), random(s, t, k));
    }
  {
    FileWriter w(p, {.gzip = 4});
    for (auto& [n, t] : ts) w.write(n, t);
    w.write("ranks/1/compress/error.layers.0.w", random({5, 5}, DType::f32, 99));
    w.set_metadata(meta(42));
    w.commit();
  }
  Reader r(p);
  EXPECT_FALSE(r.sharded());
  EXPECT_EQ(r.metadata().step, 42);
  EXPECT_EQ(r.metadata().world_size, 3);
  EXPECT_EQ(r.metadata().model_config["name"], "llama-tiny");
  EXPECT_FALSE(r.metadata().created.empty());
  EXPECT_EQ(r.tensors().size(), ts.size() + 1);
  for (auto& [n, t] : ts) {
    const TensorInfo& ti = r.info(n);
    EXPECT_EQ(ti.shape, t.shape()) << n;
    EXPECT_EQ(ti.dtype, t.dtype()) << n;
    Tensor back = r.read(n);
    EXPECT_EQ(back.shape(), t.shape());
    const auto a = t.to_doubles(), b = back.to_doubles();
    EXPECT_EQ(a, b) << n;
  }
  // Rows of a stored tensor, streamed.
  Tensor rows = Tensor::empty({10, 17}, DType::f32);
  r.read_rows("model/t6.f32", 20, rows);
  EXPECT_EQ(rows.to_doubles()[0], ts[6].second.to_doubles()[20 * 17]);
  EXPECT_THROW(r.info("model/nope"), UsageError);
  Tensor wrong = Tensor::empty({33, 16}, DType::f32);
  EXPECT_THROW(r.read_into("model/t6.f32", wrong), UsageError);
}

TEST_F(Ckpt, ToolsOfHdf5ReadOurFiles) {
  const fs::path p = dir_ / "b.h5";
  FileWriter w(p);
  w.write("model/w", random({4, 3}, DType::bf16, 1));
  w.write("model/h", random({4}, DType::f16, 2));
  w.set_metadata(meta(1));
  w.commit();
  const std::string dump = "h5dump " + p.string() + " > " + (dir_ / "dump.txt").string() + " 2>&1";
  ASSERT_EQ(std::system(dump.c_str()), 0);
  std::ifstream in(dir_ / "dump.txt");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(text.find("DATASET \"w\""), std::string::npos);
  EXPECT_NE(text.find("schema_version"), std::string::npos);
  EXPECT_EQ(std::system(("h5diff " + p.string() + " " + p.string()).c_str()), 0);
}

TEST_F(Ckpt, UncommittedWriteLeavesNothingAndKeepsTheOldFile) {
  const fs::path p = dir_ / "c.h5";
  {
    FileWriter w(p);
    w.write("model/x", random({8}, DType::f32, 1));
    w.set_metadata(meta(1));
    w.commit();
  }
  {
    FileWriter w(p);  // a second writer that dies before commit
    w.write("model/x", random({8}, DType::f32, 2));
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator{}), 1);
  Reader r(p);
  EXPECT_EQ(r.metadata().step, 1);
  EXPECT_EQ(r.read("model/x").to_doubles(), random({8}, DType::f32, 1).to_doubles());
  EXPECT_THROW(FileWriter(dir_ / "no" / "such" / "dir.h5"), UsageError);
}

TEST_F(Ckpt, BadInputsAreNamed) {
  auto expect_usage = [](const fs::path& p, const std::string& fragment) {
    try {
      Reader r(p);
      for (const auto& t : r.tensors()) r.read(t.name);
      ADD_FAILURE() << p << ": no error";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_usage(dir_ / "missing.h5", "no such file");
  { std::ofstream(dir_ / "text.h5") << "hello"; }
  expect_usage(dir_ / "text.h5", "not an HDF5 file");
  fs::create_directory(dir_ / "empty-dir");
  expect_usage(dir_ / "empty-dir", "index.h5");

  const fs::path good = dir_ / "good.h5";
  {
    FileWriter w(good);
    w.write("model/x", random({1 << 16}, DType::f32, 3));
    w.set_metadata(meta(5));
    w.commit();
  }
  // Truncated.
  fs::copy_file(good, dir_ / "trunc.h5");
  fs::resize_file(dir_ / "trunc.h5", fs::file_size(good) / 2);
  expect_usage(dir_ / "trunc.h5", "");
  // A newer schema version.
  {
    FileWriter w(dir_ / "v99.h5");
    w.set_metadata(meta(1));
    w.set_root_attr("schema_version", 99);
    w.commit();
  }
  expect_usage(dir_ / "v99.h5", "schema version 99");
  // Not ours.
  {
    hid_t f = H5Fcreate((dir_ / "plain.h5").c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    H5Fclose(f);
  }
  expect_usage(dir_ / "plain.h5", "not a dtk checkpoint");
  // One corrupted byte inside the data: the checksum catches it and names the tensor.
  fs::copy_file(good, dir_ / "flip.h5");
  {
    hid_t f = H5Fopen(good.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, "model/x", H5P_DEFAULT);
    haddr_t addr = 0;
    hsize_t size = 0;
    unsigned mask = 0;
    hsize_t offset[1] = {0};
    ASSERT_GE(H5Dget_chunk_info_by_coord(d, offset, &mask, &addr, &size), 0);
    H5Dclose(d);
    H5Fclose(f);
    std::fstream io(dir_ / "flip.h5", std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(static_cast<std::streamoff>(addr + 100));
    char c;
    io.read(&c, 1);
    c ^= 0x10;
    io.seekp(static_cast<std::streamoff>(addr + 100));
    io.write(&c, 1);
  }
  expect_usage(dir_ / "flip.h5", "model/x");
}

TEST_F(Ckpt, DirectoryRetentionAndLatest) {
  Directory d(dir_, 2);
  EXPECT_FALSE(d.latest().has_value());
  for (int64_t step : {10, 20, 30}) {
    const fs::path e = d.entry(step, false);
    FileWriter w(e);
    w.set_metadata(meta(step));
    w.commit();
    d.finish(e);
    EXPECT_EQ(*d.latest(), e);
  }
  EXPECT_FALSE(fs::exists(d.entry(10, false)));
  EXPECT_TRUE(fs::exists(d.entry(20, false)));
  EXPECT_TRUE(fs::exists(d.entry(30, false)));
  EXPECT_EQ(d.entry(7, true).filename(), "step-00000007");
  EXPECT_THROW(Directory(dir_, 0), UsageError);
}

// Placed state becomes the entries that store it (the file layout of StateEntry is unchanged).
TEST(Checkpoint, PlacedTensorsAsEntries) {
  const Tensor t = Tensor::zeros({4, 4}, DType::f32);
  const std::vector<PlacedTensor> placed = {
      {"model/w", t},
      {"compress/error/w", t, Placement::per_rank},
      {"optim/shampoo/w/block0/factor0", t, Placement::owned, 1, true},
      {"optim/exp_avg/w", t, Placement::sharded, -1, false, Rows{{8, 4}, {0, 4}, {4, 4}, 0}},
  };
  const std::vector<StateEntry> e = entries(placed);
  ASSERT_EQ(e.size(), 4u);
  EXPECT_EQ(e[0].owner, kReplicated);
  EXPECT_EQ(e[1].owner, kPerRank);
  EXPECT_EQ(e[2].owner, 1);
  EXPECT_TRUE(e[2].symmetric);
  EXPECT_EQ(e[3].owner, kSharded);
  EXPECT_EQ(e[3].shape, (Shape{8, 4}));
  EXPECT_EQ(e[3].offsets, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(e[3].lengths, (std::vector<int64_t>{4, 4}));
  for (size_t i = 0; i < e.size(); ++i) {
    EXPECT_EQ(e[i].name, placed[i].name);
    EXPECT_EQ(e[i].tensor.data(), t.data());  // the same storage: loading restores into it
  }
  EXPECT_THROW(entry({"x", t, Placement::owned}), Error);  // owned by no rank
  EXPECT_THROW(entry({"x", t, Placement::sharded, -1, true}), Error);
}

}  // namespace
}  // namespace dtk::ckpt
