// Distributed Shampoo (shampoo.h). Layout of the work on one rank:
//
// The blocks this rank owns are grouped by (diagonal or not, block shape) (std::map order:
// deterministic). A group
// keeps its state as batches ([B, b_k, b_k] factors and roots, [B, n] grafting / filtered /
// momentum tensors), so that one batched GEMM (one batched eigendecomposition at root steps)
// serves every block of the group; a group is processed in chunks of at most kChunkElements
// elements so that the scratch buffers stay bounded.
//
// Every step, per chunk: the gradient blocks are gathered into a contiguous scratch (a device
// gather through a precomputed index, or plain copies for blocks that are contiguous ranges of
// their parameter; with sharded parameters from the gathered shards); the factors are updated
// by batched GEMMs; the filtered gradient, the
// grafting direction and (from the start step) the preconditioned direction are computed; the
// final search direction is written straight into this rank's segment of the flat gathered
// buffer. One all_gather_v of that buffer gives every rank all directions, in rank order; each
// parameter then takes its direction through a gather index (or contiguous segments).
//
// Memory on every rank, beyond the owned state: the gathered buffer (4 bytes per parameter
// element, plus 2 with bf16 communication) and the update indices (8 bytes per element of
// parameters whose blocks are not contiguous ranges of them; with sharded parameters, of the
// rank's rows, and the gathered shards' 4 bytes per element and their index's 8).
#include "dtk/optim/shampoo.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/ops/ops.h"

namespace dtk::optim {

// ------------------------------------------------------------------------------ the optimizer

namespace {

constexpr int64_t kChunkElements = int64_t(1) << 24;
constexpr int kMaxFailures = 4;  // the fourth consecutive failure of a block's root is an error

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

struct Group {
  Shape dims;
  bool diagonal = false;
  int order = 0;
  int64_t n = 1;            // elements per block
  std::vector<int> blocks;  // global block ids, ascending
  int64_t chunk = 1;        // blocks per chunk
  int64_t send_offset = 0;  // in this rank's segment
  std::vector<Tensor> factor, root;  // [B, b_k, b_k] (root: both; eigenvalue-corrected: factors)
  std::vector<Tensor> basis;         // [B, b_k, b_k] eigenvectors (root_method qr; eigenvalue-corrected: f32)
  Tensor graft, filtered, momentum;  // [B, n]
  Tensor corrected;                  // [B, n] eigenvalue-corrected: the second moment in the bases
  Tensor failures;                   // i64 [B] on the host
  std::vector<Tensor> rotate;        // order >= 3: transposition indices over one chunk
  struct Run {
    int param;
    int64_t b0, b1;  // blocks [b0, b1) of the group
    Tensor index;    // their elements in the parameter; undefined: each block is contiguous
  };
  std::vector<Run> runs;
};

struct ParamUpdate {
  std::vector<std::array<int64_t, 3>> segments;  // (param start, gathered start, length)
  Tensor index;                                   // [numel] positions in the gathered buffer
};

Shape strides_of(const Shape& s) {
  Shape st(s.size(), 1);
  for (size_t i = s.size(); i-- > 1;) st[i - 1] = st[i] * s[i];
  return st;
}

// The parameter's flat indices of a block's elements, in the block's row-major order (appended).
void block_elements(const Shape& merged, const BlockDesc& b, std::vector<int64_t>& out) {
  const size_t k = b.dims.size();
  if (k == 0) {
    out.push_back(0);
    return;
  }
  const Shape st = strides_of(merged);
  std::vector<int64_t> i(k, 0);
  const int64_t last = b.dims[k - 1];
  while (true) {
    int64_t base = 0;
    for (size_t d = 0; d < k; ++d) base += (b.offset[d] + i[d]) * st[d];
    for (int64_t j = 0; j < last; ++j) out.push_back(base + j);
    if (k == 1) return;
    size_t d = k - 1;
    while (d > 0) {
      --d;
      if (++i[d] < b.dims[d]) break;
      i[d] = 0;
      if (d == 0) return;
    }
  }
}

Tensor upload_i64(const std::vector<int64_t>& v, Device d) {
  return Tensor::from_host(v.data(), {static_cast<int64_t>(v.size())}, DType::i64, d);
}

void copy_into(Tensor dst, const Tensor& src) { dst.copy_from_async(src, cuda::current_stream()); }

Tensor rows(const Tensor& flat, int64_t b, int64_t n) { return flat.slice(0, b * n).reshape({b, n}); }

class Shampoo final : public Optimizer {
 public:
  Shampoo(const ShampooConfig& cfg, const std::vector<nn::Param>& params, comm::Communicator& comm,
          const std::vector<Rows>& rows)
      : cfg_(cfg) {
    sharded_ = std::any_of(rows.begin(), rows.end(), [](const Rows& r) { return !r.offsets.empty(); });
    if (sharded_) rows_ = rows;
    cfg_.validate();
    if (sharded_) check_shards(params, comm);
    start_ = cfg_.start_preconditioning_step == -1 ? cfg_.precondition_frequency : cfg_.start_preconditioning_step;
    fdtype_ = cfg_.factor_dtype;
    ec_beta2_ = cfg_.ec_beta2 < 0 ? cfg_.beta2 : cfg_.ec_beta2;
    ec_epsilon_ = cfg_.ec_epsilon < 0 ? cfg_.epsilon : cfg_.ec_epsilon;
    bf16_ = cfg_.communication_dtype == DType::bf16;
    check_and_record(params);
    // Groups of g consecutive ranks.
    const int world = comm.size(), rank = comm.rank();
    const int g = cfg_.trainers_per_group == 0 ? world : cfg_.trainers_per_group;
    if (g > world || world % g != 0)
      fail_usage("shampoo: trainers_per_group {} must divide the {} ranks {}", g, world,
                 sharded_ ? "that hold the parameters' shards" : "of the world");
    shard_comm_ = &comm;
    if (g == world) {
      group_ = &comm;
    } else {
      group_holder_ = comm.split(rank / g, rank);
      group_ = group_holder_.get();
    }
    group_size_ = g;
    group_rank_ = group_->rank();
    in_group0_ = rank < g;
    if (group_size_ > 1 && !group_->accepts(device_))
      fail_usage("shampoo: the communicator (" + std::string(comm::backend_name(group_->backend())) +
                 ") does not accept buffers on " + device_.str() + ", where the parameters live");
    build_blocks(params);
    build_layout();
    allocate_groups();
    build_updates(params);
    if (sharded_) build_gather();
  }

  nlohmann::json config() const override { return cfg_; }

  std::vector<PlacedTensor> state() override {
    std::vector<PlacedTensor> s;
    // A block's state: owned by its owner in group 0 (group-local rank = world rank there); a
    // copy in another group is replicated (restored by name, never written).
    auto placed = [&](std::string name, const Tensor& t, bool symmetric, const BlockDesc& b) {
      PlacedTensor p{std::move(name), t, Placement::owned, b.owner, symmetric};
      if (!in_group0_) p.placement = Placement::replicated, p.owner = -1;
      // Checkpoints of older dtk held sharded parameters' blocks cut from the shards, which
      // are not these: such a checkpoint leaves the optimizer fresh.
      if (sharded_) p.resize = Resize::if_present;
      s.push_back(std::move(p));
    };
    for (size_t bi = 0; bi < blocks_.size(); ++bi) {
      const auto& [gi, i] = where_[bi];
      if (gi < 0) continue;
      Group& gr = groups_[static_cast<size_t>(gi)];
      const BlockDesc& b = blocks_[bi];
      const Shape elem = b.dims.empty() ? Shape{1} : b.dims;
      for (size_t k = 0; k < gr.factor.size(); ++k)
        placed(fmt::format("{}factor{}", b.prefix, k), gr.factor[k].select(i), true, b);
      for (size_t k = 0; k < gr.root.size(); ++k) placed(fmt::format("{}root{}", b.prefix, k), gr.root[k].select(i), true, b);
      for (size_t k = 0; k < gr.basis.size(); ++k)
        placed(fmt::format("{}eigvecs{}", b.prefix, k), gr.basis[k].select(i), false, b);
      if (gr.corrected.defined())
        placed(b.prefix + "corrected_second_moment", gr.corrected.select(i).reshape(elem), false, b);
      if (gr.graft.defined()) placed(b.prefix + "graft", gr.graft.select(i).reshape(elem), false, b);
      if (gr.filtered.defined()) placed(b.prefix + "filtered_grad", gr.filtered.select(i).reshape(elem), false, b);
      if (gr.momentum.defined()) placed(b.prefix + "momentum", gr.momentum.select(i).reshape(elem), false, b);
      if (!gr.factor.empty()) placed(b.prefix + "root_failures", gr.failures.slice(i, i + 1), false, b);
    }
    s.push_back({"step", step_});
    return s;
  }

