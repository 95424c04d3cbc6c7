#include "dtk/parallel/data_parallel.h"

#include <algorithm>
#include <cstring>
#include <spdlog/spdlog.h>

#include "dtk/core/error.h"

namespace dtk::parallel {

namespace {

comm::Buffer buffer_of(const Tensor& t) {
  return {t.data(), static_cast<size_t>(t.numel()), t.dtype(), t.device()};
}

// FNV-1a over the tensor's bytes (on the host), folded to 53 bits so it travels exactly as a double.
uint64_t checksum(const Tensor& t) {
  const Tensor h = t.is_cuda() ? t.to(Device::cpu()) : t;
  const auto* p = static_cast<const unsigned char*>(h.data());
  uint64_t x = 1469598103934665603ull;
  for (size_t i = 0; i < h.bytes(); ++i) x = (x ^ p[i]) * 1099511628211ull;
  return x & ((1ull << 53) - 1);
}

class AllReduceSync final : public GradSync {
 public:
  AllReduceSync(nn::Model& model, comm::Communicator& comm, size_t bucket_bytes) : model_(model), comm_(comm) {
    bytes_.sent = bytes_.uncompressed = static_cast<int64_t>(model.grads().bytes());  // every step the same
    // Buckets from the last parameter backwards (the order backward completes them), each a
    // contiguous range of the flat gradient buffer, closed once it reaches bucket_bytes.
    const auto& ps = model.params();
    const char* base = static_cast<const char*>(model.grads().data());
    const size_t esize = dtype_size(model.grads().dtype());
    Bucket cur;
    for (size_t i = ps.size(); i-- > 0;) {
      const nn::Param& p = ps[i];
      const int64_t off = (static_cast<const char*>(p.grad.data()) - base) / static_cast<int64_t>(esize);
      if (cur.size() == 0) cur.end = off + p.grad.numel();
      cur.begin = off;
      cur.min_block = std::min(cur.min_block, p.block);
      if (static_cast<size_t>(cur.size()) * esize >= bucket_bytes) {
        buckets_.push_back(cur);
        cur = Bucket{};
      }
    }
    if (cur.size() > 0) buckets_.push_back(cur);
  }

  void on_block_ready(int block) override {
    while (next_ < buckets_.size() && buckets_[next_].min_block >= block) start(buckets_[next_++]);
    for (auto& w : inflight_) w.test();  // drives MPI's progress
  }

  void finish(int64_t) override {
    while (next_ < buckets_.size()) start(buckets_[next_++]);
    comm::wait_all(inflight_);
    next_ = 0;
  }

  compress::Bytes bytes() const override { return bytes_; }

 private:
  struct Bucket {  // elements [begin, end) of the flat gradient buffer
    int64_t begin = 0, end = 0;
    int min_block = 1 << 30;  // the lowest block it covers: ready once that block is
    int64_t size() const { return end - begin; }
  };
  void start(const Bucket& b) {
    comm::Buffer buf = buffer_of(model_.grads()).slice(static_cast<size_t>(b.begin), static_cast<size_t>(b.size()));
    inflight_.push_back(comm_.all_reduce(buf, buf, comm::ReduceOp::sum, comm::Mode::async));
  }

  nn::Model& model_;
  comm::Communicator& comm_;
  std::vector<Bucket> buckets_;
  size_t next_ = 0;
  std::vector<comm::Work> inflight_;
  compress::Bytes bytes_;
};

class CompressedSync final : public GradSync {
 public:
  CompressedSync(nn::Model& model, compress::Compressor& c) : model_(model), c_(c) {}
  void finish(int64_t step) override { c_.aggregate(model_.params(), step); }
  compress::Bytes bytes() const override { return c_.last_bytes(); }

 private:
  nn::Model& model_;
  compress::Compressor& c_;
};

}  // namespace

void check_replicated(const Tensor& t, comm::Communicator& comm, const std::string& what) {
  if (comm.size() == 1) return;
  const double mine = static_cast<double>(checksum(t));
  const comm::Range r = comm::min_max_over_ranks(comm, {mine}, t.device())[0];
  if (r.min != r.max)
    fail(what + " differ between ranks (checksums from " + std::to_string(static_cast<uint64_t>(r.min)) + " to " +
         std::to_string(static_cast<uint64_t>(r.max)) + ", this rank " + std::to_string(static_cast<uint64_t>(mine)) + ")");
}

void broadcast_params(nn::Model& model, comm::Communicator& comm) {
  if (comm.size() == 1) return;
  comm.broadcast(buffer_of(model.values()), 0, comm::Mode::sync);
  check_replicated(model.values(), comm, "the model's parameters");
}

std::unique_ptr<GradSync> make_allreduce_sync(nn::Model& model, comm::Communicator& comm, size_t bucket_bytes) {
  if (bucket_bytes == 0) fail_usage("the gradient bucket size must be positive");
  return std::make_unique<AllReduceSync>(model, comm, bucket_bytes);
}

std::unique_ptr<GradSync> make_compressed_sync(nn::Model& model, compress::Compressor& compressor) {
  return std::make_unique<CompressedSync>(model, compressor);
}

}  // namespace dtk::parallel
