// The safetensors format (safetensors.h).
#include "dtk/ckpt/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>

#include "dtk/core/error.h"

namespace fs = std::filesystem;

namespace dtk::ckpt {

static_assert(std::endian::native == std::endian::little, "safetensors is little-endian; so must the host be");

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

std::string safetensors_prefix(const nlohmann::ordered_json& header) {
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json;
}

namespace {

// The format's cap on a header (safetensors' MAX_HEADER_SIZE, 100 MB): a larger length is a
// damaged file, not a header to allocate.
constexpr uint64_t kMaxHeader = 100'000'000;

}  // namespace

struct Safetensors::File {
  std::string name;   // as the messages name it
  int fd = -1;
  uint64_t data = 0;  // offset of the data: 8 + the header's length
  ~File() {
    if (fd >= 0) ::close(fd);
  }
};

Safetensors::~Safetensors() = default;

Safetensors::Safetensors(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    if (!fs::exists(path, ec)) fail_usage("{}: no such file", path.string());
    open_file(path);
    return;
  }
  if (fs::exists(path / "model.safetensors")) {
    open_file(path / "model.safetensors");
    return;
  }
  const fs::path index = path / "model.safetensors.index.json";
  if (!fs::exists(index)) fail_usage("{}: neither model.safetensors nor model.safetensors.index.json", path.string());
  std::ifstream in(index);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object() ||
      j["weight_map"].empty())
    fail_usage("{}: not a safetensors index (JSON with a weight_map of tensor names to files)", index.string());
  // Each shard once, in the order the index first names it; then every tensor where it says.
  std::map<std::string, std::vector<std::string>> in_file;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) fail_usage("{}: the weight_map entry of {} is not a file name", index.string(), name);
    const std::string f = file.get<std::string>();
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
      fail_usage("{}: {} is placed in \"{}\", which is not a file of the folder", index.string(), name, f);
    in_file[f].push_back(name);
  }
  std::map<std::string, Info> listed;
  std::map<std::string, Where> where;
  for (const auto& [file, names] : in_file) {
    if (!fs::exists(path / file))
      fail_usage("{}: it names the shard {}, which is missing (it should hold {})", index.string(), file, names.front());
    tensors_.clear();
    where_.clear();
    open_file(path / file);
    for (const std::string& n : names) {
      if (!tensors_.count(n))
        fail_usage("{}: it places {} in {}, which does not hold it", index.string(), n, file);
      listed[n] = tensors_[n];
      where[n] = where_[n];
    }
  }
  tensors_ = std::move(listed);
  where_ = std::move(where);
}