  void step(std::vector<nn::Param>& params, double lr) override {
    if (params.size() != shapes_.size())
      fail_usage("shampoo: step got {} parameters, the optimizer was built for {}", params.size(), shapes_.size());
    for (size_t i = 0; i < params.size(); ++i)
      if (params[i].value.shape() != local_shapes_[i] || params[i].grad.shape() != local_shapes_[i] ||
          params[i].value.device() != device_ || params[i].grad.device() != device_)
        fail_usage("shampoo: parameter " + params[i].name + " is " + params[i].value.str() +
                   ", the optimizer was built for f32" + shape_str(local_shapes_[i]) + " on " + device_.str());
    if (!std::isfinite(lr)) fail_usage("shampoo: the learning rate is not finite");
    const int64_t t = ++*step_.ptr<int64_t>();
    const bool precond = t >= start_;
    const bool spectral = cfg_.preconditioner == Preconditioner::spectral;
    // The reference's rule: at the start step, then at every multiple of the frequency after it;
    // phase j of root_spread S at the multiples shifted by j floor(f / S).
    const int64_t f = cfg_.precondition_frequency, shift = f / cfg_.root_spread;
    std::vector<char> due(static_cast<size_t>(cfg_.root_spread));
    bool root_step = false;
    for (int64_t j = 0; j < cfg_.root_spread; ++j) {
      due[static_cast<size_t>(j)] = !spectral && (t == start_ || (t > start_ && (t - j * shift) % f == 0));
      root_step = root_step || due[static_cast<size_t>(j)];
    }
    nan_code_ = fatal_code_ = std::numeric_limits<int64_t>::max();
    if (sharded_) {  // every block whole on its owner: the shards' gradients (and weights) gathered
      gather_shards(params, false, gathered_grads_);
      if (cfg_.weight_decay > 0) gather_shards(params, true, gathered_values_);
    }

    for (auto& gr : groups_)
      for (int64_t c0 = 0; c0 < static_cast<int64_t>(gr.blocks.size()); c0 += gr.chunk)
        process_chunk(gr, c0, std::min<int64_t>(c0 + gr.chunk, static_cast<int64_t>(gr.blocks.size())), params, t,
                      precond, due);

    if (root_step) agree_and_raise(t);
    communicate();
    apply(params, lr);
  }

 private:
  // ---------------------------------------------------------------- construction
  void check_and_record(const std::vector<nn::Param>& params) {
    if (!params.empty()) device_ = params[0].value.device();
    for (const auto& p : params) {
      if (!p.value.defined() || !p.grad.defined()) fail_usage("shampoo: parameter " + p.name + " has no value or gradient");
      if (p.value.dtype() != DType::f32 || p.grad.dtype() != DType::f32)
        fail_usage("shampoo: parameter " + p.name + " must be f32 (value and gradient), got " + p.value.str());
      if (p.value.device() != device_ || p.grad.device() != device_)
        fail_usage("shampoo: every parameter must live on one device; " + p.name + " is on " + p.value.device().str() +
                   ", " + params[0].name + " on " + device_.str());
      if (p.grad.shape() != p.value.shape())
        fail_usage("shampoo: the gradient of " + p.name + " is " + p.grad.str() + ", the value " + p.value.str());
      names_.push_back(p.name);
      shapes_.push_back(p.value.shape());
    }
    local_shapes_ = shapes_;
    for (size_t i = 0; i < rows_.size() && i < shapes_.size(); ++i)
      if (!rows_[i].offsets.empty()) shapes_[i] = rows_[i].shape;  // blocks of the whole parameters
    step_ = Tensor::zeros({1}, DType::i64);
  }

  void build_blocks(const std::vector<nn::Param>& params) {
    std::vector<int64_t> sizes;
    for (size_t pi = 0; pi < params.size(); ++pi) {
      const bool spectral = cfg_.preconditioner == Preconditioner::spectral;
      const ShampooBlocking bl = shampoo_blocking(shapes_[pi], cfg_.max_preconditioner_dim, spectral);
      const bool named_diagonal = std::any_of(cfg_.diagonal_params.begin(), cfg_.diagonal_params.end(),
                                              [&](const std::string& d) { return params[pi].name.find(d) != std::string::npos; });
      merged_.push_back(bl.merged);
      for (size_t i = 0; i < bl.block_shapes.size(); ++i) {
        BlockDesc b;
        b.param = static_cast<int>(pi);
        b.index = static_cast<int>(i);
        b.dims = bl.block_shapes[i];
        b.offset = bl.offsets[i];
        b.numel = shape_numel(b.dims);
        b.diagonal = named_diagonal || (spectral && b.dims.size() != 2);
        b.prefix = fmt::format("shampoo/{}/block{}/", params[pi].name, i);
        // Contiguous: every dim after some j is whole, every dim before j has extent 1.
        const size_t k = b.dims.size();
        if (k == 0) {
          b.contiguous = true;
        } else {
          size_t j = k - 1;
          while (j > 0 && b.dims[j] == bl.merged[j]) --j;
          b.contiguous = true;
          for (size_t d = 0; d < j; ++d)
            if (b.dims[d] != 1) b.contiguous = false;
          const Shape st = strides_of(bl.merged);
          for (size_t d = 0; d < k; ++d) b.start += b.offset[d] * st[d];
        }
        if (!prefix_to_block_.emplace(b.prefix, static_cast<int>(blocks_.size())).second)
          fail_usage("shampoo: two parameters are named '" + params[pi].name + "'");
        sizes.push_back(b.numel);
        blocks_.push_back(std::move(b));
      }
    }
    // Phases, then the ranks within each phase (one phase: the plain assignment).
    std::vector<Shape> dims;  // for the root costs (a diagonal block has none)
    for (const BlockDesc& b : blocks_) dims.push_back(b.diagonal ? Shape{} : b.dims);
    const std::vector<int> phases = shampoo_root_phases(dims, cfg_.root_spread);
    for (int j = 0; j < cfg_.root_spread; ++j) {
      std::vector<size_t> members;
      std::vector<int64_t> member_sizes;
      for (size_t i = 0; i < blocks_.size(); ++i)
        if (phases[i] == j) {
          members.push_back(i);
          member_sizes.push_back(sizes[i]);
        }
      const std::vector<int> owners = shampoo_assign(member_sizes, group_size_);
      for (size_t m = 0; m < members.size(); ++m) {
        blocks_[members[m]].owner = owners[m];
        blocks_[members[m]].phase = j;
      }
    }
  }

