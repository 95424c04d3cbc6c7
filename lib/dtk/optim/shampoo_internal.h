// Inside Distributed Shampoo (shampoo.h): what the distributed driver (shampoo.cpp) and the three
// preconditioners share. The driver owns the blocks, their layout over the ranks, the chunks, the
// filtered gradient, grafting, weight decay, momentum and the all-gather; a preconditioner owns
// what a non-diagonal block's direction is made of:
//   root (shampoo_root.cpp)                  Kronecker factors and their inverse roots
//   eigenvalue-corrected (shampoo_corrected.cpp)  the factors' eigenbases and Adam's second moment in them
//   spectral (shampoo_spectral.cpp)          the orthogonalised filtered gradient (Newton-Schulz, or exact)
// and Dion's matrices are not blocks: the Dion class (shampoo_dion.cpp) updates them whole.
// The first two share the factors and their amortized computation (shampoo_factors.cpp).
#pragma once
#include <fmt/format.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "dtk/comm/comm.h"
#include "dtk/core/placed.h"
#include "dtk/ops/ops.h"
#include "dtk/optim/shampoo.h"

namespace dtk::optim::shampoo {

constexpr int64_t kChunkElements = int64_t(1) << 24;
constexpr int kMaxFailures = 4;  // the fourth consecutive failure of a block's root is an error

// A buffer of the shard group's ranks' segments, rank after rank (the gathers of sharded rows:
// the driver's gradients and weights, Dion's P): counts[q] elements of rank q, from at[q].
struct RankSegments {
  std::vector<size_t> counts, at;
  size_t total = 0;
  explicit RankSegments(std::vector<size_t> c = {}) : counts(std::move(c)), at(counts.size(), 0) {
    for (size_t q = 0; q < counts.size(); ++q) at[q] = total, total += counts[q];
  }
  // Every rank's segment of buf from its own (already in place at at[rank]); the bytes it sent.
  int64_t all_gather(comm::Communicator& comm, const Tensor& buf) const {
    const auto me = static_cast<size_t>(comm.rank());
    if (comm.size() == 1) return 0;
    const comm::Buffer all = comm::buffer_of(buf).slice(0, total);
    comm.all_gather_v(all.slice(at[me], counts[me]), all, counts, comm::Mode::sync).wait();
    return static_cast<int64_t>(counts[me] * 4);
  }
};

struct BlockDesc {
  int param = 0;
  int index = 0;  // in the row-major grid of the parameter's blocks
  Shape dims;     // the block's shape ([] for a scalar parameter)
  std::vector<int64_t> offset;
  int64_t numel = 1;
  int owner = 0;            // rank in the group
  int phase = 0;            // root phase (root_spread)
  bool diagonal = false;    // the grafting direction only (diagonal_params; spectral: order != 2)
  bool contiguous = false;  // a contiguous range of the parameter's elements, in order
  int64_t start = 0;        // its first element, when contiguous
  int64_t recv_offset = 0;  // where its direction lies in the gathered buffer
  std::string prefix;       // "shampoo/<param>/block<i>/"
};

// The blocks of one shape this rank owns, their state as batches ([B, ...]).
struct Group {
  Shape dims;
  bool diagonal = false;
  int order = 0;
  int64_t n = 1;            // elements per block
  std::vector<int> blocks;  // global block ids, ascending
  int64_t chunk = 1;        // blocks per chunk
  int64_t send_offset = 0;  // in this rank's segment
  std::vector<Tensor> factor, root;  // [B, b_k, b_k] (root: both; eigenvalue-corrected: factors)
  std::vector<Tensor> basis;         // [B, b_k, b_k] eigenvectors (root_method qr; eigenvalue-corrected: basis_dtype)
  Tensor graft, filtered, momentum;  // [B, n]
  Tensor corrected;                  // [B, n] eigenvalue-corrected: the second moment in the bases (basis_dtype)
  Tensor failures;                   // i64 [B] on the host
  std::vector<Tensor> rotate;        // order >= 3: transposition indices over one chunk
  struct Run {
    int param;
    int64_t b0, b1;  // blocks [b0, b1) of the group
    Tensor index;    // their elements in the parameter; undefined: each block is contiguous
  };
  std::vector<Run> runs;
};

// The scratch of one chunk: buffers of the largest chunk's elements (or blocks), of which a
// chunk takes [Bc, n] views. Each buffer's uses within a step, in order, never overlap in time.
struct Scratch {
  Tensor grad;      // G, the chunk's gradient blocks: the whole chunk
  Tensor filtered;  // Mh, the bias-corrected filtered gradient
  Tensor side;      // W (l2 decay); the grafting direction Dg; the grafting scale; W (decoupled decay)
  Tensor ping, pong;  // alternating products: factor rotations, mode products (the root direction,
                      // the gradient into the SOAP bases), Newton-Schulz's A and B, its norm scale
  Tensor search;      // the search direction before momentum (momentum only)
  Tensor ping2, pong2;  // eigenvalue-corrected: the denominator, the way back from the bases;
                        // spectral: Newton-Schulz's X and Y
  Tensor grad64, ping64, pong64;  // f64 factors: the gradient, the rotations; f64 bases: G or Mh
                                  // widened, the products into the bases, the way back (grad64)
  Tensor side64;                  // f64 bases: the denominator, the way back
  Tensor norm_a, norm_b;          // [Bc]: per-block norms
  Tensor ones;                    // [max n] of 1: a per-block scale broadcast by an outer product
  Tensor update;                  // apply: one parameter's directions, gathered
};

// The factor a spectral or Dion update of a block [r, c] is multiplied by (SpectralScale; auto:
// muon for spectral, fan for dion).
double spectral_scale_factor(const ShampooConfig& c, int64_t r, int64_t cols);

// Row-major strides of a shape.
Shape strides_of(const Shape& s);
// The parameter's flat indices of a block's elements (merged: the parameter's merged shape), in
// the block's row-major order (appended).
void block_elements(const Shape& merged, const BlockDesc& b, std::vector<int64_t>& out);

inline Tensor rows(const Tensor& flat, int64_t b, int64_t n) { return flat.slice(0, b * n).reshape({b, n}); }
Tensor upload_i64(const std::vector<int64_t>& v, Device d);
void copy_into(Tensor dst, const Tensor& src);
// A batch [B, b, b] set to identities.
void fill_identity(Tensor& batch, Device device);

// What the driver and a preconditioner share: the options, the blocks (for messages), the scratch,
// and the first fatal condition of a step, which the driver agrees on over the group and raises.
struct Context {
  ShampooConfig cfg;
  Device device{};
  int64_t start = 1;                 // the start step, resolved
  double ec_beta2 = 0, ec_epsilon = 0;  // eigenvalue-corrected: the resolved decay and epsilon
  std::vector<std::string> names;
  std::vector<Shape> shapes;         // the whole parameters
  std::vector<BlockDesc> blocks;
  Scratch sc;
  int64_t nan_code = 0, fatal_code = 0;  // the smallest encode() of a NaN factor, of a fatal failure

