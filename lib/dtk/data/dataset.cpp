// open_dataset and the writers of data files.
#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>

#include "dtk/core/error.h"
#include "dtk/data/h5.h"
#include "dtk/data/internal.h"

namespace dtk::data {
namespace {
namespace fs = std::filesystem;
using h5::Id;

}  // namespace

// An HDF5 file under a temporary name in the destination's directory, renamed into place by
// commit(); without commit() the temporary file is removed and `path` is untouched.
class AtomicH5 {
 public:
  explicit AtomicH5(const std::string& path) : path_(path) {
    static std::atomic<int> counter{0};
    const fs::path p(path);
    dir_ = p.parent_path().empty() ? fs::path(".") : p.parent_path();
    std::error_code ec;
    if (!fs::is_directory(dir_, ec)) fail_usage(path + ": the directory " + dir_.string() + " does not exist");
    if (p.filename().empty()) fail_usage(path + ": not a file name");
    if (fs::is_directory(p, ec)) fail_usage(path + ": is a directory");
    tmp_ = dir_ / fmt::format(".{}.tmp-{}-{}", p.filename().string(), ::getpid(), counter++);
    auto g = h5::lock();
    h5::quiet();
    file_ = H5Fcreate(tmp_.c_str(), H5F_ACC_EXCL, H5P_DEFAULT, h5::file_access());
    if (file_ < 0) {
      const std::string m = h5::last_error();
      fail("cannot create " + tmp_.string() + (m.empty() ? "" : ": " + m));
    }
  }
  ~AtomicH5() {
    if (committed_) return;
    auto g = h5::lock();
    if (file_ >= 0) H5Fclose(file_);
    std::error_code ec;
    fs::remove(tmp_, ec);
  }
  AtomicH5(const AtomicH5&) = delete;
  AtomicH5& operator=(const AtomicH5&) = delete;
  hid_t id() const { return file_; }
  void commit() {
    {
      auto g = h5::lock();
      const hid_t f = file_;
      file_ = -1;
      h5::check_status(H5Fclose(f), "cannot write " + tmp_.string());
    }
    const int fd = ::open(tmp_.c_str(), O_RDONLY);
    if (fd < 0 || ::fsync(fd) != 0) {
      const std::string m = std::strerror(errno);
      if (fd >= 0) ::close(fd);
      fail("cannot write " + tmp_.string() + ": " + m);
    }
    ::close(fd);
    std::error_code ec;
    fs::rename(tmp_, path_, ec);
    if (ec) fail("cannot rename " + tmp_.string() + " to " + path_ + ": " + ec.message());
    committed_ = true;
    const int dfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }

