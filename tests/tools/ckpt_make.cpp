// ckpt-make: example checkpoints with known contents for tests/tools/shard_inspect.sh.
//   ckpt-make full OUT.h5        a full checkpoint: every dtype, a 0-d, empty and NaN/Inf tensor
//   ckpt-make changed OUT.h5     the full checkpoint with model/w.f32[0][0] one larger
//   ckpt-make sharded OUT_DIR    the same tensors as a sharded state of 4 ranks (uneven shards,
//                                whole tensors in ranks 1 and 2)
//   ckpt-make version OUT.h5 V   a tiny checkpoint claiming schema version V
//   ckpt-make large OUT_DIR ROWS one bf16 tensor model/large of ROWS x 1024 whose row r holds
//                                r % 256 as a 1-rank sharded state, written a row block at a
//                                time (the export's zip64 and memory checks)
//   ckpt-make chunk FILE NAME    prints the file offset of the first chunk of dataset NAME
//   ckpt-make header FILE NAME   prints the file offset of dataset NAME's object header
//   ckpt-make hostile OUT_DIR    well-formed HDF5 files whose content lies (seeds and
//                                regressions of tests/fuzz): checkpoints scalar-2d.h5 (the 0-d
//                                marker on a [2, 3] dataset), huge.h5 (a [2^40, 2^40] dataset),
//                                unwritten.h5 (a [2^20, 2^20] dataset, 4 TiB, no chunk
//                                written), shards.h5 (shard_offsets and shard_lengths that
//                                disagree, negative); data files images-wrap.h5 (images whose
//                                H * W * C wraps to 4) and tokens-unwritten.h5 (2^40 tokens,
//                                none written)
#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"

