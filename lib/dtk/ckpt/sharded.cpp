// Sharded states (checkpoint.h): ShardedWriter (every rank its own file, collectively),
// SerialShardedWriter (every rank file from one process), the index over the rank files, and
// the agreement of a collective write.
#include <algorithm>
#include <cstdio>
#include <random>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/ckpt/internal.h"
#include "dtk/core/error.h"

namespace dtk::ckpt {
namespace fs = std::filesystem;

std::string rank_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d.h5", rank);
  return buf;
}

namespace {

// Completes a sharded state whose rank files are in tmp_dir: writes the index (virtual datasets
// over the rank files), then renames tmp_dir over dir.
void finish_sharded(const fs::path& tmp_dir, const fs::path& dir, const std::vector<TensorInfo>& index,
                    const Metadata& meta, int world_size, const std::string& id) {
  FileWriter w(tmp_dir / "index.h5");
  for (const TensorInfo& ti : index) {
    std::vector<FileWriter::Source> src;
    if (ti.sharded()) {
      for (int r = 0; r < world_size; ++r)
        if (ti.shard_lengths[r] > 0) src.push_back({rank_file_name(r), ti.shard_offsets[r], ti.shard_lengths[r]});
    } else {  // a whole tensor in its owner's file
      src.push_back({rank_file_name(ti.owner), 0, ti.shape.empty() ? 1 : ti.shape[0]});
    }
    w.create_virtual(ti.name, ti.shape, ti.dtype, src);
    if (ti.sharded()) w.set_attrs(ti.name, {{"shard_offsets", ti.shard_offsets}, {"shard_lengths", ti.shard_lengths}});
  }
  w.set_metadata(meta);
  w.set_root_attr("shard_world_size", world_size);
  w.set_root_attr(kStateId, id);
  w.commit();
  // An existing state at dir is moved aside first and removed only once the new one is in place.
  std::error_code ec;
  fs::path old;
  if (fs::exists(dir)) {
    old = temp_name(dir);
    fs::rename(dir, old, ec);
    if (ec) fail("cannot move " + dir.string() + " aside to replace it: " + ec.message());
  }
  fs::rename(tmp_dir, dir, ec);
  if (ec) {
    std::error_code back;
    if (!old.empty()) fs::rename(old, dir, back);
    fail("cannot rename " + tmp_dir.string() + " to " + dir.string() + ": " + ec.message());
  }
  if (!old.empty()) fs::remove_all(old, ec);
  fsync_path(dir.parent_path().empty() ? fs::path(".") : dir.parent_path(), true);
}

// A new state_id: 128 random bits as 32 hex digits.
std::string new_state_id() {
  std::random_device rd;
  char buf[33];
  std::snprintf(buf, sizeof buf, "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return buf;
}

// Broadcasts a string from `root` to every rank of comm.
std::string broadcast_string(comm::Communicator& comm, std::string s, int root) {
  int64_t n = static_cast<int64_t>(s.size());
  comm.broadcast({&n, 1, DType::i64, {}}, root, comm::Mode::sync).wait();
  s.resize(static_cast<size_t>(n));
  if (n > 0) comm.broadcast({s.data(), s.size(), DType::u8, {}}, root, comm::Mode::sync).wait();
  return s;
}

}  // namespace

std::string agree(comm::Communicator& comm, const std::string& error) {
  int32_t first = error.empty() ? comm.size() : comm.rank();
  comm.all_reduce({&first, 1, DType::i32, {}}, {&first, 1, DType::i32, {}}, comm::ReduceOp::min, comm::Mode::sync).wait();
  if (first == comm.size()) return {};
  return broadcast_string(comm, first == comm.rank() ? error : std::string(), first);
}

ShardedWriter::ShardedWriter(fs::path dir, comm::Communicator& comm, WriteOptions opts)
    : dir_(std::move(dir)), comm_(comm) {
  std::string err;
  if (comm_.rank() == 0) {
    try {
      const fs::path parent = dir_.parent_path().empty() ? fs::path(".") : dir_.parent_path();
      if (!fs::is_directory(parent))
        fail("cannot write " + dir_.string() + ": directory " + parent.string() + " does not exist");
      tmp_dir_ = temp_name(dir_);
      std::error_code ec;
      fs::create_directory(tmp_dir_, ec);
      if (ec) fail("cannot create " + tmp_dir_.string() + ": " + ec.message());
      id_ = new_state_id();
    } catch (const std::exception& e) {
      err = e.what();
      tmp_dir_.clear();
    }
  }
  settle(err);
  tmp_dir_ = broadcast_string(comm_, tmp_dir_.string(), 0);
  id_ = broadcast_string(comm_, id_, 0);
  err.clear();
  try {
    mine_ = std::make_unique<FileWriter>(tmp_dir_ / rank_file_name(comm_.rank()), opts);
  } catch (const std::exception& e) {
    err = e.what();
  }
  settle(err);
}

ShardedWriter::~ShardedWriter() = default;

void ShardedWriter::settle(const std::string& error) {
  std::string e = agree(comm_, error);
  if (e.empty()) return;
  // Name the destination, not the temporary directory that is about to go.
  if (!tmp_dir_.empty() && e.starts_with(tmp_dir_.string())) e = dir_.string() + e.substr(tmp_dir_.string().size());
  mine_.reset();  // this rank's temporary file
  comm_.barrier(comm::Mode::sync).wait();
  if (comm_.rank() == 0 && !tmp_dir_.empty()) {
    std::error_code ec;
    fs::remove_all(tmp_dir_, ec);
  }
  throw AgreedError(e, 1);
}

void ShardedWriter::write_shard(const std::string& name, const Shape& shape, const Tensor& local,
                                const std::vector<int64_t>& offsets, const std::vector<int64_t>& lengths) {
  const int r = comm_.rank();
  if (static_cast<int>(offsets.size()) != comm_.size() || static_cast<int>(lengths.size()) != comm_.size())
    fail_usage("write_shard " + name + ": offsets and lengths need one entry per rank");
  if (shape.empty()) fail_usage("write_shard " + name + ": a 0-d tensor cannot be sharded; use write_whole");
  Shape ls = shape;
  ls[0] = lengths[r];
  if (local.shape() != ls) fail_usage("write_shard " + name + ": local " + local.str() + ", expected " + shape_str(ls));
  mine_->write(name, local);
  index_.push_back(TensorInfo{name, shape, local.dtype(), offsets, lengths, -1});
}

void ShardedWriter::write_whole(const std::string& name, const Shape& shape, DType t, int owner, const Tensor& data) {
  if (comm_.rank() == owner) {
    if (data.shape() != shape || data.dtype() != t)
      fail_usage("write_whole " + name + ": " + data.str() + ", expected " + std::string(dtype_name(t)) + shape_str(shape));
    mine_->write(name, data);
  }
  index_.push_back(TensorInfo{name, shape, t, {}, {}, owner});
}

void ShardedWriter::set_metadata(const Metadata& m) {
  meta_ = m;
  if (meta_.created.empty()) {  // rank 0's clock for every file, so the rank files agree
    char stamp[64] = {};
    const std::string now = now_iso8601();
    std::snprintf(stamp, sizeof stamp, "%s", now.c_str());
    comm_.broadcast({stamp, sizeof stamp, DType::u8, {}}, 0, comm::Mode::sync).wait();
    meta_.created = stamp;
  }
}

void ShardedWriter::commit_mine() {
  mine_->set_metadata(meta_);
  mine_->set_root_attr(kStateId, id_);
  mine_->commit();
  mine_committed_ = true;
}

void ShardedWriter::commit() {
  std::string err;
  try {
    if (!mine_committed_) commit_mine();
  } catch (const std::exception& e) {
    err = e.what();
  }
  settle(err);  // every rank file is complete
  mine_.reset();
  if (comm_.rank() == 0) {
    try {
      finish_sharded(tmp_dir_, dir_, index_, meta_, comm_.size(), id_);
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  settle(err);
}

// ------------------------------------------------------------------------------ SerialShardedWriter

void even_split(int64_t rows, int world_size, std::vector<int64_t>& offsets, std::vector<int64_t>& lengths) {
  if (world_size < 1) fail_usage("a sharded state needs at least one rank, got {}", world_size);
  offsets.assign(static_cast<size_t>(world_size), 0);
  lengths.assign(static_cast<size_t>(world_size), 0);
  const int64_t base = rows / world_size, extra = rows % world_size;
  int64_t off = 0;
  for (int r = 0; r < world_size; ++r) {
    offsets[r] = off;
    lengths[r] = base + (r < extra ? 1 : 0);
    off += lengths[r];
  }
}

SerialShardedWriter::SerialShardedWriter(fs::path dir, int world_size, WriteOptions opts) : dir_(std::move(dir)) {
  if (world_size < 1) fail_usage("a sharded state needs at least one rank, got {}", world_size);
  const fs::path parent = dir_.parent_path().empty() ? fs::path(".") : dir_.parent_path();
  if (!fs::is_directory(parent))
    fail_usage("cannot write " + dir_.string() + ": directory " + parent.string() + " does not exist");
  tmp_dir_ = temp_name(dir_);
  id_ = new_state_id();
  std::error_code ec;
  fs::create_directory(tmp_dir_, ec);
  if (ec) fail("cannot create " + tmp_dir_.string() + ": " + ec.message());
  try {
    for (int r = 0; r < world_size; ++r)
      files_.push_back(std::make_unique<FileWriter>(tmp_dir_ / rank_file_name(r), opts));
  } catch (...) {
    files_.clear();
    fs::remove_all(tmp_dir_, ec);
    throw;
  }
}

SerialShardedWriter::~SerialShardedWriter() {
  files_.clear();
  if (!committed_) {
    std::error_code ec;
    fs::remove_all(tmp_dir_, ec);
  }
}

void SerialShardedWriter::create(const TensorInfo& t) {
  TensorInfo ti = t;
  const int n = world_size();
  if (ti.sharded()) {
    if (ti.shape.empty()) fail_usage("create " + ti.name + ": a 0-d tensor cannot be sharded");
    if (static_cast<int>(ti.shard_offsets.size()) != n || static_cast<int>(ti.shard_lengths.size()) != n)
      fail_usage("create {}: shard offsets and lengths need one entry per rank ({})", ti.name, n);
    for (int r = 0; r < n; ++r)
      if (ti.shard_offsets[r] < 0 || ti.shard_lengths[r] < 0 || ti.shard_offsets[r] + ti.shard_lengths[r] > ti.shape[0])
        fail_usage("create {}: rank {}'s rows do not fit {}", ti.name, r, shape_str(ti.shape));
    ti.owner = -1;
    for (int r = 0; r < n; ++r) {
      Shape local = ti.shape;
      local[0] = ti.shard_lengths[r];
      files_[r]->create(ti.name, local, ti.dtype);
    }
  } else {
    if (ti.owner < 0) ti.owner = 0;
    if (ti.owner >= n)
      fail_usage("create {}: owner rank {} is not below {}", ti.name, ti.owner, n);
    files_[ti.owner]->create(ti.name, ti.shape, ti.dtype);
  }
  index_.push_back(std::move(ti));
}

void SerialShardedWriter::write_rows(const std::string& name, int64_t row0, const Tensor& rows) {
  const auto it = std::find_if(index_.begin(), index_.end(), [&](const TensorInfo& t) { return t.name == name; });
  if (it == index_.end()) fail_usage("write " + name + ": no such tensor was created");
  if (!it->sharded()) {
    files_[it->owner]->write_rows(name, row0, rows);
    return;
  }
  const int64_t n = rows.ndim() == 0 ? 1 : rows.dim(0);
  for (int r = 0; r < world_size(); ++r) {
    const int64_t lo = std::max(row0, it->shard_offsets[r]);
    const int64_t hi = std::min(row0 + n, it->shard_offsets[r] + it->shard_lengths[r]);
    if (lo < hi) files_[r]->write_rows(name, lo - it->shard_offsets[r], rows.slice(lo - row0, hi - row0));
  }
}

void SerialShardedWriter::set_metadata(const Metadata& m) {
  meta_ = m;
  if (meta_.created.empty()) meta_.created = now_iso8601();
}

void SerialShardedWriter::commit() {
  const size_t n = files_.size();
  for (auto& f : files_) {
    f->set_metadata(meta_);
    f->set_root_attr(kStateId, id_);
    f->commit();
  }
  files_.clear();
  finish_sharded(tmp_dir_, dir_, index_, meta_, static_cast<int>(n), id_);
  committed_ = true;
}

}  // namespace dtk::ckpt