  // out [Bc, n] = s [Bc] broadcast over each block's n elements: an outer product with ones,
  // exact (one term per element).
  void broadcast_blocks(const Tensor& s, int64_t n, Tensor& out) const {
    ops::gemm(false, false, 1.0, s.reshape({s.numel(), 1}), sc.ones.slice(0, n).reshape({1, n}), 0.0, out);
  }
  static int64_t encode(int block, int k) { return static_cast<int64_t>(block) * 1024 + k; }
  std::string block_label(int bi) const {
    const BlockDesc& b = blocks[static_cast<size_t>(bi)];
    const auto p = static_cast<size_t>(b.param);
    return fmt::format("block {} {} of parameter '{}' {}", b.index, shape_str(b.dims), names[p], shape_str(shapes[p]));
  }
};

// What a non-diagonal block's direction is made of.
class BlockPreconditioner {
 public:
  explicit BlockPreconditioner(Context& cx) : cx_(cx) {}
  virtual ~BlockPreconditioner() = default;
  // The group's state for its B blocks (factors, roots, bases, second moment).
  virtual void allocate(Group& gr) = 0;
  // Scratch beyond the driver's, of `elements` (the largest chunk's) each.
  virtual void allocate_scratch(const std::vector<Group>& groups, int64_t elements) = 0;
  // Every step, before the direction: the statistics of G (the chunk [c0, c1), L2-augmented).
  virtual void update(Group& gr, int64_t c0, int64_t c1, const Tensor& G, int64_t t) = 0;
  // At a root step of their phase: the amortized work of the blocks [r0, r1) of the group.
  virtual void amortized_step(Group& gr, int64_t r0, int64_t r1, int64_t t) = 0;
  // The preconditioned direction of the filtered gradient Mh [Bc, n] (G: the gradient), in
  // scratch, or undefined for the grafting direction alone this step. precond: t is at or after
  // the start step.
  virtual Tensor direction(Group& gr, int64_t c0, int64_t c1, const Tensor& G, const Tensor& Mh, int64_t t,
                           bool precond) = 0;
  // The name of the amortized work in messages ("inverse root", "eigenbasis").
  virtual const char* amortized_name() const = 0;
  // What describes its state's layout, added to the optimizer's config (checkpoints keep it).
  virtual void describe(nlohmann::json& config) const { (void)config; }
  // After the groups' state was restored from a checkpoint whose optimizer config is `saved`:
  // state an older dtk laid out otherwise brought up to date; what was done, or "".
  virtual std::string restored(std::vector<Group>& groups, const nlohmann::json& saved) {
    (void)groups, (void)saved;
    return "";
  }

