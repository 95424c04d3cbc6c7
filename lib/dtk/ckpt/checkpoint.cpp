#include "dtk/ckpt/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <fmt/format.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <fstream>
#include <random>
#include <sstream>

#include "dtk/ckpt/h5.h"
#include "dtk/core/error.h"

namespace dtk::ckpt {
namespace fs = std::filesystem;
using h5::check;
using h5::check_status;
using h5::Id;

namespace {

constexpr const char* kStateId = "state_id";  // a sharded state's identity (checkpoint.h)
constexpr size_t kChunkBytes = 1 << 20;   // target HDF5 chunk size
constexpr size_t kStageBytes = 64 << 20;  // host staging for device tensors and streaming

void fsync_path(const fs::path& p, bool directory) {
  const int fd = ::open(p.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) fail("cannot open " + p.string() + " to sync it: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) fail("fsync of " + p.string() + " failed: " + std::strerror(errno));
}

Shape dims_of(hid_t space) {
  const int nd = H5Sget_simple_extent_ndims(space);
  std::vector<hsize_t> d(static_cast<size_t>(std::max(nd, 0)));
  if (nd > 0) H5Sget_simple_extent_dims(space, d.data(), nullptr);
  return Shape(d.begin(), d.end());
}

int64_t row_elems(const Shape& s) {
  int64_t n = 1;
  for (size_t i = 1; i < s.size(); ++i) n *= s[i];
  return n;
}

// The stored shape of a tensor: 0-d tensors are kept as [1] (chunked, so checksummed) with the
// attribute dtk_scalar.
Shape stored_shape(const Shape& s) { return s.empty() ? Shape{1} : s; }

void write_metadata(hid_t file, const Metadata& m) {
  h5::set_attr(file, "format", std::string(kFormat));
  h5::set_attr(file, "schema_version", kSchemaVersion);
  h5::set_attr(file, "program", m.program);
  h5::set_attr(file, "program_version", m.program_version);
  h5::set_attr(file, "step", m.step);
  h5::set_attr(file, "world_size", m.world_size);
  h5::set_attr(file, "created", m.created.empty() ? now_iso8601() : m.created);
  h5::set_attr(file, "model_config", m.model_config.dump());
  h5::set_attr(file, "optim_config", m.optim_config.dump());
  h5::set_attr(file, "data_position", m.data_position.dump());
  h5::set_attr(file, "rng_state", m.rng_state.dump());
  h5::set_attr(file, "extra", m.extra.dump());
}

nlohmann::json json_attr(hid_t file, const char* name, const std::string& where) {
  if (!h5::has_attr(file, name)) return nlohmann::json::object();
  try {
    return nlohmann::json::parse(h5::get_attr_string(file, name));
  } catch (const nlohmann::json::exception& e) {
    fail_usage(where + ": attribute " + name + " is not valid JSON: " + e.what());
  }
}

Metadata read_metadata(hid_t file, const std::string& where) {
  if (!h5::has_attr(file, "format") || h5::get_attr_string(file, "format") != kFormat)
    fail_usage(where + ": not a dtk checkpoint (no format attribute \"" + kFormat + "\")");
  if (!h5::has_attr(file, "schema_version")) fail_usage(where + ": no schema_version attribute");
  const int64_t v = h5::get_attr_int(file, "schema_version");
  if (v != kSchemaVersion)
    fail_usage("{}: schema version {} is not supported (this dtk reads version {})", where, v, kSchemaVersion);
  Metadata m;
  auto str = [&](const char* n) { return h5::has_attr(file, n) ? h5::get_attr_string(file, n) : std::string(); };
  auto num = [&](const char* n) { return h5::has_attr(file, n) ? h5::get_attr_int(file, n) : int64_t{0}; };
  m.program = str("program");
  m.program_version = str("program_version");
  m.step = num("step");
  m.world_size = num("world_size");
  m.created = str("created");
  m.model_config = json_attr(file, "model_config", where);
  m.optim_config = json_attr(file, "optim_config", where);
  m.data_position = json_attr(file, "data_position", where);
  m.rng_state = json_attr(file, "rng_state", where);
  m.extra = json_attr(file, "extra", where);
  return m;
}

// Host rows of a tensor: the tensor itself on the host, else a staged copy.
template <typename F>
void for_host_rows(const Tensor& t, F&& f) {
  const Tensor flat = t.ndim() == 0 ? t.reshape({1}) : t;
  if (!flat.is_cuda()) {
    f(int64_t{0}, flat);
    return;
  }
  const int64_t rows = flat.dim(0), re = std::max<int64_t>(1, row_elems(flat.shape()));
  const int64_t step = std::max<int64_t>(1, static_cast<int64_t>(kStageBytes / (re * dtype_size(flat.dtype()))));
  for (int64_t r = 0; r < rows; r += step) {
    const Tensor part = flat.slice(r, std::min(rows, r + step));
    f(r, part.to(Device::cpu()));
  }
}

// The rank whose file holds a whole tensor of a sharded state: the source file of its virtual
// dataset's one mapping (rank-NNNNN.h5); -1 when it is not such a dataset.
int owner_of(hid_t ds) {
  Id dcpl(H5Dget_create_plist(ds));
  size_t count = 0;
  if (H5Pget_layout(dcpl) != H5D_VIRTUAL || H5Pget_virtual_count(dcpl, &count) < 0 || count != 1) return -1;
  const ssize_t len = H5Pget_virtual_filename(dcpl, 0, nullptr, 0);
  if (len <= 0) return -1;
  std::string file(static_cast<size_t>(len) + 1, '\0');
  H5Pget_virtual_filename(dcpl, 0, file.data(), file.size());
  file.resize(static_cast<size_t>(len));
  int rank = -1;
  char tail = 0;
  if (std::sscanf(file.c_str(), "rank-%d.h%c", &rank, &tail) != 2 || file != rank_file_name(rank)) return -1;
  return rank;
}

// "<file>: <what>", unless `what` names the file already.
std::string naming(const fs::path& file, const std::string& what) {
  return what.starts_with(file.string()) ? what : file.string() + ": " + what;
}

// Runs f, a read of the checkpoint `file`: any failure is bad input (UsageError, exit 2) that
// names the file, HDF5's and the system's errors included.
template <typename F>
void as_input(const fs::path& file, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    fail_usage(naming(file, e.what()));
  }
}

// Runs f, a write of `file`: failures name the file; bad usage stays a UsageError, anything
// else (HDF5, the system) is an Error (exit 1).
template <typename F>
void as_output(const fs::path& file, F&& f) {
  try {
    f();
  } catch (const UsageError& e) {
    fail_usage(naming(file, e.what()));
  } catch (const std::exception& e) {
    fail(naming(file, e.what()));
  }
}

// A file's state_id ("" when it has none: written before state_id existed, or a full checkpoint).
std::string state_id(hid_t file) { return h5::has_attr(file, kStateId) ? h5::get_attr_string(file, kStateId) : ""; }

}  // namespace

std::string now_iso8601() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// ------------------------------------------------------------------------------ temporaries

namespace {
constexpr const char* kTempTag = ".tmp-";

const std::string& host_name() {
  static const std::string name = [] {
    char buf[256] = {};
    if (::gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return std::string("localhost");
    return std::string(buf);
  }();
  return name;
}

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The writer's pid of a temporary's name ".<name>.tmp-<host>-<pid>-<n>" made on this host; -1
// for any other name (another host's temporary, or not one of ours).
long temp_owner(const std::string& file) {
  const size_t tag = file.rfind(kTempTag);
  if (file.empty() || file[0] != '.' || tag == std::string::npos) return -1;
  const std::string rest = file.substr(tag + std::strlen(kTempTag));
  const size_t d2 = rest.rfind('-');
  if (d2 == std::string::npos || d2 == 0) return -1;
  const size_t d1 = rest.rfind('-', d2 - 1);
  if (d1 == std::string::npos) return -1;
  const std::string host = rest.substr(0, d1), pid = rest.substr(d1 + 1, d2 - d1 - 1), n = rest.substr(d2 + 1);
  if (host != host_name() || !all_digits(pid) || !all_digits(n) || pid.size() > 9) return -1;
  return std::stol(pid);
}

bool process_alive(long pid) { return pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH); }
}  // namespace

int remove_stale_temporaries(const fs::path& dir) {
  int removed = 0;
  std::error_code ec;
  for (fs::directory_iterator it(dir.empty() ? fs::path(".") : dir, ec), end; !ec && it != end; it.increment(ec)) {
    const long pid = temp_owner(it->path().filename().string());
    if (pid < 0 || process_alive(pid)) continue;
    std::error_code rm;
    if (fs::remove_all(it->path(), rm) > 0 && !rm) {
      spdlog::info("removed {}, a temporary left by a writer that no longer runs (pid {})", it->path().string(), pid);
      ++removed;
    }
  }
  return removed;
}

fs::path temp_name(const fs::path& dest) {
  static std::atomic<int> counter{0};
  const fs::path dir = dest.parent_path();
  remove_stale_temporaries(dir);
  return dir / fmt::format(".{}{}{}-{}-{}", dest.filename().string(), kTempTag, host_name(), ::getpid(), counter++);
}

void write_file_atomic(const fs::path& path, const std::string& text) {
  const fs::path tmp = temp_name(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
  if (fd < 0) fail("cannot write " + path.string() + ": " + std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  const int err = done < text.size() || ::fsync(fd) != 0 ? errno : 0;
  if (::close(fd) != 0 || err) {
    const std::string why = std::strerror(err ? err : errno);
    std::error_code ec;
    fs::remove(tmp, ec);
    fail("cannot write " + path.string() + ": " + why);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();
    fs::remove(tmp, ec);
    fail("cannot rename " + tmp.string() + " to " + path.string() + ": " + why);
  }
  fsync_path(path.parent_path().empty() ? fs::path(".") : path.parent_path(), true);
}

// ------------------------------------------------------------------------------ FileWriter

namespace {
// Dataset access without HDF5's chunk cache: chunks are written by H5Dwrite itself, so a failed
// write is reported there, and closing a dataset never writes (and so never fails).
hid_t uncached() {
  static const hid_t dapl = [] {
    const hid_t p = H5Pcreate(H5P_DATASET_ACCESS);
    H5Pset_chunk_cache(p, 0, 0, 1.0);
    return p;
  }();
  return dapl;
}
}  // namespace

struct FileWriter::Impl {
  Id file;
  bool committed = false;  // renamed into place; else the destructor removes the temporary
};

FileWriter::FileWriter(fs::path path, WriteOptions opts) : path_(std::move(path)), opts_(opts), impl_(new Impl) {
  h5::quiet();
  const fs::path dir = path_.parent_path().empty() ? fs::path(".") : path_.parent_path();
  if (!fs::is_directory(dir)) fail_usage("cannot write " + path_.string() + ": directory " + dir.string() + " does not exist");
  if (opts_.gzip < 0 || opts_.gzip > 9) fail_usage("gzip level must be 0..9, got {}", opts_.gzip);
  tmp_ = temp_name(path_);
  as_output(path_, [&] {
    impl_->file = Id(check(H5Fcreate(tmp_.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, H5P_DEFAULT), "create " + tmp_.string()));
  });
}

// A file that will not be committed is discarded. HDF5 1.10 cannot close a file whose last
// writes fail (a full disk): H5Fclose fails, frees the file but leaves its id registered, and
// the library closes that id again at exit and crashes (SIGSEGV in H5F__close_cb from
// H5_term_library; fixed upstream by HDF5 pull request 2291, after the 1.10.8 that Debian 12
// ships). The temporary is removed anyway, so its descriptor is first pointed at an anonymous
// memory file: the closing writes land there and the close succeeds.
FileWriter::~FileWriter() {
  if (!impl_) return;
  if (!impl_->committed && impl_->file.valid()) {
    void* handle = nullptr;
    if (H5Fget_vfd_handle(impl_->file, H5P_DEFAULT, &handle) >= 0 && handle) {
      const int mem = ::memfd_create("dtk-discarded-checkpoint", 0);
      if (mem >= 0) {
        ::dup2(mem, *static_cast<int*>(handle));
        ::close(mem);
      }
    }
  }
  impl_->file.reset();
  if (!impl_->committed && !tmp_.empty()) {
    std::error_code ec;
    fs::remove(tmp_, ec);
  }
}

void FileWriter::create(const std::string& name, const Shape& shape, DType t) {
  as_output(path_, [&] {
    const Shape s = stored_shape(shape);
    h5::make_parents(impl_->file, name);
    std::vector<hsize_t> dims(s.begin(), s.end()), maxdims = dims, chunk = dims;
    const size_t row_bytes = static_cast<size_t>(std::max<int64_t>(1, row_elems(s))) * dtype_size(t);
    for (size_t i = 0; i < dims.size(); ++i) {
      if (dims[i] == 0) maxdims[i] = H5S_UNLIMITED;  // chunk sizes must not exceed fixed extents
      chunk[i] = std::max<hsize_t>(1, dims[i]);
    }
    // Rows per chunk: at most kChunkBytes, in chunks of equal size (a last chunk filled only in
    // part would still take a whole chunk's space on disk).
    const hsize_t rows = std::max<hsize_t>(1, dims[0]);
    const hsize_t most = std::clamp<hsize_t>(kChunkBytes / row_bytes, 1, rows), count = (rows + most - 1) / most;
    chunk[0] = (rows + count - 1) / count;
    // Rows far larger than a chunk (HDF5 caps chunks at 4 GiB) are split along dim 1 too.
    if (chunk.size() > 1 && row_bytes > 64 * kChunkBytes)
      chunk[1] = std::max<hsize_t>(1, kChunkBytes / (row_bytes / std::max<hsize_t>(1, dims[1])));
    Id space(check(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), maxdims.data()), "dataspace " + name));
    Id dcpl(H5Pcreate(H5P_DATASET_CREATE));
    check_status(H5Pset_chunk(dcpl, static_cast<int>(chunk.size()), chunk.data()), "chunking " + name);
    if (opts_.gzip > 0) {
      H5Pset_shuffle(dcpl);
      H5Pset_deflate(dcpl, static_cast<unsigned>(opts_.gzip));
    }
    if (opts_.checksum) check_status(H5Pset_fletcher32(dcpl), "checksum " + name);
    Id ds(check(H5Dcreate2(impl_->file, name.c_str(), h5::file_type(t), space, H5P_DEFAULT, dcpl, uncached()),
                "create dataset " + name));
    if (shape.empty()) h5::set_attr(ds, "dtk_scalar", int64_t{1});
  });
}

void FileWriter::write_rows(const std::string& name, int64_t row0, const Tensor& rows) {
  as_output(path_, [&] {
    Id ds(check(H5Dopen2(impl_->file, name.c_str(), uncached()), "open dataset " + name));
    Id fspace(H5Dget_space(ds));
    const Shape full = dims_of(fspace);
    const DType t = h5::dtype_of(Id(H5Dget_type(ds)), name);
    if (rows.dtype() != t) fail_usage("write " + name + ": " + rows.str() + " into a " + std::string(dtype_name(t)) + " dataset");
    for_host_rows(rows, [&](int64_t r, const Tensor& host) {
      const Shape hs = host.ndim() == 0 ? Shape{1} : host.shape();
      if (hs.size() != full.size() || !std::equal(hs.begin() + 1, hs.end(), full.begin() + 1) ||
          row0 + r + hs[0] > full[0])
        fail_usage("write {}: rows {} at row {} do not fit the dataset's shape {}", name, shape_str(hs), row0 + r,
                   shape_str(full));
      if (hs[0] == 0) return;
      std::vector<hsize_t> start(full.size(), 0), count(hs.begin(), hs.end());
      start[0] = static_cast<hsize_t>(row0 + r);
      Id fs_sel(H5Scopy(fspace));
      H5Sselect_hyperslab(fs_sel, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
      Id mspace(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr));
      check_status(H5Dwrite(ds, h5::memory_type(t), mspace, fs_sel, H5P_DEFAULT, host.data()), "write " + name);
    });
  });
}

void FileWriter::write(const std::string& name, const Tensor& t) {
  create(name, t.shape(), t.dtype());
  write_rows(name, 0, t);
}

void FileWriter::set_attrs(const std::string& name, const std::map<std::string, std::vector<int64_t>>& attrs) {
  as_output(path_, [&] {
    Id obj(check(H5Oopen(impl_->file, name.c_str(), H5P_DEFAULT), "open " + name));
    for (const auto& [k, v] : attrs) h5::set_attr(obj, k.c_str(), v);
  });
}

void FileWriter::set_metadata(const Metadata& m) {
  as_output(path_, [&] { write_metadata(impl_->file, m); });
}

void FileWriter::set_root_attr(const char* name, int64_t value) {
  as_output(path_, [&] { h5::set_attr(impl_->file, name, value); });
}

void FileWriter::set_root_attr(const char* name, const std::string& value) {
  as_output(path_, [&] { h5::set_attr(impl_->file, name, value); });
}

void FileWriter::create_virtual(const std::string& name, const Shape& shape, DType t, const std::vector<Source>& sources) {
  as_output(path_, [&] {
    const Shape s = stored_shape(shape);
    h5::make_parents(impl_->file, name);
    std::vector<hsize_t> dims(s.begin(), s.end());
    Id vspace(check(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), "dataspace " + name));
    Id dcpl(H5Pcreate(H5P_DATASET_CREATE));
    for (const Source& src : sources) {
      std::vector<hsize_t> start(dims.size(), 0), count = dims;
      start[0] = static_cast<hsize_t>(src.row0);
      count[0] = static_cast<hsize_t>(src.rows);
      Id sel(H5Scopy(vspace));
      check_status(H5Sselect_hyperslab(sel, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
                   "select rows of " + name);
      Id sspace(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr));
      check_status(H5Pset_virtual(dcpl, sel, src.file.c_str(), name.c_str(), sspace), "map " + name + " to " + src.file);
    }
    Id ds(check(H5Dcreate2(impl_->file, name.c_str(), h5::file_type(t), vspace, H5P_DEFAULT, dcpl, H5P_DEFAULT),
                "create virtual dataset " + name));
    if (shape.empty()) h5::set_attr(ds, "dtk_scalar", int64_t{1});
  });
}

