// export: a checkpoint's tensors (all, or those NAME selects: model/ for the model alone) as
// safetensors (https://github.com/huggingface/safetensors, "Format") or as NumPy's npz (a zip of
// NAME.npy files, stored, zip64 where needed; written by libzip), named as the checkpoint names
// them (model/norm.weight); or a llama's model as a Hugging Face folder (--format hf, nn/hf.h).
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <zip.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <ctime>
#include <exception>
#include <limits>
#include <memory>
#include <optional>

#include "command.h"
#include "dtk/ckpt/safetensors.h"
#include "dtk/cli/checks.h"
#include "dtk/core/checks.h"
#include "dtk/core/error.h"
#include "dtk/core/json_config.h"
#include "dtk/nn/hf.h"
#include "dtk/ops/ops.h"

namespace dtk::inspect {
namespace {

// Both formats are little-endian; tensors are written as the host holds them.
static_assert(std::endian::native == std::endian::little, "export writes host memory as little-endian data");

template <typename T>
void put(std::string& buf, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) buf.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
}

// ---------------------------------------------------------------------------- safetensors

// 8-byte little-endian header size N, N bytes of JSON (tensors in name order, then
// __metadata__, padded with spaces to a multiple of 8), then the data in header order.
void write_safetensors(const ckpt::Reader& in, const std::vector<const ckpt::TensorInfo*>& tensors, AtomicFile& out) {
  // Wider elements first (then by name): with the header padded to 8 bytes, every tensor's data
  // starts at a multiple of its element size, as memory-mapping loaders want.
  std::vector<const ckpt::TensorInfo*> order = tensors;
  std::stable_sort(order.begin(), order.end(),
                   [](const auto* a, const auto* b) { return dtype_size(a->dtype) > dtype_size(b->dtype); });
  nlohmann::ordered_json header;
  uint64_t offset = 0;
  for (const auto* tp : order) {
    const auto& t = *tp;
    header[t.name] = {{"dtype", ckpt::safetensors_dtype(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes()}}};
    offset += t.bytes();
  }
  const ckpt::Metadata& m = in.metadata();
  header["__metadata__"] = {{"format", ckpt::kFormat},
                            {"schema_version", std::to_string(ckpt::kSchemaVersion)},
                            {"program", m.program},
                            {"program_version", m.program_version},
                            {"step", std::to_string(m.step)},
                            {"world_size", std::to_string(m.world_size)},
                            {"created", m.created},
                            {"model_config", m.model_config.dump()},
                            {"optim_config", m.optim_config.dump()},
                            {"data_position", m.data_position.dump()},
                            {"rng_state", m.rng_state.dump()},
                            {"extra", m.extra.dump()}};
  out.write(ckpt::safetensors_prefix(header));
  for (const auto* t : order)
    for_each_chunk(in, *t, rows_per_chunk(*t, dtype_size(t->dtype), kChunkBytes),
                   [&](int64_t, const Tensor& rows) { out.write(rows.data(), rows.bytes()); });
}

// ---------------------------------------------------------------------------- npz

// bf16 has no NumPy type: it is exported as '<f4' (exact: every bf16 value is an f32 value).
DType npy_dtype(DType t) { return t == DType::bf16 ? DType::f32 : t; }

const char* npy_descr(DType t) {
  switch (npy_dtype(t)) {
    case DType::f32: return "<f4";
    case DType::f64: return "<f8";
    case DType::f16: return "<f2";
    case DType::i32: return "<i4";
    case DType::i64: return "<i8";
    case DType::u8: return "|u1";
    case DType::u16: return "<u2";
    case DType::bf16: break;
  }
  return "";
}

// The .npy header: magic, version 1.0 (2-byte header length) or 2.0 (4-byte) when the
// dictionary does not fit 65535 bytes, the dictionary padded with spaces and a newline so that
// the data starts at a multiple of 64.
std::string npy_header(const ckpt::TensorInfo& t) {
  // A shape is a Python tuple: (), (3,), (3, 4).
  const std::string shape = fmt::format("({}{})", fmt::join(t.shape, ", "), t.shape.size() == 1 ? "," : "");
  std::string dict = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", npy_descr(t.dtype), shape);
  for (int version = 1; version <= 2; ++version) {
    const size_t prefix = version == 1 ? 10 : 12;
    const size_t total = (prefix + dict.size() + 1 + 63) / 64 * 64;
    const size_t len = total - prefix;
    if (version == 1 && len > 0xffff) continue;
    std::string h = "\x93NUMPY";
    h.push_back(static_cast<char>(version));
    h.push_back(0);
    if (version == 1) put<uint16_t>(h, static_cast<uint16_t>(len));
    else put<uint32_t>(h, static_cast<uint32_t>(len));
    h += dict;
    h.append(len - dict.size() - 1, ' ');
    h.push_back('\n');
    return h;
  }
  fail_usage("{}: its .npy header is too long", t.name);
}

// The npz archive, written by libzip: each NAME.npy entry is a pull source (NpyEntry) that reads
// its tensor from the checkpoint a chunk at a time when libzip asks for bytes, and the archive
// itself goes through a write source (ArchiveSink) into the AtomicFile, so that memory stays at
// one chunk whatever the checkpoint's size and a failed export leaves nothing behind. libzip
// computes the CRC-32s, and writes zip64 records where sizes, offsets or counts need them.
//
// libzip calls the sources from C: an exception thrown inside one (a read error, a full disk)
// is kept, libzip is told the call failed, and the exception is rethrown once zip_close returns.
class ZipCallbacks {
 public:
  // Runs f, returning its value, or -1 after keeping the exception and setting `err`.
  template <typename F>
  zip_int64_t guard(zip_error_t* err, int code, F&& f) {
    try {
      return f();
    } catch (...) {
      if (!failure_) failure_ = std::current_exception();
      zip_error_set(err, code, 0);
      return -1;
    }
  }
  void rethrow() const {
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  std::exception_ptr failure_;
};

class NpyEntry {
 public:
  NpyEntry(const ckpt::Reader& in, const ckpt::TensorInfo& t, ZipCallbacks& cb)
      : in_(in), t_(t), cb_(cb), header_(npy_header(t)), to_(npy_dtype(t.dtype)) {
    zip_error_init(&err_);
  }
  ~NpyEntry() { zip_error_fini(&err_); }
  uint64_t size() const { return header_.size() + static_cast<uint64_t>(shape_numel(t_.shape)) * dtype_size(to_); }

