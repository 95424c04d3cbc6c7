#include "dtk/core/tensor.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <fmt/ranges.h>  // fmt::join

#include "dtk/core/error.h"

namespace dtk {

namespace cuda {  // the caching allocator of core/cuda/runtime.cpp
void* cached_malloc(size_t bytes, int device, size_t* block);
void cached_free(void* p, int device, size_t block);
MemoryStats cached_stats();
void cached_reset_peak();
void cached_empty();
}  // namespace cuda

namespace {
struct HostStats {
  std::atomic<size_t> current{0}, peak{0}, allocations{0};
} g_host;

void host_account(ptrdiff_t delta) {
  const size_t now = g_host.current.fetch_add(static_cast<size_t>(delta)) + static_cast<size_t>(delta);
  size_t peak = g_host.peak.load();
  while (now > peak && !g_host.peak.compare_exchange_weak(peak, now)) {
  }
}
}  // namespace

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    if (d < 0) fail_usage("negative dimension in shape " + shape_str(s));
    if (__builtin_mul_overflow(n, d, &n)) fail_usage("shape " + shape_str(s) + " has more elements than an int64 counts");
  }
  return n;
}

std::string shape_str(const Shape& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

MemoryStats memory_stats(Device d) {
  if (d.is_cuda()) return cuda::cached_stats();
  MemoryStats s;
  s.current = g_host.current.load();
  s.peak = g_host.peak.load();
  s.reserved = s.current;
  s.allocations = g_host.allocations.load();
  return s;
}

void reset_peak_memory(Device d) {
  if (d.is_cuda())
    cuda::cached_reset_peak();
  else
    g_host.peak.store(g_host.current.load());
}

void empty_cache(Device d) {
  if (d.is_cuda()) cuda::cached_empty();
}

Storage::Storage(size_t bytes, Device d) : bytes_(bytes), device_(d) {
  if (d.is_cuda()) {
    data_ = cuda::cached_malloc(bytes, d.index, &reserved_);
  } else {
    reserved_ = (bytes + 63) / 64 * 64;
    data_ = std::aligned_alloc(64, reserved_ ? reserved_ : 64);
    if (!data_) fail("out of host memory allocating {} bytes", bytes);
    g_host.allocations.fetch_add(1);
    host_account(static_cast<ptrdiff_t>(reserved_));
  }
}

Storage::~Storage() {
  if (device_.is_cuda()) {
    cuda::cached_free(data_, device_.index, reserved_);
  } else {
    std::free(data_);
    host_account(-static_cast<ptrdiff_t>(reserved_));
  }
}

Tensor Tensor::empty(const Shape& shape, DType t, Device d) {
  Tensor x;
  x.numel_ = shape_numel(shape);
  x.shape_ = shape;
  x.dtype_ = t;
  x.device_ = d;
  x.storage_ = std::make_shared<Storage>(x.bytes(), d);
  return x;
}

Tensor Tensor::zeros(const Shape& shape, DType t, Device d) {
  Tensor x = empty(shape, t, d);
  if (!x.bytes()) return x;
  if (d.is_cuda()) {
    cuda::memset_async(x.data(), 0, x.bytes(), cuda::current_stream());
  } else {
    std::memset(x.data(), 0, x.bytes());
  }
  return x;
}

int64_t Tensor::dim(int i) const {
  const int n = ndim();
  const int j = i < 0 ? i + n : i;
  if (j < 0 || j >= n) fail_usage("dimension {} out of range for {}", i, str());
  return shape_[j];
}

Tensor Tensor::reshape(const Shape& shape) const {
  Shape s = shape;
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      if (infer >= 0) fail_usage("reshape: more than one -1 in " + shape_str(shape));
      infer = static_cast<int>(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel_ % known) fail_usage("reshape: cannot view " + str() + " as " + shape_str(shape));
    s[infer] = numel_ / known;
  }
  if (shape_numel(s) != numel_) fail_usage("reshape: cannot view " + str() + " as " + shape_str(shape));
  Tensor v = *this;
  v.shape_ = s;
  return v;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  if (ndim() == 0) fail_usage("slice of a 0-d tensor");
  if (begin < 0 || end < begin || end > shape_[0])
    fail_usage("slice [{}, {}) out of range for {}", begin, end, str());
  const int64_t row = shape_[0] ? numel_ / shape_[0] : 0;
  Tensor v = *this;
  v.shape_[0] = end - begin;
  v.numel_ = row * (end - begin);
  v.offset_ += static_cast<size_t>(begin * row) * dtype_size(dtype_);
  return v;
}

