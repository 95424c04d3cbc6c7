// One HDF5 file of the checkpoint schema (checkpoint.h): FileWriter writes one (a full
// checkpoint, or a rank file or the index of a sharded state), Reader reads a full checkpoint or
// a sharded state through its index; the metadata attributes of both.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <map>
#include <mutex>

#include "dtk/ckpt/checkpoint.h"
#include "dtk/ckpt/h5.h"
#include "dtk/ckpt/internal.h"
#include "dtk/core/error.h"

namespace dtk::ckpt {
namespace fs = std::filesystem;
using h5::check;
using h5::check_status;
using h5::Id;

namespace {

constexpr size_t kChunkBytes = 1 << 20;   // target HDF5 chunk size
constexpr size_t kStageBytes = 64 << 20;  // host staging for device tensors and streaming
constexpr size_t kLockBytes = 4 << 20;    // written per hold of the HDF5 lock (core/h5.h)

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
  try {
    as_output(path_, [&] {
      const auto g = h5::lock();
      impl_->file = Id(check(H5Fcreate(tmp_.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, H5P_DEFAULT), "create " + tmp_.string()));
    });
  } catch (...) {
    // H5Fcreate makes the file before it writes the superblock; on a full disk that write fails
    // and the empty temporary stays (the destructor does not run for a constructor that threw).
    // The name is this writer's own (host, pid, counter), so nothing else is removed.
    std::error_code ec;
    fs::remove(tmp_, ec);
    throw;
  }
}

// A file that will not be committed is discarded. HDF5 1.10 cannot close a file whose last
// writes fail (a full disk): H5Fclose fails, frees the file but leaves its id registered, and
// the library closes that id again at exit and crashes (SIGSEGV in H5F__close_cb from
// H5_term_library; fixed upstream by HDF5 pull request 2291, after the 1.10.8 that Debian 12
// ships). The temporary is removed anyway, so its descriptor is first pointed at an anonymous
// memory file: the closing writes land there and the close succeeds.
FileWriter::~FileWriter() {
  if (!impl_) return;
  auto g = h5::lock();
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
  g.unlock();
  if (!impl_->committed && !tmp_.empty()) {
    std::error_code ec;
    fs::remove(tmp_, ec);
  }
}

void FileWriter::create(const std::string& name, const Shape& shape, DType t) {
  as_output(path_, [&] {
    const auto g = h5::lock();
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
    Shape full;
    DType t;
    {
      const auto g = h5::lock();
      Id ds(check(H5Dopen2(impl_->file, name.c_str(), uncached()), "open dataset " + name));
      full = dims_of(Id(H5Dget_space(ds)));
      t = h5::dtype_of(Id(H5Dget_type(ds)), name);
    }
    if (rows.dtype() != t) fail_usage("write " + name + ": " + rows.str() + " into a " + std::string(dtype_name(t)) + " dataset");
    for_host_rows(rows, [&](int64_t r, const Tensor& host) {
      const Shape hs = host.ndim() == 0 ? Shape{1} : host.shape();
      if (hs.size() != full.size() || !std::equal(hs.begin() + 1, hs.end(), full.begin() + 1) ||
          row0 + r + hs[0] > full[0])
        fail_usage("write {}: rows {} at row {} do not fit the dataset's shape {}", name, shape_str(hs), row0 + r,
                   shape_str(full));
      if (hs[0] == 0) return;
      // kLockBytes at a time, each under the HDF5 lock: another thread's reads (the training
      // loop's data) wait for one piece at most.
      const size_t row_bytes = static_cast<size_t>(std::max<int64_t>(1, row_elems(hs))) * dtype_size(t);
      const int64_t piece = std::max<int64_t>(1, static_cast<int64_t>(kLockBytes / row_bytes));
      for (int64_t p = 0; p < hs[0]; p += piece) {
        std::vector<hsize_t> start(full.size(), 0), count(hs.begin(), hs.end());
        start[0] = static_cast<hsize_t>(row0 + r + p);
        count[0] = static_cast<hsize_t>(std::min(piece, hs[0] - p));
        const auto g = h5::lock();
        Id ds(check(H5Dopen2(impl_->file, name.c_str(), uncached()), "open dataset " + name));
        Id fs_sel(H5Dget_space(ds));
        H5Sselect_hyperslab(fs_sel, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
        Id mspace(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr));
        const char* src = static_cast<const char*>(host.data()) + static_cast<size_t>(p) * row_bytes;
        check_status(H5Dwrite(ds, h5::memory_type(t), mspace, fs_sel, H5P_DEFAULT, src), "write " + name);
      }
    });
  });
}

void FileWriter::write(const std::string& name, const Tensor& t) {
  create(name, t.shape(), t.dtype());
  write_rows(name, 0, t);
}

void FileWriter::set_attrs(const std::string& name, const std::map<std::string, std::vector<int64_t>>& attrs) {
  as_output(path_, [&] {
    const auto g = h5::lock();
    Id obj(check(H5Oopen(impl_->file, name.c_str(), H5P_DEFAULT), "open " + name));
    for (const auto& [k, v] : attrs) h5::set_attr(obj, k.c_str(), v);
  });
}

void FileWriter::set_metadata(const Metadata& m) {
  as_output(path_, [&] {
    const auto g = h5::lock();
    write_metadata(impl_->file, m);
  });
}

void FileWriter::set_root_attr(const char* name, int64_t value) {
  as_output(path_, [&] {
    const auto g = h5::lock();
    h5::set_attr(impl_->file, name, value);
  });
}

void FileWriter::set_root_attr(const char* name, const std::string& value) {
  as_output(path_, [&] {
    const auto g = h5::lock();
    h5::set_attr(impl_->file, name, value);
  });
}

void FileWriter::create_virtual(const std::string& name, const Shape& shape, DType t, const std::vector<Source>& sources) {
  as_output(path_, [&] {
    const auto g = h5::lock();
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

// HDF5 1.10's metadata flush cannot fail safely: a write that fails inside it (a full disk)
// leaves the cache's skip list enabled, every later flush of the file fails ("slist already
// enabled?"), so its close does too, and the library crashes at exit as described above. So the
// space the flush writes into is reserved first, beyond the file's end (FALLOC_FL_KEEP_SIZE:
// the file's size is unchanged, and the close truncates what is not used): the file's size so
// far and a margin for the metadata the flush allocates (fractal heaps' blocks get their
// addresses then). No room: the commit fails here, before the flush, and the destructor's
// discard closes the file. A file system without fallocate (EOPNOTSUPP) is written as before.
namespace {
void reserve_for_flush(hid_t file) {
  hsize_t size = 0;
  void* handle = nullptr;
  if (H5Fget_filesize(file, &size) < 0 || H5Fget_vfd_handle(file, H5P_DEFAULT, &handle) < 0 || !handle) {
    H5Eclear2(H5E_DEFAULT);
    return;
  }
  const off_t margin = std::max<off_t>(off_t{16} << 10, static_cast<off_t>(size / 64));
  if (::fallocate(*static_cast<int*>(handle), FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(size) + margin) != 0 &&
      errno != EOPNOTSUPP && errno != ENOSYS)
    fail("reserve space to flush: {}", std::strerror(errno));
}
}  // namespace

void FileWriter::commit() {
  as_output(path_, [&] {
    {
      const auto g = h5::lock();
      reserve_for_flush(impl_->file);
      check_status(H5Fflush(impl_->file, H5F_SCOPE_GLOBAL), "flush");
      check_status(impl_->file.close(), "close");
    }
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

namespace {
std::map<std::string, int>& opened() {
  static std::map<std::string, int> m;
  return m;
}
std::mutex& opened_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace

Reader::Reader(const fs::path& path) : impl_(new Impl) {
  h5::quiet();
  {
    std::lock_guard lock(opened_mutex());
    ++opened()[path.string()];
  }
  path_ = path;
  as_input(path_, [&] { open(path); });
}

int Reader::times_opened(const fs::path& path) {
  std::lock_guard lock(opened_mutex());
  const auto it = opened().find(path.string());
  return it == opened().end() ? 0 : it->second;
}

void Reader::open(const fs::path& path) {
  if (fs::is_directory(path)) {
    if (!fs::exists(path / "index.h5")) {  // a --checkpoint-dir: its latest checkpoint
      const auto latest = Directory(path, 1).latest();
      if (!latest) fail_usage("neither a sharded state (no index.h5) nor a checkpoint directory with checkpoints");
      if (fs::is_directory(*latest) && !fs::exists(*latest / "index.h5"))  // no second checkpoint directory inside
        fail_usage(latest->string() + ": a directory entry that is not a sharded state (no index.h5)");
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
    Id space(H5Dget_space(ds));
    std::vector<hsize_t> dims(static_cast<size_t>(std::max(H5Sget_simple_extent_ndims(space), 0)));
    H5Sget_simple_extent_dims(space, dims.data(), nullptr);
    h5::check_stored(ds, dims, dtype_size(ti.dtype), where + ": " + name);
    ti.shape = dims_of(space);
    if (h5::has_attr(ds, "dtk_scalar")) {
      if (ti.shape != Shape{1}) fail_usage("{}: {} is marked 0-d (dtk_scalar) but has shape {}", where, name, shape_str(ti.shape));
      ti.shape = {};
    }
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

}  // namespace dtk::ckpt