  // Sharded parameters: every one sharded over comm, by rows, with this rank's index.
  void check_shards(const std::vector<nn::Param>& params, const comm::Communicator& comm) const {
    for (size_t i = 0; i < params.size(); ++i) {
      const Rows* r = i < rows_.size() ? &rows_[i] : nullptr;
      if (!r || r->offsets.empty())
        fail_usage("shampoo: parameter {} is whole while others are sharded: shard every parameter or none", params[i].name);
      if (static_cast<int>(r->offsets.size()) != comm.size() || r->rank != comm.rank() || r->lengths.size() != r->offsets.size())
        fail_usage("shampoo: the shards of {} are over {} ranks (this one {}), the communicator has {} (this rank {})",
                   params[i].name, r->offsets.size(), r->rank, comm.size(), comm.rank());
      if (r->shape.empty() || params[i].value.shape().empty() ||
          params[i].value.dim(0) != r->lengths[static_cast<size_t>(r->rank)])
        fail_usage("shampoo: parameter {} {} is not its rows of {}", params[i].name, params[i].value.str(), shape_str(r->shape));
    }
  }

  // The gather of the shards (sharded parameters): the packed buffer holds, rank after rank,
  // that rank's rows of every parameter in order; gathered_at_[p][e] is where element e of the
  // whole parameter p lies in it.
  void build_gather() {
    const int S = shard_comm_->size();
    gather_counts_.assign(static_cast<size_t>(S), 0);
    std::vector<std::vector<int64_t>> base(static_cast<size_t>(S));  // [rank][param]
    int64_t pos = 0;
    for (int q = 0; q < S; ++q) {
      for (size_t p = 0; p < rows_.size(); ++p) {
        base[static_cast<size_t>(q)].push_back(pos);
        const Rows& r = rows_[p];
        const int64_t row = r.shape[0] == 0 ? 0 : shape_numel(r.shape) / r.shape[0];
        const int64_t n = r.lengths[static_cast<size_t>(q)] * row;
        pos += n;
        gather_counts_[static_cast<size_t>(q)] += static_cast<size_t>(n);
      }
    }
    gathered_grads_ = Tensor::empty({std::max<int64_t>(pos, 1)}, DType::f32, device_);
    if (cfg_.weight_decay > 0) gathered_values_ = Tensor::empty({std::max<int64_t>(pos, 1)}, DType::f32, device_);
    gathered_at_.resize(rows_.size());
    for (size_t p = 0; p < rows_.size(); ++p) {
      const Rows& r = rows_[p];
      const int64_t row = r.shape[0] == 0 ? 0 : shape_numel(r.shape) / r.shape[0];
      auto& at = gathered_at_[p];
      at.resize(static_cast<size_t>(shape_numel(r.shape)));
      for (int q = 0; q < S; ++q) {
        const int64_t o = r.offsets[static_cast<size_t>(q)] * row, n = r.lengths[static_cast<size_t>(q)] * row;
        for (int64_t e = 0; e < n; ++e) at[static_cast<size_t>(o + e)] = base[static_cast<size_t>(q)][p] + e;
      }
    }
    // Every run of blocks reads the packed buffer through an index.
    for (auto& gr : groups_)
      for (auto& run : gr.runs) {
        std::vector<int64_t> idx;
        idx.reserve(static_cast<size_t>((run.b1 - run.b0) * gr.n));
        for (int64_t q = run.b0; q < run.b1; ++q)
          block_elements(merged_[static_cast<size_t>(run.param)], blocks_[static_cast<size_t>(gr.blocks[static_cast<size_t>(q)])], idx);
        for (int64_t& e : idx) e = gathered_at_[static_cast<size_t>(run.param)][static_cast<size_t>(e)];
        run.index = upload_i64(idx, device_);
      }
    gathered_at_.clear();
    gathered_at_.shrink_to_fit();
  }

  // This rank's rows of every parameter's gradient (values: weight) packed, then gathered from
  // every rank of the shard group into out.
  void gather_shards(const std::vector<nn::Param>& params, bool values, Tensor& out) {
    const int me = shard_comm_->rank();
    int64_t at = 0;
    for (int q = 0; q < me; ++q) at += static_cast<int64_t>(gather_counts_[static_cast<size_t>(q)]);
    for (const nn::Param& p : params) {
      const Tensor src = (values ? p.value : p.grad).flatten();
      copy_into(out.slice(at, at + src.numel()), src);
      at += src.numel();
    }
    if (shard_comm_->size() == 1) return;
    const size_t total = std::accumulate(gather_counts_.begin(), gather_counts_.end(), size_t{0});
    comm::Buffer all{out.data(), total, DType::f32, device_};
    size_t mine_at = 0;
    for (int q = 0; q < me; ++q) mine_at += gather_counts_[static_cast<size_t>(q)];
    shard_comm_->all_gather_v(all.slice(mine_at, gather_counts_[static_cast<size_t>(me)]), all, gather_counts_,
                              comm::Mode::sync).wait();
  }

  // Every rank's segment: its blocks grouped by shape (map order), by root phase and then
  // ascending within a group (a phase's blocks are consecutive: one batch at its root steps).
  void build_layout() {
    std::vector<std::map<std::pair<bool, Shape>, std::vector<int>>> per_rank(static_cast<size_t>(group_size_));
    for (int j = 0; j < cfg_.root_spread; ++j)
      for (size_t i = 0; i < blocks_.size(); ++i)
        if (blocks_[i].phase == j)
          per_rank[static_cast<size_t>(blocks_[i].owner)][{blocks_[i].diagonal, blocks_[i].dims}].push_back(static_cast<int>(i));
    counts_.assign(static_cast<size_t>(group_size_), 0);
    int64_t pos = 0;
    for (int r = 0; r < group_size_; ++r) {
      if (r == group_rank_) my_offset_ = pos;
      for (auto& [key, list] : per_rank[static_cast<size_t>(r)]) {
        if (r == group_rank_) {
          Group gr;
          gr.diagonal = key.first;
          gr.dims = key.second;
          gr.order = static_cast<int>(key.second.size());
          gr.n = shape_numel(key.second);
          gr.blocks = list;
          gr.send_offset = pos - my_offset_;
          groups_.push_back(std::move(gr));
        }
        for (int bi : list) {
          blocks_[static_cast<size_t>(bi)].recv_offset = pos;
          pos += blocks_[static_cast<size_t>(bi)].numel;
          counts_[static_cast<size_t>(r)] += static_cast<size_t>(blocks_[static_cast<size_t>(bi)].numel);
        }
      }
    }
    total_ = pos;
    where_.assign(blocks_.size(), {-1, 0});
    for (size_t gi = 0; gi < groups_.size(); ++gi)
      for (size_t i = 0; i < groups_[gi].blocks.size(); ++i)
        where_[static_cast<size_t>(groups_[gi].blocks[i])] = {static_cast<int>(gi), static_cast<int64_t>(i)};
  }

