// Internal to compress: what every compressor shares — the parameter layout and its buckets,
// the bucketed plain all-reduce (kind "none" and the steps before start_iter), the once-per-run
// agreement check across ranks, the step counter and the byte accounting.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtk/compress/compressor.h"

namespace dtk::compress::detail {

// The Philox keys of the shared random streams: streams::compressor_key of Config::seed
// (core/streams.h), apart from every other stream drawn from the same seed.

// The same on the host and the device: a stream-ordered copy (synchronous between host tensors).
void copy(Tensor& dst, const Tensor& src);

struct Layout {
  std::string name;
  Shape shape;
  int64_t numel = 0;
  int64_t offset = 0;  // in the flat concatenation of all grads, in parameter order
};

// The restore note of a compressor of this kind (Compressor::restore_note): per-rank error
// feedback carried over by a mean that does not continue it exactly (approximate); sharded: saved
// as its mean over the replica groups.
std::string error_feedback_note(Kind kind, bool sharded, Restored outcome, const RestoreSource& from);

class Base : public Compressor {
 public:
  Base(const Config& cfg, comm::Communicator& comm, const std::vector<nn::Param>& params, size_t bucket_bytes,
       const Topology& topology);

  void begin(std::vector<nn::Param>& params, int64_t step) final;
  void bucket_ready(size_t k) final;
  void progress() final;
  void finish() final;
  const std::vector<ParamRange>& buckets() const final { return buckets_; }
  Bytes last_bytes() const final { return bytes_; }
  std::vector<PlacedTensor> state() override;
  std::string restore_note(Restored outcome, const RestoreSource& from) const override {
    return error_feedback_note(cfg_.kind, topo_.shard != nullptr, outcome, from);
  }

 protected:
  // A compressed step (step >= start_iter) runs begin_compressed(step, first) in begin(),
  // compress_bucket(params, k) in bucket_ready(k), and compressed_step(params, step, first) in
  // finish(), which must leave the aggregate in the grads and set bytes_.sent. first: no
  // compressed step has run before (error buffers start at zero).
  virtual void begin_compressed(int64_t step, bool first) {
    (void)step;
    (void)first;
  }
  virtual void compress_bucket(std::vector<nn::Param>& params, size_t k) {
    (void)params;
    (void)k;
  }
  virtual void compressed_step(std::vector<nn::Param>& params, int64_t step, bool first) = 0;
  // Numbers that must agree on every rank (besides the layout): checked once, on the first call.
  virtual std::vector<double> agreement() { return {}; }
  // A per-rank error buffer for every parameter (views of one flat buffer), for the baselines.
  Tensor& flat_error();
  // Elements [begin, end) of the flat concatenation of bucket k's grads.
  int64_t bucket_begin(size_t k) const { return layout_[buckets_[k].first].offset; }
  int64_t bucket_end(size_t k) const {
    const Layout& l = layout_[buckets_[k].last - 1];
    return l.offset + l.numel;
  }
  // Collectives of the step in progress: track() keeps one (progress() tests it, finish()
  // completes it) and returns its number for wait(); kNoWork stands for none.
  static constexpr size_t kNoWork = SIZE_MAX;
  size_t track(comm::Work w) {
    inflight_.push_back(std::move(w));
    return inflight_.size() - 1;
  }
  void wait(size_t work) {
    if (work != kNoWork) inflight_[work].wait();
  }

  Config cfg_;
  comm::Communicator& comm_;
  Device device_;
  int world_ = 1;
  std::vector<Layout> layout_;
  std::vector<ParamRange> buckets_;
  int64_t total_ = 0;  // elements of all grads
  Bytes bytes_;
  Tensor step_;       // i64 [1] on the host: 1 + the last step aggregated (0 before the first)
  Tensor error_;      // f32 [total_]: per-rank error buffers of the baselines (when used)
  Topology topo_;     // shard and rows when the grads are shards (compressor.h)
  // The error buffer of parameter i as state() places it: per rank, or by rows when sharded.
  PlacedTensor error_state(size_t i, const Tensor& value, Resize resize) const;

 private:
  void check_params(const std::vector<nn::Param>& params) const;
  void check_agreement();
  // Plain steps: bucket k's all-reduce (sum), on the grads' own storage when they are one
  // contiguous run in parameter order, else packed into flat_.
  void start_plain(size_t k);
  void wait_tracked();

  bool checked_ = false;
  // The step in progress (between begin and finish).
  std::vector<nn::Param>* params_ = nullptr;
  int64_t step_now_ = 0;
  bool plain_ = false, first_ = false, contiguous_ = false;
  size_t next_ = 0;  // the next bucket to start
  std::vector<comm::Work> inflight_;
  Tensor flat_;  // f32 [total_]: packed grads for plain steps when they are not contiguous (lazily)
};

using Params = std::vector<nn::Param>;
std::unique_ptr<Compressor> make_none(const Config& cfg, comm::Communicator& comm, const Params& params, size_t bucket_bytes,
                                          const Topology& topology);
std::unique_ptr<Compressor> make_powersgd(const Config& cfg, comm::Communicator& comm, const Params& params,
                                          size_t bucket_bytes,
                                          const Topology& topology);
std::unique_ptr<Compressor> make_topk(const Config& cfg, comm::Communicator& comm, const Params& params, size_t bucket_bytes,
                                          const Topology& topology);
std::unique_ptr<Compressor> make_randomk(const Config& cfg, comm::Communicator& comm, const Params& params,
                                         size_t bucket_bytes,
                                          const Topology& topology);
std::unique_ptr<Compressor> make_auto(const Config& cfg, comm::Communicator& comm, const Params& params,
                                      size_t bucket_bytes, const Topology& topology);
std::unique_ptr<Compressor> make_signum(const Config& cfg, comm::Communicator& comm, const Params& params,
                                        size_t bucket_bytes,
                                          const Topology& topology);

// Elements kept per tensor by topk and randomk: ceil(ratio * numel), at least 1.
int64_t kept(double ratio, int64_t numel);

}  // namespace dtk::compress::detail
