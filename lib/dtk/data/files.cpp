// Datasets in HDF5 files: token files (1-D `tokens`, a source of the token datasets of
// stream.cpp) and classification files (`images` u8 [N,H,W,C] or `features` float [N,D], with
// `labels` [N]). Batches read only their rows, through hyperslab selections; only the labels are
// held in memory.
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <tuple>

#include "dtk/core/error.h"
#include "dtk/data/h5.h"
#include "dtk/data/internal.h"

namespace dtk::data {
namespace {
namespace fs = std::filesystem;
using h5::Id;

std::string type_name(hid_t type) {
  const H5T_class_t c = H5Tget_class(type);
  const size_t bits = H5Tget_size(type) * 8;
  if (c == H5T_INTEGER) return fmt::format("{}{}", H5Tget_sign(type) == H5T_SGN_NONE ? "u" : "i", bits);
  if (c == H5T_FLOAT) return fmt::format("f{}", bits);
  if (c == H5T_STRING) return "string";
  if (c == H5T_COMPOUND) return "compound";
  return fmt::format("class {}, {} bytes", static_cast<int>(c), bits / 8);
}

// An opened dataset of a data file: its id, type and dims.
struct Array {
  Id dset, type;
  std::vector<hsize_t> dims;
};

// Reads rows [0, n) of a's dim 0 in chunks of `chunk` rows as `type` (T in memory):
// f(first row, rows, values of those rows).
template <class T, class F>
void for_each_chunk(const Array& a, int64_t n, int64_t chunk, hid_t type, const std::string& what, F&& f) {
  std::vector<unsigned char> buf;
  std::vector<int64_t> off;
  for (int64_t r = 0; r < n; r += chunk) {
    const int64_t rows = std::min(chunk, n - r);
    h5::read_ranges(a.dset, static_cast<int>(a.dims.size()), a.dims, {{r, rows}}, type, sizeof(T), buf, off, what);
    f(r, rows, reinterpret_cast<const T*>(buf.data()));
  }
}

// The files whose every value this process checked (tokens below vocab_size, features finite),
// as they were then (path, size, modification time): programs open their data once to validate
// the options (on every rank, so that every rank refuses a bad file alike, before any work) and
// again to train, and the check reads the whole file.
using FileVersion = std::tuple<std::string, uintmax_t, int64_t>;
std::set<FileVersion> g_checked_files;
FileVersion file_version(const std::string& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  const auto mtime = fs::last_write_time(path, ec).time_since_epoch().count();
  return {fs::weakly_canonical(path, ec).string(), size, static_cast<int64_t>(mtime)};
}

// A data file opened read-only (under the HDF5 lock, which the caller holds); UsageError when
// it is not HDF5 or is damaged.
Id open_data_file(const std::string& path) {
  h5::quiet();
  Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, h5::file_access()));
  if (!file.valid()) {
    const std::string m = h5::last_error();
    fail_usage(path + ": not an HDF5 file, or a damaged one" + (m.empty() ? "" : " (" + m + ")"));
  }
  return file;
}

Array open_array(hid_t file, const char* name, const std::string& path) {
  Array a;
  a.dset = Id(H5Oopen(file, name, H5P_DEFAULT));
  if (!a.dset.valid() || H5Iget_type(a.dset) != H5I_DATASET) {
    h5::last_error();
    fail_usage(path + ": `" + name + "` is not a dataset");
  }
  a.type = Id(h5::check(H5Dget_type(a.dset), path + ": `" + name + "`"));
  Id space(h5::check(H5Dget_space(a.dset), path + ": `" + name + "`"));
  const int rank = H5Sget_simple_extent_ndims(space);
  if (rank < 0) fail_usage(path + ": `" + name + "` has no simple shape");
  a.dims.resize(static_cast<size_t>(rank));
  H5Sget_simple_extent_dims(space, a.dims.data(), nullptr);
  return a;
}

