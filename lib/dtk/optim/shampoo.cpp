// Distributed Shampoo (shampoo.h), the driver: the blocks, their owners and layout, the chunks,
// grafting, weight decay, momentum and the all-gather of the directions; a block's preconditioned
// direction is its preconditioner's (shampoo_internal.h). The blocks this rank owns are grouped
// by (diagonal or not, block shape) (std::map order: deterministic); a group keeps its state as
// batches ([B, b_k, b_k] factors and roots, [B, n] grafting / filtered / momentum tensors), so
// that one batched GEMM (one batched eigendecomposition at root steps) serves every block of
// the group, processed in chunks of at most kChunkElements elements (bounded scratch).
//
// Every step, per chunk: the gradient blocks are gathered into a contiguous scratch (through a
// precomputed index, or plain copies for blocks that are contiguous ranges of their parameter;
// sharded parameters: from the gathered shards); the preconditioner's statistics are updated
// (and at root steps its amortized work for the blocks whose phase is due); the filtered
// gradient, the grafting direction and the preconditioned direction are computed, and the
// search direction is written straight into this rank's segment of the flat gathered buffer.
// One all_gather_v gives every rank all directions, in rank order; each parameter then takes
// its direction through a gather index (or contiguous segments).
//
// Memory on every rank, beyond the owned state: the gathered buffer (4 bytes per parameter
// element, plus 2 with bf16 communication) and the update indices (8 bytes per element of
// parameters whose blocks are not contiguous ranges of them; with sharded parameters, of the
// rank's rows, and the gathered shards' 4 bytes per element and their index's 8).
#include "dtk/optim/shampoo.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/ops/ops.h"
#include "dtk/optim/shampoo_internal.h"

namespace dtk::optim {
namespace {

using namespace shampoo;

struct ParamUpdate {
  std::vector<std::array<int64_t, 3>> segments;  // (param start, gathered start, length)
  Tensor index;                                   // [numel] positions in the gathered buffer
};

class Shampoo final : public Optimizer {
 public:
  Shampoo(const ShampooConfig& cfg, const std::vector<nn::Param>& params, comm::Communicator& comm,
          const std::vector<Rows>& rows, comm::Communicator* replicas) {
    cx_.cfg = cfg;
    sharded_ = std::any_of(rows.begin(), rows.end(), [](const Rows& r) { return !r.offsets.empty(); });
    if (sharded_) rows_ = rows;
    cx_.cfg.validate();
    if (sharded_) check_shards(params, comm);
    cx_.start = cx_.cfg.start_preconditioning_step == -1 ? cx_.cfg.precondition_frequency : cx_.cfg.start_preconditioning_step;
    cx_.ec_beta2 = cx_.cfg.ec_beta2 < 0 ? cx_.cfg.beta2 : cx_.cfg.ec_beta2;
    cx_.ec_epsilon = cx_.cfg.ec_epsilon < 0 ? cx_.cfg.epsilon : cx_.cfg.ec_epsilon;
    bf16_ = cx_.cfg.communication_dtype == DType::bf16;
    // dion: every block is diagonal (its matrices are not blocks), so the root's is never asked.
    pre_ = cx_.cfg.preconditioner == Preconditioner::spectral               ? make_spectral(cx_)
           : cx_.cfg.preconditioner == Preconditioner::eigenvalue_corrected ? make_corrected(cx_)
                                                                            : make_root(cx_);
    check_and_record(params);
    // Groups of g consecutive ranks.
    const int world = comm.size(), rank = comm.rank();
    const int g = cx_.cfg.trainers_per_group == 0 ? world : cx_.cfg.trainers_per_group;
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
    if (group_size_ > 1 && !group_->accepts(cx_.device))
      fail_usage("shampoo: the communicator (" + std::string(comm::backend_name(group_->backend())) +
                 ") does not accept buffers on " + cx_.device.str() + ", where the parameters live");
    build_blocks(params);
    build_layout();
    allocate_groups();
    build_updates(params);
    if (sharded_) build_gather();
    std::vector<int> which;
    for (size_t p = 0; p < dion_.size(); ++p)
      if (dion_[p]) which.push_back(static_cast<int>(p));
    if (!which.empty()) {
      // dion_sync factors: each replica's own gradients, aggregated by Dion.
      if (cx_.cfg.dion_sync != DionSync::factors) replicas = nullptr;
      dion_mats_ = std::make_unique<Dion>(cx_, params, std::move(which), replicas, sharded_ ? &comm : nullptr, rows_);
    }
  }