 private:
  std::string path_;
  fs::path dir_, tmp_;
  hid_t file_ = -1;
  bool committed_ = false;
};

namespace {

// Writes an HDF5 file atomically (AtomicH5), filled by `fill` under the HDF5 lock.
void write_atomically(const std::string& path, const std::function<void(hid_t)>& fill) {
  AtomicH5 out(path);
  {
    auto g = h5::lock();
    fill(out.id());
  }
  out.commit();
}

// A contiguous dataset with the given file type, written from a buffer of mem_type.
void write_array(hid_t file, const char* name, hid_t file_type, hid_t mem_type, const std::vector<hsize_t>& dims,
                 const void* data) {
  Id space(h5::check(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                       std::string("dataspace of ") + name));
  Id dset(h5::check(H5Dcreate2(file, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                      std::string("create ") + name));
  hsize_t n = 1;
  for (hsize_t d : dims) n *= d;
  if (n) h5::check_status(H5Dwrite(dset, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), std::string("write ") + name);
}

void write_attrs(hid_t file, const nlohmann::json& attrs) {
  if (attrs.is_null()) return;
  if (!attrs.is_object()) fail_usage("data file attributes must be a JSON object");
  for (auto it = attrs.begin(); it != attrs.end(); ++it) h5::write_attr(file, it.key(), it.value());
}

void check_labels(const std::string& path, std::span<const int32_t> labels, int64_t n, int64_t classes) {
  if (classes < 1) fail_usage("{}: classes must be positive ({})", path, classes);
  if (static_cast<int64_t>(labels.size()) != n)
    fail_usage("{}: {} labels for {} samples", path, labels.size(), n);
  for (size_t i = 0; i < labels.size(); ++i)
    if (labels[i] < 0 || labels[i] >= classes)
      fail_usage("{}: label {} of sample {} is out of range [0, {})", path, labels[i], i, classes);
}

void write_classification(const std::string& path, const char* name, hid_t file_type, hid_t mem_type,
                          const void* data, const Shape& shape, std::span<const int32_t> labels, int64_t classes,
                          const char* format, const nlohmann::json& attrs) {
  check_labels(path, labels, shape[0], classes);
  const std::vector<hsize_t> dims(shape.begin(), shape.end());
  write_atomically(path, [&](hid_t f) {
    write_array(f, name, file_type, mem_type, dims, data);
    write_array(f, "labels", H5T_STD_I32LE, H5T_NATIVE_INT32, {static_cast<hsize_t>(shape[0])}, labels.data());
    h5::write_attr(f, "format", format);
    h5::write_attr(f, "classes", classes);
    write_attrs(f, attrs);
  });
}

}  // namespace

double Dataset::optimal_loss() const { return std::numeric_limits<double>::quiet_NaN(); }

std::unique_ptr<Dataset> open_dataset(const std::string& spec, const nn::ModelConfig& model, bool validation,
                                      uint64_t seed) {
  if (spec == "synthetic") {
    if (model.classifier()) return detail::make_mixture_dataset(model, validation, seed);
    if (model.vocab > 0 && model.seq_len > 0) return detail::make_markov_dataset(model, validation, seed);
    fail_usage("--data synthetic: no synthetic data for a model of arch '" + std::string(name_of(model.arch)) +
               "' (llama-like models need vocab and seq_len)");
  }
  if (spec.empty()) fail_usage("no data given (expected \"synthetic\" or an HDF5 data file)");
  if (const auto shards = detail::token_shards(spec); !shards.empty()) return detail::open_token_shards(spec, shards, model);
  return detail::open_file_dataset(spec, model);
}

struct TokenWriter::Impl {
  std::string path;
  int64_t total, vocab, written = 0;
  bool wide;  // u32 in the file, else u16
  AtomicH5 out;
  Id dset;
  std::vector<uint16_t> narrow;
  Impl(const std::string& p, int64_t n, int64_t v) : path(p), total(n), vocab(v), wide(v > 65536), out(p) {}
};

TokenWriter::TokenWriter(const std::string& path, int64_t tokens, int64_t vocab_size, const nlohmann::json& attrs) {
  if (vocab_size < 1 || vocab_size > (int64_t{1} << 32))
    fail_usage("{}: vocab_size {} is out of range [1, 2^32]", path, vocab_size);
  if (tokens < 0) fail_usage("{}: {} tokens", path, tokens);
  impl_ = std::make_unique<Impl>(path, tokens, vocab_size);
  auto g = h5::lock();
  const hid_t f = impl_->out.id();
  const hsize_t n = static_cast<hsize_t>(tokens);
  Id space(h5::check(H5Screate_simple(1, &n, nullptr), "dataspace of tokens"));
  impl_->dset = Id(h5::check(H5Dcreate2(f, "tokens", impl_->wide ? H5T_STD_U32LE : H5T_STD_U16LE, space, H5P_DEFAULT,
                                        H5P_DEFAULT, H5P_DEFAULT),
                             "create tokens"));
  h5::write_attr(f, "format", "dtk-tokens");
  h5::write_attr(f, "vocab_size", vocab_size);
  write_attrs(f, attrs);
}

TokenWriter::~TokenWriter() {
  if (!impl_) return;
  auto g = h5::lock();
  impl_->dset.reset();
}

void TokenWriter::append(std::span<const uint32_t> tokens) {
  Impl& w = *impl_;
  const auto n = static_cast<int64_t>(tokens.size());
  if (w.written + n > w.total) fail("{}: {} tokens appended to a file of {}", w.path, w.written + n, w.total);
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] >= static_cast<uint64_t>(w.vocab))
      fail_usage("{}: token {} at position {} is not below vocab_size {}", w.path, tokens[i],
                 w.written + static_cast<int64_t>(i), w.vocab);
  if (n == 0) return;
  // Converted here to the file's type, so that HDF5 writes the bytes as they are.
  const void* data = tokens.data();
  if (!w.wide) {
    w.narrow.resize(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) w.narrow[i] = static_cast<uint16_t>(tokens[i]);
    data = w.narrow.data();
  }
  auto g = h5::lock();
  const hsize_t start = static_cast<hsize_t>(w.written), count = static_cast<hsize_t>(n);
  Id fspace(h5::check(H5Dget_space(w.dset), "tokens"));
  h5::check_status(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, &start, nullptr, &count, nullptr), "select tokens");
  Id mspace(h5::check(H5Screate_simple(1, &count, nullptr), "dataspace of tokens"));
  h5::check_status(H5Dwrite(w.dset, w.wide ? H5T_NATIVE_UINT32 : H5T_NATIVE_UINT16, mspace, fspace, H5P_DEFAULT, data),
                   "cannot write tokens to " + w.path);
  w.written += n;
}

