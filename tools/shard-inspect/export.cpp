// export: a checkpoint as safetensors (https://github.com/huggingface/safetensors, "Format") or
// as NumPy's npz (a zip of NAME.npy files, stored, zip64 where needed).
#include <algorithm>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <zlib.h>

#include <bit>
#include <ctime>
#include <limits>

#include "command.h"
#include "dtk/core/error.h"
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

const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u8: return "U8";
    case DType::u16: return "U16";
  }
  return "";
}

// 8-byte little-endian header size N, N bytes of JSON (tensors in name order, then
// __metadata__, padded with spaces to a multiple of 8), then the data in header order.
void write_safetensors(const ckpt::Reader& in, AtomicFile& out) {
  // Wider elements first (then by name): with the header padded to 8 bytes, every tensor's data
  // starts at a multiple of its element size, as memory-mapping loaders want.
  std::vector<const ckpt::TensorInfo*> order;
  for (const auto& t : in.tensors()) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(),
                   [](const auto* a, const auto* b) { return dtype_size(a->dtype) > dtype_size(b->dtype); });
  nlohmann::ordered_json header;
  uint64_t offset = 0;
  for (const auto* tp : order) {
    const auto& t = *tp;
    header[t.name] = {{"dtype", safetensors_dtype(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes()}}};
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
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string head;
  put<uint64_t>(head, json.size());
  out.write(head);
  out.write(json);
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
  fail_usage(t.name + ": its .npy header is too long");
}

// A zip archive written entry by entry: stored (no compression), CRC-32 patched into the local
// header once the entry's data is written, zip64 extra fields and end records where sizes,
// offsets or the number of entries exceed the classic format's limits.
class ZipWriter {
 public:
  explicit ZipWriter(AtomicFile& out) : out_(out) {
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    dos_time_ = static_cast<uint16_t>(tm.tm_hour << 11 | tm.tm_min << 5 | tm.tm_sec / 2);
    dos_date_ = static_cast<uint16_t>(std::max(tm.tm_year - 80, 0) << 9 | (tm.tm_mon + 1) << 5 | tm.tm_mday);
  }

