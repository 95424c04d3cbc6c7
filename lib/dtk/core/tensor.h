// Tensor: a shape, a dtype and a device over reference-counted storage. Storage is contiguous
// and row-major; views (reshape, slices along dim 0, select) share it at an offset. Host memory
// is aligned to 64 bytes (vector loads); CUDA memory comes from a caching allocator over
// cudaMalloc whose statistics (current, peak, reserved bytes) the programs report.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "dtk/core/device.h"
#include "dtk/core/dtype.h"

namespace dtk {

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);  // "[2, 3]"

// A CUDA stream (cudaStream_t as an opaque handle); nullptr is the legacy default stream.
struct Stream {
  void* handle = nullptr;
};

struct MemoryStats {
  size_t current = 0;   // bytes held by live tensors
  size_t peak = 0;      // maximum of current since start or reset
  size_t reserved = 0;  // bytes obtained from the device (cached included)
  size_t allocations = 0;
};
MemoryStats memory_stats(Device d);
void reset_peak_memory(Device d);
void empty_cache(Device d);  // give cached CUDA blocks back to the driver

class Storage {
 public:
  Storage(size_t bytes, Device d);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  size_t reserved_ = 0;  // size of the block actually held
  Device device_;
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(const Shape& shape, DType t, Device d = Device::cpu());
  static Tensor zeros(const Shape& shape, DType t, Device d = Device::cpu());
  // A tensor with a copy of host data (n = numel elements of type t).
  static Tensor from_host(const void* data, const Shape& shape, DType t, Device d = Device::cpu());
  static Tensor from_doubles(const std::vector<double>& v, const Shape& shape, DType t, Device d = Device::cpu());

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const;  // negative counts from the end
  int64_t numel() const { return numel_; }
  size_t bytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool is_cuda() const { return device_.is_cuda(); }

  void* data() const { return static_cast<char*>(storage_->data()) + offset_; }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data());
  }

  // Views (share storage).
  Tensor reshape(const Shape& shape) const;  // one -1 allowed
  Tensor flatten() const { return reshape({numel_}); }
  Tensor slice(int64_t begin, int64_t end) const;  // rows [begin, end) of dim 0
  Tensor select(int64_t i) const;                  // row i of dim 0, without that dim
  Tensor view(DType t) const;  // the same bytes as a 1-d tensor of t (its bytes must be a multiple of t's size)
  bool shares_storage(const Tensor& o) const { return storage_ == o.storage_; }
  // The 1-d view over parts laid end to end in one storage (each starting where the one before
  // ends, one dtype): what a multi-tensor op runs over at once. Undefined when they are not.
  static Tensor joined(const std::vector<Tensor>& parts);

  // Copies. Casts between dtypes are ops::cast (device kernels); these keep the dtype.
  Tensor to(Device d) const;
  Tensor clone() const;
  void copy_from(const Tensor& src);  // same numel and dtype, any devices; synchronous
  void copy_from_async(const Tensor& src, Stream s);  // device copies queued on s
  std::vector<double> to_doubles() const;  // a host copy as doubles (tests, reports)
  double item() const;                     // the one element, as a double

  std::string str() const;  // "f32[2, 3] on cpu"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::f32;
  Device device_{};
};

// Shape and device checks used by ops: a clear UsageError naming the op and the tensors.
void check_same_shape(const char* op, const Tensor& a, const Tensor& b);
void check_same_device(const char* op, const Tensor& a, const Tensor& b);
void check_dtype(const char* op, const Tensor& a, std::initializer_list<DType> allowed);

namespace cuda {
Stream current_stream();             // the stream ops run on (per thread; default: legacy)
void set_current_stream(Stream s);
Stream create_stream();
void destroy_stream(Stream s);
// The host waits until the work queued on s so far has completed (wait_event: watched).
void stream_synchronize(Stream s, const char* what = "work queued on the GPU");
void memcpy_async(void* dst, const void* src, size_t bytes, Stream s);
void memset_async(void* dst, int value, size_t bytes, Stream s);

// CUDA events (cudaEvent_t as opaque handles) for timing on a stream; made on the current device.
void* create_timing_event();
void destroy_event(void* event);
void record_event(void* event, Stream s);
double elapsed_seconds(void* start, void* stop);  // both completed
bool event_done(void* event);                     // completed (never waits)
}  // namespace cuda

// Time a stream spends between two points, in stream order, without making the host wait for
// the device at each point: on a CUDA device a pair of events (the seconds the stream took from
// start() to stop(), whatever the host did meanwhile: for a stream that waits on a collective,
// the time it stalled); on the CPU the host clock. A CUDA interval is added to its sum when
// collect() runs, which first waits (watched) for the stream to pass the last stop; a CPU
// interval at stop(). The sums must outlive collect(). One interval open at a time.
class StreamTimer {
 public:
  explicit StreamTimer(Device d);
  ~StreamTimer();
  StreamTimer(const StreamTimer&) = delete;
  StreamTimer& operator=(const StreamTimer&) = delete;
  void start();            // on the current stream
  void stop(double* sum);  // adds the interval's seconds to *sum (CUDA: at collect())
  void collect();

 private:
  struct Pending {
    void *start, *stop;
    double* sum;
  };
  void* take();
  Device device_;
  void* open_ = nullptr;         // CUDA: the start event of the open interval
  double host_start_ = 0;        // CPU: when the open interval started (steady clock, seconds)
  std::vector<Pending> pending_;
  std::vector<void*> free_;      // CUDA events to reuse
};

// Host tensors onto a GPU without the host waiting for the device (Tensor::to waits for the
// copy, and so for all the work queued before it): each tensor goes into a pinned block of a
// ring and from there to the device by an asynchronous copy on the current stream, so that the
// host prepares the next micro-batches while the GPU works. A block is written again only once
// the copy that read it has completed (an event). When the oldest block's copy is still queued,
// the ring grows by a block rather than wait, up to kMaxPinned bytes: a step of token batches
// (kilobytes each) is never held back; beyond that the host waits for the oldest copy (watched,
// and counted by cuda::host_stalls). For a CPU device: the tensor itself.
class HostUpload {
 public:
  explicit HostUpload(Device d) : device_(d) {}
  ~HostUpload();
  HostUpload(const HostUpload&) = delete;
  HostUpload& operator=(const HostUpload&) = delete;
  Tensor operator()(const Tensor& host);

 private:
  static constexpr size_t kMaxPinned = size_t(256) << 20;
  struct Slot {
    void* block = nullptr;  // pinned
    size_t bytes = 0;
    void* copied = nullptr;  // event recorded after the copy that read the block
  };
  Device device_;
  std::vector<Slot> slots_;  // a ring: from next_ on, oldest copy first (one stream: they complete in order)
  size_t next_ = 0;
  size_t pinned_ = 0;  // the blocks' bytes
};

}  // namespace dtk
