// The baselines of the PowerSGD paper: top-k and random-k sparsification with error feedback,
// and signum (signs with a majority vote). Each works per tensor on M_r = W * grad_r + error_r
// (error_r = 0 without error feedback), the rank's estimate of the mean gradient.
#include <algorithm>
#include <climits>
#include <cmath>

#include "dtk/compress/internal.h"
#include "dtk/core/streams.h"
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"

namespace dtk::compress::detail {
namespace {

// Shared by topk and randomk: k_i coordinates of every tensor, packed in parameter order.
class Sparse : public Base {
 public:
  Sparse(const Config& cfg, comm::Communicator& comm, const Params& params, size_t bucket_bytes,
         const Topology& topology)
      : Base(cfg, comm, params, bucket_bytes, topology) {
    for (const auto& l : layout_) {
      k_.push_back(kept(cfg_.ratio, l.numel));
      koff_.push_back(k_total_);
      k_total_ += k_.back();
    }
    vals_ = Tensor::zeros({k_total_}, DType::f32, device_);
    neg_ = Tensor::zeros({k_total_}, DType::f32, device_);
    if (cfg_.error_feedback)
      flat_error();
    else
      m_ = Tensor::zeros({total_}, DType::f32, device_);
  }

 protected:
  // M_r of tensor i (in the error buffer with error feedback, else in scratch).
  Tensor m_of(size_t i) {
    Tensor& buf = cfg_.error_feedback ? error_ : m_;
    return buf.slice(layout_[i].offset, layout_[i].offset + layout_[i].numel);
  }
  Tensor vals_of(size_t i) const { return vals_.slice(koff_[i], koff_[i] + k_[i]); }
  void form_m(std::vector<nn::Param>& params, bool first) {
    if (first && cfg_.error_feedback) ops::fill(error_, 0.0);
    for (size_t i = 0; i < params.size(); ++i) {
      Tensor m = m_of(i);
      const Tensor g = params[i].grad.flatten();
      if (cfg_.error_feedback)
        ops::axpy(world_, g, m);
      else
        ops::scale(g, world_, m);
    }
  }
  // Error feedback: the coordinates sent leave the error buffer (M[idx] - M[idx] = 0 exactly).
  void remove_sent(size_t i, const Tensor& idx) {
    if (!cfg_.error_feedback || k_[i] == 0) return;
    Tensor neg = neg_.slice(koff_[i], koff_[i] + k_[i]);
    ops::scale(vals_of(i), -1.0, neg);
    Tensor m = m_of(i);
    ops::scatter_add(idx, neg, m);
  }

  std::vector<int64_t> k_, koff_;
  int64_t k_total_ = 0;
  Tensor vals_, neg_;  // f32 [K]
  Tensor m_;           // f32 [total]: M_r without error feedback
};

// topk: every rank sends its own k largest-magnitude coordinates of M_r (values and indices,
// one all-gather each); the aggregate is sum over ranks of the scattered values / W.
class TopK final : public Sparse {
 public:
  TopK(const Config& cfg, comm::Communicator& comm, const Params& params, size_t bucket_bytes, const Topology& topology)
      : Sparse(cfg, comm, params, bucket_bytes, topology) {
    bool small = true;
    for (const auto& l : layout_) small = small && l.numel <= INT32_MAX;
    const DType wire = small ? DType::i32 : DType::i64;  // indices travel as i32 when they fit
    const int64_t wk = world_ * k_total_;
    idx_ = Tensor::zeros({k_total_}, DType::i64, device_);
    widx_ = Tensor::zeros({k_total_}, wire, device_);
    gvals_ = Tensor::zeros({wk}, DType::f32, device_);
    gwidx_ = Tensor::zeros({wk}, wire, device_);
    gidx_ = Tensor::zeros({wk}, DType::i64, device_);
  }