  static zip_int64_t callback(void* self, void* data, zip_uint64_t len, zip_source_cmd_t cmd) {
    auto& e = *static_cast<NpyEntry*>(self);
    switch (cmd) {
      case ZIP_SOURCE_OPEN:  // from the start (f32 chunks: bf16 widens)
        e.chunks_.emplace(e.in_, e.t_, rows_per_chunk(e.t_, 4, kChunkBytes / 2));
        e.pos_ = 0, e.chunk_ = Tensor(), e.chunk_pos_ = 0;
        return 0;
      case ZIP_SOURCE_READ: return e.cb_.guard(&e.err_, ZIP_ER_READ, [&] { return e.read(static_cast<char*>(data), len); });
      case ZIP_SOURCE_CLOSE: e.chunks_.reset(), e.chunk_ = Tensor(); return 0;
      case ZIP_SOURCE_STAT: {
        auto* st = static_cast<zip_stat_t*>(data);
        zip_stat_init(st);
        st->valid = ZIP_STAT_SIZE | ZIP_STAT_MTIME;
        st->size = e.size();
        st->mtime = std::time(nullptr);
        return sizeof(zip_stat_t);
      }
      case ZIP_SOURCE_ERROR: return zip_error_to_data(&e.err_, data, len);
      case ZIP_SOURCE_FREE: return 0;  // the entries are owned by write_npz
      case ZIP_SOURCE_SUPPORTS: return ZIP_SOURCE_SUPPORTS_READABLE;
      default: zip_error_set(&e.err_, ZIP_ER_OPNOTSUPP, 0); return -1;
    }
  }

 private:
  // The header, then the rows as the .npy dtype, chunk by chunk.
  zip_int64_t read(char* out, zip_uint64_t len) {
    zip_uint64_t n = 0;
    while (n < len) {
      if (pos_ < header_.size()) {
        const size_t k = std::min<size_t>(len - n, header_.size() - pos_);
        std::memcpy(out + n, header_.data() + pos_, k);
        pos_ += k, n += k;
        continue;
      }
      if (chunk_pos_ == chunk_.bytes() && !next_chunk()) break;
      const size_t k = std::min<size_t>(len - n, chunk_.bytes() - chunk_pos_);
      std::memcpy(out + n, static_cast<const char*>(chunk_.data()) + chunk_pos_, k);
      chunk_pos_ += k, pos_ += k, n += k;
    }
    return static_cast<zip_int64_t>(n);
  }
  bool next_chunk() {
    Tensor x;
    if (!chunks_->next(x)) return false;
    if (x.dtype() != to_) {
      Tensor wide = Tensor::empty(x.shape(), to_);
      ops::cast(x, wide);
      x = std::move(wide);
    }
    chunk_ = std::move(x);
    chunk_pos_ = 0;
    return true;
  }

