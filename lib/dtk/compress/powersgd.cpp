// PowerSGD (Vogels, Karimireddy and Jaggi, 2019): rank-r power iteration with warm start and
// error feedback. One compressed step, for every matrix M_r = W * grad_r + error_r [n, m]:
//   P = mean_r(M_r) Q                    all-reduce of every P (with the uncompressed grads)
//   P^ = orthonormalise(P)
//   Q_r = M_r^T P^, Q = mean_r(Q_r)       all-reduce of every Q
//   grad = P^ Q^T on every rank;  error_r = M_r - P^ Q_r^T (projection) or M_r - P^ Q^T (full)
// Matrices of the same [n, m] and rank share one [B, n, m] buffer, so every product above is one
// strided-batched GEMM per shape (a llama layer's wk/wv, w1/w3, and the same matrices of every
// layer). The per-rank M_r lives in that buffer and is the error buffer between steps.
#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "dtk/compress/common.h"
#include "dtk/core/error.h"
#include "dtk/ops/ops.h"

namespace dtk::compress::detail {
namespace {

// MGS's epsilon: a column of P whose norm (after projecting out the previous columns) is below
// it becomes zero instead of NaN. P's first column has about the norm ||M||_F, so an absolute
// threshold this small zeroes only (numerically) zero columns, never a small but genuine
// gradient; rounding noise left in a column of a rank-deficient P is normalised into some
// direction orthogonal to the others, which is harmless (its Q column is ~0).
constexpr double kMgsEps = 1e-16;

struct Group {
  int64_t n = 0, m = 0, r = 0;
  std::vector<int> members;  // parameter indices, slot b = position here
  int64_t p_off = 0, q_off = 0;
  Tensor mat;  // f32 [B, n, m]: M_r during a step, the error buffer between steps
  int64_t batch() const { return static_cast<int64_t>(members.size()); }
};

struct Slot {  // where a parameter goes
  int group = -1;   // -1: uncompressed
  int64_t b = 0;    // slot in its group
  int64_t u_off = 0;  // uncompressed: offset in pbuf_ (after every P)
  int64_t q_param_off = 0;  // compressed: offset of its Q in parameter order (its Philox offset)
};

class PowerSGD final : public Base {
 public:
  PowerSGD(const Config& cfg, comm::Communicator& comm, const std::vector<nn::Param>& params)
      : Base(cfg, comm, params), q_key_(stream_key(cfg.seed, kDomainQ)), guard_key_(stream_key(cfg.seed, kDomainQGuard)) {
    std::map<std::tuple<int64_t, int64_t, int64_t>, int> by_shape;
    slots_.resize(layout_.size());
    int64_t q_param = 0;
    for (size_t i = 0; i < layout_.size(); ++i) {
      const auto& l = layout_[i];
      if (l.shape.size() >= 2 && l.numel > 0) {
        const int64_t n = l.shape[0], m = l.numel / n;
        const int64_t r = std::min<int64_t>({cfg_.rank, n, m});
        if (static_cast<double>(n + m) * static_cast<double>(r) * cfg_.min_compression_rate <
            static_cast<double>(n) * static_cast<double>(m)) {
          const auto key = std::make_tuple(n, m, r);
          auto it = by_shape.find(key);
          if (it == by_shape.end()) {
            it = by_shape.emplace(key, static_cast<int>(groups_.size())).first;
            groups_.push_back({n, m, r, {}, 0, 0, {}});
          }
          Group& g = groups_[it->second];
          slots_[i] = {it->second, g.batch(), 0, q_param};
          g.members.push_back(static_cast<int>(i));
          q_param += m * r;
          continue;
        }
      }
      slots_[i].u_off = u_total_;
      u_total_ += l.numel;
    }
    for (auto& g : groups_) {
      g.p_off = p_total_;
      g.q_off = q_total_;
      p_total_ += g.batch() * g.n * g.r;
      q_total_ += g.batch() * g.m * g.r;
      g.mat = Tensor::zeros({g.batch(), g.n, g.m}, DType::f32, device_);
      colmax_total_ += g.batch() * g.r;
    }
    for (auto& s : slots_)
      if (s.group < 0) s.u_off += p_total_;
    pbuf_ = Tensor::zeros({p_total_ + u_total_}, DType::f32, device_);
    q_ = Tensor::zeros({q_total_}, DType::f32, device_);
    qlocal_ = Tensor::zeros({q_total_}, DType::f32, device_);
    if (cfg_.comm_dtype == DType::bf16 && q_total_ > 0)
      wire_ = Tensor::zeros({std::max(p_total_, q_total_)}, DType::bf16, device_);
    if (colmax_total_ > 0) colmax_ = Tensor::zeros({colmax_total_}, DType::f32, device_);
    draw_q(0);
  }

