// The dtk checkpoint schema (man 5 dtk-checkpoint): writing, reading and validating full
// checkpoints and sharded states, atomically.
//
// A full checkpoint is one HDF5 file. Every tensor is a dataset named by its path
// ("model/layers.0.attention.wq.weight", "optim/...", "compress/..."); state that differs per
// rank lives under "ranks/<r>/". Root attributes: format "dtk-checkpoint", schema_version,
// program, program_version, step, world_size, created, and JSON documents model_config,
// optim_config, data_position, rng_state and extra.
//
// A sharded state is a directory: rank-<r>.h5 per rank, each written by its rank alone, holding
// that rank's rows (dim 0) of every sharded tensor under the same names (plus whole tensors the
// rank owns), and index.h5, whose virtual datasets present every full tensor over the rank
// files; each sharded index dataset carries attributes shard_offsets and shard_lengths, the
// index file the root attribute shard_world_size. A whole tensor of a sharded state is a virtual
// dataset over the one rank file that holds it (its owner).
//
// Writes go to a temporary name in the destination's directory, are flushed and fsynced, and are
// renamed over the final name at commit: a crash leaves the old checkpoint or the new one.
// Temporaries are named ".<name>.tmp-<host>-<pid>-<n>" (temp_name); the next write into the same
// directory removes those whose writer is dead (a process of this host that no longer exists).
//
// Identity of a sharded state: every rank file and the index carry the root attribute state_id,
// a random 128-bit id (32 hex digits) made once per sharded write and shared by every rank of it.
// Reader refuses (UsageError naming the odd rank file) a sharded state whose rank files do not
// all carry the index's state_id: rank files of different writes mixed in one directory. Files
// written before state_id existed carry none: a state where no file has one is accepted as it
// always was; one where only some files have it is a mix and refused.
//
// Errors: a write that fails (a full disk, a permission, an HDF5 error) is an Error (exit 1)
// naming the file; collective writes (save_state, save_sharded_state, ShardedWriter) fail on
// every rank alike with AgreedError(message of the lowest failing rank, 1) and leave no
// temporary behind. Anything wrong with a checkpoint being read (not a checkpoint, damaged,
// truncated, unreadable, mixed) is a UsageError (exit 2) naming the file.
#pragma once
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/core/tensor.h"

namespace dtk::ckpt {

inline constexpr int64_t kSchemaVersion = 1;
inline constexpr const char* kFormat = "dtk-checkpoint";

struct Metadata {
  std::string program;
  std::string program_version;
  int64_t step = 0;
  int64_t world_size = 1;
  std::string created;  // ISO 8601 UTC; filled at commit when empty
  nlohmann::json model_config = nlohmann::json::object();
  nlohmann::json optim_config = nlohmann::json::object();
  nlohmann::json data_position = nlohmann::json::object();
  nlohmann::json rng_state = nlohmann::json::object();
  nlohmann::json extra = nlohmann::json::object();
};

// A tensor as stored: its full shape and, for sharded tensors, each rank's rows of dim 0.
struct TensorInfo {
  std::string name;
  Shape shape;
  DType dtype = DType::f32;
  std::vector<int64_t> shard_offsets, shard_lengths;  // empty when not sharded
  int owner = -1;  // a whole tensor of a sharded state: the rank whose file holds it; else -1
  bool sharded() const { return !shard_offsets.empty(); }
  size_t bytes() const { return static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype); }
};

struct WriteOptions {
  int gzip = 0;          // 0: none; 1..9: HDF5's deflate filter at that level
  bool checksum = true;  // HDF5's Fletcher32 on every dataset
};

