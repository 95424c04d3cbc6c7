// The safetensors format (https://github.com/huggingface/safetensors, "Format"), the one place
// dtk knows it: an 8-byte little-endian header length N, N bytes of JSON ({name: {"dtype",
// "shape", "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}}, padded with spaces),
// then the tensors' bytes, offsets relative to the end of the header.
//
// Safetensors reads one file, or a Hugging Face folder's model.safetensors or its shards through
// model.safetensors.index.json ({"weight_map": {name: file}}), as transformers'
// from_pretrained does. Everything is checked on open, before a byte of data is read: the header
// (JSON, dtypes, shapes, offsets that match the shapes, lie inside the file and do not
// overlap), and the index (every shard it names exists and holds the tensors it says). Reads are
// by rows of dim 0 (pread), so a rank reads only its own rows of a large tensor. Anything wrong
// is a UsageError (exit 2) naming the file and the tensor.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtk/core/tensor.h"

namespace dtk::ckpt {

// The format's dtype names: "F32", "BF16", ... (every DType has one).
const char* safetensors_dtype(DType t);

// What precedes the data: the header's length and its JSON, padded with spaces to a multiple of
// 8 bytes (so that every tensor whose offset is a multiple of its element size stays aligned).
std::string safetensors_prefix(const nlohmann::ordered_json& header);

class Safetensors {
 public:
  // A .safetensors file, or a folder holding model.safetensors or model.safetensors.index.json.
  explicit Safetensors(const std::filesystem::path& path);
  ~Safetensors();
  Safetensors(const Safetensors&) = delete;
  Safetensors& operator=(const Safetensors&) = delete;

  struct Info {
    Shape shape;
    DType dtype = DType::f32;
    std::string file;  // the file that holds it (its name in the folder)
  };
  const std::map<std::string, Info>& tensors() const { return tensors_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const Info& info(const std::string& name) const;  // UsageError naming it when absent
  // Rows [row0, row0 + out.dim(0)) of dim 0 into `out`, a host tensor of the stored dtype whose
  // other dims are the stored ones (a 0-d tensor: the whole value).
  void read_rows(const std::string& name, int64_t row0, Tensor& out) const;

 private:
  struct File;
  struct Where {
    size_t file;
    uint64_t offset;  // of the tensor's first byte in the file
  };
  void open_file(const std::filesystem::path& path);
  std::vector<std::unique_ptr<File>> files_;
  std::map<std::string, Info> tensors_;
  std::map<std::string, Where> where_;
};

}  // namespace dtk::ckpt