  std::vector<std::pair<std::string, Tensor>> state() override {
    std::vector<std::pair<std::string, Tensor>> out;
    for (size_t i = 0; i < layout_.size(); ++i)
      if (slots_[i].group >= 0) out.emplace_back("q/" + layout_[i].name, q_of(i));
    if (cfg_.error_feedback)
      for (size_t i = 0; i < layout_.size(); ++i)
        if (slots_[i].group >= 0) out.emplace_back("error/" + layout_[i].name, mat_of(i).reshape(layout_[i].shape));
    out.emplace_back("step", step_);
    return out;
  }

 protected:
  std::vector<double> agreement() override {
    // The layout of the compressed matrices and a checksum of Q (drawn from the shared seed, or
    // restored): identical bits on every rank, so the sums agree exactly.
    std::vector<double> v = {static_cast<double>(groups_.size()), static_cast<double>(p_total_),
                             static_cast<double>(q_total_), static_cast<double>(cfg_.rank),
                             static_cast<double>(cfg_.comm_dtype == DType::bf16), cfg_.warm_start ? 1.0 : 0.0};
    if (q_total_ > 0) {
      v.push_back(ops::reduce_all(ops::Reduce::sum, q_));
      v.push_back(ops::dot(q_, q_));
    }
    return v;
  }