  // The config, and what the preconditioner adds to describe its state's layout.
  nlohmann::json config() const override {
    nlohmann::json j = cx_.cfg;
    pre_->describe(j);
    return j;
  }
  std::string restored(const nlohmann::json& saved) override { return pre_->restored(groups_, saved); }
  std::string_view component_name() const override { return "shampoo"; }

  // Its blocks (parameter, index, shape, the rank of the group that owns it, its root phase,
  // diagonal: the grafting direction alone) and the elements each rank of a group computes.
  nlohmann::json plan() const override {
    nlohmann::json blocks = nlohmann::json::array();
    for (const BlockDesc& b : cx_.blocks)
      blocks.push_back({{"param", cx_.names[static_cast<size_t>(b.param)]}, {"block", b.index}, {"shape", b.dims},
                        {"owner", b.owner}, {"phase", b.phase}, {"diagonal", b.diagonal}});
    nlohmann::json out = {{"preconditioner", cx_.cfg.preconditioner}, {"group_size", group_size_},
                          {"elements_per_rank", counts_}, {"blocks", std::move(blocks)}};
    if (dion_mats_) out["dion"] = {{"sync", cx_.cfg.dion_sync}, {"matrices", dion_mats_->plan()}};
    return out;
  }

  // Blocks of sharded parameters that an older fsdp-train cut from the shards (Resize::if_present).
  std::string restore_note(Restored outcome, const RestoreSource& from) const override {
    if (outcome != Restored::fresh || !sharded_) return "";
    return from.path + ": its Shampoo blocks were cut from the shards (fsdp-train before the whole parameters' "
                       "blocks, dtk-checkpoint(5)), so Shampoo starts afresh";
  }

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
    for (size_t bi = 0; bi < cx_.blocks.size(); ++bi) {
      const auto& [gi, i] = where_[bi];
      if (gi < 0) continue;
      Group& gr = groups_[static_cast<size_t>(gi)];
      const BlockDesc& b = cx_.blocks[bi];
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
    if (dion_mats_)
      for (PlacedTensor& t : dion_mats_->state()) s.push_back(std::move(t));
    s.push_back({"step", step_});
    return s;
  }

  // Dion's buffers of sharded parameters, one per replica group: their mean (collective).
  std::vector<PlacedTensor> saved_state() override {
    if (dion_mats_) dion_mats_->before_save();
    return state();
  }

  // optim_comm_bytes: the payload this rank put into the optimizer's collectives in the last step.
  void metrics(nlohmann::ordered_json& m) const override { m["optim_comm_bytes"] = last_bytes_; }