Tensor Tensor::joined(const std::vector<Tensor>& parts) {
  if (parts.empty() || !parts[0].defined()) return {};
  Tensor v = parts[0].flatten();
  for (size_t i = 1; i < parts.size(); ++i) {
    const Tensor& p = parts[i];
    if (!p.defined() || p.storage_ != v.storage_ || p.dtype_ != v.dtype_ || p.offset_ != v.offset_ + v.bytes())
      return {};
    v.numel_ += p.numel_;
  }
  v.shape_ = {v.numel_};
  return v;
}

Tensor Tensor::view(DType t) const {
  if (bytes() % dtype_size(t)) fail_usage("view: " + str() + " is not a whole number of " + std::string(dtype_name(t)));
  Tensor v = *this;
  v.dtype_ = t;
  v.numel_ = static_cast<int64_t>(bytes() / dtype_size(t));
  v.shape_ = {v.numel_};
  return v;
}

Tensor Tensor::select(int64_t i) const {
  Tensor v = slice(i, i + 1);
  v.shape_.erase(v.shape_.begin());
  return v;
}

Tensor Tensor::from_host(const void* data, const Shape& shape, DType t, Device d) {
  Tensor x = empty(shape, t, d);
  if (!x.bytes()) return x;
  if (d.is_cuda())
    cuda::memcpy(x.data(), data, x.bytes());
  else
    std::memcpy(x.data(), data, x.bytes());
  return x;
}

Tensor Tensor::from_doubles(const std::vector<double>& v, const Shape& shape, DType t, Device d) {
  if (static_cast<int64_t>(v.size()) != shape_numel(shape))
    fail_usage("from_doubles: {} values for shape {}", v.size(), shape_str(shape));
  std::vector<unsigned char> host(v.size() * dtype_size(t));
  for (size_t i = 0; i < v.size(); ++i) store_from_double(t, host.data(), i, v[i]);
  return from_host(host.data(), shape, t, d);
}

void Tensor::copy_from(const Tensor& src) {
  if (src.numel_ != numel_ || src.dtype_ != dtype_)
    fail_usage("copy_from: " + src.str() + " into " + str() + " (numel and dtype must match)");
  if (!bytes() || data() == src.data()) return;
  if (is_cuda() || src.is_cuda())
    cuda::memcpy(data(), src.data(), bytes());
  else
    std::memmove(data(), src.data(), bytes());
}

void Tensor::copy_from_async(const Tensor& src, Stream s) {
  if (src.numel_ != numel_ || src.dtype_ != dtype_)
    fail_usage("copy_from_async: " + src.str() + " into " + str() + " (numel and dtype must match)");
  if (!bytes() || data() == src.data()) return;
  if (is_cuda() || src.is_cuda())
    cuda::memcpy_async(data(), src.data(), bytes(), s);
  else
    std::memmove(data(), src.data(), bytes());
}

Tensor Tensor::to(Device d) const {
  Tensor out = empty(shape_, dtype_, d);
  out.copy_from(*this);
  return out;
}

Tensor Tensor::clone() const { return to(device_); }

std::vector<double> Tensor::to_doubles() const {
  const Tensor h = is_cuda() ? to(Device::cpu()) : *this;
  std::vector<double> out(static_cast<size_t>(numel_));
  for (size_t i = 0; i < out.size(); ++i) out[i] = load_as_double(dtype_, h.data(), i);
  return out;
}

double Tensor::item() const {
  if (numel_ != 1) fail_usage("item: " + str() + " does not have exactly one element");
  return to_doubles()[0];
}

std::string Tensor::str() const {
  if (!defined()) return "undefined tensor";
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + " on " + device_.str();
}