  void compressed_step(std::vector<nn::Param>& params, int64_t step, bool first) override {
    const bool ef = cfg_.error_feedback;
    const bool bf16 = cfg_.comm_dtype == DType::bf16;
    const double w = world_;
    if (first && ef)
      for (auto& g : groups_) ops::fill(g.mat, 0.0);
    if (!cfg_.warm_start) draw_q(static_cast<uint64_t>(step) + 1);

    // M_r = W grad_r + error_r; P = M_r Q / W (summed over ranks: mean(M) Q).
    for (auto& g : groups_) {
      for (int64_t b = 0; b < g.batch(); ++b) {
        Tensor mb = g.mat.select(b);
        const Tensor grad = params[static_cast<size_t>(g.members[b])].grad.reshape({g.n, g.m});
        if (ef)
          ops::axpy(w, grad, mb);
        else
          ops::scale(grad, w, mb);
      }
      Tensor p = p_of(g);
      ops::gemm(false, false, 1.0 / w, g.mat, q_group(g), 0.0, p);
    }
    for (size_t i = 0; i < layout_.size(); ++i)
      if (slots_[i].group < 0) {
        Tensor dst = u_of(i);
        copy(dst, params[i].grad.flatten());
      }

    // All-reduce P and the uncompressed grads: one f32 collective, or (bf16 P) the f32 grads in
    // flight while P travels as bf16.
    if (!bf16) {
      all_reduce(pbuf_, comm::ReduceOp::sum);
    } else {
      comm::Work wu;
      if (u_total_ > 0) wu = all_reduce(pbuf_.slice(p_total_, p_total_ + u_total_), comm::ReduceOp::sum, comm::Mode::async);
      if (p_total_ > 0) {
        Tensor ps = pbuf_.slice(0, p_total_), ws = wire_.slice(0, p_total_);
        ops::cast(ps, ws);
        all_reduce(ws, comm::ReduceOp::sum);
        ops::cast(ws, ps);
      }
      wu.wait();
    }

    // P^ and Q_r = M_r^T P^.
    for (auto& g : groups_) {
      Tensor p = p_of(g);
      const bool mgs = cfg_.orthogonalize == "mgs" || (cfg_.orthogonalize == "auto" && g.r <= 2);
      if (mgs)
        ops::orthonormalize_mgs(p, kMgsEps);
      else
        ops::orthonormalize_qr(p);
      Tensor ql = qlocal_group(g);
      ops::gemm(true, false, 1.0, g.mat, p, 0.0, ql);
    }

    // Q = mean_r Q_r, in flight while the projection error is computed from the local Q_r.
    comm::Work wq;
    if (q_total_ > 0) {
      if (!bf16) {
        wq = comm_.all_reduce(buffer(qlocal_), buffer(q_), comm::ReduceOp::avg, comm::Mode::async);
      } else {
        Tensor ws = wire_.slice(0, q_total_);
        ops::cast(qlocal_, ws);
        wq = all_reduce(ws, comm::ReduceOp::sum, comm::Mode::async);
      }
    }
    if (ef && cfg_.error_mode == "projection")
      for (auto& g : groups_) ops::gemm(false, true, -1.0, p_of(g), qlocal_group(g), 1.0, g.mat);
    wq.wait();
    if (bf16 && q_total_ > 0) {
      ops::cast(wire_.slice(0, q_total_), q_);
      ops::scale(q_, 1.0 / w, q_);
    }

    // grad = P^ Q^T; full error: M_r - P^ Q^T.
    for (auto& g : groups_) {
      const Tensor p = p_of(g), q = q_group(g);
      for (int64_t b = 0; b < g.batch(); ++b) {
        Tensor grad = params[static_cast<size_t>(g.members[b])].grad.reshape({g.n, g.m});
        ops::gemm(false, true, 1.0, p.select(b), q.select(b), 0.0, grad);
        if (ef && cfg_.error_mode == "full") {
          Tensor mb = g.mat.select(b);
          ops::axpy(-1.0, grad, mb);
        }
      }
    }
    for (size_t i = 0; i < layout_.size(); ++i)
      if (slots_[i].group < 0) {
        Tensor dst = params[i].grad.flatten();
        copy(dst, u_of(i));
      }
    if (cfg_.warm_start) redraw_zero_columns(step);

    bytes_.sent = (p_total_ + q_total_) * static_cast<int64_t>(dtype_size(cfg_.comm_dtype)) + u_total_ * 4;
  }

 private:
  comm::Buffer buffer(const Tensor& t) const {
    return {t.data(), static_cast<size_t>(t.numel()), t.dtype(), device_};
  }
  comm::Work all_reduce(const Tensor& t, comm::ReduceOp op, comm::Mode mode = comm::Mode::sync) {
    if (t.numel() == 0) return {};
    return comm_.all_reduce(buffer(t), buffer(t), op, mode);
  }
  Tensor p_of(const Group& g) const { return pbuf_.slice(g.p_off, g.p_off + g.batch() * g.n * g.r).reshape({g.batch(), g.n, g.r}); }
  Tensor q_group(const Group& g) const { return q_.slice(g.q_off, g.q_off + g.batch() * g.m * g.r).reshape({g.batch(), g.m, g.r}); }
  Tensor qlocal_group(const Group& g) const {
    return qlocal_.slice(g.q_off, g.q_off + g.batch() * g.m * g.r).reshape({g.batch(), g.m, g.r});
  }
  Tensor q_of(size_t i) const { return q_group(groups_[slots_[i].group]).select(slots_[i].b); }
  Tensor mat_of(size_t i) const { return groups_[slots_[i].group].mat.select(slots_[i].b); }
  Tensor u_of(size_t i) const { return pbuf_.slice(slots_[i].u_off, slots_[i].u_off + layout_[i].numel); }