 protected:
  Context& cx_;
};

// Dion's matrices (shampoo_dion.cpp; shampoo.h, "Dion"): not blocks, each whole, and every rank
// updates every one of them (its own rows when sharded), applying the update itself.
class Dion {
 public:
  // which: the indices of Dion's matrices in params (as step() takes them: whole, or this rank's
  // rows over `shards`). replicas: the ranks whose own gradients Dion aggregates (dion_sync
  // factors over replicated parameters), else null: the gradients arrive aggregated. shards:
  // the shard group the rows are split over (rows), else null.
  Dion(Context& cx, const std::vector<nn::Param>& params, std::vector<int> which, comm::Communicator* replicas,
       comm::Communicator* shards, const std::vector<Rows>& rows);
  // M += G, the power iteration with its two rounds of collectives, the error feedback, Q, and
  // the update of every matrix (W = W (1 - lr wd) - lr s P Q^T with decoupled weight decay).
  void step(std::vector<nn::Param>& params, double lr);
  std::vector<PlacedTensor> state();
  // Before a save (collective): sharded buffers, one per replica group, become their mean there
  // (exact: every later step depends on them only through it), as one shard group writes.
  void before_save();
  nlohmann::json plan() const;
  int64_t bytes_sent() const { return bytes_; }  // payload of the last step's collectives

 private:
  struct Mat {
    int param = 0;
    int64_t m = 0, n = 0, r = 0;  // the whole matrix [m, n] (the parameter as [d0, rest]) and its rank
    int64_t row0 = 0, rows = 0;   // this rank's rows of the m
    bool transposed = false;      // m < n: the iteration runs on M^T, P on the longer side
    double scale = 1;             // spectral_scale_factor(m, n)
    Tensor M;                     // [rows, n]: the buffer (momentum and error feedback)
    Tensor Q;                     // [n, r], or transposed [rows, r]: the right factor, warm start
    Tensor P;                     // [a, r] (a = max(m, n)): the whole left factor of this step
    int64_t p_at = 0, r_at = 0, norm_at = 0;  // in the staging buffers
  };
  // bcast [rows, r] = v [r] repeated on every row: an outer product with ones (exact).
  void broadcast_columns(const Tensor& v, Tensor& out) const;
  void reduce_replicas(Tensor& buf);
  void reduce_shards(const Tensor& part);

  Context& cx_;
  std::vector<Mat> mats_;
  comm::Communicator* replicas_ = nullptr;
  comm::Communicator* shards_ = nullptr;  // null also for a shard group of one
  bool sharded_ = false;                  // rows of the matrices (their state placed by rows)
  int replica_count_ = 1;
  // Round 1: [sums over shards (transposed: M^T Q) | this rank's rows (not transposed: M Q)];
  // round 2: [sums over shards (not transposed: M^T P) | rows (transposed: M P)]; the columns'
  // squared norms [sums over shards (transposed) | whole (not transposed)].
  Tensor stage1_, stage2_, norms_, gathered_, ones_;
  Tensor qn_, bcast_, den_, keep_;  // one matrix's new Q [rows, r], a broadcast [rows, r]; [r] vectors
  std::vector<Rows> rows_;
  int64_t sum1_ = 0, sum2_ = 0, sum_norms_ = 0;
  RankSegments segments_;  // round 1's rows over the shard group, per rank
  int64_t bytes_ = 0;
};

std::unique_ptr<BlockPreconditioner> make_root(Context& cx);
std::unique_ptr<BlockPreconditioner> make_corrected(Context& cx);
std::unique_ptr<BlockPreconditioner> make_spectral(Context& cx);

// The Kronecker factors of the root and eigenvalue-corrected preconditioners, and their amortized
// computation with its failure rules (shampoo.h: retried in f64, the previous result kept, the
// kMaxFailures-th an error; a NaN or Inf factor an error).
class Factored : public BlockPreconditioner {
 public:
  using BlockPreconditioner::BlockPreconditioner;
  // The f64 factors' gradient, and their rotations (order >= 3).
  void allocate_scratch(const std::vector<Group>& groups, int64_t elements) override;