  void step(std::vector<nn::Param>& params, double lr) override {
    if (params.size() != cx_.shapes.size())
      fail_usage("shampoo: step got {} parameters, the optimizer was built for {}", params.size(), cx_.shapes.size());
    for (size_t i = 0; i < params.size(); ++i)
      if (params[i].value.shape() != local_shapes_[i] || params[i].grad.shape() != local_shapes_[i] ||
          params[i].value.device() != cx_.device || params[i].grad.device() != cx_.device)
        fail_usage("shampoo: parameter " + params[i].name + " is " + params[i].value.str() +
                   ", the optimizer was built for f32" + shape_str(local_shapes_[i]) + " on " + cx_.device.str());
    if (!std::isfinite(lr)) fail_usage("shampoo: the learning rate is not finite");
    const int64_t t = ++*step_.ptr<int64_t>();
    const bool precond = t >= cx_.start;
    const bool no_roots = cx_.cfg.preconditioner == Preconditioner::spectral || cx_.cfg.preconditioner == Preconditioner::dion;
    // The reference's rule: at the start step, then at every multiple of the frequency after it;
    // phase j of root_spread S at the multiples shifted by j floor(f / S).
    const int64_t f = cx_.cfg.precondition_frequency, shift = f / cx_.cfg.root_spread;
    std::vector<char> due(static_cast<size_t>(cx_.cfg.root_spread));
    bool root_step = false;
    for (int64_t j = 0; j < cx_.cfg.root_spread; ++j) {
      due[static_cast<size_t>(j)] = !no_roots && (t == cx_.start || (t > cx_.start && (t - j * shift) % f == 0));
      root_step = root_step || due[static_cast<size_t>(j)];
    }
    cx_.nan_code = cx_.fatal_code = std::numeric_limits<int64_t>::max();
    last_bytes_ = 0;
    if (sharded_) {  // every block whole on its owner: the shards' gradients (and weights) gathered
      gather_shards(params, false, gathered_grads_);
      if (cx_.cfg.weight_decay > 0) gather_shards(params, true, gathered_values_);
    }

    for (auto& gr : groups_)
      for (int64_t c0 = 0; c0 < static_cast<int64_t>(gr.blocks.size()); c0 += gr.chunk)
        process_chunk(gr, c0, std::min<int64_t>(c0 + gr.chunk, static_cast<int64_t>(gr.blocks.size())), params, t,
                      precond, due);

    if (root_step) agree_and_raise(t);
    communicate();
    apply(params, lr);
    if (dion_mats_) {
      dion_mats_->step(params, lr);
      last_bytes_ += dion_mats_->bytes_sent();
    }
  }

 private:
  // ---------------------------------------------------------------- construction
  void check_and_record(const std::vector<nn::Param>& params) {
    if (!params.empty()) cx_.device = params[0].value.device();
    for (const auto& p : params) {
      if (!p.value.defined() || !p.grad.defined()) fail_usage("shampoo: parameter " + p.name + " has no value or gradient");
      if (p.value.dtype() != DType::f32 || p.grad.dtype() != DType::f32)
        fail_usage("shampoo: parameter " + p.name + " must be f32 (value and gradient), got " + p.value.str());
      if (p.value.device() != cx_.device || p.grad.device() != cx_.device)
        fail_usage("shampoo: every parameter must live on one device; " + p.name + " is on " + p.value.device().str() +
                   ", " + params[0].name + " on " + cx_.device.str());
      if (p.grad.shape() != p.value.shape())
        fail_usage("shampoo: the gradient of " + p.name + " is " + p.grad.str() + ", the value " + p.value.str());
      cx_.names.push_back(p.name);
      cx_.shapes.push_back(p.value.shape());
    }
    local_shapes_ = cx_.shapes;
    for (size_t i = 0; i < rows_.size() && i < cx_.shapes.size(); ++i)
      if (!rows_[i].offsets.empty()) cx_.shapes[i] = rows_[i].shape;  // blocks of the whole parameters
    step_ = Tensor::zeros({1}, DType::i64);
  }