// Writes one HDF5 file of the schema (a full checkpoint, or one rank's file of a sharded state).
class FileWriter {
 public:
  explicit FileWriter(std::filesystem::path path, WriteOptions opts = {});
  ~FileWriter();  // without commit(), the temporary file is removed
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  // A whole tensor from any device (device tensors are copied to the host in chunks).
  void write(const std::string& name, const Tensor& t);
  // Streaming: create a dataset, then fill it by rows of dim 0.
  void create(const std::string& name, const Shape& shape, DType t);
  void write_rows(const std::string& name, int64_t row0, const Tensor& rows);
  void set_attrs(const std::string& name, const std::map<std::string, std::vector<int64_t>>& attrs);
  void set_metadata(const Metadata& m);
  void set_root_attr(const char* name, int64_t value);
  void set_root_attr(const char* name, const std::string& value);
  // A virtual dataset over rows of datasets of the same name in other files (relative paths
  // resolve against this file's directory).
  struct Source {
    std::string file;
    int64_t row0 = 0, rows = 0;
  };
  void create_virtual(const std::string& name, const Shape& shape, DType t, const std::vector<Source>& sources);
  void commit();  // flush, close, fsync, rename over the final path, fsync the directory

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_, tmp_;
  WriteOptions opts_;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Reads a full checkpoint file or a sharded state (its directory or its index.h5): validates
// the format and schema version on open; every read checks shape, dtype and checksums and names
// the first problem (UsageError: the input is bad).
class Reader {
 public:
  // A checkpoint file, a sharded state's directory, or a checkpoint directory (Directory): its
  // latest checkpoint.
  explicit Reader(const std::filesystem::path& path);
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  // How many Readers this process has opened on `path` (as given): a resume opens its checkpoint
  // once (tests/tools/resume.sh).
  static int times_opened(const std::filesystem::path& path);

  bool sharded() const;
  const std::filesystem::path& path() const { return path_; }  // the file opened (index.h5 when sharded)
  const Metadata& metadata() const;
  const std::vector<TensorInfo>& tensors() const;  // sorted by name
  const TensorInfo& info(const std::string& name) const;  // UsageError when missing
  bool contains(const std::string& name) const;

  Tensor read(const std::string& name, Device d = Device::cpu()) const;
  // Reads into an existing tensor, which must have the stored shape and dtype.
  void read_into(const std::string& name, Tensor& out) const;
  // Rows [row0, row0 + out.dim(0)) of dim 0 (streaming; out on the host).
  void read_rows(const std::string& name, int64_t row0, Tensor& out) const;
  // The shard files of a sharded state (empty for a full checkpoint).
  std::vector<std::filesystem::path> shard_files() const;

 private:
  void open(const std::filesystem::path& path);
  void read_stored(const std::string& name, const Shape& full, const Shape& rows, int64_t row0, Tensor& out) const;
  std::filesystem::path path_;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A sharded state written by every rank of `comm` together: each rank writes its own file; at
// commit, rank 0 writes the index once every rank has finished, then renames the directory
// into place. Collective: every rank calls every method in the same order.
class ShardedWriter {
 public:
  // Rank 0 creates the temporary directory; a failure on any rank is an AgreedError on every rank.
  ShardedWriter(std::filesystem::path dir, comm::Communicator& comm, WriteOptions opts = {});
  // Without commit(), each rank's temporary file is removed; the temporary directory stays until
  // the next write into `dir`'s parent after rank 0's process has ended (remove_stale_temporaries).
  ~ShardedWriter();
  ShardedWriter(const ShardedWriter&) = delete;
  ShardedWriter& operator=(const ShardedWriter&) = delete;
  // This rank's rows [offset, offset + local.dim(0)) of a tensor of global shape `shape`;
  // `offsets` and `lengths` give every rank's rows (the same on every rank).
  void write_shard(const std::string& name, const Shape& shape, const Tensor& local,
                   const std::vector<int64_t>& offsets, const std::vector<int64_t>& lengths);
  // A whole tensor stored once, in rank `owner`'s file (only that rank passes a defined tensor;
  // every rank passes the shape and dtype).
  void write_whole(const std::string& name, const Shape& shape, DType t, int owner, const Tensor& data);
  void set_metadata(const Metadata& m);
  // This rank's part of commit() alone, without communication (a write in the background runs it
  // on a thread of its own, after set_metadata): its file completed and renamed into the
  // temporary directory. commit() does it when it has not been done.
  void commit_mine();
  // Collective: every rank passes its own error from the writes above ("" when they succeeded);
  // when any rank failed, every rank removes its temporaries and throws AgreedError(message of
  // the lowest failing rank, 1).
  void settle(const std::string& error);
  // Collective; a failure on any rank (its file, or rank 0's index and rename) is an
  // AgreedError on every rank, and no temporary is left.
  void commit();