// After its type and shape are checked, before anything is read: its data is all there and its
// size fits (core/h5.h).
void check_stored(const Array& a, const std::string& path, const char* name) {
  h5::check_stored(a.dset, a.dims, H5Tget_size(a.type), path + ": `" + name + "`");
}

bool exists(hid_t file, const char* name) { return H5Lexists(file, name, H5P_DEFAULT) > 0; }

// C, H, W of images stored [N, H, W, C] (or [N, H, W]: one channel).
Shape chw_of(const std::vector<hsize_t>& dims) {
  const auto d = [&](size_t i) { return static_cast<int64_t>(dims[i]); };
  return {dims.size() == 4 ? d(3) : 1, d(1), d(2)};
}

// An integer attribute on the file's root or, failing that, on a dataset.
bool int_attr(hid_t file, hid_t dset, const char* name, int64_t* out, const std::string& path) {
  return h5::read_int_attr(file, name, out, path) || (dset >= 0 && h5::read_int_attr(dset, name, out, path));
}

std::string dims_str(const std::vector<hsize_t>& d) {
  return fmt::format("[{}]", fmt::join(d, ", "));
}

// A classification file, held open for its lifetime and closed under the HDF5 lock (as H5Tokens).
class FileDataset : public Dataset {
 protected:
  FileDataset(std::string path, Id file) : path_(std::move(path)), file_(std::move(file)) {}
  ~FileDataset() override {
    auto g = h5::lock();
    arr_.dset.reset();
    arr_.type.reset();
    file_.reset();
  }
  std::string path_;
  Id file_;
  Array arr_;
  double optimal_ = std::numeric_limits<double>::quiet_NaN();
};

// ------------------------------------------------------------------------------ token files
// A dtk token file as a source of a token dataset (stream.cpp): u16 or u32 `tokens`, vocab_size.
class H5Tokens final : public detail::TokenSource {
 public:
  H5Tokens(std::string path, Id file) : path_(std::move(path)), file_(std::move(file)) {
    const std::string& p = path_;
    arr_ = open_array(file_, "tokens", p);
    if (arr_.dims.size() != 1) fail_usage(p + ": `tokens` must be 1-D (it is " + dims_str(arr_.dims) + ")");
    const hid_t t = arr_.type;
    if (H5Tget_class(t) != H5T_INTEGER || H5Tget_sign(t) != H5T_SGN_NONE ||
        (H5Tget_size(t) != 2 && H5Tget_size(t) != 4))
      fail_usage(p + ": `tokens` must be u16 or u32 (it is " + type_name(t) + ")");
    check_stored(arr_, p, "tokens");
    dtype_ = H5Tget_size(t) == 2 ? "u16" : "u32";
    n_ = static_cast<int64_t>(arr_.dims[0]);
    if (!int_attr(file_, arr_.dset, "vocab_size", &vocab_, p))
      fail_usage(p + ": the attribute vocab_size is missing (write token files with data-pack)");
    if (vocab_ < 1) fail_usage("{}: vocab_size {} is not positive", p, vocab_);
    double v;
    if (h5::read_double_attr(file_, "optimal_loss", &v)) optimal_ = v;
  }
  ~H5Tokens() override {
    auto g = h5::lock();
    arr_.dset.reset();
    arr_.type.reset();
    file_.reset();
  }
  const std::string& path() const override { return path_; }
  int64_t size() const override { return n_; }
  int64_t vocab() const override { return vocab_; }
  std::string dtype() const override { return dtype_; }
  double optimal_loss() const override { return optimal_; }
  void read(int64_t begin, std::span<uint32_t> out) const override {
    if (out.empty()) return;
    std::vector<unsigned char> buf;
    std::vector<int64_t> off;
    auto g = h5::lock();
    h5::read_ranges(arr_.dset, 1, arr_.dims, {{begin, static_cast<int64_t>(out.size())}}, H5T_NATIVE_UINT32,
                    sizeof(uint32_t), buf, off, path_ + ": reading `tokens`");
    std::memcpy(out.data(), buf.data(), out.size_bytes());
  }