void FileWriter::commit() {
  as_output(path_, [&] {
    check_status(H5Fflush(impl_->file, H5F_SCOPE_GLOBAL), "flush");
    check_status(impl_->file.close(), "close");
    fsync_path(tmp_, false);
    std::error_code ec;
    fs::rename(tmp_, path_, ec);
    if (ec) {
      fs::remove(tmp_);
      fail("cannot rename " + tmp_.string() + " to " + path_.string() + ": " + ec.message());
    }
    impl_->committed = true;
    fsync_path(path_.parent_path().empty() ? fs::path(".") : path_.parent_path(), true);
  });
}

// ------------------------------------------------------------------------------ Reader

struct Reader::Impl {
  Id file;
  bool sharded = false;
  Metadata meta;
  std::vector<TensorInfo> tensors;
  std::vector<fs::path> shards;
};

Reader::Reader(const fs::path& path) : impl_(new Impl) {
  h5::quiet();
  path_ = path;
  as_input(path_, [&] { open(path); });
}

void Reader::open(const fs::path& path) {
  if (fs::is_directory(path)) {
    if (!fs::exists(path / "index.h5")) {  // a --checkpoint-dir: its latest checkpoint
      const auto latest = Directory(path, 1).latest();
      if (!latest) fail_usage("neither a sharded state (no index.h5) nor a checkpoint directory with checkpoints");
      path_ = *latest;
      return open(*latest);
    }
    path_ = path / "index.h5";
  }
  const std::string where = path_.string();
  if (!fs::exists(path_)) fail_usage(where + ": no such file");
  if (!fs::is_regular_file(path_)) fail_usage(where + ": not a regular file");
  const htri_t is = H5Fis_hdf5(path_.c_str());
  if (is <= 0) {
    h5::last_error();
    fail_usage(where + ": not an HDF5 file");
  }
  const hid_t f = H5Fopen(path_.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) fail_usage(where + ": cannot be opened (truncated or damaged?): " + h5::last_error());
  impl_->file = Id(f);
  impl_->meta = read_metadata(f, where);

  // Every dataset, by name.
  struct Visit {
    std::vector<std::string> names;
  } visit;
  check_status(H5Ovisit(
                   f, H5_INDEX_NAME, H5_ITER_INC,
                   [](hid_t, const char* name, const H5O_info_t* info, void* data) -> herr_t {
                     if (info->type == H5O_TYPE_DATASET) static_cast<Visit*>(data)->names.emplace_back(name);
                     return 0;
                   },
                   &visit),
               where + ": cannot list its contents");
  for (const auto& name : visit.names) {
    Id ds(check(H5Dopen2(f, name.c_str(), H5P_DEFAULT), where + ": open " + name));
    TensorInfo ti;
    ti.name = name;
    ti.dtype = h5::dtype_of(Id(H5Dget_type(ds)), where + ": " + name);
    ti.shape = dims_of(Id(H5Dget_space(ds)));
    if (h5::has_attr(ds, "dtk_scalar")) ti.shape = {};
    if (h5::has_attr(ds, "shard_offsets")) {
      ti.shard_offsets = h5::get_attr_ints(ds, "shard_offsets");
      ti.shard_lengths = h5::get_attr_ints(ds, "shard_lengths");
    } else if (h5::has_attr(f, "shard_world_size")) {
      ti.owner = owner_of(ds);
    }
    impl_->tensors.push_back(std::move(ti));
  }
  std::sort(impl_->tensors.begin(), impl_->tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });

  impl_->sharded = h5::has_attr(f, "shard_world_size");
  if (impl_->sharded) {
    const int64_t n = h5::get_attr_int(f, "shard_world_size");
    const std::string id = state_id(f);
    for (int64_t r = 0; r < n; ++r) {
      const fs::path p = path_.parent_path() / rank_file_name(static_cast<int>(r));
      if (!fs::exists(p)) fail_usage(where + ": shard " + p.filename().string() + " is missing");
      // Every rank file must come from the index's write (checkpoint.h: identity).
      const hid_t rf = H5Fopen(p.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
      if (rf < 0) fail_usage(p.string() + ": cannot be opened (truncated or damaged?): " + h5::last_error());
      const std::string rid = state_id(Id(rf));
      if (rid != id)
        fail_usage(p.string() + ": a rank file of another sharded state (state_id " + (rid.empty() ? "none" : rid) +
                   ", the index's " + (id.empty() ? "none" : id) + "); every rank file must come from the same write");
      impl_->shards.push_back(p);
    }
  }
}