 private:
  std::filesystem::path dir_, tmp_dir_;
  comm::Communicator& comm_;
  std::unique_ptr<FileWriter> mine_;
  bool mine_committed_ = false;
  std::vector<TensorInfo> index_;
  Metadata meta_;
  std::string id_;  // state_id, rank 0's, the same on every rank
};

// A sharded state of `world_size` ranks written by one process (resharding, conversion, tests):
// every rank file is open here, and tensors are streamed by global rows of dim 0, which are
// routed to the rank files that hold them. The same files and index as ShardedWriter's.
class SerialShardedWriter {
 public:
  SerialShardedWriter(std::filesystem::path dir, int world_size, WriteOptions opts = {});
  ~SerialShardedWriter();  // without commit(), the temporary directory is removed
  SerialShardedWriter(const SerialShardedWriter&) = delete;
  SerialShardedWriter& operator=(const SerialShardedWriter&) = delete;

  // A tensor: sharded (t.shard_offsets and t.shard_lengths give every rank's rows of dim 0) or
  // whole in rank t.owner's file (0 when t.owner is -1).
  void create(const TensorInfo& t);
  // Rows [row0, row0 + rows.dim(0)) of the full tensor (a 0-d tensor: the whole of it).
  void write_rows(const std::string& name, int64_t row0, const Tensor& rows);
  void set_metadata(const Metadata& m);
  void commit();  // every rank file, then the index; then the directory is renamed into place

  int world_size() const { return static_cast<int>(files_.size()); }

 private:
  std::filesystem::path dir_, tmp_dir_;
  std::vector<std::unique_ptr<FileWriter>> files_;
  std::vector<TensorInfo> index_;
  Metadata meta_;
  std::string id_;  // state_id
  bool committed_ = false;
};

// Rows of dim 0 split as evenly as possible over `world_size` ranks, the first ranks taking one
// extra row: offsets and lengths for TensorInfo / ShardedWriter::write_shard.
void even_split(int64_t rows, int world_size, std::vector<int64_t>& offsets, std::vector<int64_t>& lengths);

// Rank file names inside a sharded state.
std::string rank_file_name(int rank);

// A checkpoint directory with retention: step-<8 digits>[.h5] entries and a `latest` file that
// names the newest complete one, updated after the entry is in place.
class Directory {
 public:
  Directory(std::filesystem::path dir, int keep);
  std::filesystem::path entry(int64_t step, bool sharded) const;
  // Records `entry` as the latest (atomically) and removes all but the newest `keep` entries,
  // and dead writers' temporaries (remove_stale_temporaries).
  void finish(const std::filesystem::path& entry);
  // The latest complete entry, if any (the `latest` file, else the newest entry present).
  std::optional<std::filesystem::path> latest() const;

 private:
  std::filesystem::path dir_;
  int keep_;
};

// Writes text to path atomically (temporary file in the same directory, fsync, rename).
void write_file_atomic(const std::filesystem::path& path, const std::string& text);

// A temporary name for `dest` in its directory, ".<name>.tmp-<host>-<pid>-<n>", after removing
// the temporaries there that dead writers left (remove_stale_temporaries). Every writer of dtk
// (checkpoint files, sharded states' directories, `latest`, shard-inspect's outputs) takes its
// temporary names here.
std::filesystem::path temp_name(const std::filesystem::path& dest);
// Removes the temporaries in `dir` whose writer is dead: names of temp_name's form made on this
// host whose pid no longer runs (gone, a zombie not yet reaped, or reused by a process started
// after the temporary was last written). A live writer's temporaries, other hosts' (no sound way to
// tell whether their writer lives) and other names are left alone. Returns how many it removed.
int remove_stale_temporaries(const std::filesystem::path& dir);

// Agreement after a collective write: every rank of `comm` passes its own error ("" when its part
// succeeded) and learns, on every rank alike, "" when every rank succeeded, else the error of
// the lowest failing rank (callers then throw AgreedError(that, 1) on every rank). Collective.
std::string agree(comm::Communicator& comm, const std::string& error);
std::string now_iso8601();

}  // namespace dtk::ckpt
