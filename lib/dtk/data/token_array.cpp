// Token ids in other tools' files, memory-mapped (token_array.h).
#include "dtk/data/token_array.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <regex>
#include <vector>

#include "dtk/core/error.h"

namespace dtk::data {

static_assert(std::endian::native == std::endian::little, "token files are little-endian; so must the host be");

namespace {

constexpr int32_t kLlmcMagic = 20240520;
constexpr size_t kLlmcHeader = 256 * sizeof(int32_t);

template <typename T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// NumPy's type string for a token dtype: '|u1', '<u2', '<u4', '<i4', '<i8'.
std::optional<TokenType> npy_token_dtype(const std::string& descr) {
  static const std::pair<const char*, TokenType> kTypes[] = {
      {"|u1", TokenType::u8}, {"<u2", TokenType::u16}, {"<u4", TokenType::u32}, {"<i4", TokenType::i32}, {"<i8", TokenType::i64}};
  for (const auto& [name, t] : kTypes)
    if (descr == name) return t;
  return std::nullopt;
}

}  // namespace

size_t token_type_size(TokenType t) {
  switch (t) {
    case TokenType::u8: return 1;
    case TokenType::u16: return 2;
    case TokenType::u32:
    case TokenType::i32: return 4;
    case TokenType::i64: return 8;
  }
  return 0;
}

TokenArray::TokenArray(std::string path, std::optional<TokenType> raw_dtype) : path_(std::move(path)) {
  const std::string& p = path_;
  fd_ = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail_usage("{}: cannot open: {}", p, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fail_usage("{}: not a regular file", p);
  }
  const auto size = static_cast<size_t>(st.st_size);
  // The headers: .npy's (at most 4 GiB, in practice a few hundred bytes: the first 64 KiB are
  // read, a longer one is read whole below) and llm.c's 1 KiB.
  std::vector<unsigned char> head(std::min<size_t>(size, 65536));
  const auto pread_all = [&](unsigned char* dst, size_t n, size_t at) {
    while (n > 0) {
      const ssize_t got = ::pread(fd_, dst, n, static_cast<off_t>(at));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) fail_usage("{}: cannot read: {}", p, got < 0 ? std::strerror(errno) : "the file ends early");
      dst += got, at += static_cast<size_t>(got), n -= static_cast<size_t>(got);
    }
  };
  try {
    pread_all(head.data(), head.size(), 0);
    const unsigned char* h = head.data();
    if (raw_dtype) {
      format_ = Format::raw;
      dtype_ = *raw_dtype;
      if (size % token_type_size(dtype_) != 0)
        fail_usage("{}: {} bytes are not a whole number of {} tokens (truncated?)", p, size, name_of(dtype_));
      data_ = 0;
      n_ = static_cast<int64_t>(size / token_type_size(dtype_));
      descr_ = fmt::format("raw {}", name_of(dtype_));
    } else if (size >= 10 && std::memcmp(h, "\x93NUMPY", 6) == 0) {
      format_ = Format::npy;
      const int major = h[6];
      if (major < 1 || major > 3) fail_usage("{}: .npy format version {}.{}, which dtk does not read", p, major, h[7]);
      const size_t prefix = major == 1 ? 10 : 12;
      if (size < prefix) fail_usage("{}: a truncated .npy header", p);
      const size_t len = major == 1 ? load<uint16_t>(h + 8) : load<uint32_t>(h + 8);
      if (len > size - prefix) fail_usage("{}: a truncated .npy header ({} bytes announced)", p, len);
      std::string dict(len, '\0');
      pread_all(reinterpret_cast<unsigned char*>(dict.data()), len, prefix);
      static const std::regex descr_re(R"('descr'\s*:\s*'([^']*)')"), fortran_re(R"('fortran_order'\s*:\s*(True|False))"),
          shape_re(R"('shape'\s*:\s*\(([^)]*)\))");
      std::smatch m_descr, m_fortran, m_shape;
      if (!std::regex_search(dict, m_descr, descr_re) || !std::regex_search(dict, m_fortran, fortran_re) ||
          !std::regex_search(dict, m_shape, shape_re))
        fail_usage("{}: not a .npy header (descr, fortran_order, shape): {}", p, dict);
      descr_ = "npy " + m_descr[1].str();
      const auto t = npy_token_dtype(m_descr[1].str());
      if (!t)
        fail_usage("{}: a .npy array of '{}': token ids are '|u1', '<u2', '<u4', '<i4' or '<i8' (little-endian integers)", p,
                   m_descr[1].str());
      dtype_ = *t;
      int64_t numel = 1, dims = 0;
      static const std::regex dim_re(R"(\d+)");
      const std::string shape = m_shape[1].str();
      for (auto it = std::sregex_iterator(shape.begin(), shape.end(), dim_re); it != std::sregex_iterator(); ++it) {
        const int64_t d = std::stoll(it->str());
        if (d != 0 && numel > (int64_t{1} << 60) / d) fail_usage("{}: the .npy shape ({}) is too large", p, shape);
        numel *= d;
        ++dims;
      }
      if (dims > 1 && m_fortran[1] == "True") fail_usage("{}: a Fortran-order .npy array of {} dimensions", p, dims);
      data_ = prefix + len;
      n_ = numel;
      const uint64_t want = data_ + static_cast<uint64_t>(numel) * token_type_size(dtype_);
      if (size != want)
        fail_usage("{}: shape ({}) of {} needs {} bytes, the file has {} ({})", p, shape, m_descr[1].str(), want, size,
                   size < want ? "truncated" : "trailing bytes");
    } else if (size >= kLlmcHeader && load<int32_t>(h) == kLlmcMagic) {
      format_ = Format::llmc;
      const int32_t version = load<int32_t>(h + 4);
      if (version != 1 && version != 2)
        fail_usage("{}: llm.c .bin version {}; dtk reads 1 (u16 tokens) and 2 (u32 tokens)", p, version);
      dtype_ = version == 1 ? TokenType::u16 : TokenType::u32;
      const int32_t count = load<int32_t>(h + 8);
      if (count < 0) fail_usage("{}: llm.c .bin header counts {} tokens", p, count);
      data_ = kLlmcHeader;
      n_ = count;
      const uint64_t want = kLlmcHeader + static_cast<uint64_t>(count) * token_type_size(dtype_);
      if (size != want)
        fail_usage("{}: its header counts {} tokens of {}, which need {} bytes; the file has {} ({})", p, count,
                   name_of(dtype_), want, size, size < want ? "truncated" : "trailing bytes");
      descr_ = fmt::format("llm.c .bin v{} ({})", version, name_of(dtype_));
    } else {
      fail_usage("{}: neither .npy nor an llm.c .bin shard (that starts with the magic {}, this file with {}); data-pack "
                 "tokens --dtype reads a headerless file of raw token ids",
                 p, kLlmcMagic, size >= 4 ? std::to_string(load<int32_t>(h)) : "nothing");
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

TokenArray::~TokenArray() { ::close(fd_); }

std::string TokenArray::describe() const { return descr_; }

void TokenArray::advise_sequential(bool sequential) const {
  ::posix_fadvise(fd_, 0, 0, sequential ? POSIX_FADV_SEQUENTIAL : POSIX_FADV_RANDOM);
}

void TokenArray::read(int64_t begin, std::span<uint32_t> out) const {
  const auto n = static_cast<int64_t>(out.size());
  if (begin < 0 || begin + n > n_) fail("{}: tokens [{}, {}) of {}", path_, begin, begin + n, n_);
  // The file's bytes: straight into `out` when they are u32, else through a buffer of this thread.
  const size_t elem = token_type_size(dtype_), bytes = static_cast<size_t>(n) * elem;
  thread_local std::vector<unsigned char> staging;
  unsigned char* dst = reinterpret_cast<unsigned char*>(out.data());
  if (dtype_ != TokenType::u32) {
    staging.resize(bytes);
    dst = staging.data();
  }
  size_t at = data_ + static_cast<size_t>(begin) * elem;
  for (size_t left = bytes, done = 0; left > 0;) {
    const ssize_t got = ::pread(fd_, dst + done, left, static_cast<off_t>(at));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) fail_usage("{}: cannot read: {}", path_, got < 0 ? std::strerror(errno) : "the file ends early");
    done += static_cast<size_t>(got), at += static_cast<size_t>(got), left -= static_cast<size_t>(got);
  }
  const unsigned char* src = dst;
  const auto bad = [&](int64_t i, int64_t v) {
    fail_usage("{}: token {} at position {} is not a token id (0 to 2^32 - 1)", path_, v, begin + i);
  };
  switch (dtype_) {
    case TokenType::u8:
      for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = src[i];
      break;
    case TokenType::u16:
      for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = load<uint16_t>(src + 2 * i);
      break;
    case TokenType::u32: break;  // read in place
    case TokenType::i32:
      for (int64_t i = 0; i < n; ++i) {
        const int32_t v = load<int32_t>(src + 4 * i);
        if (v < 0) bad(i, v);
        out[static_cast<size_t>(i)] = static_cast<uint32_t>(v);
      }
      break;
    case TokenType::i64:
      for (int64_t i = 0; i < n; ++i) {
        const int64_t v = load<int64_t>(src + 8 * i);
        if (v < 0 || v > std::numeric_limits<uint32_t>::max()) bad(i, v);
        out[static_cast<size_t>(i)] = static_cast<uint32_t>(v);
      }
      break;
  }
}

}  // namespace dtk::data