  const ckpt::Reader& in_;
  const ckpt::TensorInfo& t_;
  ZipCallbacks& cb_;
  const std::string header_;
  const DType to_;
  zip_error_t err_;
  std::optional<Chunks> chunks_;  // while open
  uint64_t pos_ = 0;              // bytes of the entry read
  Tensor chunk_;                  // the rows being read, as the .npy dtype
  size_t chunk_pos_ = 0;
};

// The archive's bytes, into the AtomicFile: libzip writes its records and entries in order, and
// seeks back to rewrite a local header once the entry's CRC-32 is known.
class ArchiveSink {
 public:
  ArchiveSink(AtomicFile& out, ZipCallbacks& cb) : out_(out), cb_(cb) { zip_error_init(&err_); }
  ~ArchiveSink() { zip_error_fini(&err_); }

  static zip_int64_t callback(void* self, void* data, zip_uint64_t len, zip_source_cmd_t cmd) {
    auto& s = *static_cast<ArchiveSink*>(self);
    switch (cmd) {
      // Reading: the archive starts empty.
      case ZIP_SOURCE_OPEN:
      case ZIP_SOURCE_CLOSE:
      case ZIP_SOURCE_FREE:  // owned by write_npz
      case ZIP_SOURCE_READ: return 0;
      case ZIP_SOURCE_STAT: {
        auto* st = static_cast<zip_stat_t*>(data);
        zip_stat_init(st);
        st->valid = ZIP_STAT_SIZE;
        st->size = 0;
        return sizeof(zip_stat_t);
      }
      case ZIP_SOURCE_SEEK:
      case ZIP_SOURCE_TELL: return 0;
      // Writing.
      case ZIP_SOURCE_BEGIN_WRITE: s.pos_ = 0; return 0;
      case ZIP_SOURCE_WRITE: return s.cb_.guard(&s.err_, ZIP_ER_WRITE, [&] { return s.write(data, len); });
      case ZIP_SOURCE_SEEK_WRITE: {
        const zip_int64_t to = zip_source_seek_compute_offset(s.pos_, s.out_.tell(), data, len, &s.err_);
        if (to < 0) return -1;
        s.pos_ = static_cast<uint64_t>(to);
        return 0;
      }
      case ZIP_SOURCE_TELL_WRITE: return static_cast<zip_int64_t>(s.pos_);
      case ZIP_SOURCE_COMMIT_WRITE:    // the caller commits the AtomicFile after zip_close
      case ZIP_SOURCE_ROLLBACK_WRITE:  // the AtomicFile removes its temporary file
      case ZIP_SOURCE_REMOVE: return 0;
      case ZIP_SOURCE_ERROR: return zip_error_to_data(&s.err_, data, len);
      case ZIP_SOURCE_SUPPORTS: return ZIP_SOURCE_SUPPORTS_WRITABLE;
      default: zip_error_set(&s.err_, ZIP_ER_OPNOTSUPP, 0); return -1;
    }
  }

 private:
  // At the end of what is written, or over written bytes (a local header rewritten).
  zip_int64_t write(const void* data, zip_uint64_t len) {
    const auto* p = static_cast<const char*>(data);
    if (pos_ > out_.tell()) fail("zip: a write past the end of the archive");
    const uint64_t over = std::min<uint64_t>(len, out_.tell() - pos_);
    if (over) out_.write_at(pos_, p, over);
    if (over < len) out_.write(p + over, len - over);
    pos_ += len;
    return static_cast<zip_int64_t>(len);
  }