  void build_blocks(const std::vector<nn::Param>& params) {
    std::vector<int64_t> sizes;
    for (size_t pi = 0; pi < params.size(); ++pi) {
      const bool spectral = cx_.cfg.preconditioner == Preconditioner::spectral;
      const ShampooBlocking bl = shampoo_blocking(cx_.shapes[pi], cx_.cfg.max_preconditioner_dim, spectral);
      const bool diagonal = named_diagonal(cx_.cfg, params[pi].name);
      merged_.push_back(bl.merged);
      dion_.push_back(dion_matrix(cx_.cfg, params[pi].name, cx_.shapes[pi]) ? 1 : 0);
      if (dion_.back()) continue;  // not blocks: Dion's matrices (shampoo_dion.cpp)
      for (size_t i = 0; i < bl.block_shapes.size(); ++i) {
        BlockDesc b;
        b.param = static_cast<int>(pi);
        b.index = static_cast<int>(i);
        b.dims = bl.block_shapes[i];
        b.offset = bl.offsets[i];
        b.numel = shape_numel(b.dims);
        b.diagonal = diagonal || (spectral && b.dims.size() != 2) || cx_.cfg.preconditioner == Preconditioner::dion;
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
        if (!prefix_to_block_.emplace(b.prefix, static_cast<int>(cx_.blocks.size())).second)
          fail_usage("shampoo: two parameters are named '" + params[pi].name + "'");
        sizes.push_back(b.numel);
        cx_.blocks.push_back(std::move(b));
      }
    }
    // Phases, then the ranks within each phase (one phase: the plain assignment).
    std::vector<Shape> dims;  // for the root costs (a diagonal block has none)
    for (const BlockDesc& b : cx_.blocks) dims.push_back(b.diagonal ? Shape{} : b.dims);
    const std::vector<int> phases = shampoo_root_phases(dims, cx_.cfg.root_spread);
    for (int j = 0; j < cx_.cfg.root_spread; ++j) {
      std::vector<size_t> members;
      std::vector<int64_t> member_sizes;
      for (size_t i = 0; i < cx_.blocks.size(); ++i)
        if (phases[i] == j) {
          members.push_back(i);
          member_sizes.push_back(sizes[i]);
        }
      const std::vector<int> owners = shampoo_assign(member_sizes, group_size_);
      for (size_t m = 0; m < members.size(); ++m) {
        cx_.blocks[members[m]].owner = owners[m];
        cx_.blocks[members[m]].phase = j;
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
    std::vector<size_t> counts(static_cast<size_t>(S), 0);
    std::vector<std::vector<int64_t>> base(static_cast<size_t>(S));  // [rank][param]
    int64_t pos = 0;
    for (int q = 0; q < S; ++q) {
      for (size_t p = 0; p < rows_.size(); ++p) {
        base[static_cast<size_t>(q)].push_back(pos);
        const Rows& r = rows_[p];
        const int64_t row = r.shape[0] == 0 ? 0 : shape_numel(r.shape) / r.shape[0];
        const int64_t n = dion_[p] ? 0 : r.lengths[static_cast<size_t>(q)] * row;  // Dion's stay on their shards
        pos += n;
        counts[static_cast<size_t>(q)] += static_cast<size_t>(n);
      }
    }
    segments_ = RankSegments(std::move(counts));
    gathered_grads_ = Tensor::empty({std::max<int64_t>(pos, 1)}, DType::f32, cx_.device);
    if (cx_.cfg.weight_decay > 0) gathered_values_ = Tensor::empty({std::max<int64_t>(pos, 1)}, DType::f32, cx_.device);
    gathered_at_.resize(rows_.size());
    for (size_t p = 0; p < rows_.size(); ++p) {
      if (dion_[p]) continue;
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
          block_elements(merged_[static_cast<size_t>(run.param)], cx_.blocks[static_cast<size_t>(gr.blocks[static_cast<size_t>(q)])], idx);
        for (int64_t& e : idx) e = gathered_at_[static_cast<size_t>(run.param)][static_cast<size_t>(e)];
        run.index = upload_i64(idx, cx_.device);
      }
    gathered_at_.clear();
    gathered_at_.shrink_to_fit();
  }

  // This rank's rows of every parameter's gradient (values: weight) packed, then gathered from
  // every rank of the shard group into out.
  void gather_shards(const std::vector<nn::Param>& params, bool values, Tensor& out) {
    auto at = static_cast<int64_t>(segments_.at[static_cast<size_t>(shard_comm_->rank())]);
    for (size_t i = 0; i < params.size(); ++i) {
      if (dion_[i]) continue;
      const Tensor src = (values ? params[i].value : params[i].grad).flatten();
      copy_into(out.slice(at, at + src.numel()), src);
      at += src.numel();
    }
    last_bytes_ += segments_.all_gather(*shard_comm_, out);
  }

  // Every rank's segment: its blocks grouped by shape (map order), by root phase and then
  // ascending within a group (a phase's blocks are consecutive: one batch at its root steps).
  void build_layout() {
    std::vector<std::map<std::pair<bool, Shape>, std::vector<int>>> per_rank(static_cast<size_t>(group_size_));
    for (int j = 0; j < cx_.cfg.root_spread; ++j)
      for (size_t i = 0; i < cx_.blocks.size(); ++i)
        if (cx_.blocks[i].phase == j)
          per_rank[static_cast<size_t>(cx_.blocks[i].owner)][{cx_.blocks[i].diagonal, cx_.blocks[i].dims}].push_back(static_cast<int>(i));
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
          cx_.blocks[static_cast<size_t>(bi)].recv_offset = pos;
          pos += cx_.blocks[static_cast<size_t>(bi)].numel;
          counts_[static_cast<size_t>(r)] += static_cast<size_t>(cx_.blocks[static_cast<size_t>(bi)].numel);
        }
      }
    }
    total_ = pos;
    where_.assign(cx_.blocks.size(), {-1, 0});
    for (size_t gi = 0; gi < groups_.size(); ++gi)
      for (size_t i = 0; i < groups_[gi].blocks.size(); ++i)
        where_[static_cast<size_t>(groups_[gi].blocks[i])] = {static_cast<int>(gi), static_cast<int64_t>(i)};
  }

