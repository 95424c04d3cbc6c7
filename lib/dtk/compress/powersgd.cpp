// PowerSGD (Vogels, Karimireddy and Jaggi, 2019): rank-r power iteration with warm start and
// error feedback. One compressed step, for every matrix M_r = W * grad_r + error_r [n, m]:
//   P = mean_r(M_r) Q                    all-reduce of every P (with the uncompressed grads)
//   P^ = orthonormalise(P)
//   Q_r = M_r^T P^, Q = mean_r(Q_r)       all-reduce of every Q
//   grad = P^ Q^T on every rank;  error_r = M_r - P^ Q_r^T (projection) or M_r - P^ Q^T (full)
// The step runs bucket by bucket, as backward makes the buckets' grads final (the paper's
// hook-based implementation): when bucket k is ready its P is computed and all-reduced; when
// bucket k + 1 is ready, bucket k's Q goes out; when bucket k + 2 is, bucket k is finished. So
// each collective has a block of backward to hide behind, and every rank issues them in the
// same order (the stages advance at bucket_ready calls, never on completion). Within a bucket,
// matrices of the same [n, m] and rank share one [B, n, m] buffer, so every product above is
// one strided-batched GEMM per shape (a llama layer's wk/wv, w1/w3). The per-rank M_r lives in
// that buffer and is the error buffer between steps. Each matrix's result does not depend on
// the bucketing: products and orthonormalisation are per matrix, sums per element.
// Sharded gradients (Topology::shard, compressor.h): M_r holds this rank's rows of the whole
// matrix (padded to the shard group's common row count, the padding rows zero throughout); P's
// rows are gathered over the shard group before the orthonormalisation, and the local Q summed
// over it before Q goes to the replicas, so each whole matrix is compressed as above. Those two
// shard-group collectives are asynchronous like the rest, each a stage of its own (the gather
// waited at the next bucket_ready, the sum at the one after), so that a block of backward hides
// each instead of the GPU idling while the host waits for it; the data and the order of every
// operation are the same, only the waits move.
#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "dtk/compress/internal.h"
#include "dtk/core/streams.h"
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
  Tensor mat;  // f32 [B, ns, m]: M_r during a step, the error buffer between steps
  // The rows this rank holds (ns = n unsharded; sharded: the shard group's padded row count)
  // and, sharded, every shard's rows of the whole matrix.
  int64_t ns = 0;
  std::vector<int64_t> offsets, lengths;
  int64_t batch() const { return static_cast<int64_t>(members.size()); }
};

struct Slot {  // where a parameter goes
  int group = -1;   // -1: uncompressed
  int64_t b = 0;    // slot in its group
  int64_t u_off = 0;  // uncompressed: offset in pbuf_ (after its bucket's P)
  int64_t q_param_off = 0;  // compressed: offset of its Q in parameter order (its Philox offset)
};

// A bucket's share of the buffers and its progress through the step. pbuf_[p_begin, p_end) is
// its P, [p_end, u_end) its uncompressed grads (so f32 P and those grads travel in one
// collective); q_ and qlocal_ [q_begin, q_end) its Q; wire_ [w_begin, ...) its bf16 P, then Q.
// Sharded, gathered_ [g_begin, g_begin + shards * (p_end - p_begin)) receives every shard's P.
struct Region {
  std::vector<int> groups;
  int64_t p_begin = 0, p_end = 0, u_end = 0, q_begin = 0, q_end = 0, w_begin = 0, g_begin = 0;
  // Sharded, a bucket goes p_sent -> p_gathered (P's all-gather over the shard group issued) ->
  // q_summed (Q_local's sum over it issued) -> q_sent; unsharded, p_sent -> q_sent at once.
  enum class Stage { idle, p_sent, p_gathered, q_summed, q_sent, done } stage = Stage::idle;
  size_t wp = 0, wu = 0, wq = 0, wg = 0, ws = 0;  // the collectives in flight (Base::track numbers)
};