 protected:
  void compressed_step(std::vector<nn::Param>& params, int64_t, bool first) override {
    form_m(params, first);
    for (size_t i = 0; i < params.size(); ++i) {
      if (k_[i] == 0) continue;
      Tensor v = vals_of(i), idx = idx_.slice(koff_[i], koff_[i] + k_[i]);
      ops::topk_abs(m_of(i), k_[i], v, idx);
      remove_sent(i, idx);
    }
    if (k_total_ > 0) {
      ops::cast(idx_, widx_);
      comm::Work wv = comm_.all_gather(comm::buffer_of(vals_), comm::buffer_of(gvals_), comm::Mode::async);
      comm::Work wi = comm_.all_gather(comm::buffer_of(widx_), comm::buffer_of(gwidx_), comm::Mode::async);
      wv.wait();
      wi.wait();
      ops::cast(gwidx_, gidx_);
      ops::scale(gvals_, 1.0 / world_, gvals_);
    }
    for (size_t i = 0; i < params.size(); ++i) {
      Tensor g = params[i].grad.flatten();
      ops::fill(g, 0.0);
      if (k_[i] == 0) continue;
      for (int s = 0; s < world_; ++s) {
        const int64_t off = s * k_total_ + koff_[i];
        ops::scatter_add(gidx_.slice(off, off + k_[i]), gvals_.slice(off, off + k_[i]), g);
      }
    }
    bytes_.sent = k_total_ * static_cast<int64_t>(4 + dtype_size(widx_.dtype()));
  }

 private:
  Tensor idx_;    // i64 [K]: this rank's indices
  Tensor widx_;   // i32 (or i64) [K]: the same on the wire
  Tensor gvals_;  // f32 [W K]: every rank's values, rank-major
  Tensor gwidx_;  // [W K]: every rank's indices on the wire
  Tensor gidx_;   // i64 [W K]
};

// randomk: the same k coordinates of each tensor on every rank, drawn per step from the shared
// seed; their values are summed by one all-reduce. Like the paper's baseline, the values are
// not rescaled by n / k: error feedback carries the rest into later steps.
class RandomK final : public Sparse {
 public:
  RandomK(const Config& cfg, comm::Communicator& comm, const Params& params, size_t bucket_bytes,
          const Topology& topology)
      : Sparse(cfg, comm, params, bucket_bytes, topology), key_(streams::compressor_key(cfg.seed, streams::kRandomK)) {}

  // The coordinates of tensor i at a step: randomk_indices under the step's key, at the
  // tensor's offset in the flat gradient (tensor i draws counters [offset_i, offset_i + k_i)).
  Tensor indices(size_t i, int64_t step) const {
    return ops::randomk_indices(layout_[i].numel, k_[i], streams::compressor_key(key_, static_cast<uint64_t>(step)),
                                static_cast<uint64_t>(layout_[i].offset), device_);
  }

 protected:
  void compressed_step(std::vector<nn::Param>& params, int64_t step, bool first) override {
    form_m(params, first);
    std::vector<Tensor> idx(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      if (k_[i] == 0) continue;
      idx[i] = indices(i, step);
      Tensor v = vals_of(i);
      ops::gather(m_of(i), idx[i], v);
      remove_sent(i, idx[i]);
    }
    if (k_total_ > 0) {
      comm_.all_reduce(comm::buffer_of(vals_), comm::buffer_of(vals_), comm::ReduceOp::sum, comm::Mode::sync).wait();
      ops::scale(vals_, 1.0 / world_, vals_);
    }
    for (size_t i = 0; i < params.size(); ++i) {
      Tensor g = params[i].grad.flatten();
      ops::fill(g, 0.0);
      if (k_[i] > 0) ops::scatter_add(idx[i], vals_of(i), g);
    }
    bytes_.sent = k_total_ * 4;
  }

 private:
  uint64_t key_;
};

// signum: majority vote over the ranks' signs. Per tensor of n elements, rank r sends
// sign(M_r) (as sign + 1, one byte per element when W <= 127) and ||M_r||_1; the aggregate is
//   sign(sum_r sign(M_r)) * (sum_r ||M_r||_1 / W) / n,
// the majority sign scaled by the ranks' mean L1 norm per element (0 where the vote ties).
// With error feedback (EF-signSGD, Karimireddy et al. 2019) each rank keeps what its own scaled
// sign missed: error_r = M_r - (||M_r||_1 / n) sign(M_r).
class Signum final : public Base {
 public:
  Signum(const Config& cfg, comm::Communicator& comm, const Params& params, size_t bucket_bytes,
         const Topology& topology)
      : Base(cfg, comm, params, bucket_bytes, topology) {
    // Votes travel as sign + 1 in {0, 1, 2}; their sum over W ranks (at most 2W) must be exact.
    vote_ = world_ <= 127 ? DType::u8 : world_ <= 1024 ? DType::f16 : DType::f32;
    int64_t most = 0;
    for (const auto& l : layout_) most = std::max(most, l.numel);
    votes_ = Tensor::zeros({total_}, vote_, device_);
    tmp_ = Tensor::zeros({most}, DType::f32, device_);
    norms_ = Tensor::zeros({static_cast<int64_t>(layout_.size())}, DType::f32, device_);
    if (cfg_.error_feedback) flat_error();
  }