  void allocate_groups() {
    const bool graft_state = cx_.cfg.grafting == Grafting::adagrad || cx_.cfg.grafting == Grafting::rmsprop || cx_.cfg.grafting == Grafting::adam;
    int64_t scratch = 1, max_chunk = 1, max_n = 1;
    for (auto& gr : groups_) {
      const int64_t B = static_cast<int64_t>(gr.blocks.size());
      gr.chunk = std::clamp<int64_t>(kChunkElements / gr.n, 1, B);
      scratch = std::max(scratch, gr.chunk * gr.n);
      max_chunk = std::max(max_chunk, gr.chunk);
      max_n = std::max(max_n, gr.n);
      if (!gr.diagonal) pre_->allocate(gr);
      if (graft_state) gr.graft = Tensor::zeros({B, gr.n}, DType::f32, cx_.device);
      if (cx_.cfg.beta1 > 0) gr.filtered = Tensor::zeros({B, gr.n}, DType::f32, cx_.device);
      if (cx_.cfg.momentum > 0) gr.momentum = Tensor::zeros({B, gr.n}, DType::f32, cx_.device);
      gr.failures = Tensor::zeros({B}, DType::i64);
      // Runs of consecutive blocks of one parameter, for gathering the gradient blocks.
      for (int64_t i = 0; i < B;) {
        const int p = cx_.blocks[static_cast<size_t>(gr.blocks[static_cast<size_t>(i)])].param;
        int64_t j = i;
        bool contiguous = true;
        while (j < B && cx_.blocks[static_cast<size_t>(gr.blocks[static_cast<size_t>(j)])].param == p) {
          contiguous = contiguous && cx_.blocks[static_cast<size_t>(gr.blocks[static_cast<size_t>(j)])].contiguous;
          ++j;
        }
        Group::Run run{p, i, j, {}};
        if (!contiguous && !sharded_) {  // sharded: build_gather indexes every run
          std::vector<int64_t> idx;
          idx.reserve(static_cast<size_t>((j - i) * gr.n));
          for (int64_t q = i; q < j; ++q)
            block_elements(merged_[static_cast<size_t>(p)], cx_.blocks[static_cast<size_t>(gr.blocks[static_cast<size_t>(q)])], idx);
          run.index = upload_i64(idx, cx_.device);
        }
        gr.runs.push_back(std::move(run));
        i = j;
      }
    }
    Scratch& sc = cx_.sc;
    for (Tensor* t : {&sc.grad, &sc.filtered, &sc.side, &sc.ping, &sc.pong}) *t = Tensor::empty({scratch}, DType::f32, cx_.device);
    if (cx_.cfg.momentum > 0) cx_.sc.search = Tensor::empty({scratch}, DType::f32, cx_.device);
    pre_->allocate_scratch(groups_, scratch);
    cx_.sc.norm_a = Tensor::empty({max_chunk}, DType::f32, cx_.device);
    cx_.sc.norm_b = Tensor::empty({max_chunk}, DType::f32, cx_.device);
    cx_.sc.ones = Tensor::empty({max_n}, DType::f32, cx_.device);
    ops::fill(cx_.sc.ones, 1.0);
    recv_ = Tensor::zeros({std::max<int64_t>(total_, 1)}, DType::f32, cx_.device);
    if (bf16_) recv16_ = Tensor::zeros({std::max<int64_t>(total_, 1)}, DType::bf16, cx_.device);
    agree_ = Tensor::zeros({2}, DType::i64, cx_.device);
  }