  // Q of every matrix from the shared Philox stream: element j of parameter i's Q draws counter
  // (its offset in parameter order) + round * (all of Q), under the Q key. Round 0 is the
  // initial Q; round s + 1 the redraw at step s when warm_start is off.
  void draw_q(uint64_t round) {
    for (size_t i = 0; i < layout_.size(); ++i)
      if (slots_[i].group >= 0) {
        Tensor q = q_of(i);
        ops::normal_(q, q_key_, static_cast<uint64_t>(slots_[i].q_param_off) + round * static_cast<uint64_t>(q_total_));
      }
  }

  // A column of Q that is exactly zero (the matrix's M was zero, or its P column was) would stay
  // zero under warm start forever (P = M Q then has a zero column, and so has the next Q). Such
  // columns are redrawn from a shared stream. Q is identical on every rank, and "exactly zero"
  // (a max of |x|, no rounding) decides alike everywhere, so Q stays identical. One small
  // device-to-host copy per step.
  void redraw_zero_columns(int64_t step) {
    if (colmax_total_ == 0) return;
    int64_t off = 0;
    for (auto& g : groups_) {
      const Tensor q = q_group(g);
      for (int64_t b = 0; b < g.batch(); ++b) {
        Tensor out = colmax_.slice(off, off + g.r);
        ops::reduce(ops::Reduce::absmax, ops::Axis::cols, q.select(b), out);
        off += g.r;
      }
    }
    const auto host = colmax_.to_doubles();
    off = 0;
    for (auto& g : groups_) {
      for (int64_t b = 0; b < g.batch(); ++b, off += g.r) {
        bool any = false;
        for (int64_t j = 0; j < g.r; ++j) any = any || host[static_cast<size_t>(off + j)] == 0;
        if (!any) continue;
        std::vector<uint8_t> mask(static_cast<size_t>(g.m * g.r), 0);
        for (int64_t j = 0; j < g.r; ++j)
          if (host[static_cast<size_t>(off + j)] == 0)
            for (int64_t k = 0; k < g.m; ++k) mask[static_cast<size_t>(k * g.r + j)] = 1;
        const size_t i = static_cast<size_t>(g.members[b]);
        Tensor fresh = Tensor::empty({g.m, g.r}, DType::f32, device_);
        ops::normal_(fresh, guard_key_,
                     static_cast<uint64_t>(slots_[i].q_param_off) + static_cast<uint64_t>(step) * static_cast<uint64_t>(q_total_));
        const Tensor cond = Tensor::from_host(mask.data(), {g.m, g.r}, DType::u8, device_);
        Tensor q = q_of(i);
        ops::where(cond, fresh, q, q);
      }
    }
  }

  uint64_t q_key_, guard_key_;
  std::vector<Group> groups_;
  std::vector<Slot> slots_;
  int64_t p_total_ = 0, q_total_ = 0, u_total_ = 0, colmax_total_ = 0;
  Tensor pbuf_;    // f32 [every P, then every uncompressed grad]
  Tensor q_;       // f32 [every Q]: the aggregated Q, kept for the warm start
  Tensor qlocal_;  // f32 [every Q]: this rank's Q_r = M_r^T P^
  Tensor wire_;    // bf16 [max(P, Q)] when comm_dtype is bf16
  Tensor colmax_;  // f32 [sum of ranks]: max |Q| per column
};

}  // namespace

std::unique_ptr<Compressor> make_powersgd(const Config& cfg, comm::Communicator& comm,
                                          const std::vector<nn::Param>& params) {
  return std::make_unique<PowerSGD>(cfg, comm, params);
}

}  // namespace dtk::compress::detail