namespace {
using namespace dtk;

struct Item {
  std::string name;
  Tensor t;
  std::vector<int64_t> lengths;  // sharded: rows per rank; empty: even split; {-1, owner}: whole
};

Tensor normal(const Shape& s, DType t, uint64_t seed) {
  Tensor x = Tensor::empty(s, t);
  ops::normal_(x, seed, 0);
  return x;
}

Tensor values(const Shape& s, DType t, double (*f)(int64_t)) {
  std::vector<double> v(static_cast<size_t>(shape_numel(s)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = f(static_cast<int64_t>(i));
  return Tensor::from_doubles(v, s, t);
}

std::vector<Item> items() {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  std::vector<Item> v;
  v.push_back({"model/ramp", values({10}, DType::f32, [](int64_t i) { return double(i); }), {4, 0, 3, 3}});
  v.push_back({"model/w.f32", normal({7, 5}, DType::f32, 1), {}});
  v.push_back({"model/w.f64", normal({6, 3}, DType::f64, 2), {}});
  v.push_back({"model/w.bf16", normal({9, 4}, DType::bf16, 3), {}});
  v.push_back({"model/w.f16", normal({5}, DType::f16, 4), {1, 1, 1, 2}});
  v.push_back({"model/big", normal({300, 40}, DType::f32, 5), {}});
  v.push_back({"model/ids.i32", values({11}, DType::i32, [](int64_t i) { return double(3 * i - 7); }), {}});
  v.push_back({"model/ids.i64", values({4, 2}, DType::i64, [](int64_t i) { return 1e15 + double(i); }), {}});
  v.push_back({"model/bytes.u8", values({13}, DType::u8, [](int64_t i) { return double(i * 19 % 256); }), {}});
  v.push_back({"model/u16", values({3, 3}, DType::u16, [](int64_t i) { return double(i * 1000); }), {}});
  v.push_back({"model/empty", Tensor::empty({0}, DType::f32), {}});
  v.push_back({"model/empty2", Tensor::empty({3, 0}, DType::f32), {}});
  Tensor special = Tensor::from_doubles({1, nan, inf, -inf, -2, nan}, {6}, DType::f32);
  v.push_back({"model/special", special, {}});
  v.push_back({"optim/step", Tensor::from_doubles({42}, {}, DType::i64), {-1, 2}});
  v.push_back({"ranks/1/compress/error", normal({2, 2}, DType::f32, 6), {-1, 1}});
  return v;
}

ckpt::Metadata meta() {
  ckpt::Metadata m;
  m.program = "ckpt-make";
  m.program_version = "1.0";
  m.step = 42;
  m.world_size = 4;
  m.created = "2026-01-02T03:04:05Z";
  m.model_config = {{"name", "tiny"}, {"dim", 5}};
  m.optim_config = {{"lr", 0.001}};
  m.data_position = {{"epoch", 1}, {"index", 77}};
  m.rng_state = {{"seed", 1234}};
  m.extra = {{"note", "test"}};
  return m;
}

void full(const char* out, bool changed) {
  ckpt::FileWriter w(out);
  for (const auto& it : items()) {
    if (changed && it.name == "model/w.f32") it.t.ptr<float>()[0] += 1;
    w.write(it.name, it.t);
  }
  w.set_metadata(meta());
  w.commit();
}

void sharded(const char* out) {
  constexpr int n = 4;
  ckpt::SerialShardedWriter w(out, n);
  for (const auto& it : items()) {
    ckpt::TensorInfo ti{it.name, it.t.shape(), it.t.dtype(), {}, {}, -1};
    if (!it.lengths.empty() && it.lengths[0] < 0) {
      ti.owner = static_cast<int>(it.lengths[1]);
    } else if (it.lengths.empty()) {
      ckpt::even_split(it.t.dim(0), n, ti.shard_offsets, ti.shard_lengths);
    } else {
      ti.shard_lengths = it.lengths;
      int64_t off = 0;
      for (int64_t len : it.lengths) ti.shard_offsets.push_back(off), off += len;
    }
    w.create(ti);
    w.write_rows(it.name, 0, it.t);
  }
  w.set_metadata(meta());
  w.commit();
}

void version(const char* out, int64_t v) {
  ckpt::FileWriter w(out);
  w.write("model/x", Tensor::from_doubles({1, 2, 3}, {3}, DType::f32));
  w.set_metadata(meta());
  w.set_root_attr("schema_version", v);
  w.commit();
}

void large(const char* out, int64_t rows) {
  constexpr int64_t cols = 1024, block = 4096;
  ckpt::SerialShardedWriter w(out, 1);
  ckpt::TensorInfo ti{"model/large", {rows, cols}, DType::bf16, {0}, {rows}, -1};
  w.create(ti);
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t n = std::min(block, rows - r0);
    Tensor x = Tensor::empty({n, cols}, DType::bf16);
    auto* p = x.ptr<uint16_t>();
    for (int64_t r = 0; r < n; ++r) {
      const float v = static_cast<float>((r0 + r) % 256);
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      std::fill(p + r * cols, p + (r + 1) * cols, static_cast<uint16_t>(bits >> 16));  // exact
    }
    w.write_rows(ti.name, r0, x);
  }
  w.set_metadata(meta());
  w.commit();
}

int chunk(const char* file, const char* name) {
  hid_t f = H5Fopen(file, H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t d = f < 0 ? -1 : H5Dopen2(f, name, H5P_DEFAULT);
  hsize_t offset[H5S_MAX_RANK] = {0};
  haddr_t addr = 0;
  hsize_t size = 0;
  unsigned mask = 0;
  const bool ok = d >= 0 && H5Dget_chunk_info_by_coord(d, offset, &mask, &addr, &size) >= 0;
  if (d >= 0) H5Dclose(d);
  if (f >= 0) H5Fclose(f);
  if (!ok) {
    std::fprintf(stderr, "ckpt-make: no chunk of %s in %s\n", name, file);
    return 1;
  }
  std::printf("%llu %llu\n", static_cast<unsigned long long>(addr), static_cast<unsigned long long>(size));
  return 0;
}

int header(const char* file, const char* name) {
  hid_t f = H5Fopen(file, H5F_ACC_RDONLY, H5P_DEFAULT);
  H5O_info_t info{};
  const bool ok = f >= 0 && H5Oget_info_by_name2(f, name, &info, H5O_INFO_BASIC, H5P_DEFAULT) >= 0;
  if (f >= 0) H5Fclose(f);
  if (!ok) {
    std::fprintf(stderr, "ckpt-make: no object %s in %s\n", name, file);
    return 1;
  }
  std::printf("%llu\n", static_cast<unsigned long long>(info.addr));
  return 0;
}

// A small valid checkpoint at `path`, reopened for writing: the HDF5 file id.
hid_t base_for_hostile(const std::string& path) {
  {
    ckpt::FileWriter w(path);
    w.write("model/x", Tensor::from_doubles({1, 2, 3}, {3}, DType::f32));
    w.set_metadata(meta());
    w.commit();
  }
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  if (f < 0) fail("cannot reopen " + path);
  return f;
}

// A chunked f32 dataset of `dims` (chunks of one element), zeros written when `fill`.
hid_t hostile_dataset(hid_t f, const char* name, std::vector<hsize_t> dims, bool fill = true, hid_t type = H5T_IEEE_F32LE) {
  const hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
  std::vector<hsize_t> chunk(dims.size(), 1);
  H5Pset_chunk(dcpl, static_cast<int>(chunk.size()), chunk.data());
  const hid_t d = H5Dcreate2(f, name, type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
  H5Pclose(dcpl);
  H5Sclose(space);
  if (d < 0) fail(std::string("cannot create ") + name);
  if (fill) {
    hsize_t n = 1;
    for (hsize_t x : dims) n *= x;
    const std::vector<float> zeros(n, 0.0f);
    H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, zeros.data());
  }
  return d;
}

void int_attr(hid_t obj, const char* name, const std::vector<int64_t>& v) {
  const hsize_t n = v.size();
  const hid_t space = H5Screate_simple(1, &n, nullptr);
  const hid_t a = H5Acreate2(obj, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(a, H5T_NATIVE_INT64, v.data());
  H5Aclose(a);
  H5Sclose(space);
}

void hostile(const std::string& dir) {
  {
    const hid_t f = base_for_hostile(dir + "/scalar-2d.h5");
    const hid_t d = hostile_dataset(f, "model/s", {2, 3});
    int_attr(d, "dtk_scalar", {1});
    H5Dclose(d);
    H5Fclose(f);
  }
  {
    const hid_t f = base_for_hostile(dir + "/huge.h5");
    H5Dclose(hostile_dataset(f, "model/huge", {hsize_t{1} << 40, hsize_t{1} << 40}, false));
    H5Fclose(f);
  }
  {
    const hid_t f = base_for_hostile(dir + "/unwritten.h5");
    H5Dclose(hostile_dataset(f, "model/unwritten", {hsize_t{1} << 20, hsize_t{1} << 20}, false));
    H5Fclose(f);
  }
  // Data files (data-pack's layout, tests/fuzz/token_file and image_file).
  {
    const hid_t f = H5Fcreate((dir + "/images-wrap.h5").c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    // [1, 2^62 + 1, 4, 1]: H * W * C wraps to 4 in 64 bits, an mlp of input_dim 4's sample size
    H5Dclose(hostile_dataset(f, "images", {1, (hsize_t{1} << 62) + 1, 4, 1}, false, H5T_STD_U8LE));
    const hid_t l = hostile_dataset(f, "labels", {1}, false, H5T_STD_I64LE);
    const int64_t zero = 0;
    H5Dwrite(l, H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, &zero);
    H5Dclose(l);
    H5Fclose(f);
  }
  {
    const hid_t f = H5Fcreate((dir + "/tokens-unwritten.h5").c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    H5Dclose(hostile_dataset(f, "tokens", {hsize_t{1} << 40}, false, H5T_STD_U16LE));
    int_attr(f, "vocab_size", {256});
    H5Fclose(f);
  }
  {
    const hid_t f = base_for_hostile(dir + "/shards.h5");
    const hid_t d = hostile_dataset(f, "model/sh", {4});
    int_attr(d, "shard_offsets", {0, 7, -3});
    int_attr(d, "shard_lengths", {1});
    H5Dclose(d);
    H5Fclose(f);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  try {
    if ((cmd == "full" || cmd == "changed") && argc == 3) full(argv[2], cmd == "changed");
    else if (cmd == "sharded" && argc == 3) sharded(argv[2]);
    else if (cmd == "version" && argc == 4) version(argv[2], std::stoll(argv[3]));
    else if (cmd == "large" && argc == 4) large(argv[2], std::stoll(argv[3]));
    else if (cmd == "chunk" && argc == 4) return chunk(argv[2], argv[3]);
    else if (cmd == "header" && argc == 4) return header(argv[2], argv[3]);
    else if (cmd == "hostile" && argc == 3) hostile(argv[2]);
    else {
      std::fprintf(stderr, "usage: ckpt-make full|changed OUT.h5 | sharded DIR | version OUT.h5 V | chunk FILE NAME | header FILE NAME | hostile DIR\n");
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt-make: %s\n", e.what());
    return 1;
  }
  return 0;
}
