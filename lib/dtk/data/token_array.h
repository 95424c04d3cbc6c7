// Token ids in the files other tools write, read with pread where asked: a file of any size is
// never held whole (nor mapped: its pages would count in the reader's resident memory).
//   npy   NumPy's .npy (format versions 1-3): little-endian u8, u16, u32, i32 or i64 of any
//         shape in C order, read flat; a Fortran-order array of more than one dimension is refused.
//   llmc  llm.c's and nanoGPT-style .bin shards: a header of 256 little-endian int32 (magic
//         20240520, version 1: u16 tokens (GPT-2), version 2: u32 tokens (Llama 3), the token
//         count), then the tokens.
//   raw   a headerless little-endian array of a type the caller names (u8, u16, u32, i32, i64).
// The format is found from the content (NumPy's magic, llm.c's magic) unless a raw dtype is
// given. Anything that does not add up (a truncated file, a header whose count or shape the
// file's size contradicts, an unknown dtype or version) is a UsageError naming the file.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "dtk/core/enums.h"

namespace dtk::data {

// The integer types of token ids in files (dtk's DType has no u32).
enum class TokenType { u8, u16, u32, i32, i64 };
DTK_ENUM_NAMES(TokenType, {TokenType::u8, "u8"}, {TokenType::u16, "u16"}, {TokenType::u32, "u32"}, {TokenType::i32, "i32"},
               {TokenType::i64, "i64"})
size_t token_type_size(TokenType t);

class TokenArray {
 public:
  enum class Format { npy, llmc, raw };
  TokenArray(std::string path, std::optional<TokenType> raw_dtype = std::nullopt);
  ~TokenArray();
  TokenArray(const TokenArray&) = delete;
  TokenArray& operator=(const TokenArray&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return n_; }  // tokens
  TokenType dtype() const { return dtype_; }
  Format format() const { return format_; }
  std::string describe() const;  // "llm.c .bin v1 (u16)", "npy <i8", "raw u32"
  // Tokens [begin, begin + out.size()) as u32; a negative id, or one above 2^32 - 1, is a
  // UsageError naming the file and the position.
  void read(int64_t begin, std::span<uint32_t> out) const;
  // Hints that the tokens will be read front to back (packing) or at random (training).
  void advise_sequential(bool sequential) const;

 private:
  std::string path_;
  Format format_ = Format::raw;
  TokenType dtype_ = TokenType::u16;
  int64_t n_ = 0;
  int fd_ = -1;
  size_t data_ = 0;  // offset of the first token
  std::string descr_;
};

}  // namespace dtk::data