class PowerSGD final : public Base {
 public:
  PowerSGD(const Config& cfg, comm::Communicator& comm, const std::vector<nn::Param>& params, size_t bucket_bytes,
           const Topology& topology)
      : Base(cfg, comm, params, bucket_bytes, topology),
        split_(topo_.shard != nullptr && topo_.shard->size() > 1),
        q_key_(streams::compressor_key(cfg.seed, streams::kQ)),
        guard_key_(streams::compressor_key(cfg.seed, streams::kQGuard)) {
    slots_.resize(layout_.size());
    std::vector<int64_t> rank_of(layout_.size(), 0);  // the approximation's rank, 0: uncompressed
    int64_t q_param = 0;
    for (size_t i = 0; i < layout_.size(); ++i) {
      const Shape& whole = whole_shape(i);  // the rank and the rate are judged on the whole matrix
      if (whole.size() < 2 || shape_numel(whole) == 0) continue;
      const int64_t n = whole[0], m = shape_numel(whole) / n;
      const int64_t r = std::min<int64_t>({cfg_.rank, n, m});
      if (static_cast<double>(n + m) * static_cast<double>(r) * cfg_.min_compression_rate >=
          static_cast<double>(n) * static_cast<double>(m))
        continue;
      rank_of[i] = r;
      slots_[i].q_param_off = q_param;
      q_param += m * r;
    }
    int64_t pb = 0, wb = 0, gb = 0;  // offsets in pbuf_, wire_ and gathered_
    int64_t whole_max = 0;  // sharded: the largest whole P
    const int64_t shards = split_ ? topo_.shard->size() : 0;
    regions_.resize(buckets_.size());
    for (size_t k = 0; k < buckets_.size(); ++k) {
      Region& reg = regions_[k];
      std::map<std::tuple<int64_t, int64_t, int64_t>, int> by_shape;
      for (size_t i = buckets_[k].first; i < buckets_[k].last; ++i) {
        if (rank_of[i] == 0) continue;
        const Shape& whole = whole_shape(i);
        const int64_t n = whole[0], m = shape_numel(whole) / n;
        auto it = by_shape.find({n, m, rank_of[i]});
        if (it == by_shape.end()) {
          it = by_shape.emplace(std::make_tuple(n, m, rank_of[i]), static_cast<int>(groups_.size())).first;
          Group g;
          g.n = n, g.m = m, g.r = rank_of[i], g.ns = n;
          if (topo_.shard) {
            g.offsets = topo_.rows[i].offsets, g.lengths = topo_.rows[i].lengths;
            g.ns = *std::max_element(g.lengths.begin(), g.lengths.end());
          }
          groups_.push_back(std::move(g));
          reg.groups.push_back(it->second);
        }
        Group& g = groups_[it->second];
        slots_[i].group = it->second;
        slots_[i].b = g.batch();
        g.members.push_back(static_cast<int>(i));
      }
      reg.p_begin = pb;
      reg.q_begin = q_total_;
      for (int gi : reg.groups) {
        Group& g = groups_[gi];
        g.p_off = pb;
        g.q_off = q_total_;
        pb += g.batch() * g.ns * g.r;
        q_total_ += g.batch() * g.m * g.r;
        g.mat = Tensor::zeros({g.batch(), g.ns, g.m}, DType::f32, device_);
        whole_max = std::max(whole_max, g.batch() * g.n * g.r);
        colmax_total_ += g.batch() * g.r;
      }
      reg.p_end = pb;
      reg.q_end = q_total_;
      reg.g_begin = gb;
      gb += shards * (reg.p_end - reg.p_begin);
      p_total_ += reg.p_end - reg.p_begin;
      for (size_t i = buckets_[k].first; i < buckets_[k].last; ++i)
        if (slots_[i].group < 0) {
          slots_[i].u_off = pb;
          pb += layout_[i].numel;
        }
      reg.u_end = pb;
      u_total_ += reg.u_end - reg.p_end;
      reg.w_begin = wb;
      wb += std::max(reg.p_end - reg.p_begin, reg.q_end - reg.q_begin);
    }
    pbuf_ = Tensor::zeros({pb}, DType::f32, device_);
    q_ = Tensor::zeros({q_total_}, DType::f32, device_);
    qlocal_ = Tensor::zeros({q_total_}, DType::f32, device_);
    if (cfg_.comm_dtype == DType::bf16 && wb > 0) wire_ = Tensor::zeros({wb}, DType::bf16, device_);
    if (colmax_total_ > 0) colmax_ = Tensor::zeros({colmax_total_}, DType::f32, device_);
    if (split_ && gb > 0) {  // a bucket's own: its gather may be in flight beside another bucket's use
      gathered_ = Tensor::zeros({gb}, DType::f32, device_);
      whole_p_ = Tensor::zeros({whole_max}, DType::f32, device_);
    }
    draw_q(0);
  }

