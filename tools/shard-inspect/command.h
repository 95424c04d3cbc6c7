// shard-inspect's subcommands and what they share: opening inputs, guarding outputs, streaming
// tensors chunk by chunk, printing tables and JSON.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/core/tensor.h"

namespace dtk::inspect {
namespace fs = std::filesystem;

// A subcommand: its options, a validate phase that opens inputs and checks outputs (UsageError:
// exit 2, before anything is written) and the work, which returns the exit status.
class Command {
 public:
  virtual ~Command() = default;
  virtual void add_options(CLI::App& sub) = 0;
  virtual void validate() = 0;
  virtual int run() = 0;
};

// What every writing subcommand shares: the input CKPT, -o OUT, --force and --gzip.
class WriteCommand : public Command {
 protected:
  // --gzip only where the output is HDF5 (hdf5_output).
  void add_io_options(CLI::App& sub, const std::string& input_help, bool hdf5_output = true);
  // Opens the input, then checks the output (a directory when it will be a sharded state).
  void open(bool directory_output);
  void open_like_input() { open_input_only(); check(in_->sharded()); }
  void open_input_only();
  void check(bool directory_output);
  ckpt::WriteOptions write_options() const { return {.gzip = gzip_, .checksum = true}; }

  std::string input_, output_;
  bool force_ = false;
  int gzip_ = 0;
  std::unique_ptr<ckpt::Reader> in_;
};

struct CommandSpec {
  const char* name;
  const char* summary;
  std::unique_ptr<Command> (*make)();
};
const std::vector<CommandSpec>& commands();

std::unique_ptr<Command> make_ls();
std::unique_ptr<Command> make_show();
std::unique_ptr<Command> make_stats();
std::unique_ptr<Command> make_verify();
std::unique_ptr<Command> make_diff();
std::unique_ptr<Command> make_consolidate();
std::unique_ptr<Command> make_reshard();
std::unique_ptr<Command> make_convert();
std::unique_ptr<Command> make_extract();
std::unique_ptr<Command> make_export();

// ---------------------------------------------------------------------------- streaming
// Host memory for one chunk of one tensor (a chunk is at least one row of dim 0).
inline constexpr size_t kChunkBytes = size_t{64} << 20;

// Rows of dim 0 per chunk of t when each element takes elem_bytes of the budget.
int64_t rows_per_chunk(const ckpt::TensorInfo& t, size_t elem_bytes, size_t budget);

// The chunks of a tensor in order, rows of dim 0 at a time, read when asked for (a 0-d tensor:
// one chunk, the 0-d tensor; an empty tensor: one chunk, its empty rows).
class Chunks {
 public:
  Chunks(const ckpt::Reader& in, const ckpt::TensorInfo& t, int64_t chunk_rows)
      : in_(in), t_(t), chunk_rows_(chunk_rows), rows_(t.shape.empty() ? 1 : t.shape[0]) {}
  // Reads the next chunk into x; false after the last.
  bool next(Tensor& x);
  int64_t row0() const { return row0_; }  // the first row of the chunk last read

 private:
  const ckpt::Reader& in_;
  const ckpt::TensorInfo& t_;
  const int64_t chunk_rows_, rows_;
  int64_t row0_ = 0, next_ = 0;
  bool done_ = false;
};

// Calls f(row0, rows) over the whole tensor, chunk by chunk (Chunks).
template <typename F>
void for_each_chunk(const ckpt::Reader& in, const ckpt::TensorInfo& t, int64_t chunk_rows, F&& f) {
  Chunks chunks(in, t, chunk_rows);
  for (Tensor x; chunks.next(x);) f(chunks.row0(), x);
}

// The values of a host tensor as f64 (exact for every float dtype).
Tensor to_f64(const Tensor& t);

// ---------------------------------------------------------------------------- inputs, outputs
// Opens a checkpoint (a file, a sharded state's directory or its index.h5); UsageError if bad.
std::unique_ptr<ckpt::Reader> open_input(const fs::path& p);

// NAME arguments select tensors by full name, or a group by a prefix ending in '/' (model/).
bool selected(const std::string& tensor, const std::vector<std::string>& names);
// UsageError naming the first NAME that selects no tensor of any of the inputs.
void check_names(const std::vector<std::string>& names, std::initializer_list<const ckpt::Reader*> inputs);
// Checks that `out` may be written: its directory exists, it is not the input, and it does not
// exist unless `force` (then it must be of the kind written: a directory for sharded states).
void check_output(const fs::path& out, bool force, bool directory, const ckpt::Reader& in);

// A file written under a temporary name in its directory (ckpt::temp_name, which first removes
// dead writers' temporaries there) and renamed into place by commit(); without commit() the
// temporary file is removed.
class AtomicFile {
 public:
  explicit AtomicFile(fs::path path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t bytes);
  void write(const std::string& s) { write(s.data(), s.size()); }
  uint64_t tell() const { return pos_; }
  void write_at(uint64_t offset, const void* data, size_t bytes);  // overwrites written bytes
  void commit();

 private:
  fs::path path_, tmp_;
  std::FILE* f_ = nullptr;
  uint64_t pos_ = 0;
};

// ---------------------------------------------------------------------------- output
// A table on stdout: a header row starting with '#', columns aligned, then the rows.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : rows_{std::move(header)} {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print() const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

std::string num(double v);             // %.6g; "inf", "-inf", "nan"
nlohmann::json json_num(double v);     // null when not finite (JSON has no inf or nan)
std::string sharding(const ckpt::TensorInfo& t);  // "4 shards, dim 0", "rank 2" or "-"
nlohmann::json tensor_json(const ckpt::TensorInfo& t);  // name, dtype, shape, bytes, sharding
void print_json(const nlohmann::json& j);
void print_path(const fs::path& p);  // the path written, on stdout

}  // namespace dtk::inspect