  void allocate_groups() {
    const bool graft_state = cfg_.grafting == Grafting::adagrad || cfg_.grafting == Grafting::rmsprop || cfg_.grafting == Grafting::adam;
    int64_t scratch = 1, max_chunk = 1, max_n = 1;
    bool rotate64 = false, ext_scratch = false;
    for (auto& gr : groups_) {
      const int64_t B = static_cast<int64_t>(gr.blocks.size());
      gr.chunk = std::clamp<int64_t>(kChunkElements / gr.n, 1, B);
      scratch = std::max(scratch, gr.chunk * gr.n);
      max_chunk = std::max(max_chunk, gr.chunk);
      max_n = std::max(max_n, gr.n);
      const Preconditioner pre = gr.diagonal ? Preconditioner::spectral : cfg_.preconditioner;  // spectral: no factors
      for (int k = 0; k < gr.order && pre != Preconditioner::spectral; ++k) {
        const int64_t b = gr.dims[static_cast<size_t>(k)];
        gr.factor.push_back(Tensor::zeros({B, b, b}, fdtype_, device_));
        if (pre == Preconditioner::eigenvalue_corrected) {  // Q = I until the first basis
          gr.basis.push_back(Tensor::empty({B, b, b}, DType::f32, device_));
          fill_identity(gr.basis.back());
          continue;
        }
        gr.root.push_back(Tensor::empty({B, b, b}, DType::f32, device_));
        fill_identity(gr.root.back());
        if (cfg_.root_method == RootMethod::qr) gr.basis.push_back(Tensor::zeros({B, b, b}, fdtype_, device_));
      }
      if (pre == Preconditioner::eigenvalue_corrected) gr.corrected = Tensor::zeros({B, gr.n}, DType::f32, device_);
      if (pre != Preconditioner::root) ext_scratch = true;
      if (graft_state) gr.graft = Tensor::zeros({B, gr.n}, DType::f32, device_);
      if (cfg_.beta1 > 0) gr.filtered = Tensor::zeros({B, gr.n}, DType::f32, device_);
      if (cfg_.momentum > 0) gr.momentum = Tensor::zeros({B, gr.n}, DType::f32, device_);
      gr.failures = Tensor::zeros({B}, DType::i64);
      // Rotations for the factors of order >= 3: [C, r, c] -> [C, c, r] with r = b_k.
      if (gr.order >= 3 && !gr.factor.empty()) {
        if (fdtype_ == DType::f64) rotate64 = true;
        for (int k = 0; k + 1 < gr.order; ++k) {
          const int64_t r = gr.dims[static_cast<size_t>(k)], c = gr.n / r;
          std::vector<int64_t> idx(static_cast<size_t>(gr.chunk * gr.n));
          for (int64_t bi = 0; bi < gr.chunk; ++bi)
            for (int64_t j = 0; j < c; ++j)
              for (int64_t i = 0; i < r; ++i) idx[static_cast<size_t>(bi * gr.n + j * r + i)] = bi * gr.n + i * c + j;
          gr.rotate.push_back(upload_i64(idx, device_));
        }
      }
      // Runs of consecutive blocks of one parameter, for gathering the gradient blocks.
      for (int64_t i = 0; i < B;) {
        const int p = blocks_[static_cast<size_t>(gr.blocks[static_cast<size_t>(i)])].param;
        int64_t j = i;
        bool contiguous = true;
        while (j < B && blocks_[static_cast<size_t>(gr.blocks[static_cast<size_t>(j)])].param == p) {
          contiguous = contiguous && blocks_[static_cast<size_t>(gr.blocks[static_cast<size_t>(j)])].contiguous;
          ++j;
        }
        Group::Run run{p, i, j, {}};
        if (!contiguous && !sharded_) {  // sharded: build_gather indexes every run
          std::vector<int64_t> idx;
          idx.reserve(static_cast<size_t>((j - i) * gr.n));
          for (int64_t q = i; q < j; ++q)
            block_elements(merged_[static_cast<size_t>(p)], blocks_[static_cast<size_t>(gr.blocks[static_cast<size_t>(q)])], idx);
          run.index = upload_i64(idx, device_);
        }
        gr.runs.push_back(std::move(run));
        i = j;
      }
    }
    for (Tensor* t : {&sc_grad_, &sc_a_, &sc_b_, &sc_c_, &sc_d_}) *t = Tensor::empty({scratch}, DType::f32, device_);
    if (cfg_.momentum > 0) sc_e_ = Tensor::empty({scratch}, DType::f32, device_);
    if (ext_scratch) {
      sc_x_ = Tensor::empty({scratch}, DType::f32, device_);
      sc_y_ = Tensor::empty({scratch}, DType::f32, device_);
    }
    if (fdtype_ == DType::f64) sc_g64_ = Tensor::empty({scratch}, DType::f64, device_);
    if (rotate64) {
      sc_c64_ = Tensor::empty({scratch}, DType::f64, device_);
      sc_d64_ = Tensor::empty({scratch}, DType::f64, device_);
    }
    sc_ng_ = Tensor::empty({max_chunk}, DType::f32, device_);
    sc_np_ = Tensor::empty({max_chunk}, DType::f32, device_);
    ones_ = Tensor::empty({max_n}, DType::f32, device_);
    ops::fill(ones_, 1.0);
    recv_ = Tensor::zeros({std::max<int64_t>(total_, 1)}, DType::f32, device_);
    if (bf16_) recv16_ = Tensor::zeros({std::max<int64_t>(total_, 1)}, DType::bf16, device_);
    agree_ = Tensor::zeros({2}, DType::i64, device_);
  }

  void fill_identity(Tensor& batch) {
    const int64_t B = batch.dim(0), b = batch.dim(1);
    const int64_t tile = std::clamp<int64_t>(kChunkElements / (b * b), 1, std::max<int64_t>(B, 1));
    std::vector<float> eye(static_cast<size_t>(tile * b * b), 0.0f);
    for (int64_t t = 0; t < tile; ++t)
      for (int64_t i = 0; i < b; ++i) eye[static_cast<size_t>(t * b * b + i * b + i)] = 1.0f;
    const Tensor src = Tensor::from_host(eye.data(), {tile, b, b}, DType::f32, device_);
    for (int64_t s = 0; s < B; s += tile) {
      const int64_t e = std::min(B, s + tile);
      batch.slice(s, e).copy_from(src.slice(0, e - s));
    }
  }

  // How each parameter takes its direction from the gathered buffer.
  void build_updates(const std::vector<nn::Param>& params) {
    std::vector<std::vector<int>> of_param(params.size());
    for (size_t i = 0; i < blocks_.size(); ++i) of_param[static_cast<size_t>(blocks_[i].param)].push_back(static_cast<int>(i));
    int64_t max_index = 0;
    updates_.resize(params.size());
    for (size_t p = 0; p < params.size(); ++p) {
      ParamUpdate& u = updates_[p];
      bool contiguous = true;
      std::vector<std::array<int64_t, 3>> segs;
      for (int bi : of_param[p]) {
        const BlockDesc& b = blocks_[static_cast<size_t>(bi)];
        contiguous = contiguous && b.contiguous;
        segs.push_back({b.start, b.recv_offset, b.numel});
      }
      if (contiguous) {
        std::sort(segs.begin(), segs.end());
        for (const auto& s : segs) {
          if (!u.segments.empty()) {
            auto& l = u.segments.back();
            if (l[0] + l[2] == s[0] && l[1] + l[2] == s[1]) {
              l[2] += s[2];
              continue;
            }
          }
          u.segments.push_back(s);
        }
      }
      if (!contiguous || u.segments.size() > 32 || sharded_) {
        u.segments.clear();
        const int64_t numel = shape_numel(shapes_[p]);
        std::vector<int64_t> idx(static_cast<size_t>(numel));
        std::vector<int64_t> el;
        for (int bi : of_param[p]) {
          const BlockDesc& b = blocks_[static_cast<size_t>(bi)];
          el.clear();
          block_elements(merged_[p], b, el);
          for (size_t j = 0; j < el.size(); ++j) idx[static_cast<size_t>(el[j])] = b.recv_offset + static_cast<int64_t>(j);
        }
        if (sharded_) {  // this rank's rows only
          const Rows& r = rows_[p];
          const int64_t row = r.shape[0] == 0 ? 0 : numel / r.shape[0];
          const int64_t o = r.offsets[static_cast<size_t>(r.rank)] * row, n = r.lengths[static_cast<size_t>(r.rank)] * row;
          idx = std::vector<int64_t>(idx.begin() + o, idx.begin() + o + n);
        }
        u.index = upload_i64(idx, device_);
        max_index = std::max(max_index, std::min(static_cast<int64_t>(idx.size()), kChunkElements));
      }
    }
    if (max_index > 0) sc_upd_ = Tensor::empty({max_index}, DType::f32, device_);
  }