  // How each parameter takes its direction from the gathered buffer.
  void build_updates(const std::vector<nn::Param>& params) {
    std::vector<std::vector<int>> of_param(params.size());
    for (size_t i = 0; i < cx_.blocks.size(); ++i) of_param[static_cast<size_t>(cx_.blocks[i].param)].push_back(static_cast<int>(i));
    int64_t max_index = 0;
    updates_.resize(params.size());
    for (size_t p = 0; p < params.size(); ++p) {
      if (dion_[p]) continue;  // Dion applies its own
      ParamUpdate& u = updates_[p];
      bool contiguous = true;
      std::vector<std::array<int64_t, 3>> segs;
      for (int bi : of_param[p]) {
        const BlockDesc& b = cx_.blocks[static_cast<size_t>(bi)];
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
        const int64_t numel = shape_numel(cx_.shapes[p]);
        std::vector<int64_t> idx(static_cast<size_t>(numel));
        std::vector<int64_t> el;
        for (int bi : of_param[p]) {
          const BlockDesc& b = cx_.blocks[static_cast<size_t>(bi)];
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
        u.index = upload_i64(idx, cx_.device);
        max_index = std::max(max_index, std::min(static_cast<int64_t>(idx.size()), kChunkElements));
      }
    }
    if (max_index > 0) cx_.sc.update = Tensor::empty({max_index}, DType::f32, cx_.device);
  }

  // ---------------------------------------------------------------- one step
  void process_chunk(Group& gr, int64_t c0, int64_t c1, const std::vector<nn::Param>& params, int64_t t, bool precond,
                     const std::vector<char>& due) {
    const int64_t Bc = c1 - c0, n = gr.n;
    Tensor G = rows(cx_.sc.grad, Bc, n);
    extract(gr, c0, c1, params, G, false);
    if (cx_.cfg.weight_decay > 0 && cx_.cfg.weight_decay_type == WeightDecayType::l2) {  // G += wd W, before everything
      Tensor W = rows(cx_.sc.side, Bc, n);
      extract(gr, c0, c1, params, W, true);
      ops::axpy(cx_.cfg.weight_decay, W, G);
    }
    if (!gr.diagonal) pre_->update(gr, c0, c1, G, t);
    for (int64_t r0 = c0; r0 < c1 && !gr.factor.empty();) {  // the runs of blocks whose phase is due (consecutive)
      const auto phase_of = [&](int64_t i) { return cx_.blocks[static_cast<size_t>(gr.blocks[static_cast<size_t>(i)])].phase; };
      int64_t r1 = r0 + 1;
      while (r1 < c1 && phase_of(r1) == phase_of(r0)) ++r1;
      if (due[static_cast<size_t>(phase_of(r0))]) pre_->amortized_step(gr, r0, r1, t);
      r0 = r1;
    }

    // Filtered gradient.
    Tensor Mh = G;
    if (cx_.cfg.beta1 > 0) {
      Tensor M = gr.filtered.slice(c0, c1);
      ops::lerp(M, G, 1.0 - cx_.cfg.beta1, M);
      Mh = M;
      if (cx_.cfg.use_bias_correction) {
        Mh = rows(cx_.sc.filtered, Bc, n);
        ops::scale(M, 1.0 / (1.0 - std::pow(cx_.cfg.beta1, static_cast<double>(t))), Mh);
      }
    }
    // Grafting direction.
    Tensor Dg = Mh;
    if (gr.graft.defined()) {
      Tensor A = gr.graft.slice(c0, c1);
      Tensor S = rows(cx_.sc.side, Bc, n);
      ops::mul(G, G, S);
      if (cx_.cfg.grafting == Grafting::adagrad)
        ops::add(A, S, A);
      else
        ops::lerp(A, S, 1.0 - cx_.cfg.grafting_beta2, A);
      if (cx_.cfg.grafting == Grafting::adam) {
        ops::scale(A, 1.0 / (1.0 - std::pow(cx_.cfg.grafting_beta2, static_cast<double>(t))), S);
        ops::sqrt(S, S);
      } else {
        ops::sqrt(A, S);
      }
      ops::add_scalar(S, cx_.cfg.grafting_epsilon, S);
      ops::div(Mh, S, S);
      Dg = S;
    }
    Tensor dst = recv_.slice(my_offset_ + gr.send_offset + c0 * n, my_offset_ + gr.send_offset + c1 * n).reshape({Bc, n});
    Tensor T = cx_.cfg.momentum > 0 ? rows(cx_.sc.search, Bc, n) : dst;
    // The preconditioned direction; undefined: the grafting direction alone.
    const Tensor P = gr.diagonal ? Tensor{} : pre_->direction(gr, c0, c1, G, Mh, t, precond);
    if (!P.defined()) {
      copy_into(T, Dg);
    } else if (cx_.cfg.grafting == Grafting::none || cx_.cfg.grafting_scope == GraftingScope::diagonal) {
      copy_into(T, P);
    } else {
      // Per block: D = P * ||Dg|| / ||P||.
      Tensor ng = cx_.sc.norm_a.slice(0, Bc), np = cx_.sc.norm_b.slice(0, Bc);
      ops::reduce(ops::Reduce::norm2, ops::Axis::rows, Dg, ng);
      ops::reduce(ops::Reduce::norm2, ops::Axis::rows, P, np);
      ops::clamp(np, std::numeric_limits<float>::min(), std::numeric_limits<double>::infinity(), np);
      ops::div(ng, np, ng);
      Tensor S = rows(cx_.sc.side, Bc, n);
      cx_.broadcast_blocks(ng, n, S);
      ops::mul(P, S, T);
    }
    if (cx_.cfg.weight_decay > 0 && cx_.cfg.weight_decay_type == WeightDecayType::decoupled) {  // D += wd W, before momentum
      Tensor W = rows(cx_.sc.side, Bc, n);
      extract(gr, c0, c1, params, W, true);
      ops::axpy(cx_.cfg.weight_decay, W, T);
    }
    if (cx_.cfg.momentum > 0) {
      ops::fill(dst, 0.0);
      Tensor mom = gr.momentum.slice(c0, c1);
      ops::sgd_step(dst, T, mom, -1.0, cx_.cfg.momentum, 0.0, cx_.cfg.nesterov);  // dst = 0 + D
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
          const BlockDesc& b = cx_.blocks[static_cast<size_t>(gr.blocks[static_cast<size_t>(i)])];
          copy_into(flat.slice((i - c0) * n, (i - c0 + 1) * n), src.slice(b.start, b.start + n));
        }
      }
    }
  }