 protected:
  // The factors, zero, and the rotations of order >= 3.
  void allocate_factors(Group& gr);
  // F_k = beta2 F_k + (1 - beta2) G_(k) G_(k)^T for every k, on the steps factor_update_every says.
  void update_factors(Group& gr, int64_t c0, int64_t c1, const Tensor& G, int64_t t);
  // X x_0 M_0 ... x_{K-1} M_{K-1} (mode products; back: with M_k^T), alternating buf0 and buf1.
  Tensor modes(const Group& gr, int64_t c0, int64_t c1, const std::vector<Tensor>& mats, const Tensor& X0, bool back,
               const Tensor& buf0, const Tensor& buf1) const;
  // The factors' bias correction: 1 / (1 - beta2^u), u the number of factor updates so far.
  double factor_correction(int64_t t) const;
  ops::RootOptions root_options() const;

  // For every factor k of the blocks [c0, c1), in batches of bounded size, the bias-corrected
  // factors Fc of a batch whose factors are all finite go to compute(k, r0, Fc, failed) (r0: the
  // batch's first block; it sets failed[r0 + i] for a block that keeps its previous result); then
  // the failures are counted and NaN or Inf recorded.
  template <typename Compute>
  void amortized(Group& gr, int64_t c0, int64_t c1, int64_t t, Compute&& compute) {
    const int64_t Bc = c1 - c0;
    std::vector<char> failed(static_cast<size_t>(Bc), 0), nonfinite(static_cast<size_t>(Bc), 0);
    const double corr = factor_correction(t);
    for (int k = 0; k < gr.order; ++k) {
      const int64_t b = gr.dims[static_cast<size_t>(k)];
      const int64_t rc = std::clamp<int64_t>(kChunkElements / (b * b), 1, Bc);
      for (int64_t r0 = 0; r0 < Bc; r0 += rc) {
        const int64_t r1 = std::min(Bc, r0 + rc);
        const Tensor F = gr.factor[static_cast<size_t>(k)].slice(c0 + r0, c0 + r1);
        if (nonfinite_factors(gr, c0 + r0, F, k, nonfinite, r0)) continue;
        Tensor Fc = F;
        if (corr != 1.0) {
          Fc = Tensor::empty(F.shape(), cx_.cfg.factor_dtype, cx_.device);
          ops::scale(F, corr, Fc);
        }
        compute(k, r0, Fc, failed);
      }
    }
    count_failures(gr, c0, failed, nonfinite, t);
  }

  // A batch's results out [nb, b, b] into dst (of the factors Fc), where ok says they succeeded;
  // a block i that failed is computed again alone in f64 by retry(i, F [1, b, b], result [1, b, b],
  // zeroed) and, if that fails too, keeps dst's block and is marked in failed (from index r0).
  template <typename Retry>
  void take_or_retry(const std::vector<char>& ok, const Tensor& Fc, const Tensor& out, Tensor dst,
                     std::vector<char>& failed, int64_t r0, Retry&& retry) {
    if (std::all_of(ok.begin(), ok.end(), [](char v) { return v != 0; })) {
      ops::cast(out, dst);
      return;
    }
    const int64_t b = Fc.dim(1);
    for (int64_t i = 0; i < Fc.dim(0); ++i) {
      Tensor di = dst.select(i);
      if (ok[static_cast<size_t>(i)]) {
        ops::cast(out.select(i), di);
        continue;
      }
      Tensor Fd = Tensor::empty({1, b, b}, DType::f64, cx_.device), Rd = Tensor::zeros({1, b, b}, DType::f64, cx_.device);
      ops::cast(Fc.slice(i, i + 1), Fd);
      if (retry(i, Fd, Rd))
        ops::cast(Rd.select(0), di);
      else
        failed[static_cast<size_t>(r0 + i)] = 1;
    }
  }

 private:
  bool nonfinite_factors(const Group& gr, int64_t c, const Tensor& F, int k, std::vector<char>& nonfinite, int64_t at);
  void count_failures(Group& gr, int64_t c0, const std::vector<char>& failed, const std::vector<char>& nonfinite,
                      int64_t t);
};

}  // namespace dtk::optim::shampoo