  AtomicFile& out_;
  ZipCallbacks& cb_;
  zip_error_t err_;
  uint64_t pos_ = 0;
};

void write_npz(const ckpt::Reader& in, const std::vector<const ckpt::TensorInfo*>& tensors, AtomicFile& out) {
  // libzip writes no file for an archive without entries.
  if (tensors.empty()) fail_usage("npz: no tensors to export");
  ZipCallbacks cb;
  ArchiveSink sink(out, cb);
  std::vector<std::unique_ptr<NpyEntry>> entries;  // alive until zip_close has read them
  zip_error_t err;
  zip_error_init(&err);
  zip_source_t* src = zip_source_function_create(&ArchiveSink::callback, &sink, &err);
  std::unique_ptr<zip_t, decltype(&zip_discard)> za(src ? zip_open_from_source(src, ZIP_CREATE | ZIP_TRUNCATE, &err) : nullptr,
                                                    &zip_discard);
  if (!za) {
    const std::string why = zip_error_strerror(&err);
    if (src) zip_source_free(src);
    zip_error_fini(&err);
    fail("zip: cannot start the archive: {}", why);
  }
  zip_error_fini(&err);
  const auto give_up = [&](const std::string& what) {
    const std::string why = zip_strerror(za.get());
    za.reset();
    cb.rethrow();
    fail("zip: {}: {}", what, why);
  };
  for (const auto* tp : tensors) {
    const auto& t = *tp;
    entries.push_back(std::make_unique<NpyEntry>(in, t, cb));
    zip_source_t* e = zip_source_function(za.get(), &NpyEntry::callback, entries.back().get());
    if (!e) give_up(t.name);
    const zip_int64_t i = zip_file_add(za.get(), (t.name + ".npy").c_str(), e, ZIP_FL_ENC_UTF_8);
    if (i < 0) {
      zip_source_free(e);
      give_up(t.name);
    }
    if (zip_set_file_compression(za.get(), static_cast<zip_uint64_t>(i), ZIP_CM_STORE, 0) < 0) give_up(t.name);
  }
  if (zip_close(za.get()) < 0) give_up("cannot write the archive");
  za.release();  // zip_close freed it
}

// ---------------------------------------------------------------------------- hf

// A folder written under a temporary name beside it and renamed into place by commit(); without
// commit() the temporary folder is removed. commit() over an existing folder (--force) renames
// the old one aside first and removes it after.
class AtomicDir {
 public:
  explicit AtomicDir(fs::path path) : path_(std::move(path)), tmp_(ckpt::temp_name(path_)) {
    if (!fs::create_directory(tmp_)) fail("cannot create " + tmp_.string());
  }
  ~AtomicDir() {
    std::error_code ec;
    if (!committed_) fs::remove_all(tmp_, ec);
  }
  const fs::path& tmp() const { return tmp_; }
  void commit() {
    std::error_code ec;
    fs::path old;
    if (fs::exists(fs::symlink_status(path_))) {
      old = ckpt::temp_name(path_);
      fs::rename(path_, old, ec);
      if (ec) fail("cannot move {} aside: {}", path_.string(), ec.message());
    }
    fs::rename(tmp_, path_, ec);
    if (ec) {
      std::error_code back;
      if (!old.empty()) fs::rename(old, path_, back);
      fail("cannot rename {} to {}: {}", tmp_.string(), path_.string(), ec.message());
    }
    committed_ = true;
    if (!old.empty()) fs::remove_all(old, ec);
  }

 private:
  fs::path path_, tmp_;
  bool committed_ = false;
};

// The model's tensors in the Hugging Face Llama layout (nn/hf.h) in folder `dir`: config.json,
// and model.safetensors or, past max_shard bytes, model-0000K-of-0000N.safetensors with
// model.safetensors.index.json, as transformers' save_pretrained writes them. Tensors in the
// checkpoint's parameter order, converted to `dtype`, streamed a chunk of rows at a time (wq and
// wk, whose rows the rotary order permutes, whole).
void write_hf(const ckpt::Reader& in, const nn::ModelConfig& cfg, const fs::path& dir, DType dtype, uint64_t max_shard) {
  const nlohmann::ordered_json config = nn::hf::config(cfg, dtype);
  struct Out {
    const ckpt::TensorInfo* t;
    std::string name;
    uint64_t bytes;
  };
  std::vector<std::vector<Out>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const auto& t : in.tensors()) {
    if (!t.name.starts_with("model/")) continue;
    const std::string dtk_name = t.name.substr(6);
    if (!dtype_is_float(t.dtype)) fail_usage("{}: {} is not a float tensor", t.name, dtype_name(t.dtype));
    const Out o{&t, nn::hf::tensor_name(dtk_name), static_cast<uint64_t>(shape_numel(t.shape)) * dtype_size(dtype)};
    if (in_shard > 0 && in_shard + o.bytes > max_shard) shards.emplace_back(), in_shard = 0;
    shards.back().push_back(o);
    in_shard += o.bytes;
    total += o.bytes;
  }
  if (shards.front().empty()) fail_usage("{}: no model tensors to export", in.path().string());
  AtomicDir out(dir);
  const size_t n = shards.size();
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (size_t s = 0; s < n; ++s) {
    const std::string file =
        n == 1 ? "model.safetensors" : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, n);
    nlohmann::ordered_json header;
    uint64_t offset = 0;
    for (const Out& o : shards[s]) {
      header[o.name] = {{"dtype", ckpt::safetensors_dtype(dtype)}, {"shape", o.t->shape}, {"data_offsets", {offset, offset + o.bytes}}};
      offset += o.bytes;
      weight_map[o.name] = file;
    }
    header["__metadata__"] = {{"format", "pt"}};  // transformers refuses safetensors without it
    AtomicFile f(out.tmp() / file);
    f.write(ckpt::safetensors_prefix(header));
    for (const Out& o : shards[s]) {
      const std::string dtk_name = o.t->name.substr(6);
      const auto converted = [&](const Tensor& x) {
        if (x.dtype() == dtype) return x;
        Tensor c = Tensor::empty(x.shape(), dtype);
        ops::cast(x, c);
        return c;
      };
      if (const int64_t heads = nn::hf::rope_heads(dtk_name, cfg); heads > 0) {
        const Tensor w = nn::hf::permute_rope_rows(converted(in.read(o.t->name)), heads, true);
        f.write(w.data(), w.bytes());
      } else {
        for_each_chunk(in, *o.t, rows_per_chunk(*o.t, dtype_size(o.t->dtype) + dtype_size(dtype), kChunkBytes),
                       [&](int64_t, const Tensor& rows) {
                         const Tensor c = converted(rows);
                         f.write(c.data(), c.bytes());
                       });
      }
    }
    f.commit();
  }
  if (n > 1) {
    const nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    AtomicFile f(out.tmp() / "model.safetensors.index.json");
    f.write(index.dump(2) + "\n");
    f.commit();
  }
  AtomicFile c(out.tmp() / "config.json");
  c.write(config.dump(2) + "\n");
  c.commit();
  out.commit();
}