Reader::~Reader() = default;

bool Reader::sharded() const { return impl_->sharded; }
const Metadata& Reader::metadata() const { return impl_->meta; }
const std::vector<TensorInfo>& Reader::tensors() const { return impl_->tensors; }
std::vector<fs::path> Reader::shard_files() const { return impl_->shards; }

bool Reader::contains(const std::string& name) const {
  return std::any_of(impl_->tensors.begin(), impl_->tensors.end(), [&](const TensorInfo& t) { return t.name == name; });
}

const TensorInfo& Reader::info(const std::string& name) const {
  for (const auto& t : impl_->tensors)
    if (t.name == name) return t;
  fail_usage(path_.string() + ": no tensor named " + name);
}

void Reader::read_rows(const std::string& name, int64_t row0, Tensor& out) const {
  const TensorInfo& ti = info(name);
  const Shape full = stored_shape(ti.shape);
  const Shape os = out.ndim() == 0 ? Shape{1} : out.shape();
  if (out.dtype() != ti.dtype || out.is_cuda() || os.size() != full.size() ||
      !std::equal(os.begin() + 1, os.end(), full.begin() + 1) || row0 < 0 || row0 + os[0] > full[0])
    fail_usage("read {}: {} at row {} does not fit the stored {}{}", name, out.str(), row0, dtype_name(ti.dtype),
               shape_str(ti.shape));
  if (os[0] == 0 || out.numel() == 0) return;
  as_input(path_, [&] { read_stored(name, full, os, row0, out); });
}