  // ---------------------------------------------------------------- one step
  void process_chunk(Group& gr, int64_t c0, int64_t c1, const std::vector<nn::Param>& params, int64_t t, bool precond,
                     const std::vector<char>& due) {
    const int64_t Bc = c1 - c0, n = gr.n;
    Tensor G = rows(sc_grad_, Bc, n);
    extract(gr, c0, c1, params, G, false);
    if (cfg_.weight_decay > 0 && cfg_.weight_decay_type == WeightDecayType::l2) {  // G += wd W, before everything
      Tensor W = rows(sc_b_, Bc, n);
      extract(gr, c0, c1, params, W, true);
      ops::axpy(cfg_.weight_decay, W, G);
    }
    if (!gr.factor.empty() && (t - 1) % cfg_.factor_update_every == 0) update_factors(gr, c0, c1, G);
    for (int64_t r0 = c0; r0 < c1 && !gr.factor.empty();) {  // the runs of blocks whose phase is due (consecutive)
      const auto phase_of = [&](int64_t i) { return blocks_[static_cast<size_t>(gr.blocks[static_cast<size_t>(i)])].phase; };
      int64_t r1 = r0 + 1;
      while (r1 < c1 && phase_of(r1) == phase_of(r0)) ++r1;
      if (due[static_cast<size_t>(phase_of(r0))]) {
        if (cfg_.preconditioner == Preconditioner::eigenvalue_corrected)
          compute_bases(gr, r0, r1, t);
        else
          compute_roots(gr, r0, r1, t);
      }
      r0 = r1;
    }

    // Filtered gradient.
    Tensor Mh = G;
    if (cfg_.beta1 > 0) {
      Tensor M = gr.filtered.slice(c0, c1);
      ops::lerp(M, G, 1.0 - cfg_.beta1, M);
      Mh = M;
      if (cfg_.use_bias_correction) {
        Mh = rows(sc_a_, Bc, n);
        ops::scale(M, 1.0 / (1.0 - std::pow(cfg_.beta1, static_cast<double>(t))), Mh);
      }
    }
    // Grafting direction.
    Tensor Dg = Mh;
    if (gr.graft.defined()) {
      Tensor A = gr.graft.slice(c0, c1);
      Tensor S = rows(sc_b_, Bc, n);
      ops::mul(G, G, S);
      if (cfg_.grafting == Grafting::adagrad)
        ops::add(A, S, A);
      else
        ops::lerp(A, S, 1.0 - cfg_.grafting_beta2, A);
      if (cfg_.grafting == Grafting::adam) {
        ops::scale(A, 1.0 / (1.0 - std::pow(cfg_.grafting_beta2, static_cast<double>(t))), S);
        ops::sqrt(S, S);
      } else {
        ops::sqrt(A, S);
      }
      ops::add_scalar(S, cfg_.grafting_epsilon, S);
      ops::div(Mh, S, S);
      Dg = S;
    }
    Tensor dst = recv_.slice(my_offset_ + gr.send_offset + c0 * n, my_offset_ + gr.send_offset + c1 * n).reshape({Bc, n});
    Tensor T = cfg_.momentum > 0 ? rows(sc_e_, Bc, n) : dst;
    Tensor P;  // the preconditioned direction; undefined: the grafting direction alone
    if (gr.diagonal) {  // the grafting direction alone
    } else if (cfg_.preconditioner == Preconditioner::spectral) {
      P = orthogonalize(gr, Bc, Mh);
    } else if (cfg_.preconditioner == Preconditioner::eigenvalue_corrected) {
      update_corrected(gr, c0, c1, G);
      if (precond || cfg_.grafting == Grafting::none) P = corrected_direction(gr, c0, c1, Mh, t);
    } else if (precond) {
      P = modes(gr, c0, c1, gr.root, Mh, false, sc_c_, sc_d_);
    }
    if (!P.defined()) {
      copy_into(T, Dg);
    } else if (cfg_.grafting == Grafting::none) {
      copy_into(T, P);
    } else {
      // Per block: D = P * ||Dg|| / ||P||, the scale broadcast over the block by an outer
      // product with ones (exact: one term per element).
      Tensor ng = sc_ng_.slice(0, Bc), np = sc_np_.slice(0, Bc);
      ops::reduce(ops::Reduce::norm2, ops::Axis::rows, Dg, ng);
      ops::reduce(ops::Reduce::norm2, ops::Axis::rows, P, np);
      ops::clamp(np, std::numeric_limits<float>::min(), std::numeric_limits<double>::infinity(), np);
      ops::div(ng, np, ng);
      Tensor S = rows(sc_b_, Bc, n);
      ops::gemm(false, false, 1.0, ng.reshape({Bc, 1}), ones_.slice(0, n).reshape({1, n}), 0.0, S);
      ops::mul(P, S, T);
    }
    if (cfg_.weight_decay > 0 && cfg_.weight_decay_type == WeightDecayType::decoupled) {  // D += wd W, before momentum
      Tensor W = rows(sc_b_, Bc, n);
      extract(gr, c0, c1, params, W, true);
      ops::axpy(cfg_.weight_decay, W, T);
    }
    if (cfg_.momentum > 0) {
      ops::fill(dst, 0.0);
      Tensor mom = gr.momentum.slice(c0, c1);
      ops::sgd_step(dst, T, mom, -1.0, cfg_.momentum, 0.0, cfg_.nesterov);  // dst = 0 + D
    }
  }

  // The blocks [c0, c1) of the parameters' gradients (values: their values) into G's rows.
  void extract(const Group& gr, int64_t c0, int64_t c1, const std::vector<nn::Param>& params, Tensor& G, bool values) {
    const int64_t n = gr.n;
    Tensor flat = G.flatten();
    for (const auto& run : gr.runs) {
      const int64_t lo = std::max(run.b0, c0), hi = std::min(run.b1, c1);
      if (lo >= hi) continue;
      const nn::Param& pr = params[static_cast<size_t>(run.param)];
      const Tensor src = sharded_ ? (values ? gathered_values_ : gathered_grads_) : (values ? pr.value : pr.grad).flatten();
      if (run.index.defined()) {
        Tensor out = flat.slice((lo - c0) * n, (hi - c0) * n);
        ops::gather(src, run.index.slice((lo - run.b0) * n, (hi - run.b0) * n), out);
      } else {
        for (int64_t i = lo; i < hi; ++i) {
          const BlockDesc& b = blocks_[static_cast<size_t>(gr.blocks[static_cast<size_t>(i)])];
          copy_into(flat.slice((i - c0) * n, (i - c0 + 1) * n), src.slice(b.start, b.start + n));
        }
      }
    }
  }