class Export : public WriteCommand {
 public:
  void add_options(CLI::App& sub) override {
    add_io_options(sub, "a full checkpoint or a sharded state", false);
    sub.add_option("NAME", names_, "only these tensors, or groups ending in / (model/ for the model alone); default all");
    sub.add_option("--format", format_,
                   "safetensors or npz (the tensors as the checkpoint names them), or hf: a llama's model as a Hugging "
                   "Face LlamaForCausalLM folder (config.json and safetensors; -o names the folder)")
        ->required()
        ->check(CLI::IsMember({"safetensors", "npz", "hf"}));
    cli::add_enum(sub, "--dtype", dtype_, "hf: the tensors' dtype", {DType::f32, DType::bf16});
    cli::add_size(sub, "--max-shard-size", max_shard_, "hf: safetensors files of at most this size (a larger tensor alone)");
  }
  void validate() override {
    if (format_ != "hf") {
      open(false);
      check_names(names_, {in_.get()});
      return;
    }
    if (!names_.empty()) fail_usage("--format hf exports the model whole: no NAME");
    open_input_only();
    if (output_.empty()) fail_usage("no output given (-o DIR)");
    check_output_parent("-o", output_);
    if (fs::exists(fs::symlink_status(output_))) {
      if (!force_) fail_usage(output_ + " exists; use --force to overwrite it");
      if (!fs::is_directory(output_) || !fs::exists(fs::path(output_) / "config.json"))
        fail_usage(output_ + " exists and is not a Hugging Face export; --force replaces only those");
    }
    cfg_ = read_config<nn::ModelConfig>(in_->metadata().model_config, "model config");
    nn::hf::config(cfg_, dtype_);  // a llama, a dtype the layout takes: else a UsageError before writing
  }
  int run() override {
    if (format_ == "hf") {
      write_hf(*in_, cfg_, output_, dtype_, max_shard_);
      print_path(output_);
      return 0;
    }
    // The selected tensors, with their names as the checkpoint has them (model/norm.weight).
    std::vector<const ckpt::TensorInfo*> tensors;
    for (const auto& t : in_->tensors())
      if (names_.empty() || selected(t.name, names_)) tensors.push_back(&t);
    AtomicFile out(output_);
    if (format_ == "safetensors") write_safetensors(*in_, tensors, out);
    else write_npz(*in_, tensors, out);
    out.commit();
    print_path(output_);
    return 0;
  }

 private:
  std::string format_;
  std::vector<std::string> names_;
  nn::ModelConfig cfg_;  // --format hf: the checkpoint's model
  DType dtype_ = DType::f32;
  uint64_t max_shard_ = uint64_t{5} << 30;  // transformers' default, 5 GB (GiB here)
};

}  // namespace

std::unique_ptr<Command> make_export() { return std::make_unique<Export>(); }

}  // namespace dtk::inspect