void Safetensors::open_file(const fs::path& path) {
  auto f = std::make_unique<File>();
  f->name = path.string();
  const std::string& n = f->name;
  f->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f->fd < 0) fail_usage("{}: cannot open: {}", n, std::strerror(errno));
  struct stat st {};
  if (::fstat(f->fd, &st) != 0) fail_usage("{}: cannot stat: {}", n, std::strerror(errno));
  const auto size = static_cast<uint64_t>(st.st_size);
  uint64_t len = 0;
  if (size < 8 || ::pread(f->fd, &len, 8, 0) != 8) fail_usage("{}: not a safetensors file (shorter than its header)", n);
  if (len > kMaxHeader || len > size - 8)
    fail_usage("{}: not a safetensors file, or truncated: a header of {} bytes in a file of {}", n, len, size);
  std::string text(len, '\0');
  if (::pread(f->fd, text.data(), len, 8) != static_cast<ssize_t>(len)) fail_usage("{}: cannot read its header", n);
  const nlohmann::json h = nlohmann::json::parse(text, nullptr, false);
  if (h.is_discarded() || !h.is_object()) fail_usage("{}: not a safetensors file (its header is not a JSON object)", n);
  f->data = 8 + len;
  const uint64_t data_bytes = size - f->data;
  struct Span {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Span> spans;
  for (const auto& [name, t] : h.items()) {
    if (name == "__metadata__") continue;
    const auto bad = [&](const std::string& why) { fail_usage("{}: tensor {}: {}", n, name, why); };
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets"))
      bad("not a tensor entry (dtype, shape, data_offsets)");
    if (!t["dtype"].is_string()) bad("its dtype is not a string");
    const std::string dt = t["dtype"].get<std::string>();
    const DType* found = std::find_if(std::begin(kAllDTypes), std::end(kAllDTypes),
                                      [&](DType d) { return dt == safetensors_dtype(d); });
    if (found == std::end(kAllDTypes)) bad("dtype " + dt + ", which dtk does not read (F32, F64, BF16, F16, I32, I64, U8, U16)");
    Info info{{}, *found, path.filename().string()};
    uint64_t numel = 1;
    if (!t["shape"].is_array()) bad("its shape is not a list");
    for (const auto& d : t["shape"]) {
      if (!d.is_number_unsigned()) bad("its shape " + t["shape"].dump() + " is not a list of sizes");
      const uint64_t v = d.get<uint64_t>();
      if (v != 0 && numel > (uint64_t{1} << 62) / v) bad("its shape " + t["shape"].dump() + " is too large");
      numel *= v;
      info.shape.push_back(static_cast<int64_t>(v));
    }
    const auto& o = t["data_offsets"];
    if (!o.is_array() || o.size() != 2 || !o[0].is_number_unsigned() || !o[1].is_number_unsigned())
      bad("its data_offsets are not [begin, end]");
    const uint64_t b = o[0].get<uint64_t>(), e = o[1].get<uint64_t>();
    if (e < b || e - b != numel * dtype_size(info.dtype))
      bad(fmt::format("data_offsets [{}, {}] do not hold {} {} values of shape {}", b, e, numel, dt, t["shape"].dump()));
    if (e > data_bytes)
      bad(fmt::format("data_offsets [{}, {}] run past the end of the data ({} bytes): the file is truncated, or its header "
                      "lies", b, e, data_bytes));
    spans.push_back({b, e, name});
    tensors_[name] = std::move(info);
    where_[name] = {files_.size(), f->data + b};
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  const Span* reach = nullptr;  // the tensor that reaches furthest so far
  for (const Span& s : spans) {
    if (s.end == s.begin) continue;
    if (reach && s.begin < reach->end)
      fail_usage("{}: tensors {} and {} overlap in the data: a header that lies about offsets", n, reach->name, s.name);
    if (!reach || s.end > reach->end) reach = &s;
  }
  files_.push_back(std::move(f));
}

const Safetensors::Info& Safetensors::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) fail_usage("no tensor {} in the safetensors", name);
  return it->second;
}

void Safetensors::read_rows(const std::string& name, int64_t row0, Tensor& out) const {
  const Info& t = info(name);
  const Where& w = where_.at(name);
  const File& f = *files_[w.file];
  if (out.is_cuda() || out.dtype() != t.dtype)
    fail("Safetensors::read_rows({}): a host tensor of {} wanted, got {}", name, dtype_name(t.dtype), out.str());
  uint64_t row_bytes = dtype_size(t.dtype);
  for (size_t d = 1; d < t.shape.size(); ++d) row_bytes *= static_cast<uint64_t>(t.shape[d]);
  const bool whole = t.shape.empty();
  if (!whole && (out.ndim() != static_cast<int64_t>(t.shape.size()) || row0 < 0 || row0 + out.dim(0) > t.shape[0] ||
                 !std::equal(t.shape.begin() + 1, t.shape.end(), out.shape().begin() + 1)))
    fail("Safetensors::read_rows({}): rows {} of {} do not fit {}", name, row0, shape_str(t.shape), out.str());
  uint64_t at = w.offset + static_cast<uint64_t>(whole ? 0 : row0) * row_bytes;
  auto* dst = static_cast<char*>(out.data());
  size_t left = out.bytes();
  while (left > 0) {
    const ssize_t got = ::pread(f.fd, dst, std::min<size_t>(left, size_t{1} << 30), static_cast<off_t>(at));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) fail_usage("{}: cannot read {}: {}", f.name, name, got < 0 ? std::strerror(errno) : "the file ends early");
    dst += got, at += static_cast<uint64_t>(got), left -= static_cast<size_t>(got);
  }
}

}  // namespace dtk::ckpt