  void update_factors(Group& gr, int64_t c0, int64_t c1, const Tensor& G) {
    if (gr.order == 0) return;
    const int64_t Bc = c1 - c0, n = gr.n;
    Tensor X = G;
    if (fdtype_ == DType::f64) {
      X = rows(sc_g64_, Bc, n);
      ops::cast(G, X);
    }
    const double alpha = cfg_.beta2 == 1 ? 1.0 : 1.0 - cfg_.beta2, beta = cfg_.beta2;
    const auto& d = gr.dims;
    if (gr.order == 1) {
      const Tensor v = X.reshape({Bc, n, 1});
      Tensor F = gr.factor[0].slice(c0, c1);
      ops::syrk(false, alpha, v, beta, F);
    } else if (gr.order == 2) {
      const Tensor m = X.reshape({Bc, d[0], d[1]});
      Tensor F0 = gr.factor[0].slice(c0, c1), F1 = gr.factor[1].slice(c0, c1);
      ops::syrk(false, alpha, m, beta, F0);
      ops::syrk(true, alpha, m, beta, F1);
    } else {
      // Unfold along dim k by rotating the dims: [b_k, rest] -> [rest, b_k] = [b_{k+1}, ...].
      Tensor cur = X;
      for (int k = 0; k < gr.order; ++k) {
        const int64_t b = d[static_cast<size_t>(k)];
        const Tensor m = cur.reshape({Bc, b, n / b});
        Tensor F = gr.factor[static_cast<size_t>(k)].slice(c0, c1);
        ops::syrk(false, alpha, m, beta, F);
        if (k + 1 < gr.order) {
          Tensor& buf = fdtype_ == DType::f64 ? (k % 2 ? sc_d64_ : sc_c64_) : (k % 2 ? sc_d_ : sc_c_);
          Tensor next = buf.slice(0, Bc * n);
          ops::gather(cur.flatten(), gr.rotate[static_cast<size_t>(k)].slice(0, Bc * n), next);
          cur = next;
        }
      }
    }
  }

  // X x_0 M_0 ... x_{K-1} M_{K-1} (mode products with the chunk's matrices M_k = mats[k]; back:
  // with M_k^T): each product contracts the leading dim and appends the new one at the end, so
  // after K products the dims are back in order. With M_k = Q_k (columns: a basis), back = false
  // gives the coordinates in the bases (Q_k^T on every mode) and back = true returns from them.
  // The products alternate between buf0 and buf1 (neither may hold X).
  Tensor modes(const Group& gr, int64_t c0, int64_t c1, const std::vector<Tensor>& mats, const Tensor& X0, bool back,
               const Tensor& buf0, const Tensor& buf1) {
    const int64_t Bc = c1 - c0, n = gr.n;
    Tensor X = X0;
    for (int k = 0; k < gr.order; ++k) {
      const int64_t b = gr.dims[static_cast<size_t>(k)];
      Tensor Y = (k % 2 ? buf1 : buf0).slice(0, Bc * n).reshape({Bc, n / b, b});
      ops::gemm(true, back, 1.0, X.reshape({Bc, b, n / b}), mats[static_cast<size_t>(k)].slice(c0, c1), 0.0, Y);
      X = Y;
    }
    return X.reshape({Bc, n});
  }

  // eigenvalue-corrected: V = b V + (1 - b) (G in the bases)^2, every step (b = 1: the sum).
  void update_corrected(Group& gr, int64_t c0, int64_t c1, const Tensor& G) {
    const int64_t Bc = c1 - c0, n = gr.n;
    Tensor Gr = rows(sc_c_, Bc, n);
    if (gr.order == 0)
      copy_into(Gr, G);
    else
      Gr = modes(gr, c0, c1, gr.basis, G, false, sc_c_, sc_d_);
    ops::mul(Gr, Gr, Gr);
    Tensor V = gr.corrected.slice(c0, c1);
    if (ec_beta2_ == 1)
      ops::add(V, Gr, V);
    else
      ops::lerp(V, Gr, 1.0 - ec_beta2_, V);
  }

  // eigenvalue-corrected: Q [(Mh in the bases) / (sqrt(V / bc2) + e)] (back from the bases).
  Tensor corrected_direction(Group& gr, int64_t c0, int64_t c1, const Tensor& Mh, int64_t t) {
    const int64_t Bc = c1 - c0, n = gr.n;
    Tensor Pr = rows(sc_c_, Bc, n);
    if (gr.order == 0)
      copy_into(Pr, Mh);
    else
      Pr = modes(gr, c0, c1, gr.basis, Mh, false, sc_c_, sc_d_);
    const bool correct = cfg_.use_bias_correction && ec_beta2_ < 1;
    Tensor den = rows(sc_x_, Bc, n);
    ops::scale(gr.corrected.slice(c0, c1), correct ? 1.0 / (1.0 - std::pow(ec_beta2_, static_cast<double>(t))) : 1.0, den);
    ops::sqrt(den, den);
    ops::add_scalar(den, ec_epsilon_, den);
    ops::div(Pr, den, Pr);
    if (gr.order == 0) return Pr;
    return modes(gr, c0, c1, gr.basis, Pr, true, sc_x_, sc_y_);
  }

  // spectral: s U V^T of each block Mh [r, c] of the chunk (Newton-Schulz or exact).
  Tensor orthogonalize(const Group& gr, int64_t Bc, const Tensor& M) {
    const int64_t r = gr.dims[0], c = gr.dims[1], n = gr.n;
    const bool tall = r > c;  // then X^T X and X B: the reference's transposed iteration, mirrored
    const int64_t m = tall ? c : r;
    Tensor X = rows(sc_x_, Bc, n), Y = rows(sc_y_, Bc, n);
    double scale = 1.0;
    if (cfg_.spectral_scale == SpectralScale::muon) scale = std::sqrt(std::max(1.0, static_cast<double>(r) / c));
    if (cfg_.spectral_scale == SpectralScale::rms) scale = 0.2 * std::sqrt(static_cast<double>(std::max(r, c)));
    if (cfg_.spectral_method == SpectralMethod::exact && orthogonalize_exact(Bc, r, c, M, X)) {
      ops::scale(X, scale, X);
      return X;
    }
    // X = M / max(||M||_F, 1e-8) per block, then X = a X + (b A + c A^2) X with A = X X^T.
    Tensor nr = sc_np_.slice(0, Bc), S = rows(sc_c_, Bc, n);
    ops::reduce(ops::Reduce::norm2, ops::Axis::rows, M, nr);
    ops::clamp(nr, 1e-8, std::numeric_limits<double>::infinity(), nr);
    ops::gemm(false, false, 1.0, nr.reshape({Bc, 1}), ones_.slice(0, n).reshape({1, n}), 0.0, S);
    ops::div(M, S, X);
    Tensor A = sc_c_.slice(0, Bc * m * m).reshape({Bc, m, m}), B = sc_d_.slice(0, Bc * m * m).reshape({Bc, m, m});
    constexpr double ka = 3.4445, kb = -4.7750, kc = 2.0315;  // Jordan et al.'s quintic
    for (int i = 0; i < cfg_.newton_schulz_steps; ++i) {
      const Tensor X3 = X.reshape({Bc, r, c});
      Tensor Y3 = Y.reshape({Bc, r, c});
      ops::gemm(tall, !tall, 1.0, X3, X3, 0.0, A);
      ops::gemm(false, false, kc, A, A, 0.0, B);
      ops::axpy(kb, A, B);
      ops::scale(X, ka, Y);
      if (tall)
        ops::gemm(false, false, 1.0, X3, B, 1.0, Y3);
      else
        ops::gemm(false, false, 1.0, B, X3, 1.0, Y3);
      std::swap(X, Y);
    }
    ops::scale(X, scale, X);
    return X;
  }

  // U V^T of each block of M [Bc, r, c] into out, in f64: X (X^T X)^(+1/2) (tall) or
  // (X X^T)^(+1/2) X, the pseudo-inverse root dropping singular values at or below about
  // sqrt(m eps) of the largest. False (out unspecified) when a block fails: Newton-Schulz then.
  bool orthogonalize_exact(int64_t Bc, int64_t r, int64_t c, const Tensor& M, Tensor& out) {
    const bool tall = r > c;
    const int64_t m = tall ? c : r;
    Tensor X = Tensor::empty({Bc, r, c}, DType::f64, device_), G = Tensor::empty({Bc, m, m}, DType::f64, device_);
    Tensor R = Tensor::empty({Bc, m, m}, DType::f64, device_), O = Tensor::empty({Bc, r, c}, DType::f64, device_);
    ops::cast(M.reshape({Bc, r, c}), X);
    ops::gemm(tall, !tall, 1.0, X, X, 0.0, G);
    ops::RootOptions o;
    o.method = RootMethod::pseudo_inverse;
    o.eps = 0;
    const std::vector<char> ok = ops::inverse_roots(G, 2.0, o, R);
    if (!std::all_of(ok.begin(), ok.end(), [](char v) { return v != 0; })) {
      if (!warned_exact_) spdlog::warn("shampoo: the exact orthogonalisation failed; Newton-Schulz iterations instead");
      warned_exact_ = true;
      return false;
    }
    if (tall)
      ops::gemm(false, false, 1.0, X, R, 0.0, O);
    else
      ops::gemm(false, false, 1.0, R, X, 0.0, O);
    Tensor o3 = out.reshape({Bc, r, c});
    ops::cast(O, o3);
    return true;
  }

