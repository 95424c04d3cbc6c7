// Dion (Ahn et al. 2025; shampoo.h, "Dion"): for every matrix X [m, n] (a parameter as [d0,
// rest]), with its buffer M and right factor Q, one step is
//   M += G;  P = orth(M Q);  R = M^T P;  M -= (1 - mu) P R^T;  Q = R / (||R_j|| + 1e-8) per column;
//   X = X (1 - lr wd) - lr s P Q^T
// run on M^T when m < n (P on the longer side). Over data-parallel ranks that keep their own
// gradients (dion_sync factors) M Q and M^T P are averaged over them, so that only the factors
// travel; over a shard group holding rows of X the products are summed (M^T Q, M^T P) or
// gathered (M Q) there, and only the factors travel too. Two rounds of collectives per step for
// all the matrices together.
#include <fmt/format.h>

#include <algorithm>

#include "dtk/core/error.h"
#include "dtk/optim/shampoo_internal.h"

namespace dtk::optim::shampoo {
namespace {

constexpr uint64_t kDionSeed = 0x44696f6e;  // Q's initial draw: one stream per parameter
constexpr double kColumnEpsilon = 1e-8;      // the reference's epsilon of the column normalisation

}  // namespace

Dion::Dion(Context& cx, const std::vector<nn::Param>& params, std::vector<int> which, comm::Communicator* replicas,
           comm::Communicator* shards, const std::vector<Rows>& rows)
    : cx_(cx), replicas_(replicas), shards_(shards), sharded_(shards != nullptr), rows_(rows) {
  if (replicas_ && replicas_->size() > 1) replica_count_ = replicas_->size();
  if (shards_ && shards_->size() == 1) shards_ = nullptr;
  if (replicas_ && replicas_->size() == 1) replicas_ = nullptr;
  for (comm::Communicator* c : {replicas_, shards_})
    if (c && !c->accepts(cx_.device))
      fail_usage("shampoo: the communicator (" + std::string(comm::backend_name(c->backend())) +
                 ") does not accept buffers on " + cx_.device.str() + ", where the parameters live");
  const int S = shards_ ? shards_->size() : 1;
  int64_t s1 = 0, s2 = 0, sn = 0, max_q = 1, max_rows = 1, max_r = 1;
  for (int pi : which) {
    const auto p = static_cast<size_t>(pi);
    const Shape& whole = cx_.shapes[p];
    Mat x;
    x.param = pi;
    x.m = whole[0];
    x.n = shape_numel(whole) / x.m;
    x.r = dion_rank(cx_.cfg, x.m, x.n);
    x.transposed = x.m < x.n;
    x.scale = spectral_scale_factor(cx_.cfg, x.m, x.n);
    x.rows = params[p].value.numel() / x.n;
    if (p < rows.size() && !rows[p].offsets.empty()) x.row0 = rows[p].offsets[static_cast<size_t>(rows[p].rank)];
    x.M = Tensor::zeros({x.rows, x.n}, DType::f32, cx_.device);
    // Q drawn whole (the same on every rank and world size), N(0, 1); transposed: this rank's rows.
    const int64_t qm = x.transposed ? x.m : x.n;
    Tensor q = Tensor::empty({qm, x.r}, DType::f32, cx_.device);
    ops::normal_(q, kDionSeed + static_cast<uint64_t>(pi), 0);
    x.Q = x.transposed ? q.slice(x.row0, x.row0 + x.rows).clone() : q;
    if (x.transposed) x.p_at = s1, s1 += x.n * x.r;  // round 1's sums come first
    else x.r_at = s2, s2 += x.n * x.r;
    if (x.transposed) x.norm_at = sn, sn += x.r;
    max_q = std::max(max_q, (x.transposed ? x.rows : x.n) * x.r);
    max_rows = std::max({max_rows, x.rows, x.n});
    max_r = std::max(max_r, x.r);
    mats_.push_back(std::move(x));
  }
  sum1_ = s1, sum2_ = s2, sum_norms_ = sn;
  std::vector<size_t> counts(static_cast<size_t>(S), 0);
  for (Mat& x : mats_) {
    if (!x.transposed) x.p_at = s1, s1 += x.rows * x.r;
    else x.r_at = s2, s2 += x.rows * x.r;
    if (!x.transposed) x.norm_at = sn, sn += x.r;
    if (!x.transposed) {
      const Rows& rw = rows.size() > static_cast<size_t>(x.param) ? rows[static_cast<size_t>(x.param)] : Rows{};
      for (int q = 0; q < S; ++q)
        counts[static_cast<size_t>(q)] += static_cast<size_t>((shards_ ? rw.lengths[static_cast<size_t>(q)] : x.rows) * x.r);
    }
  }
  segments_ = RankSegments(std::move(counts));
  stage1_ = Tensor::zeros({std::max<int64_t>(s1, 1)}, DType::f32, cx_.device);
  stage2_ = Tensor::zeros({std::max<int64_t>(s2, 1)}, DType::f32, cx_.device);
  norms_ = Tensor::zeros({std::max<int64_t>(sn, 1)}, DType::f32, cx_.device);
  ones_ = Tensor::empty({max_rows}, DType::f32, cx_.device);
  ops::fill(ones_, 1.0);
  for (Tensor* t : {&qn_, &bcast_}) *t = Tensor::empty({max_q}, DType::f32, cx_.device);
  for (Tensor* t : {&den_, &keep_}) *t = Tensor::empty({max_r}, DType::f32, cx_.device);
  if (shards_ && segments_.total > 0) gathered_ = Tensor::zeros({static_cast<int64_t>(segments_.total)}, DType::f32, cx_.device);
  // The whole P: round 1's own slice, or (rows gathered over the shard group) its own tensor.
  for (Mat& x : mats_) {
    if (x.transposed || !shards_) x.P = stage1_.slice(x.p_at, x.p_at + std::max(x.m, x.n) * x.r).reshape({std::max(x.m, x.n), x.r});
    else x.P = Tensor::zeros({x.m, x.r}, DType::f32, cx_.device);
  }
}

void Dion::broadcast_columns(const Tensor& v, Tensor& out) const {
  const int64_t rows = out.dim(0), r = out.dim(1);
  ops::gemm(false, false, 1.0, ones_.slice(0, rows).reshape({rows, 1}), v.reshape({1, r}), 0.0, out);
}

// The mean over the replicas (sum, then 1 / W).
void Dion::reduce_replicas(Tensor& buf) {
  if (!replicas_) return;
  comm::Buffer b = comm::buffer_of(buf);
  replicas_->all_reduce(b, b, comm::ReduceOp::sum, comm::Mode::sync).wait();
  bytes_ += static_cast<int64_t>(b.bytes());
  ops::scale(buf, 1.0 / replica_count_, buf);
}

void Dion::reduce_shards(const Tensor& part) {
  if (!shards_ || part.numel() == 0) return;
  comm::Buffer b = comm::buffer_of(part);
  shards_->all_reduce(b, b, comm::ReduceOp::sum, comm::Mode::sync).wait();
  bytes_ += static_cast<int64_t>(b.bytes());
}

void Dion::step(std::vector<nn::Param>& params, double lr) {
  bytes_ = 0;
  if (mats_.empty()) return;
  const ShampooConfig& c = cx_.cfg;
  const double mu = c.beta1;
  const bool l2 = c.weight_decay > 0 && c.weight_decay_type == WeightDecayType::l2;
  // Round 1: M += W G (each rank's estimate of the mean gradient), then M Q or M^T Q.
  for (Mat& x : mats_) {
    nn::Param& p = params[static_cast<size_t>(x.param)];
    if (x.rows > 0) {
      ops::axpy(static_cast<double>(replica_count_), p.grad.reshape({x.rows, x.n}), x.M);
      if (l2) ops::axpy(c.weight_decay, p.value.reshape({x.rows, x.n}), x.M);
    }
    if (x.transposed) {
      Tensor part = stage1_.slice(x.p_at, x.p_at + x.n * x.r).reshape({x.n, x.r});
      if (x.rows > 0) ops::gemm(true, false, 1.0, x.M, x.Q, 0.0, part);
      else ops::fill(part, 0.0);
    } else if (x.rows > 0) {
      Tensor part = stage1_.slice(x.p_at, x.p_at + x.rows * x.r).reshape({x.rows, x.r});
      ops::gemm(false, false, 1.0, x.M, x.Q, 0.0, part);
    }
  }
  reduce_replicas(stage1_);
  reduce_shards(stage1_.slice(0, sum1_));
  if (shards_ && gathered_.defined()) {  // every rank's rows of the untransposed P (on every rank alike)
    const auto me = static_cast<size_t>(shards_->rank());
    const auto mine_at = static_cast<int64_t>(segments_.at[me]), mine = static_cast<int64_t>(segments_.counts[me]);
    if (mine > 0) copy_into(gathered_.slice(mine_at, mine_at + mine), stage1_.slice(sum1_, sum1_ + mine));
    bytes_ += segments_.all_gather(*shards_, gathered_);
    // Rank q's segment holds its rows of every untransposed matrix, in order.
    std::vector<int64_t> at(segments_.at.begin(), segments_.at.end());
    for (Mat& x : mats_) {
      if (x.transposed) continue;
      const Rows& rw = rows_[static_cast<size_t>(x.param)];
      for (size_t q = 0; q < at.size(); ++q) {
        const int64_t len = rw.lengths[q] * x.r;
        copy_into(x.P.flatten().slice(rw.offsets[q] * x.r, rw.offsets[q] * x.r + len), gathered_.slice(at[q], at[q] + len));
        at[q] += len;
      }
    }
  }
  for (Mat& x : mats_) ops::orthonormalize_qr(x.P);  // the same input everywhere: the same P

  // Round 2: M^T P (summed over the shards) or M P (this rank's rows).
  for (Mat& x : mats_) {
    const Tensor Ps = x.transposed ? x.P : x.P.slice(x.row0, x.row0 + x.rows);
    if (!x.transposed) {
      Tensor part = stage2_.slice(x.r_at, x.r_at + x.n * x.r).reshape({x.n, x.r});
      if (x.rows > 0) ops::gemm(true, false, 1.0, x.M, Ps, 0.0, part);
      else ops::fill(part, 0.0);
    } else if (x.rows > 0) {
      Tensor part = stage2_.slice(x.r_at, x.r_at + x.rows * x.r).reshape({x.rows, x.r});
      ops::gemm(false, false, 1.0, x.M, Ps, 0.0, part);
    }
  }
  reduce_replicas(stage2_);
  reduce_shards(stage2_.slice(0, sum2_));
  // The columns' squared norms of R (transposed: summed over the shards' rows), then their roots.
  for (Mat& x : mats_) {
    const int64_t rr = x.transposed ? x.rows : x.n;
    Tensor nr = norms_.slice(x.norm_at, x.norm_at + x.r);
    if (rr == 0) {
      ops::fill(nr, 0.0);
      continue;
    }
    const Tensor R = stage2_.slice(x.r_at, x.r_at + rr * x.r).reshape({rr, x.r});
    ops::reduce(ops::Reduce::norm2, ops::Axis::cols, R, nr);
    ops::mul(nr, nr, nr);
  }
  reduce_shards(norms_.slice(0, sum_norms_));
  ops::sqrt(norms_, norms_);

  // Error feedback, the new Q, the update.
  for (Mat& x : mats_) {
    if (x.rows == 0 && x.transposed) continue;
    const int64_t rr = x.transposed ? x.rows : x.n;
    const Tensor R = stage2_.slice(x.r_at, x.r_at + rr * x.r).reshape({rr, x.r});
    const Tensor nr = norms_.slice(x.norm_at, x.norm_at + x.r);
    const Tensor Ps = x.transposed ? x.P : x.P.slice(x.row0, x.row0 + x.rows);
    // Qn = R / (||R_j|| + eps); a zero column (a zero M) keeps its previous Q as the warm start.
    Tensor den = den_.slice(0, x.r), keep = keep_.slice(0, x.r);
    Tensor B = bcast_.slice(0, rr * x.r).reshape({rr, x.r}), Qn = qn_.slice(0, rr * x.r).reshape({rr, x.r});
    ops::add_scalar(nr, kColumnEpsilon, den);
    broadcast_columns(den, B);
    ops::div(R, B, Qn);
    if (x.rows > 0) {
      Tensor M = x.M;
      if (x.transposed) ops::gemm(false, true, -(1.0 - mu), R, x.P, 1.0, M);
      else ops::gemm(false, true, -(1.0 - mu), Ps, R, 1.0, M);
      Tensor X = params[static_cast<size_t>(x.param)].value.reshape({x.rows, x.n});
      if (c.weight_decay > 0 && c.weight_decay_type == WeightDecayType::decoupled) ops::scale(X, 1.0 - lr * c.weight_decay, X);
      if (x.transposed) ops::gemm(false, true, -lr * x.scale, Qn, x.P, 1.0, X);
      else ops::gemm(false, true, -lr * x.scale, Ps, Qn, 1.0, X);
    }
    ops::sign(nr, keep);  // 1 where the column is non-zero, 0 where it is zero
    ops::scale(keep, -1.0, keep);
    ops::add_scalar(keep, 1.0, keep);
    broadcast_columns(keep, B);
    ops::mul(x.Q, B, x.Q);
    ops::add(x.Q, Qn, x.Q);
  }
}

std::vector<PlacedTensor> Dion::state() {
  std::vector<PlacedTensor> s;
  for (Mat& x : mats_) {
    const auto p = static_cast<size_t>(x.param);
    const std::string prefix = "dion/" + cx_.names[p] + "/";
    PlacedTensor m{prefix + "momentum", x.M, Placement::replicated};
    PlacedTensor q{prefix + "q", x.Q, Placement::replicated};
    if (sharded_) {
      m.placement = Placement::sharded, m.rows = rows_[p];
      m.rows.shape = {x.m, x.n};
      Rows qr = rows_[p];
      qr.shape = {x.m, x.r};
      if (x.transposed) q.placement = Placement::sharded, q.rows = qr;
    } else if (cx_.cfg.dion_sync == DionSync::factors) {
      // Each rank's own buffer; every later step depends on them only through their mean
      // (P = mean M Q, R = mean M^T P, and the error feedback subtracts the same P R^T from
      // each), so another number of ranks takes the mean exactly.
      m.placement = Placement::per_rank, m.resize = Resize::mean;
    }
    s.push_back(std::move(m));
    s.push_back(std::move(q));
  }
  return s;
}

void Dion::before_save() {
  if (!sharded_ || !replicas_) return;
  for (Mat& x : mats_) {
    if (x.M.numel() == 0) continue;
    comm::Buffer b = comm::buffer_of(x.M);
    replicas_->all_reduce(b, b, comm::ReduceOp::avg, comm::Mode::sync).wait();
  }
}

nlohmann::json Dion::plan() const {
  nlohmann::json out = nlohmann::json::array();
  for (const Mat& x : mats_)
    out.push_back({{"param", cx_.names[static_cast<size_t>(x.param)]}, {"shape", Shape{x.m, x.n}}, {"rank", x.r},
                   {"transposed", x.transposed}, {"scale", x.scale}});
  return out;
}

}  // namespace dtk::optim::shampoo