  // Starts an entry of `size` bytes; write() its data, then end_entry().
  void begin_entry(const std::string& name, uint64_t size) {
    Entry e{name, size, out_.tell(), 0};
    const bool z64 = size >= kMax32;
    std::string h;
    put<uint32_t>(h, 0x04034b50);
    put<uint16_t>(h, z64 ? 45 : 20);  // version needed
    put<uint16_t>(h, 0);              // flags
    put<uint16_t>(h, 0);              // stored
    put<uint16_t>(h, dos_time_);
    put<uint16_t>(h, dos_date_);
    crc_at_ = out_.tell() + h.size();
    put<uint32_t>(h, 0);  // crc-32, patched by end_entry
    put<uint32_t>(h, z64 ? kMax32 : static_cast<uint32_t>(size));
    put<uint32_t>(h, z64 ? kMax32 : static_cast<uint32_t>(size));
    put<uint16_t>(h, static_cast<uint16_t>(name.size()));
    put<uint16_t>(h, z64 ? 20 : 0);
    h += name;
    if (z64) {
      put<uint16_t>(h, 0x0001);
      put<uint16_t>(h, 16);
      put<uint64_t>(h, size);
      put<uint64_t>(h, size);
    }
    out_.write(h);
    entries_.push_back(e);
    crc_ = crc32(0L, Z_NULL, 0);
    written_ = 0;
  }
  void write(const void* data, size_t bytes) {
    const auto* p = static_cast<const Bytef*>(data);
    for (size_t done = 0; done < bytes;) {  // zlib's crc32 takes 32-bit lengths
      const uInt n = static_cast<uInt>(std::min<size_t>(bytes - done, 1u << 30));
      crc_ = crc32(crc_, p + done, n);
      done += n;
    }
    out_.write(data, bytes);
    written_ += bytes;
  }
  void end_entry() {
    Entry& e = entries_.back();
    if (written_ != e.size) fail("zip entry {}: wrote {} of {} bytes", e.name, written_, e.size);
    e.crc = static_cast<uint32_t>(crc_);
    std::string c;
    put<uint32_t>(c, e.crc);
    out_.write_at(crc_at_, c.data(), c.size());
  }
  // The central directory and the end records.
  void finish() {
    const uint64_t cd_start = out_.tell();
    for (const Entry& e : entries_) {
      const bool zsize = e.size >= kMax32, zoff = e.offset >= kMax32;
      std::string extra;
      if (zsize || zoff) {
        put<uint16_t>(extra, 0x0001);
        put<uint16_t>(extra, static_cast<uint16_t>((zsize ? 16 : 0) + (zoff ? 8 : 0)));
        if (zsize) {
          put<uint64_t>(extra, e.size);
          put<uint64_t>(extra, e.size);
        }
        if (zoff) put<uint64_t>(extra, e.offset);
      }
      std::string h;
      put<uint32_t>(h, 0x02014b50);
      put<uint16_t>(h, 45);  // version made by
      put<uint16_t>(h, zsize || zoff ? 45 : 20);
      put<uint16_t>(h, 0);
      put<uint16_t>(h, 0);
      put<uint16_t>(h, dos_time_);
      put<uint16_t>(h, dos_date_);
      put<uint32_t>(h, e.crc);
      put<uint32_t>(h, zsize ? kMax32 : static_cast<uint32_t>(e.size));
      put<uint32_t>(h, zsize ? kMax32 : static_cast<uint32_t>(e.size));
      put<uint16_t>(h, static_cast<uint16_t>(e.name.size()));
      put<uint16_t>(h, static_cast<uint16_t>(extra.size()));
      put<uint16_t>(h, 0);  // comment
      put<uint16_t>(h, 0);  // disk
      put<uint16_t>(h, 0);  // internal attributes
      put<uint32_t>(h, 0);  // external attributes
      put<uint32_t>(h, zoff ? kMax32 : static_cast<uint32_t>(e.offset));
      h += e.name;
      h += extra;
      out_.write(h);
    }
    const uint64_t cd_size = out_.tell() - cd_start, n = entries_.size();
    const bool z64 = n >= 0xffff || cd_size >= kMax32 || cd_start >= kMax32;
    std::string t;
    if (z64) {
      const uint64_t eocd64 = out_.tell();
      put<uint32_t>(t, 0x06064b50);
      put<uint64_t>(t, 44);
      put<uint16_t>(t, 45);
      put<uint16_t>(t, 45);
      put<uint32_t>(t, 0);
      put<uint32_t>(t, 0);
      put<uint64_t>(t, n);
      put<uint64_t>(t, n);
      put<uint64_t>(t, cd_size);
      put<uint64_t>(t, cd_start);
      put<uint32_t>(t, 0x07064b50);
      put<uint32_t>(t, 0);
      put<uint64_t>(t, eocd64);
      put<uint32_t>(t, 1);
    }
    put<uint32_t>(t, 0x06054b50);
    put<uint16_t>(t, 0);
    put<uint16_t>(t, 0);
    put<uint16_t>(t, z64 ? 0xffff : static_cast<uint16_t>(n));
    put<uint16_t>(t, z64 ? 0xffff : static_cast<uint16_t>(n));
    put<uint32_t>(t, z64 ? kMax32 : static_cast<uint32_t>(cd_size));
    put<uint32_t>(t, z64 ? kMax32 : static_cast<uint32_t>(cd_start));
    put<uint16_t>(t, 0);
    out_.write(t);
  }

 private:
  static constexpr uint32_t kMax32 = 0xffffffffu;
  struct Entry {
    std::string name;
    uint64_t size, offset;
    uint32_t crc;
  };
  AtomicFile& out_;
  std::vector<Entry> entries_;
  uint16_t dos_time_ = 0, dos_date_ = 0;
  uint64_t crc_at_ = 0, written_ = 0;
  uLong crc_ = 0;
};

void write_npz(const ckpt::Reader& in, AtomicFile& out) {
  ZipWriter zip(out);
  for (const auto& t : in.tensors()) {
    const std::string header = npy_header(t);
    const DType to = npy_dtype(t.dtype);
    zip.begin_entry(t.name + ".npy", header.size() + static_cast<uint64_t>(shape_numel(t.shape)) * dtype_size(to));
    zip.write(header.data(), header.size());
    for_each_chunk(in, t, rows_per_chunk(t, 4, kChunkBytes / 2), [&](int64_t, const Tensor& rows) {
      if (rows.dtype() == to) {
        zip.write(rows.data(), rows.bytes());
        return;
      }
      Tensor wide = Tensor::empty(rows.shape(), to);
      ops::cast(rows, wide);
      zip.write(wide.data(), wide.bytes());
    });
    zip.end_entry();
  }
  zip.finish();
}

class Export : public WriteCommand {
 public:
  void add_options(CLI::App& sub) override {
    add_io_options(sub, "a full checkpoint or a sharded state", false);
    sub.add_option("--format", format_, "safetensors or npz")->required()->check(CLI::IsMember({"safetensors", "npz"}));
  }
  void validate() override { open(false); }
  int run() override {
    AtomicFile out(output_);
    if (format_ == "safetensors") write_safetensors(*in_, out);
    else write_npz(*in_, out);
    out.commit();
    print_path(output_);
    return 0;
  }

 private:
  std::string format_;
};

}  // namespace

std::unique_ptr<Command> make_export() { return std::make_unique<Export>(); }

}  // namespace dtk::inspect