void check_same_shape(const char* op, const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) fail_usage(std::string(op) + ": shapes differ: " + a.str() + " and " + b.str());
}
void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  if (a.device() != b.device()) fail_usage(std::string(op) + ": devices differ: " + a.str() + " and " + b.str());
}
void check_dtype(const char* op, const Tensor& a, std::initializer_list<DType> allowed) {
  for (DType t : allowed)
    if (a.dtype() == t) return;
  std::string names;
  for (DType t : allowed) names += (names.empty() ? "" : ", ") + std::string(dtype_name(t));
  fail_usage(std::string(op) + ": " + a.str() + " has an unsupported dtype (expected " + names + ")");
}

// ---------------------------------------------------------------------------- StreamTimer

namespace {
double host_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

StreamTimer::StreamTimer(Device d) : device_(d) {}

StreamTimer::~StreamTimer() {
  for (const Pending& p : pending_) free_.insert(free_.end(), {p.start, p.stop});
  if (open_) free_.push_back(open_);
  for (void* e : free_) cuda::destroy_event(e);
}

void* StreamTimer::take() {
  if (free_.empty()) return cuda::create_timing_event();
  void* e = free_.back();
  free_.pop_back();
  return e;
}

void StreamTimer::start() {
  if (!device_.is_cuda()) {
    host_start_ = host_seconds();
    return;
  }
  if (!open_) open_ = take();
  cuda::record_event(open_, cuda::current_stream());
}

void StreamTimer::stop(double* sum) {
  if (!device_.is_cuda()) {
    *sum += host_seconds() - host_start_;
    return;
  }
  if (!open_) fail("StreamTimer::stop without start");
  void* e = take();
  cuda::record_event(e, cuda::current_stream());
  pending_.push_back({open_, e, sum});
  open_ = nullptr;
}

void StreamTimer::collect() {
  if (pending_.empty()) return;
  cuda::wait_event(pending_.back().stop, "timed work on the GPU");
  for (const Pending& p : pending_) {
    *p.sum += cuda::elapsed_seconds(p.start, p.stop);
    free_.insert(free_.end(), {p.start, p.stop});
  }
  pending_.clear();
}

// ---------------------------------------------------------------------------- HostUpload

HostUpload::~HostUpload() {
  for (Slot& s : slots_) {
    if (s.copied) {
      try {
        cuda::wait_event(s.copied, "an upload to the GPU");
      } catch (...) {  // a failed device: the copy may still read the block, which is left to the exit
        continue;
      }
      cuda::destroy_event(s.copied);
    }
    if (s.block) cuda::free_pinned(s.block);
  }
}

Tensor HostUpload::operator()(const Tensor& host) {
  if (!device_.is_cuda()) return host.is_cuda() ? host.to(device_) : host;
  if (host.is_cuda()) return host.to(device_);
  // The oldest block, unless its copy is still queued and the ring may grow: then a new block
  // goes in before it, as the newest.
  if (slots_.empty() || (!cuda::event_done(slots_[next_].copied) && pinned_ + host.bytes() <= kMaxPinned)) {
    slots_.insert(slots_.begin() + static_cast<std::ptrdiff_t>(next_), Slot{});
    slots_[next_].copied = cuda::create_timing_event();
  } else {
    cuda::wait_event(slots_[next_].copied, "an upload to the GPU");  // the oldest copy: done, or the ring is full
  }
  Slot& s = slots_[next_];
  next_ = (next_ + 1) % slots_.size();
  if (s.bytes < host.bytes()) {
    void* larger = cuda::malloc_pinned(host.bytes());
    if (s.block) cuda::free_pinned(s.block);
    pinned_ += host.bytes() - s.bytes;
    s.block = larger;
    s.bytes = host.bytes();
  }
  if (host.bytes()) std::memcpy(s.block, host.data(), host.bytes());
  Tensor out = Tensor::empty(host.shape(), host.dtype(), device_);
  const Stream stream = cuda::current_stream();
  if (host.bytes()) cuda::memcpy_async(out.data(), s.block, host.bytes(), stream);
  cuda::record_event(s.copied, stream);
  return out;
}

}  // namespace dtk
