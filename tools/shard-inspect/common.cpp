#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>

#include "command.h"
#include "dtk/cli/checks.h"
#include "dtk/core/checks.h"
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"

namespace dtk::inspect {

int64_t rows_per_chunk(const ckpt::TensorInfo& t, size_t elem_bytes, size_t budget) {
  int64_t row = 1;
  for (size_t i = 1; i < t.shape.size(); ++i) row *= t.shape[i];
  const size_t row_bytes = static_cast<size_t>(std::max<int64_t>(row, 1)) * elem_bytes;
  return std::max<int64_t>(1, static_cast<int64_t>(budget / row_bytes));
}

bool Chunks::next(Tensor& x) {
  if (done_) return false;
  Shape s = t_.shape;
  if (!s.empty()) s[0] = std::min(chunk_rows_, rows_ - next_);
  x = Tensor::empty(s, t_.dtype);
  in_.read_rows(t_.name, next_, x);
  row0_ = next_;
  next_ += s.empty() ? 1 : s[0];
  done_ = next_ >= rows_;
  return true;
}

Tensor to_f64(const Tensor& t) {
  if (t.dtype() == DType::f64) return t;
  Tensor out = Tensor::empty(t.shape(), DType::f64);
  ops::cast(t, out);
  return out;
}

std::unique_ptr<ckpt::Reader> open_input(const fs::path& p) {
  if (p.empty()) fail_usage("no checkpoint given");
  return std::make_unique<ckpt::Reader>(p);
}

void check_output(const fs::path& out, bool force, bool directory, const ckpt::Reader& in) {
  if (out.empty()) fail_usage("no output given (-o OUT)");
  check_output_parent("-o", out.string());
  std::error_code ec;
  const fs::path o = fs::weakly_canonical(out, ec);
  const fs::path file = fs::weakly_canonical(in.path(), ec);
  if (o == file || (in.sharded() && (o == file.parent_path() || o.parent_path() == file.parent_path())))
    fail_usage("output " + out.string() + " would overwrite the input " + in.path().string());
  if (!fs::exists(fs::symlink_status(out))) return;
  if (!force) fail_usage(out.string() + " exists; use --force to overwrite it");
  if (directory && !fs::is_directory(out))
    fail_usage(out.string() + " exists and is not a directory; a sharded state is a directory");
  if (!directory && fs::is_directory(out)) fail_usage(out.string() + " is a directory; remove it to write a file there");
  if (directory && !fs::exists(out / "index.h5") && !fs::is_empty(out))
    fail_usage(out.string() + " is a directory but not a sharded state; --force replaces only sharded states");
}

bool selected(const std::string& tensor, const std::vector<std::string>& names) {
  for (const auto& n : names)
    if (tensor == n || (!n.empty() && n.back() == '/' && tensor.rfind(n, 0) == 0)) return true;
  return false;
}

void check_names(const std::vector<std::string>& names, std::initializer_list<const ckpt::Reader*> inputs) {
  for (const auto& n : names) {
    bool any = false;
    std::string where;
    for (const auto* in : inputs) {
      for (const auto& t : in->tensors()) any = any || selected(t.name, {n});
      where += (where.empty() ? "" : " or ") + in->path().string();
    }
    if (!any) fail_usage("no tensor " + n + " in " + where);
  }
}

void WriteCommand::add_io_options(CLI::App& sub, const std::string& input_help, bool hdf5_output) {
  sub.add_option("CKPT", input_, input_help)->required();
  sub.add_option("-o,--output", output_, "where to write (a file, or a directory for a sharded state)")->required();
  sub.add_flag("-f,--force", force_, "overwrite an existing output");
  if (hdf5_output)
    sub.add_option("--gzip", gzip_, "compress datasets with HDF5's deflate filter at this level (0: none)")
        ->check(cli::between(0, 9));
}

void WriteCommand::open_input_only() { in_ = open_input(input_); }

void WriteCommand::check(bool directory_output) { check_output(output_, force_, directory_output, *in_); }

void WriteCommand::open(bool directory_output) {
  open_input_only();
  check(directory_output);
}

// ---------------------------------------------------------------------------- AtomicFile

AtomicFile::AtomicFile(fs::path path) : path_(std::move(path)) {
  tmp_ = ckpt::temp_name(path_);  // also removes dead writers' temporaries
  f_ = std::fopen(tmp_.c_str(), "wbx");
  if (!f_) fail("cannot create " + tmp_.string() + ": " + std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (f_) {
    std::fclose(f_);
    std::error_code ec;
    fs::remove(tmp_, ec);
  }
}

void AtomicFile::write(const void* data, size_t bytes) {
  if (bytes && std::fwrite(data, 1, bytes, f_) != bytes) fail("cannot write " + tmp_.string() + ": " + std::strerror(errno));
  pos_ += bytes;
}

void AtomicFile::write_at(uint64_t offset, const void* data, size_t bytes) {
  if (::fseeko(f_, static_cast<off_t>(offset), SEEK_SET) != 0 || std::fwrite(data, 1, bytes, f_) != bytes ||
      ::fseeko(f_, static_cast<off_t>(pos_), SEEK_SET) != 0)
    fail("cannot write " + tmp_.string() + ": " + std::strerror(errno));
}

void AtomicFile::commit() {
  if (std::fflush(f_) != 0 || ::fsync(::fileno(f_)) != 0) fail("cannot write " + tmp_.string() + ": " + std::strerror(errno));
  std::fclose(f_);
  f_ = nullptr;
  std::error_code ec;
  fs::rename(tmp_, path_, ec);
  if (ec) {
    fs::remove(tmp_);
    fail("cannot rename " + tmp_.string() + " to " + path_.string() + ": " + ec.message());
  }
  const fs::path dir = path_.parent_path().empty() ? fs::path(".") : path_.parent_path();
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// ---------------------------------------------------------------------------- output

void Table::print() const {
  std::vector<size_t> width;
  for (const auto& r : rows_)
    for (size_t i = 0; i < r.size(); ++i) {
      if (width.size() <= i) width.push_back(0);
      width[i] = std::max(width[i], r[i].size() + (&r == &rows_[0] && i == 0 ? 2 : 0));
    }
  for (size_t k = 0; k < rows_.size(); ++k) {
    std::string line = k == 0 ? "# " : "";
    for (size_t i = 0; i < rows_[k].size(); ++i) {
      line += rows_[k][i];
      if (i + 1 < rows_[k].size())
        line.append(width[i] - rows_[k][i].size() - (k == 0 && i == 0 ? 2 : 0) + 2, ' ');
    }
    std::cout << line << '\n';
  }
}

std::string num(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

nlohmann::json json_num(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

std::string sharding(const ckpt::TensorInfo& t) {
  if (t.sharded()) return fmt::format("{} shards, dim 0", t.shard_offsets.size());
  if (t.owner >= 0) return fmt::format("rank {}", t.owner);
  return "-";
}

nlohmann::json tensor_json(const ckpt::TensorInfo& t) {
  nlohmann::json j = {{"name", t.name}, {"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"bytes", t.bytes()}};
  if (t.sharded())
    j["sharding"] = {{"shards", t.shard_offsets.size()}, {"dim", 0}, {"offsets", t.shard_offsets}, {"lengths", t.shard_lengths}};
  else if (t.owner >= 0)
    j["sharding"] = {{"rank", t.owner}};
  else
    j["sharding"] = nullptr;
  return j;
}

void print_json(const nlohmann::json& j) { std::cout << j.dump(2) << '\n'; }

void print_path(const fs::path& p) { std::cout << p.string() << '\n'; }

}  // namespace dtk::inspect
