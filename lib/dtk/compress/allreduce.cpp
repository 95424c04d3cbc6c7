// The plain bucketed all-reduce of data-parallel training: kind "none", and every compressor's
// steps before --start-iter. detail::Base (internal.h) is what every compressor shares: the
// parameters' layout in buckets, the bucket-by-bucket all-reduce started as each bucket's
// gradients are ready (overlapped with the rest of backward), the once-per-run agreement check
// across ranks, the step counter and the byte accounting; a compressor adds compressed_step.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "dtk/compress/internal.h"

#include <fmt/format.h>
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"

namespace dtk::compress {

namespace detail {

void copy(Tensor& dst, const Tensor& src) { dst.copy_from_async(src, cuda::current_stream()); }

int64_t kept(double ratio, int64_t numel) {
  const auto k = static_cast<int64_t>(std::ceil(ratio * static_cast<double>(numel) - 1e-9));
  return std::clamp<int64_t>(k, std::min<int64_t>(1, numel), numel);
}

Base::Base(const Config& cfg, comm::Communicator& comm, const std::vector<nn::Param>& params, size_t bucket_bytes,
           const Topology& topology)
    : cfg_(cfg), comm_(comm), world_(comm.size()), topo_(topology) {
  cfg_.validate();
  for (const auto& p : params) {
    if (!p.grad.defined()) fail_usage("compressor: parameter '" + p.name + "' has no gradient tensor");
    if (p.grad.dtype() != DType::f32)
      fail_usage("compressor: gradients must be f32, '" + p.name + "' is " + p.grad.str());
    if (!layout_.empty() && p.grad.device() != device_)
      fail_usage("compressor: every gradient must be on one device; '" + p.name + "' is on " +
                 p.grad.device().str() + ", '" + layout_[0].name + "' on " + device_.str());
    if (layout_.empty()) device_ = p.grad.device();
    layout_.push_back({p.name, p.grad.shape(), p.grad.numel(), total_});
    total_ += p.grad.numel();
  }
  if (!comm_.accepts(device_))
    fail_usage("compressor: the " + std::string(comm::backend_name(comm_.backend())) +
               " communicator does not take buffers on " + device_.str() +
               " (NCCL needs CUDA tensors; use the mpi backend for CPU tensors)");
  step_ = Tensor::zeros({1}, DType::i64);
  bytes_.uncompressed = total_ * 4;
  if (topo_.shard) {
    if (topo_.rows.size() != params.size())
      fail_usage("compressor: sharded gradients need the rows of each of the {} parameters, got {}", params.size(),
                 topo_.rows.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const Rows& r = topo_.rows[i];
      const auto s = static_cast<size_t>(topo_.shard->size());
      if (r.offsets.size() != s || r.lengths.size() != s || r.rank != topo_.shard->rank() || r.shape.empty() ||
          layout_[i].shape.empty() || layout_[i].shape[0] != r.lengths[static_cast<size_t>(r.rank)])
        fail_usage("compressor: parameter '{}' is not rows {} of {} over a shard group of {}", layout_[i].name,
                   shape_str(layout_[i].shape), shape_str(r.shape), s);
    }
  }
  if (!topo_.buckets.empty()) {  // given: contiguous, from the last parameter backwards, covering all
    size_t end = params.size();
    for (const ParamRange& b : topo_.buckets) {
      if (b.last != end || b.first > b.last) fail_usage("compressor: the given buckets do not cover the parameters in order");
      end = b.first;
    }
    if (end != 0) fail_usage("compressor: the given buckets do not cover the parameters in order");
    buckets_ = topo_.buckets;
    return;
  }
  // Buckets from the last parameter backwards; empty parameters join the bucket around them.
  ParamRange cur{params.size(), params.size()};
  int64_t bytes = 0;
  for (size_t i = params.size(); i-- > 0;) {
    cur.first = i;
    bytes += layout_[i].numel * 4;
    if (static_cast<uint64_t>(bytes) >= bucket_bytes) {
      buckets_.push_back(cur);
      cur = {i, i};
      bytes = 0;
    }
  }
  if (cur.first < cur.last) buckets_.push_back(cur);
}

std::string error_feedback_note(Kind kind, bool sharded, Restored outcome, const RestoreSource& from) {
  if (outcome != Restored::approximate) return "";
  const std::string_view k = name_of(kind);
  if (sharded)
    return fmt::format("{}: {}'s error feedback was saved as its mean over the replica groups, which does not continue "
                       "it exactly ({} compresses each replica's own gradient)", from.path, k, k);
  return fmt::format("{}: {}'s per-rank error feedback is carried over as its mean over ranks, which does not continue "
                     "it exactly ({} compresses each rank's own gradient)", from.sizes(), k, k);
}

std::vector<PlacedTensor> Base::state() {
  std::vector<PlacedTensor> out;
  // On another number of ranks the error buffers are carried over as their mean (compressor.h):
  // exactly for randomk, whose step depends on them only through it; topk and signum compress
  // each rank's own M_r, so no redistribution continues them exactly.
  const Resize resize = cfg_.kind == Kind::randomk ? Resize::mean : Resize::mean_approximate;
  if (error_.defined())
    for (size_t i = 0; i < layout_.size(); ++i) {
      const Layout& l = layout_[i];
      out.push_back(error_state(i, error_.slice(l.offset, l.offset + l.numel).reshape(l.shape), resize));
    }
  out.push_back({"step", step_});
  return out;
}

PlacedTensor Base::error_state(size_t i, const Tensor& value, Resize resize) const {
  PlacedTensor t{"error/" + layout_[i].name, value, Placement::per_rank, -1, false, Rows{}, resize};
  if (topo_.shard) t.placement = Placement::sharded, t.rows = topo_.rows[i];
  return t;
}

Tensor& Base::flat_error() {
  if (!error_.defined()) error_ = Tensor::zeros({total_}, DType::f32, device_);
  return error_;
}

void Base::check_params(const std::vector<nn::Param>& params) const {
  if (params.size() != layout_.size())
    fail_usage("compressor: built for {} parameters, called with {}", layout_.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    const auto& l = layout_[i];
    if (p.name != l.name || !p.grad.defined() || p.grad.shape() != l.shape || p.grad.dtype() != DType::f32 ||
        p.grad.device() != device_)
      fail_usage("compressor: parameter {} is '{}' {}, expected '{}' f32{} on {}", i, p.name,
                 p.grad.defined() ? p.grad.str() : std::string("without a gradient"), l.name, shape_str(l.shape),
                 device_.str());
  }
}

// Every rank must hold the same layout, configuration and shared random state, or the
// collectives would mismatch (a hang or garbage). One all-reduce (max) of [v, -v] gives the
// maximum and minimum of each number over ranks; they agree everywhere iff max == min, which
// every rank sees alike, so every rank fails together.
void Base::check_agreement() {
  std::vector<double> v = {static_cast<double>(layout_.size()),
                           static_cast<double>(total_),
                           static_cast<double>(cfg_.kind),
                           static_cast<double>(cfg_.seed & 0xffffffffull),
                           static_cast<double>(cfg_.seed >> 32),
                           static_cast<double>(cfg_.start_iter),
                           static_cast<double>(step_.ptr<int64_t>()[0])};
  static const char* const kWhat[] = {"number of parameters", "number of gradient elements", "compressor kind",
                                      "seed (low bits)",      "seed (high bits)",            "start_iter",
                                      "step counter"};
  const size_t fixed = v.size();
  for (double x : agreement()) v.push_back(x);
  const std::vector<comm::Range> r = comm::min_max_over_ranks(comm_, v, device_);
  for (size_t i = 0; i < v.size(); ++i) {
    if (r[i].min == r[i].max || (std::isnan(r[i].min) && std::isnan(r[i].max))) continue;
    std::ostringstream os;
    os << "compressor '" << name_of(cfg_.kind) << "': the ranks disagree on the "
       << (i < fixed ? kWhat[i] : "shared compressor state (the Q checksum: seed or restored state differ)")
       << " (from " << r[i].min << " to " << r[i].max
       << "); every rank must build the same model and compressor options, with the same seed and state";
    fail_usage(os.str());
  }
}

void Base::begin(std::vector<nn::Param>& params, int64_t step) {
  if (params_) fail("compressor: begin() called again before finish()");
  check_params(params);
  if (step < 0) fail_usage("compressor: step must be >= 0, got {}", step);
  if (!checked_) {
    check_agreement();
    checked_ = true;
  }
  params_ = &params;
  step_now_ = step;
  next_ = 0;
  plain_ = cfg_.kind == Kind::none || step < cfg_.start_iter;
  if (plain_) {
    bytes_.sent = total_ * 4;
    contiguous_ = true;
    const auto* base = params.empty() ? nullptr : static_cast<const char*>(params[0].grad.data());
    for (size_t i = 0; i < params.size() && contiguous_; ++i)
      contiguous_ = params[i].grad.shares_storage(params[0].grad) &&
                    static_cast<const char*>(params[i].grad.data()) == base + layout_[i].offset * 4;
    return;
  }
  // No compressed step has run yet (step_ = 1 + the last step aggregated): compression begins
  // now, with error buffers at zero.
  first_ = step_.ptr<int64_t>()[0] <= cfg_.start_iter;
  begin_compressed(step, first_);
}

void Base::bucket_ready(size_t k) {
  if (!params_) fail("compressor: bucket_ready() outside begin() and finish()");
  if (k != next_ || k >= buckets_.size())
    fail("compressor: bucket {} ready out of order (expected {} of {})", k, next_, buckets_.size());
  ++next_;
  if (plain_)
    start_plain(k);
  else
    compress_bucket(*params_, k);
}

void Base::progress() {
  for (auto& w : inflight_) w.test();
}

void Base::finish() {
  if (!params_) fail("compressor: finish() without begin()");
  while (next_ < buckets_.size()) bucket_ready(next_);
  std::vector<nn::Param>& params = *params_;
  if (plain_) {
    wait_tracked();
    if (!contiguous_)
      for (size_t i = 0; i < params.size(); ++i) {
        Tensor dst = params[i].grad.flatten();
        copy(dst, flat_.slice(layout_[i].offset, layout_[i].offset + layout_[i].numel));
      }
  } else {
    compressed_step(params, step_now_, first_);
    wait_tracked();
  }
  params_ = nullptr;
  step_.ptr<int64_t>()[0] = step_now_ + 1;
}

void Base::wait_tracked() {
  comm::wait_all(inflight_);
  inflight_.clear();
}

void Base::start_plain(size_t k) {
  const int64_t b = bucket_begin(k), e = bucket_end(k);
  if (e == b) return;
  std::vector<nn::Param>& params = *params_;
  void* data = nullptr;
  if (contiguous_) {
    data = static_cast<char*>(params[0].grad.data()) + b * 4;
  } else {
    if (!flat_.defined()) flat_ = Tensor::empty({total_}, DType::f32, device_);
    for (size_t i = buckets_[k].first; i < buckets_[k].last; ++i) {
      Tensor dst = flat_.slice(layout_[i].offset, layout_[i].offset + layout_[i].numel);
      copy(dst, params[i].grad.flatten());
    }
    data = static_cast<char*>(flat_.data()) + b * 4;
  }
  const comm::Buffer buf{data, static_cast<size_t>(e - b), DType::f32, device_};
  track(comm_.all_reduce(buf, buf, comm::ReduceOp::sum, comm::Mode::async));
}

namespace {
class None final : public Base {
 public:
  using Base::Base;

 protected:
  // Never called: every step of kind none is a plain step.
  void compressed_step(std::vector<nn::Param>&, int64_t, bool) override {}
};
}  // namespace

std::unique_ptr<Compressor> make_none(const Config& cfg, comm::Communicator& comm, const Params& params, size_t bucket_bytes,
                                      const Topology& topology) {
  return std::make_unique<None>(cfg, comm, params, bucket_bytes, topology);
}

}  // namespace detail
}  // namespace dtk::compress