void TokenWriter::commit() {
  Impl& w = *impl_;
  if (w.written != w.total) fail("{}: {} tokens of {} written", w.path, w.written, w.total);
  {
    auto g = h5::lock();
    w.dset.reset();
  }
  w.out.commit();
}

void write_token_file(const std::string& path, std::span<const uint32_t> tokens, int64_t vocab_size,
                      const nlohmann::json& attrs) {
  TokenWriter w(path, static_cast<int64_t>(tokens.size()), vocab_size, attrs);
  w.append(tokens);
  w.commit();
}

void write_image_file(const std::string& path, std::span<const uint8_t> images, const Shape& shape,
                      std::span<const int32_t> labels, int64_t classes, const nlohmann::json& attrs) {
  if (shape.size() != 4) fail_usage(path + ": images must have the shape [N, H, W, C] (got " + shape_str(shape) + ")");
  for (int64_t d : shape)
    if (d < 0) fail_usage(path + ": bad image shape " + shape_str(shape));
  if (static_cast<int64_t>(images.size()) != shape_numel(shape))
    fail_usage("{}: {} bytes of images for the shape {}", path, images.size(), shape_str(shape));
  write_classification(path, "images", H5T_STD_U8LE, H5T_NATIVE_UINT8, images.data(), shape, labels, classes,
                       "dtk-images", attrs);
}

void write_feature_file(const std::string& path, std::span<const float> features, const Shape& shape,
                        std::span<const int32_t> labels, int64_t classes, const nlohmann::json& attrs) {
  if (shape.size() != 2) fail_usage(path + ": features must have the shape [N, D] (got " + shape_str(shape) + ")");
  for (int64_t d : shape)
    if (d < 0) fail_usage(path + ": bad feature shape " + shape_str(shape));
  if (static_cast<int64_t>(features.size()) != shape_numel(shape))
    fail_usage("{}: {} features for the shape {}", path, features.size(), shape_str(shape));
  if (const size_t at = detail::first_non_finite(features.data(), features.size()); at < features.size())
    fail_usage("{}: sample {} holds {} (column {}); features must be finite", path, static_cast<int64_t>(at) / shape[1],
               std::isnan(features[at]) ? "NaN" : features[at] > 0 ? "+inf" : "-inf",
               static_cast<int64_t>(at) % shape[1]);
  write_classification(path, "features", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, features.data(), shape, labels, classes,
                       "dtk-features", attrs);
}

}  // namespace dtk::data