  // Every rank of the group learns the first fatal condition, so that all raise the same error.
  void agree_and_raise(int64_t t) {
    int64_t codes[2] = {cx_.nan_code, cx_.fatal_code};
    if (group_size_ > 1) {
      agree_.copy_from(Tensor::from_host(codes, {2}, DType::i64));
      comm::Buffer buf{agree_.data(), 2, DType::i64, cx_.device};
      group_->all_reduce(buf, buf, comm::ReduceOp::min, comm::Mode::sync).wait();
      const Tensor host = agree_.to(Device::cpu());
      codes[0] = host.ptr<int64_t>()[0];
      codes[1] = host.ptr<int64_t>()[1];
    }
    constexpr int64_t none = std::numeric_limits<int64_t>::max();
    if (codes[0] != none) {
      const int bi = static_cast<int>(codes[0] / 1024), k = static_cast<int>(codes[0] % 1024);
      const BlockDesc& b = cx_.blocks[static_cast<size_t>(bi)];
      fail("shampoo: the Kronecker factor {} of {} holds NaN or Inf at step {}: the gradients of parameter '{}' were "
           "not finite. Check the loss and the data, lower the learning rate, or clip the gradients",
           k, cx_.block_label(bi), t, cx_.names[static_cast<size_t>(b.param)]);
    }
    if (codes[1] != none)
      fail("shampoo: the {} of {} failed {} times in a row (step {}): its factors are too ill-conditioned; "
           "raise epsilon (now {}) or use factor_dtype f64",
           pre_->amortized_name(),
           cx_.block_label(static_cast<int>(codes[1] / 1024)), kMaxFailures, t, nlohmann::json(cx_.cfg.epsilon).dump());
  }