 protected:
  std::vector<double> agreement() override { return {static_cast<double>(vote_)}; }

  void compressed_step(std::vector<nn::Param>& params, int64_t, bool first) override {
    const bool ef = cfg_.error_feedback;
    if (first && ef) ops::fill(error_, 0.0);
    const size_t t = params.size();
    std::vector<Tensor> ms(t);
    for (size_t i = 0; i < t; ++i) {
      Tensor g = params[i].grad.flatten();
      if (ef) {
        ms[i] = error_.slice(layout_[i].offset, layout_[i].offset + layout_[i].numel);
        ops::axpy(world_, g, ms[i]);
      } else {
        ops::scale(g, world_, g);  // the grad is M_r now (it is overwritten by the aggregate)
        ms[i] = g;
      }
      Tensor tmp = tmp_.slice(0, layout_[i].numel), norm = norms_.slice(static_cast<int64_t>(i), static_cast<int64_t>(i) + 1);
      ops::abs(ms[i], tmp);
      ops::reduce(ops::Reduce::sum, ops::Axis::all, tmp, norm);
    }
    std::vector<double> local;
    if (ef && t > 0) local = norms_.to_doubles();
    for (size_t i = 0; i < t; ++i) {
      Tensor tmp = tmp_.slice(0, layout_[i].numel);
      ops::sign(ms[i], tmp);
      if (ef && layout_[i].numel > 0) ops::axpy(-local[i] / static_cast<double>(layout_[i].numel), tmp, ms[i]);
      ops::add_scalar(tmp, 1.0, tmp);
      Tensor v = votes_.slice(layout_[i].offset, layout_[i].offset + layout_[i].numel);
      ops::cast(tmp, v);
    }
    comm::Work wv;
    if (total_ > 0) wv = comm_.all_reduce(comm::buffer_of(votes_), comm::buffer_of(votes_), comm::ReduceOp::sum, comm::Mode::async);
    if (t > 0) comm_.all_reduce(comm::buffer_of(norms_), comm::buffer_of(norms_), comm::ReduceOp::sum, comm::Mode::sync).wait();
    wv.wait();
    const std::vector<double> sums = t > 0 ? norms_.to_doubles() : std::vector<double>{};
    for (size_t i = 0; i < t; ++i) {
      if (layout_[i].numel == 0) continue;
      Tensor g = params[i].grad.flatten();
      ops::cast(votes_.slice(layout_[i].offset, layout_[i].offset + layout_[i].numel), g);
      ops::add_scalar(g, -static_cast<double>(world_), g);  // sum_r sign(M_r)
      ops::sign(g, g);
      ops::scale(g, sums[i] / world_ / static_cast<double>(layout_[i].numel), g);
    }
    bytes_.sent = total_ * static_cast<int64_t>(dtype_size(vote_)) + static_cast<int64_t>(t) * 4;
  }

 private:
  DType vote_;
  Tensor votes_;  // [total]: sign + 1 per element, summed over ranks in place
  Tensor tmp_;    // f32 [largest tensor]
  Tensor norms_;  // f32 [tensors]: ||M_r||_1, summed over ranks in place
};

}  // namespace

std::unique_ptr<Compressor> make_topk(const Config& cfg, comm::Communicator& comm, const Params& params, size_t bucket_bytes,
                                      const Topology& topology) {
  return std::make_unique<TopK>(cfg, comm, params, bucket_bytes, topology);
}
std::unique_ptr<Compressor> make_randomk(const Config& cfg, comm::Communicator& comm, const Params& params,
                                         size_t bucket_bytes, const Topology& topology) {
  return std::make_unique<RandomK>(cfg, comm, params, bucket_bytes, topology);
}
std::unique_ptr<Compressor> make_signum(const Config& cfg, comm::Communicator& comm, const Params& params,
                                        size_t bucket_bytes, const Topology& topology) {
  return std::make_unique<Signum>(cfg, comm, params, bucket_bytes, topology);
}

}  // namespace dtk::compress::detail