  // The factors' bias correction: 1 / (1 - beta2^u), u the number of factor updates so far.
  double factor_correction(int64_t t) const {
    if (!cfg_.use_bias_correction || cfg_.beta2 >= 1) return 1.0;
    const int64_t u = (t - 1) / cfg_.factor_update_every + 1;
    return 1.0 / (1.0 - std::pow(cfg_.beta2, static_cast<double>(u)));
  }

  // eigenvalue-corrected: the bases of the chunk's bias-corrected factors (eigh, or qr warm-
  // started from the current bases, the first time from none: a full eigh). A block whose
  // computation fails is retried in f64, else keeps its bases.
  void compute_bases(Group& gr, int64_t c0, int64_t c1, int64_t t) {
    const ops::RootOptions o = root_options();
    const bool warm = o.method == RootMethod::qr && t != start_;
    amortized(gr, c0, c1, t, "eigenbasis", [&](int k, int64_t r0, const Tensor& Fc, std::vector<char>& failed) {
      const int64_t nb = Fc.dim(0), b = Fc.dim(1);
      Tensor Q = gr.basis[static_cast<size_t>(k)].slice(c0 + r0, c0 + r0 + nb);
      Tensor Qn = Tensor::zeros({nb, b, b}, fdtype_, device_);
      if (warm) ops::cast(Q, Qn);
      // A failed block: again in f64 from no basis (a full eigh, in the method's column order).
      take_or_retry(ops::eigenbases(Fc, o, Qn), Fc, Qn, Q, failed, r0,
                    [&](int64_t, const Tensor& Fd, Tensor& Qd) { return ops::eigenbases(Fd, o, Qd)[0] != 0; });
    });
  }

  // A batch's results out [nb, b, b] into dst (of the factors Fc [nb, b, b]), where ok says they
  // succeeded; a block i that failed is computed again alone in f64 by retry(i, F [1, b, b],
  // result [1, b, b], zeroed) and, if that fails too, keeps dst's block and is marked in failed
  // (from index r0).
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
      Tensor Fd = Tensor::empty({1, b, b}, DType::f64, device_), Rd = Tensor::zeros({1, b, b}, DType::f64, device_);
      ops::cast(Fc.slice(i, i + 1), Fd);
      if (retry(i, Fd, Rd))
        ops::cast(Rd.select(0), di);
      else
        failed[static_cast<size_t>(r0 + i)] = 1;
    }
  }