  void communicate() {
    if (total_ == 0) return;
    const size_t mine = counts_[static_cast<size_t>(group_rank_)];
    if (bf16_) {
      Tensor my32 = recv_.slice(my_offset_, my_offset_ + static_cast<int64_t>(mine));
      Tensor my16 = recv16_.slice(my_offset_, my_offset_ + static_cast<int64_t>(mine));
      if (mine) ops::cast(my32, my16);
      if (group_size_ > 1) {
        comm::Buffer all{recv16_.data(), static_cast<size_t>(total_), DType::bf16, cx_.device};
        group_->all_gather_v(all.slice(static_cast<size_t>(my_offset_), mine), all, counts_, comm::Mode::sync).wait();
        last_bytes_ += static_cast<int64_t>(mine * 2);
      }
      Tensor all16 = recv16_.slice(0, total_), all32 = recv_.slice(0, total_);
      ops::cast(all16, all32);  // every rank applies the same rounded directions
    } else if (group_size_ > 1) {
      comm::Buffer all{recv_.data(), static_cast<size_t>(total_), DType::f32, cx_.device};
      group_->all_gather_v(all.slice(static_cast<size_t>(my_offset_), mine), all, counts_, comm::Mode::sync).wait();
      last_bytes_ += static_cast<int64_t>(mine * 4);
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
          Tensor tmp = cx_.sc.update.slice(0, e1 - e0);
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

  Context cx_;  // the options, the blocks, the scratch, a step's fatal conditions
  std::unique_ptr<BlockPreconditioner> pre_;
  std::vector<char> dion_;             // per parameter: one of Dion's matrices (no blocks)
  std::unique_ptr<Dion> dion_mats_;    // their update, when there are any
  int64_t last_bytes_ = 0;             // optim_comm_bytes of the last step
  std::shared_ptr<comm::Communicator> group_holder_;
  comm::Communicator* group_ = nullptr;
  int group_size_ = 1, group_rank_ = 0;
  bool in_group0_ = true;
  // Sharded parameters (rows_): the blocks are the whole parameters' blocks; every step gathers
  // the shards' gradients (and weights, with weight decay) over shard_comm_ (build_gather).
  bool sharded_ = false;
  std::vector<Rows> rows_;
  comm::Communicator* shard_comm_ = nullptr;
  RankSegments segments_;                            // the packed shards, per rank of the shard group
  std::vector<std::vector<int64_t>> gathered_at_;    // construction only
  Tensor gathered_grads_, gathered_values_;
  std::vector<Shape> local_shapes_;                  // the parameters as step() takes them
  bool bf16_ = false;

  std::vector<Shape> merged_;
  std::unordered_map<std::string, int> prefix_to_block_;
  std::vector<std::pair<int, int64_t>> where_;  // block -> (group, index in it), group -1: not held
  std::vector<Group> groups_;
  std::vector<ParamUpdate> updates_;
  std::vector<size_t> counts_;  // elements per rank of the group
  int64_t my_offset_ = 0, total_ = 0;

  Tensor step_;  // i64 [1] on the host
  Tensor recv_, recv16_, agree_;
};

}  // namespace

std::unique_ptr<Optimizer> make_shampoo(const ShampooConfig& cfg, const std::vector<nn::Param>& params,
                                        comm::Communicator& comm, const std::vector<Rows>& rows,
                                        comm::Communicator* replicas) {
  return std::make_unique<Shampoo>(cfg, params, comm, rows, replicas);
}

}  // namespace dtk::optim