 private:
  std::string path_;
  Id file_;
  Array arr_;
  int64_t n_ = 0, vocab_ = 0;
  std::string dtype_;
  double optimal_ = std::numeric_limits<double>::quiet_NaN();
};

// ------------------------------------------------------------------------------ classification
class ClassFile final : public FileDataset {
 public:
  ClassFile(std::string path, Id file, const nn::ModelConfig& m) : FileDataset(std::move(path), std::move(file)) {
    const std::string& p = path_;
    images_ = !exists(file_, "features");
    const char* name = images_ ? "images" : "features";
    arr_ = open_array(file_, name, p);
    const hid_t t = arr_.type;
    if (images_) {
      if (H5Tget_class(t) != H5T_INTEGER || H5Tget_sign(t) != H5T_SGN_NONE || H5Tget_size(t) != 1)
        fail_usage(p + ": `images` must be u8 (it is " + type_name(t) + ")");
      if (arr_.dims.size() != 4 && arr_.dims.size() != 3)
        fail_usage(p + ": `images` must be [N, H, W, C] (it is " + dims_str(arr_.dims) + ")");
    } else {
      if (H5Tget_class(t) != H5T_FLOAT) fail_usage(p + ": `features` must be f32 (it is " + type_name(t) + ")");
      if (arr_.dims.size() != 2) fail_usage(p + ": `features` must be [N, D] (it is " + dims_str(arr_.dims) + ")");
    }
    check_stored(arr_, p, name);
    n_ = static_cast<int64_t>(arr_.dims[0]);
    d_ = 1;
    for (size_t i = 1; i < arr_.dims.size(); ++i) d_ *= static_cast<int64_t>(arr_.dims[i]);
    if (n_ == 0) fail_usage(p + ": `" + name + "` holds no samples");
    if (images_) chw_ = chw_of(arr_.dims);
    if (m.arch == nn::Arch::resnet && images_ && chw_ != m.input_shape)
      fail_usage(p + ": the images are " + shape_str(chw_) + " (C, H, W), but the model's input_shape is " +
                 shape_str(m.input_shape));
    if (d_ != m.sample_numel())
      fail_usage("{}: a sample of `{}` {} has {} values, but the model takes {} ({}); {}", p, name, dims_str(arr_.dims),
                 d_, m.sample_numel(), m.arch == nn::Arch::mlp ? "its input_dim" : "its input_shape",
                 m.arch == nn::Arch::mlp ? fmt::format("add --input-dim {} to fit the data", d_)
                                 : "--input-shape C,H,W sets the model's (default: the images' own)");

    if (!exists(file_, "labels")) fail_usage(p + ": the dataset `labels` is missing");
    Array lab = open_array(file_, "labels", p);
    if (H5Tget_class(lab.type) != H5T_INTEGER) fail_usage(p + ": `labels` must be integers (it is " + type_name(lab.type) + ")");
    if (lab.dims.size() != 1 || static_cast<int64_t>(lab.dims[0]) != n_)
      fail_usage("{}: `labels` must be [{}] like `{}` (it is {})", p, n_, name, dims_str(lab.dims));
    check_stored(lab, p, "labels");
    int64_t attr_classes = 0;
    classes_ = m.classes;
    if (int_attr(file_, lab.dset, "classes", &attr_classes, p)) {
      if (attr_classes < 1) fail_usage("{}: the attribute classes ({}) is not positive", p, attr_classes);
      if (attr_classes > m.classes)
        fail_usage("{}: the file has {} classes, but the model has {}; add --classes {} to fit the data", p, attr_classes,
                   m.classes, attr_classes);
      classes_ = attr_classes;
    }
    // The labels, read in bounded chunks and checked.
    labels_.resize(static_cast<size_t>(n_));
    for_each_chunk<int64_t>(lab, n_, int64_t{1} << 20, H5T_NATIVE_INT64, p + ": reading `labels`",
                            [&](int64_t r, int64_t rows, const int64_t* v) {
      for (int64_t i = 0; i < rows; ++i) {
        if (v[i] < 0 || v[i] >= classes_)
          fail_usage("{}: label {} of sample {} is out of range [0, {}) ({})", p, v[i], r + i, classes_,
                     attr_classes ? "the file's classes attribute" : "the model's classes");
        labels_[static_cast<size_t>(r + i)] = static_cast<int32_t>(v[i]);
      }
    });
    if (!images_) detail::check_once(path_, [&] { check_finite_features(); });
    double v;
    if (h5::read_double_attr(file_, "optimal_loss", &v)) optimal_ = v;
  }
  int64_t size() const override { return n_; }
  nn::Batch get(std::span<const int64_t> indices) const override {
    const int64_t B = static_cast<int64_t>(indices.size()), D = d_;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    ranges.reserve(indices.size());
    for (int64_t i : indices) {
      DTK_CHECK(i >= 0 && i < n_, path_ + ": sample index out of range");
      ranges.emplace_back(i, 1);
    }
    std::vector<unsigned char> buf;
    std::vector<int64_t> off;
    {
      auto g = h5::lock();
      h5::read_ranges(arr_.dset, static_cast<int>(arr_.dims.size()), arr_.dims, ranges,
                        images_ ? H5T_NATIVE_UINT8 : H5T_NATIVE_FLOAT, images_ ? 1 : sizeof(float), buf, off,
                        path_ + (images_ ? ": reading `images`" : ": reading `features`"));
    }
    Tensor x = Tensor::empty(images_ ? Shape{B, chw_[0], chw_[1], chw_[2]} : Shape{B, D}, DType::f32);
    Tensor y = Tensor::empty({B}, DType::i32);
    float* px = x.ptr<float>();
    int32_t* py = y.ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t o = off[static_cast<size_t>(b)] * D;
      if (images_) {  // H, W, C bytes -> C, H, W floats in [0, 1]
        const unsigned char* s = buf.data() + o;
        const int64_t C = chw_[0], HW = chw_[1] * chw_[2];
        float* dst = px + b * D;
        for (int64_t i = 0; i < HW; ++i)
          for (int64_t c = 0; c < C; ++c) dst[c * HW + i] = static_cast<float>(s[i * C + c]) / 255.0f;
      } else {
        const float* s = reinterpret_cast<const float*>(buf.data()) + o;
        std::copy(s, s + D, px + b * D);
      }
      py[b] = labels_[static_cast<size_t>(indices[static_cast<size_t>(b)])];
    }
    return {x, y};
  }
  nlohmann::json describe() const override {
    nlohmann::json j = {{"source", path_}, {"kind", "classification"}, {"samples", n_},
                        {"classes", classes_}, {"input_dim", d_}, {"format", images_ ? "images" : "features"}};
    if (images_) j["image_shape"] = chw_;
    if (!std::isnan(optimal_)) j["optimal_loss"] = optimal_;
    return j;
  }
  double optimal_loss() const override { return optimal_; }

 private:
  // Every feature, as the model will see it (f32), is finite: one pass over the file in chunks
  // of about 16 MiB. UsageError naming the first sample that holds NaN or an infinity.
  void check_finite_features() const {
    const int64_t chunk = std::max<int64_t>(1, (int64_t{4} << 20) / d_);
    for_each_chunk<float>(arr_, n_, chunk, H5T_NATIVE_FLOAT, path_ + ": reading `features`",
                          [&](int64_t r, int64_t rows, const float* x) {
      const size_t n = static_cast<size_t>(rows * d_), at = detail::first_non_finite(x, n);
      if (at == n) return;
      const float bad = x[at];
      fail_usage("{}: sample {} of `features` holds {} (column {}); features must be finite", path_,
                 r + static_cast<int64_t>(at) / d_, std::isnan(bad) ? "NaN" : bad > 0 ? "+inf" : "-inf",
                 static_cast<int64_t>(at) % d_);
    });
  }

  bool images_ = true;
  int64_t n_ = 0, d_ = 0, classes_ = 0;
  Shape chw_;  // images: C, H, W
  std::vector<int32_t> labels_;
};

}  // namespace