void Reader::read_stored(const std::string& name, const Shape& full, const Shape& os, int64_t row0, Tensor& out) const {
  const TensorInfo& ti = info(name);
  Id ds(check(H5Dopen2(impl_->file, name.c_str(), H5P_DEFAULT), "open " + name));
  Id fspace(H5Dget_space(ds));
  std::vector<hsize_t> start(full.size(), 0), count(os.begin(), os.end());
  start[0] = static_cast<hsize_t>(row0);
  H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
  Id mspace(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr));
  if (H5Dread(ds, h5::memory_type(ti.dtype), mspace, fspace, H5P_DEFAULT, out.data()) < 0)
    fail_usage(path_.string() + ": the data of " + name + " cannot be read (damaged? checksum?): " + h5::last_error());
}

void Reader::read_into(const std::string& name, Tensor& out) const {
  const TensorInfo& ti = info(name);
  if (out.shape() != ti.shape || out.dtype() != ti.dtype)
    fail_usage(path_.string() + ": " + name + " is " + std::string(dtype_name(ti.dtype)) + shape_str(ti.shape) +
               ", expected " + out.str());
  if (!out.is_cuda()) {
    Tensor o = out;
    read_rows(name, 0, o);
    return;
  }
  Tensor flat = out.ndim() == 0 ? out.reshape({1}) : out;
  const int64_t rows = flat.dim(0), re = std::max<int64_t>(1, row_elems(flat.shape()));
  const int64_t step = std::max<int64_t>(1, static_cast<int64_t>(kStageBytes / (re * dtype_size(flat.dtype()))));
  for (int64_t r = 0; r < rows; r += step) {
    Tensor part = flat.slice(r, std::min(rows, r + step));
    Tensor host = Tensor::empty(part.shape(), part.dtype());
    read_rows(name, r, host);
    part.copy_from(host);
  }
}