  // The amortized computation (roots or eigenbases) of the chunk's blocks [c0, c1): for every
  // factor k, in batches of bounded size, the bias-corrected factors Fc of a batch whose factors
  // are all finite go to compute(k, r0, Fc, failed) (r0: the batch's first block in the chunk;
  // it sets failed[r0 + i] for a block that keeps its previous result); then the failures are
  // counted (count_failures) and NaN or Inf recorded (nonfinite_factors).
  template <typename Compute>
  void amortized(Group& gr, int64_t c0, int64_t c1, int64_t t, const char* what, Compute&& compute) {
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
          Fc = Tensor::empty(F.shape(), fdtype_, device_);
          ops::scale(F, corr, Fc);
        }
        compute(k, r0, Fc, failed);
      }
    }
    count_failures(gr, c0, failed, nonfinite, t, what);
  }

  // A chunk's factors F (blocks [c, c + nb) of the group) with NaN or Inf: marked (from index
  // at in nonfinite) and recorded for agree_and_raise; true when there is one.
  bool nonfinite_factors(const Group& gr, int64_t c, const Tensor& F, int k, std::vector<char>& nonfinite, int64_t at) {
    if (ops::count_nonfinite(F) == 0) return false;
    for (int64_t i = 0; i < F.dim(0); ++i)
      if (ops::count_nonfinite(F.select(i)) > 0) {
        nonfinite[static_cast<size_t>(at + i)] = 1;
        nan_code_ = std::min(nan_code_, encode(gr.blocks[static_cast<size_t>(c + i)], k));
      }
    return true;  // an error on every rank follows (agree_and_raise)
  }

  double root_exponent(int order) const { return cfg_.exponent_override > 0 ? cfg_.exponent_override : 2.0 * order; }

  // Roots of the chunk's factors (amortized: failures per block counted, fatal conditions
  // recorded). A block whose root fails is retried in f64, else keeps its previous root.
  void compute_roots(Group& gr, int64_t c0, int64_t c1, int64_t t) {
    const double p = root_exponent(gr.order);
    amortized(gr, c0, c1, t, "inverse root", [&](int k, int64_t r0, const Tensor& Fc, std::vector<char>& failed) {
      const int64_t nb = Fc.dim(0), b = Fc.dim(1);
      Tensor out = Tensor::empty({nb, b, b}, fdtype_, device_);
      Tensor Q;  // qr: the kept bases (a failed block's is zeroed: it restarts from a full eigh)
      if (cfg_.root_method == RootMethod::qr) Q = gr.basis[static_cast<size_t>(k)].slice(c0 + r0, c0 + r0 + nb);
      const std::vector<char> ok = ops::inverse_roots(Fc, p, root_options(), out, Q.defined() ? &Q : nullptr);
      Tensor R = gr.root[static_cast<size_t>(k)].slice(c0 + r0, c0 + r0 + nb);
      // A failed block: again in f64 by an eigendecomposition with the same rule (the
      // pseudo-inverse's, or epsilon and the shift); qr's from no basis (a full eigh), whose
      // basis is kept for the next warm start, as that of a block that had not failed.
      ops::RootOptions o64 = root_options();
      if (o64.method != RootMethod::pseudo_inverse && o64.method != RootMethod::qr) o64.method = RootMethod::eigh;
      take_or_retry(ok, Fc, out, R, failed, r0, [&](int64_t i, const Tensor& Fd, Tensor& Od) {
        if (o64.method != RootMethod::qr) return ops::inverse_roots(Fd, p, o64, Od)[0] != 0;
        Tensor Bd = Tensor::zeros(Fd.shape(), DType::f64, device_);
        if (ops::inverse_roots(Fd, p, o64, Od, &Bd)[0] == 0) return false;
        Tensor Qi = Q.select(i);
        ops::cast(Bd.select(0), Qi);
        return true;
      });
      // Exactly symmetric (V diag V^T is so only to rounding), as checkpoints store it packed.
      ops::symmetrize(R);
    });
  }

  // Consecutive failures per block of the chunk at c0: reset on success; the kMaxFailures-th is
  // recorded for agree_and_raise, earlier ones warned about.
  void count_failures(Group& gr, int64_t c0, const std::vector<char>& failed, const std::vector<char>& nonfinite,
                      int64_t t, const char* what) {
    const int64_t Bc = static_cast<int64_t>(failed.size());
    int64_t* fails = gr.failures.ptr<int64_t>();
    for (int64_t i = 0; i < Bc; ++i) {
      if (nonfinite[static_cast<size_t>(i)]) continue;
      int64_t& f = fails[c0 + i];
      if (!failed[static_cast<size_t>(i)]) {
        f = 0;
        continue;
      }
      ++f;
      const int bi = gr.blocks[static_cast<size_t>(c0 + i)];
      if (f >= kMaxFailures) {
        fatal_code_ = std::min(fatal_code_, encode(bi, 0));
      } else {
        spdlog::warn("shampoo: the {} of {} failed at step {} (failure {} in a row); it keeps its previous one", what,
                     block_label(bi), t, f);
      }
    }
  }

  // The batched roots of ops::inverse_roots in the factor dtype, by root_method.
  ops::RootOptions root_options() const {
    ops::RootOptions o;
    o.method = cfg_.root_method;
    o.eps = cfg_.epsilon;
    o.max_iters = cfg_.newton_max_iters;
    o.tolerance = cfg_.newton_tolerance;
    o.qr_max_iterations = cfg_.qr_max_iterations;
    o.qr_tolerance = cfg_.qr_tolerance;
    o.rank_rtol = cfg_.rank_rtol;
    o.rank_atol = cfg_.rank_atol;
    if (o.method == RootMethod::pseudo_inverse) o.eps = 0;  // the rank cutoff replaces it
    return o;
  }

  static int64_t encode(int block, int k) { return static_cast<int64_t>(block) * 1024 + k; }

  std::string block_label(int bi) const {
    const BlockDesc& b = blocks_[static_cast<size_t>(bi)];
    const auto p = static_cast<size_t>(b.param);
    return fmt::format("block {} {} of parameter '{}' {}", b.index, shape_str(b.dims), names_[p], shape_str(shapes_[p]));
  }

  // Every rank of the group learns the first fatal condition, so that all raise the same error.
  void agree_and_raise(int64_t t) {
    int64_t codes[2] = {nan_code_, fatal_code_};
    if (group_size_ > 1) {
      agree_.copy_from(Tensor::from_host(codes, {2}, DType::i64));
      comm::Buffer buf{agree_.data(), 2, DType::i64, device_};
      group_->all_reduce(buf, buf, comm::ReduceOp::min, comm::Mode::sync).wait();
      const Tensor host = agree_.to(Device::cpu());
      codes[0] = host.ptr<int64_t>()[0];
      codes[1] = host.ptr<int64_t>()[1];
    }
    constexpr int64_t none = std::numeric_limits<int64_t>::max();
    if (codes[0] != none) {
      const int bi = static_cast<int>(codes[0] / 1024), k = static_cast<int>(codes[0] % 1024);
      const BlockDesc& b = blocks_[static_cast<size_t>(bi)];
      fail("shampoo: the Kronecker factor {} of {} holds NaN or Inf at step {}: the gradients of parameter '{}' were "
           "not finite. Check the loss and the data, lower the learning rate, or clip the gradients",
           k, block_label(bi), t, names_[static_cast<size_t>(b.param)]);
    }
    if (codes[1] != none)
      fail("shampoo: the {} of {} failed {} times in a row (step {}): its factors are too ill-conditioned; "
           "raise epsilon (now {}) or use factor_dtype f64",
           cfg_.preconditioner == Preconditioner::eigenvalue_corrected ? "eigenbasis" : "inverse root",
           block_label(static_cast<int>(codes[1] / 1024)), kMaxFailures, t, nlohmann::json(cfg_.epsilon).dump());
  }

  void communicate() {
    if (total_ == 0) return;
    const size_t mine = counts_[static_cast<size_t>(group_rank_)];
    if (bf16_) {
      Tensor my32 = recv_.slice(my_offset_, my_offset_ + static_cast<int64_t>(mine));
      Tensor my16 = recv16_.slice(my_offset_, my_offset_ + static_cast<int64_t>(mine));
      if (mine) ops::cast(my32, my16);
      if (group_size_ > 1) {
        comm::Buffer all{recv16_.data(), static_cast<size_t>(total_), DType::bf16, device_};
        group_->all_gather_v(all.slice(static_cast<size_t>(my_offset_), mine), all, counts_, comm::Mode::sync).wait();
      }
      Tensor all16 = recv16_.slice(0, total_), all32 = recv_.slice(0, total_);
      ops::cast(all16, all32);  // every rank applies the same rounded directions
    } else if (group_size_ > 1) {
      comm::Buffer all{recv_.data(), static_cast<size_t>(total_), DType::f32, device_};
      group_->all_gather_v(all.slice(static_cast<size_t>(my_offset_), mine), all, counts_, comm::Mode::sync).wait();
    }
  }

  void apply(std::vector<nn::Param>& params, double lr) {
    for (size_t p = 0; p < params.size(); ++p) {
      Tensor value = params[p].value.flatten();
      if (value.numel() == 0) continue;
      const ParamUpdate& u = updates_[p];
      if (u.index.defined()) {
        for (int64_t e0 = 0; e0 < value.numel(); e0 += kChunkElements) {
          const int64_t e1 = std::min(value.numel(), e0 + kChunkElements);
          Tensor tmp = sc_upd_.slice(0, e1 - e0);
          ops::gather(recv_, u.index.slice(e0, e1), tmp);
          Tensor part = value.slice(e0, e1);
          ops::axpy(-lr, tmp, part);
        }
      } else {
        for (const auto& s : u.segments) {
          Tensor part = value.slice(s[0], s[0] + s[2]);
          ops::axpy(-lr, recv_.slice(s[1], s[1] + s[2]), part);
        }
      }
    }
  }

  ShampooConfig cfg_;
  std::shared_ptr<comm::Communicator> group_holder_;
  comm::Communicator* group_ = nullptr;
  int group_size_ = 1, group_rank_ = 0;
  bool in_group0_ = true;
  // Sharded parameters (rows_): the blocks are the whole parameters' blocks; every step gathers
  // the shards' gradients (and weights, with weight decay) over shard_comm_ (build_gather).
  bool sharded_ = false;
  std::vector<Rows> rows_;
  comm::Communicator* shard_comm_ = nullptr;
  std::vector<size_t> gather_counts_;                // elements per rank of the shard group
  std::vector<std::vector<int64_t>> gathered_at_;    // construction only
  Tensor gathered_grads_, gathered_values_;
  std::vector<Shape> local_shapes_;                  // the parameters as step() takes them
  int64_t start_ = 1;
  DType fdtype_ = DType::f32;
  double ec_beta2_ = 0, ec_epsilon_ = 0;  // eigenvalue-corrected: the resolved decay and epsilon
  bool warned_exact_ = false;
  bool bf16_ = false;
  Device device_{};

  std::vector<std::string> names_;
  std::vector<Shape> shapes_, merged_;
  std::vector<BlockDesc> blocks_;
  std::unordered_map<std::string, int> prefix_to_block_;
  std::vector<std::pair<int, int64_t>> where_;  // block -> (group, index in it), group -1: not held
  std::vector<Group> groups_;
  std::vector<ParamUpdate> updates_;
  std::vector<size_t> counts_;  // elements per rank of the group
  int64_t my_offset_ = 0, total_ = 0;

  Tensor step_;  // i64 [1] on the host
  Tensor recv_, recv16_, agree_;
  Tensor sc_grad_, sc_a_, sc_b_, sc_c_, sc_d_, sc_e_, sc_x_, sc_y_, sc_g64_, sc_c64_, sc_d64_, sc_ng_, sc_np_, ones_, sc_upd_;
  int64_t nan_code_ = 0, fatal_code_ = 0;
};

}  // namespace

std::unique_ptr<Optimizer> make_shampoo(const ShampooConfig& cfg, const std::vector<nn::Param>& params,
                                        comm::Communicator& comm, const std::vector<Rows>& rows) {
  return std::make_unique<Shampoo>(cfg, params, comm, rows);
}

}  // namespace dtk::optim