  std::vector<PlacedTensor> state() override {
    std::vector<PlacedTensor> out;
    for (size_t i = 0; i < layout_.size(); ++i)
      if (slots_[i].group >= 0) out.push_back({"q/" + layout_[i].name, q_of(i)});
    if (cfg_.error_feedback)
      for (size_t i = 0; i < layout_.size(); ++i)
        if (slots_[i].group >= 0)
          out.push_back(error_state(i, rows_of(mat_of(i), i).reshape(layout_[i].shape), Resize::mean));
    out.push_back({"step", step_});
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

  void begin_compressed(int64_t step, bool first) override {
    if (first && cfg_.error_feedback)
      for (auto& g : groups_) ops::fill(g.mat, 0.0);
    if (!cfg_.warm_start) draw_q(static_cast<uint64_t>(step) + 1);
    for (auto& reg : regions_) reg.stage = Region::Stage::idle;
  }

  // Bucket k's P goes out; the buckets before it advance one stage each.
  void compress_bucket(std::vector<nn::Param>& params, size_t k) override {
    send_p(params, k);
    for (size_t j = 0; j < k; ++j) advance(params, j);
  }

  // After backward: every bucket has sent its P; advance them all until done.
  void compressed_step(std::vector<nn::Param>& params, int64_t step, bool) override {
    for (bool busy = true; busy;) {
      busy = false;
      for (size_t j = 0; j < regions_.size(); ++j) {
        advance(params, j);
        busy = busy || regions_[j].stage != Region::Stage::done;
      }
    }
    if (cfg_.warm_start) redraw_zero_columns(step);
    bytes_.sent = (p_total_ + q_total_) * static_cast<int64_t>(dtype_size(cfg_.comm_dtype)) + u_total_ * 4;
  }

 private:
  void advance(std::vector<nn::Param>& params, size_t k) {
    Region& reg = regions_[k];
    switch (reg.stage) {
      case Region::Stage::p_sent:
        if (split_ && reg.p_end > reg.p_begin) {
          gather_p(k);
        } else {
          receive_p(reg);
          project(k);
          send_q(k);
        }
        break;
      case Region::Stage::p_gathered: project(k); break;
      case Region::Stage::q_summed: send_q(k); break;
      case Region::Stage::q_sent: decompress(params, k); break;
      default: break;
    }
  }

  // M_r = W grad_r + error_r; P = M_r Q / W, all-reduced (summed: mean(M) Q) with the bucket's
  // uncompressed grads: one f32 collective, or (bf16 P) the f32 grads beside P as bf16.
  void send_p(std::vector<nn::Param>& params, size_t k) {
    Region& reg = regions_[k];
    const double w = world_;
    for (int gi : reg.groups) {
      Group& g = groups_[gi];
      for (int64_t b = 0; b < g.batch(); ++b) {
        const auto i = static_cast<size_t>(g.members[b]);
        Tensor mb = rows_of(g.mat.select(b), i);
        if (mb.numel() == 0) continue;
        const Tensor grad = params[i].grad.reshape({mb.shape()[0], g.m});
        if (cfg_.error_feedback)
          ops::axpy(w, grad, mb);
        else
          ops::scale(grad, w, mb);
      }
      Tensor p = p_of(g);
      ops::gemm(false, false, 1.0 / w, g.mat, q_group(g), 0.0, p);
    }
    for (size_t i = buckets_[k].first; i < buckets_[k].last; ++i)
      if (slots_[i].group < 0) {
        Tensor dst = u_of(i);
        copy(dst, params[i].grad.flatten());
      }
    if (cfg_.comm_dtype != DType::bf16) {
      reg.wp = all_reduce(pbuf_.slice(reg.p_begin, reg.u_end), comm::ReduceOp::sum);
      reg.wu = kNoWork;
    } else {
      reg.wu = all_reduce(pbuf_.slice(reg.p_end, reg.u_end), comm::ReduceOp::sum);
      reg.wp = kNoWork;
      if (reg.p_end > reg.p_begin) {
        Tensor ws = wire_p(reg);
        ops::cast(pbuf_.slice(reg.p_begin, reg.p_end), ws);
        reg.wp = all_reduce(ws, comm::ReduceOp::sum);
      }
    }
    reg.wg = reg.ws = kNoWork;
    reg.stage = Region::Stage::p_sent;
  }

  // The replicas' sum of P has arrived (the bf16 wire's copied back into pbuf_).
  void receive_p(Region& reg) {
    wait(reg.wp);
    if (cfg_.comm_dtype == DType::bf16 && reg.p_end > reg.p_begin) {
      Tensor ps = pbuf_.slice(reg.p_begin, reg.p_end);
      ops::cast(wire_p(reg), ps);
    }
  }

  // Sharded: every shard's rows of P, for the whole matrices (its own slice of gathered_).
  void gather_p(size_t k) {
    Region& reg = regions_[k];
    receive_p(reg);
    const int64_t n = reg.p_end - reg.p_begin;
    reg.wg = track(topo_.shard->all_gather(comm::buffer_of(pbuf_.slice(reg.p_begin, reg.p_end)),
                                           comm::buffer_of(gathered_.slice(reg.g_begin, reg.g_begin + topo_.shard->size() * n)),
                                           comm::Mode::async));
    reg.stage = Region::Stage::p_gathered;
  }

  // P^ = orthonormalise(P) and Q_r = M_r^T P^. Sharded, Q_g = sum over the shards of
  // M_s^T P^_s, this replica's M^T P^ (the fast hop), goes out.
  void project(size_t k) {
    Region& reg = regions_[k];
    wait(reg.wg);
    reg.wg = kNoWork;
    for (int gi : reg.groups) {
      Group& g = groups_[gi];
      Tensor p = p_of(g);
      if (split_)
        orthonormalize_whole(reg, g);
      else
        orthonormalize(p, g.r);
      Tensor ql = qlocal_group(g);
      ops::gemm(true, false, 1.0, g.mat, p, 0.0, ql);
    }
    reg.ws = kNoWork;
    if (split_ && reg.q_end > reg.q_begin) {
      const Tensor ql = qlocal_.slice(reg.q_begin, reg.q_end);
      reg.ws = track(topo_.shard->all_reduce(comm::buffer_of(ql), comm::buffer_of(ql), comm::ReduceOp::sum,
                                             comm::Mode::async));
    }
    reg.stage = Region::Stage::q_summed;
  }

  // Q_r (sharded: Q_g) averaged over the replicas into Q, while the projection error is computed
  // from the local one.
  void send_q(size_t k) {
    Region& reg = regions_[k];
    wait(reg.ws);
    reg.ws = kNoWork;
    reg.wq = kNoWork;
    if (reg.q_end > reg.q_begin) {
      const Tensor ql = qlocal_.slice(reg.q_begin, reg.q_end);
      if (cfg_.comm_dtype != DType::bf16) {
        const Tensor q = q_.slice(reg.q_begin, reg.q_end);
        reg.wq = track(comm_.all_reduce(comm::buffer_of(ql), comm::buffer_of(q), comm::ReduceOp::avg, comm::Mode::async));
      } else {
        Tensor ws = wire_q(reg);
        ops::cast(ql, ws);
        reg.wq = all_reduce(ws, comm::ReduceOp::sum);
      }
    }
    if (cfg_.error_feedback && cfg_.error_mode == ErrorMode::projection)
      for (int gi : reg.groups) {
        Group& g = groups_[gi];
        ops::gemm(false, true, -1.0, p_of(g), qlocal_group(g), 1.0, g.mat);
      }
    reg.stage = Region::Stage::q_sent;
  }

  // grad = P^ Q^T; full error: M_r - P^ Q^T; the uncompressed grads copied back.
  void decompress(std::vector<nn::Param>& params, size_t k) {
    Region& reg = regions_[k];
    wait(reg.wq);
    wait(reg.wu);
    if (cfg_.comm_dtype == DType::bf16 && reg.q_end > reg.q_begin) {
      Tensor q = q_.slice(reg.q_begin, reg.q_end);
      ops::cast(wire_q(reg), q);
      ops::scale(q, 1.0 / world_, q);
    }
    for (int gi : reg.groups) {
      Group& g = groups_[gi];
      const Tensor p = p_of(g), q = q_group(g);
      for (int64_t b = 0; b < g.batch(); ++b) {
        const auto i = static_cast<size_t>(g.members[b]);
        Tensor mb = rows_of(g.mat.select(b), i);
        if (mb.numel() == 0) continue;
        Tensor grad = params[i].grad.reshape({mb.shape()[0], g.m});
        ops::gemm(false, true, 1.0, rows_of(p.select(b), i), q.select(b), 0.0, grad);
        if (cfg_.error_feedback && cfg_.error_mode == ErrorMode::full) ops::axpy(-1.0, grad, mb);
      }
    }
    for (size_t i = buckets_[k].first; i < buckets_[k].last; ++i)
      if (slots_[i].group < 0) {
        Tensor dst = params[i].grad.flatten();
        copy(dst, u_of(i));
      }
    reg.stage = Region::Stage::done;
  }

 private:
  // The whole tensor's shape (sharded: its rows' whole), and the rows of a [ns, ...] buffer that
  // parameter i's gradient holds (all of them unsharded).
  const Shape& whole_shape(size_t i) const { return topo_.shard ? topo_.rows[i].shape : layout_[i].shape; }
  Tensor rows_of(const Tensor& t, size_t i) const {
    const int64_t len = layout_[i].shape[0];
    return len == t.shape()[0] ? t : t.slice(0, len);
  }

  void orthonormalize(Tensor& p, int64_t r) const {
    const bool mgs = cfg_.orthogonalize == Orthogonalize::mgs || (cfg_.orthogonalize == Orthogonalize::auto_ && r <= 2);
    if (mgs)
      ops::orthonormalize_mgs(p, kMgsEps);
    else
      ops::orthonormalize_qr(p);
  }

  // Sharded: group g's whole P [B, n, r] assembled from the gathered shards (their padding rows
  // dropped), orthonormalised as the unsharded P would be, and this rank's rows put back.
  void orthonormalize_whole(const Region& reg, const Group& g) {
    const int64_t B = g.batch(), n = g.n, r = g.r, ns = g.ns, region = reg.p_end - reg.p_begin;
    const int me = topo_.shard->rank();
    Tensor whole = whole_p_.slice(0, B * n * r);
    for (int64_t b = 0; b < B; ++b)
      for (size_t s = 0; s < g.lengths.size(); ++s) {
        if (g.lengths[s] == 0) continue;
        const int64_t src = reg.g_begin + static_cast<int64_t>(s) * region + (g.p_off - reg.p_begin) + b * ns * r;
        Tensor dst = whole.slice(b * n * r + g.offsets[s] * r, b * n * r + (g.offsets[s] + g.lengths[s]) * r);
        copy(dst, gathered_.slice(src, src + g.lengths[s] * r));
      }
    Tensor w = whole.reshape({B, n, r});
    orthonormalize(w, r);
    const int64_t off = g.offsets[static_cast<size_t>(me)], len = g.lengths[static_cast<size_t>(me)];
    for (int64_t b = 0; b < B; ++b) {
      if (len == 0) continue;
      Tensor dst = pbuf_.slice(g.p_off + b * ns * r, g.p_off + (b * ns + len) * r);
      copy(dst, whole.slice(b * n * r + off * r, b * n * r + (off + len) * r));
    }
  }

  // An in-place asynchronous all-reduce, tracked; kNoWork for an empty tensor.
  size_t all_reduce(const Tensor& t, comm::ReduceOp op) {
    if (t.numel() == 0) return kNoWork;
    return track(comm_.all_reduce(comm::buffer_of(t), comm::buffer_of(t), op, comm::Mode::async));
  }
  Tensor wire_p(const Region& reg) const { return wire_.slice(reg.w_begin, reg.w_begin + reg.p_end - reg.p_begin); }
  Tensor wire_q(const Region& reg) const { return wire_.slice(reg.w_begin, reg.w_begin + reg.q_end - reg.q_begin); }
  Tensor p_of(const Group& g) const {
    return pbuf_.slice(g.p_off, g.p_off + g.batch() * g.ns * g.r).reshape({g.batch(), g.ns, g.r});
  }
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

  bool split_;  // sharded over a shard group of more than one rank
  uint64_t q_key_, guard_key_;
  std::vector<Group> groups_;
  std::vector<Slot> slots_;
  std::vector<Region> regions_;  // per bucket
  int64_t p_total_ = 0, q_total_ = 0, u_total_ = 0, colmax_total_ = 0;
  Tensor pbuf_;    // f32 [per bucket: its P, then its uncompressed grads]
  Tensor q_;       // f32 [every Q]: the aggregated Q, kept for the warm start
  Tensor qlocal_;  // f32 [every Q]: this rank's Q_r = M_r^T P^
  Tensor wire_;    // bf16 [per bucket: max(its P, its Q)] when comm_dtype is bf16
  Tensor colmax_;  // f32 [sum of ranks]: max |Q| per column
  Tensor gathered_, whole_p_;  // sharded: every bucket's P from every shard; a group's whole P
};

}  // namespace

std::unique_ptr<Compressor> make_powersgd(const Config& cfg, comm::Communicator& comm, const Params& params,
                                          size_t bucket_bytes, const Topology& topology) {
  return std::make_unique<PowerSGD>(cfg, comm, params, bucket_bytes, topology);
}

}  // namespace dtk::compress::detail