Tensor Reader::read(const std::string& name, Device d) const {
  const TensorInfo& ti = info(name);
  Tensor out = Tensor::empty(ti.shape, ti.dtype, d);
  read_into(name, out);
  return out;
}

// ------------------------------------------------------------------------------ sharded

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
  comm.broadcast({&n, 1, DType::i64, {}}, root, comm::Mode::sync);
  s.resize(static_cast<size_t>(n));
  if (n > 0) comm.broadcast({s.data(), s.size(), DType::u8, {}}, root, comm::Mode::sync);
  return s;
}

}  // namespace

std::string agree(comm::Communicator& comm, const std::string& error) {
  int32_t first = error.empty() ? comm.size() : comm.rank();
  comm.all_reduce({&first, 1, DType::i32, {}}, {&first, 1, DType::i32, {}}, comm::ReduceOp::min, comm::Mode::sync);
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
  comm_.barrier(comm::Mode::sync);
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
    comm_.broadcast({stamp, sizeof stamp, DType::u8, {}}, 0, comm::Mode::sync);
    meta_.created = stamp;
  }
}

void ShardedWriter::commit() {
  std::string err;
  try {
    mine_->set_metadata(meta_);
    mine_->set_root_attr(kStateId, id_);
    mine_->commit();
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

// ------------------------------------------------------------------------------ Directory

Directory::Directory(fs::path dir, int keep) : dir_(std::move(dir)), keep_(keep) {
  if (keep_ < 1) fail_usage("--keep must be at least 1");
}

fs::path Directory::entry(int64_t step, bool sharded) const {
  char buf[40];
  std::snprintf(buf, sizeof buf, "step-%08lld%s", static_cast<long long>(step), sharded ? "" : ".h5");
  return dir_ / buf;
}

namespace {
// step-NNNNNNNN or step-NNNNNNNN.h5 -> NNNNNNNN, or -1
int64_t step_of(const fs::path& p) {
  std::string n = p.filename().string();
  if (n.size() > 3 && n.ends_with(".h5")) n.resize(n.size() - 3);
  if (!n.starts_with("step-") || n.size() == 5) return -1;
  for (size_t i = 5; i < n.size(); ++i)
    if (n[i] < '0' || n[i] > '9') return -1;
  return std::stoll(n.substr(5));
}
}  // namespace

void Directory::finish(const fs::path& entry) {
  write_file_atomic(dir_ / "latest", entry.filename().string() + "\n");  // also removes dead writers' temporaries
  std::vector<std::pair<int64_t, fs::path>> entries;
  for (const auto& e : fs::directory_iterator(dir_)) {
    const int64_t s = step_of(e.path());
    if (s >= 0) entries.emplace_back(s, e.path());
  }
  std::sort(entries.begin(), entries.end());
  const int64_t drop = static_cast<int64_t>(entries.size()) - keep_;
  for (int64_t i = 0; i < drop; ++i) {
    if (entries[i].second.filename() == entry.filename()) continue;
    std::error_code ec;
    fs::remove_all(entries[i].second, ec);
  }
}

std::optional<fs::path> Directory::latest() const {
  std::ifstream in(dir_ / "latest");
  std::string name;
  if (in && std::getline(in, name) && !name.empty() && fs::exists(dir_ / name)) return dir_ / name;
  std::optional<fs::path> best;
  int64_t best_step = -1;
  if (!fs::is_directory(dir_)) return best;
  for (const auto& e : fs::directory_iterator(dir_)) {
    const int64_t s = step_of(e.path());
    if (s > best_step) best_step = s, best = e.path();
  }
  return best;
}

}  // namespace dtk::ckpt