namespace detail {

void check_once(const std::string& path, const std::function<void()>& check) {
  const FileVersion v = file_version(path);
  if (g_checked_files.contains(v)) return;
  check();
  g_checked_files.insert(v);
}

std::unique_ptr<TokenSource> open_token_source(const std::string& path) {
  auto g = h5::lock();
  Id file = open_data_file(path);
  if (!exists(file, "tokens")) fail_usage(path + ": holds no `tokens` (not a dtk token file)");
  return std::make_unique<H5Tokens>(path, std::move(file));
}

size_t first_non_finite(const float* x, size_t n) {
  const auto non_finite = [](float v) {  // exponent all ones: an infinity or a NaN
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    return (u & 0x7f800000u) == 0x7f800000u;
  };
  constexpr size_t kBlock = 4096;
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t e = std::min(n, b + kBlock);
    unsigned any = 0;
    for (size_t i = b; i < e; ++i) any |= non_finite(x[i]);
    if (any)
      for (size_t i = b; i < e; ++i)
        if (non_finite(x[i])) return i;
  }
  return n;
}

std::unique_ptr<Dataset> open_file_dataset(const std::string& path, const nn::ModelConfig& model) {
  std::error_code ec;
  if (!fs::exists(path, ec)) fail_usage(path + ": no such file (expected \"synthetic\" or an HDF5 data file)");
  if (fs::is_directory(path, ec)) fail_usage(path + ": is a directory, not an HDF5 data file");
  if (!std::ifstream(path, std::ios::binary)) fail_usage(path + ": cannot be read (permissions?)");
  auto g = h5::lock();
  Id file = open_data_file(path);
  const bool classify = model.classifier();
  try {
    if (exists(file, "tokens")) {
      if (classify)
        fail_usage(path + ": a token file, but the model (" + std::string(name_of(model.arch)) + ") is a classifier; it needs `images` or `features`");
      std::vector<std::unique_ptr<TokenSource>> one;
      one.push_back(std::make_unique<H5Tokens>(path, std::move(file)));
      g.unlock();
      return make_token_dataset(path, std::move(one), model);
    }
    if (exists(file, "images") || exists(file, "features")) {
      if (!classify)
        fail_usage(path + ": a classification file, but the model (" + std::string(name_of(model.arch)) + ") takes `tokens`");
      return std::make_unique<ClassFile>(path, std::move(file), model);
    }
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {  // an HDF5 failure while reading a file that opened: bad input
    fail_usage(e.what());
  }
  fail_usage(path + ": holds no `tokens`, `images` or `features` dataset (not a dtk data file; write one with data-pack)");
}

}  // namespace detail

std::vector<int64_t> image_shape(const std::string& spec) {
  std::error_code ec;
  if (spec == "synthetic" || !fs::is_regular_file(spec, ec)) return {};
  auto g = h5::lock();
  h5::quiet();
  Id file(H5Fopen(spec.c_str(), H5F_ACC_RDONLY, h5::file_access()));
  if (!file.valid() || !exists(file, "images")) return {};
  try {
    const Array a = open_array(file, "images", spec);
    if (a.dims.size() == 3 || a.dims.size() == 4) return chw_of(a.dims);
  } catch (const Error&) {  // open_dataset says what is wrong with the file
  }
  return {};
}

}  // namespace dtk::data
