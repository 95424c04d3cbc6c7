#include "dtk/parallel/fsdp.h"
#include "dtk/parallel/fsdp_schedule.h"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <fstream>
#include <spdlog/spdlog.h>

#include "dtk/core/device.h"
#include "dtk/core/error.h"
#include "dtk/nn/layers.h"
#include "dtk/ops/ops.h"
#include "dtk/optim/optimizer.h"

namespace dtk::parallel {

using namespace fsdp;

// ------------------------------------------------------------------------------ the runtime

struct Fsdp::Impl {
  nn::Model& model;
  FsdpConfig cfg;
  std::shared_ptr<comm::Communicator> shard, replica, host_shard;
  comm::Communicator& host_world;
  int S = 1, sr = 0;  // shard group size, rank in it
  Device dev;
  // Per parameter: columns (elements per row), shard offset in the flat shard buffer
  // (elements), padded shard numel.
  std::vector<int64_t> cols, off, sn;
  WireBytes wire;  // per parameter, padded as the shards are
  Tensor shard_values, shard_grads;
  // --keep-unsharded-grad: every bucket's whole gradient (f32, param-major, padded), kept across
  // the step's micro-batches and reduce-scattered once after the last.
  Tensor full_grads;
  // Per bucket: chunk offset and numel in the shard buffer; gathered numel (S * chunk).
  std::vector<int64_t> chunk_off, chunk_n;
  // Parameters whose gradients the optimizer aggregates across the replicas itself (Dion); per
  // bucket, the runs [begin, end) of the shard buffer that HSDP's all-reduce sums (the rest).
  std::vector<char> local;
  bool any_local = false;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> replica_runs;
  int64_t max_chunk = 0;
  Schedule train, eval;
  // Arenas (allocated by build, reused every step; count() sizes each pool). A bucket buffer
  // (f32, one gathered bucket) holds the bucket's values while it is gathered and, after its
  // backward, the rank-major send of its reduce-scatter; a wire holds a gather in flight.
  std::vector<Tensor> values;
  struct Wire {
    Tensor send, recv;  // send: the shard cast to the param dtype (bf16), recv: the gathered bucket
  };
  std::vector<Wire> wires;
  std::vector<Tensor> grad_slots;
  std::vector<Tensor> reduced;  // reduce-scatter results (a chunk each)
  Tensor recv_f32;  // bf16 reduce: the result cast before it is added
  std::vector<int> free_values, free_wires, free_grads, free_reduced;
  std::vector<int> value_of, wire_of, grad_of, send_of, reduced_of;  // per bucket, -1 none
  std::vector<comm::Work> gathers, reduces;
  std::vector<comm::Work> replica_works;
  bool last_micro = false;
  // HSDP with a compressor over the replica communicator (compress::Topology): its buckets are
  // the plan's, last first, each started once its reduce-scatter of the last micro-batch is done.
  std::optional<compress::Config> ccfg;
  std::unique_ptr<compress::Compressor> comp;
  std::vector<char> ready;  // per compressor bucket, this step
  size_t next_ready = 0;
  Tensor saved_error;  // topk, signum: their error buffers' mean over the replicas, for a save
  // Metrics of the last step.
  double ag_bytes = 0, rs_bytes = 0, ar_bytes = 0, exposed_s = 0;
  // Stream-ordered times (core/tensor.h): on the GPU what the device spent, not what launching
  // took. exposed: the compute stream's stalls on collectives; blocks: per-block compute.
  StreamTimer exposed{dev}, blocks{dev};
  // Auto plan and --print-plan: costs measured over the first steps.
  bool measuring = false;
  int64_t steps_seen = 0;
  Costs costs;
  std::vector<double> fwd_s, bwd_s;  // summed over the step's passes (micro-batches)
  int64_t passes = 0;

  Impl(nn::Model& m, comm::Communicator& world, comm::Communicator& host, FsdpConfig c)
      : model(m), cfg(std::move(c)), host_world(host), dev(m.device()) {
    S = world.size() / cfg.replicate;
    const int group = world.rank() / S;
    sr = world.rank() % S;
    shard = world.split(group, world.rank());
    host_shard = host.split(group, host.rank());
    if (cfg.replicate > 1) replica = world.split(sr, world.rank());
  }

  void settle_plan(Fsdp& f);  // --buckets auto, --print-plan: the first steps measure (before_step)

  void make_compressor(const std::vector<nn::Param>& params, const std::vector<Rows>& rows, const BucketPlan& plan) {
    validate_compressor(*ccfg, cfg.replicate, cfg.buckets);
    compress::Topology t;
    for (size_t k = plan.size(); k-- > 0;) t.buckets.push_back({plan[k].first, plan[k].end});
    t.shard = shard.get();
    t.rows = rows;
    std::unique_ptr<compress::Compressor> c = compress::make_compressor(*ccfg, *replica, params, SIZE_MAX, t);
    if (comp) {  // a new plan (--buckets auto): the state carries over, by name
      const std::vector<PlacedTensor> from = comp->state(), to = c->state();
      for (size_t i = 0; i < to.size(); ++i) {
        if (from.at(i).name != to[i].name) fail("fsdp: the compressor's state changed with the plan at " + to[i].name);
        Tensor v = to[i].value;
        v.copy_from(from[i].value);
      }
    }
    comp = std::move(c);
    ready.assign(plan.size(), 0);
  }

  // Plan bucket k's shard gradient is final (the last micro-batch): the compressor starts every
  // bucket that is ready, in its order.
  void compress_ready(size_t k) {
    ready[ready.size() - 1 - k] = 1;
    while (next_ready < ready.size() && ready[next_ready]) comp->bucket_ready(next_ready++);
  }

  Tensor shard_view(const Tensor& flat, size_t i, int64_t rows) const {
    Shape s = model.params()[i].shape;
    s[0] = rows;
    return flat.slice(off[i], off[i] + rows * cols[i]).reshape(s);
  }

  void layout(std::vector<nn::Param>& params, std::vector<Rows>& rows_out) {
    const auto& ps = model.params();
    int64_t total = 0;
    for (const nn::Param& p : ps) {
      if (p.shape.empty()) fail("fsdp: parameter " + p.name + " is a scalar; shards split dim 0");
      const int64_t rows = p.shape[0], rpad = (rows + S - 1) / S;
      cols.push_back(rows > 0 ? shape_numel(p.shape) / rows : 0);
      off.push_back(total);
      sn.push_back(rpad * cols.back());
      total += sn.back();
      wire.gather.push_back(static_cast<double>(sn.back() * S * static_cast<int64_t>(dtype_size(cfg.param_dtype))));
      wire.reduce.push_back(static_cast<double>(sn.back() * S * static_cast<int64_t>(dtype_size(cfg.reduce_dtype))));
      Rows r{p.shape, {}, {}, sr};
      for (int q = 0; q < S; ++q) {
        const int64_t o = std::min(rows, q * rpad);
        r.offsets.push_back(o);
        r.lengths.push_back(std::min(rows, o + rpad) - o);
      }
      rows_out.push_back(std::move(r));
    }
    shard_values = Tensor::zeros({total}, DType::f32, dev);
    shard_grads = Tensor::zeros({total}, DType::f32, dev);
    for (size_t i = 0; i < ps.size(); ++i) {
      const int64_t len = rows_out[i].lengths[static_cast<size_t>(sr)];
      nn::Param p;
      p.name = ps[i].name;
      p.block = ps[i].block;
      p.value = shard_view(shard_values, i, len);
      p.grad = shard_view(shard_grads, i, len);
      p.shape = p.value.shape();
      params.push_back(std::move(p));
    }
  }

  // Turns the plan into the schedules and sizes every buffer from them (start-up, and once
  // more when the automatic plan replaces the measuring one).
  void build(const BucketPlan& plan) {
    const int B = model.num_blocks();
    chunk_off.clear(), chunk_n.clear();
    max_chunk = 0;
    replica_runs.clear();
    for (const Bucket& b : plan) {
      chunk_off.push_back(off[b.first]);
      chunk_n.push_back(bucket_sum(sn, b));
      max_chunk = std::max(max_chunk, chunk_n.back());
      auto& runs = replica_runs.emplace_back();
      for (size_t i = b.first; i < b.end; ++i) {
        if (i < local.size() && local[i]) continue;
        if (!runs.empty() && runs.back().second == off[i]) runs.back().second += sn[i];
        else runs.emplace_back(off[i], off[i] + sn[i]);
      }
    }
    train = make_schedule(plan, B, cfg, true);
    eval = make_schedule(plan, B, cfg, false);
    const Counts ct = count(train, B, true), ce = count(eval, B, false);
    const int64_t F = max_chunk * S;
    auto pool = [&](std::vector<Tensor>& v, size_t n, int64_t numel, DType t) {
      v.assign(n, {});
      for (Tensor& x : v) x = Tensor::empty({numel}, t, dev);
    };
    // Free the old arenas before the new ones are allocated (the automatic plan's rebuild).
    values.clear(), wires.clear(), grad_slots.clear(), reduced.clear();
    pool(values, std::max(ct.values, ce.values), F, DType::f32);
    wires.assign(std::max(ct.wires, ce.wires), {});
    for (Wire& w : wires) {
      if (cfg.param_dtype != DType::f32) w.send = Tensor::empty({max_chunk}, cfg.param_dtype, dev);
      w.recv = Tensor::empty({F}, cfg.param_dtype, dev);
    }
    pool(grad_slots, cfg.keep_unsharded_grad ? 0 : ct.grads, F, DType::f32);
    full_grads = cfg.keep_unsharded_grad ? Tensor::zeros({shard_values.numel() * S}, DType::f32, dev) : Tensor();
    pool(reduced, ct.reducing, max_chunk, cfg.reduce_dtype);
    recv_f32 = cfg.reduce_dtype != DType::f32 ? Tensor::empty({max_chunk}, DType::f32, dev) : Tensor();
    const size_t K = plan.size();
    for (auto* v : {&value_of, &wire_of, &grad_of, &send_of, &reduced_of}) v->assign(K, -1);
    gathers.assign(K, {}), reduces.assign(K, {});
    auto fill = [](std::vector<int>& v, size_t n) {
      v.clear();
      for (size_t i = n; i-- > 0;) v.push_back(static_cast<int>(i));
    };
    fill(free_values, values.size()), fill(free_wires, wires.size());
    fill(free_grads, grad_slots.size()), fill(free_reduced, reduced.size());
  }

  // Every buffer build() allocated.
  int64_t arena_bytes() const {
    size_t n = (recv_f32.defined() ? recv_f32.bytes() : 0) + (full_grads.defined() ? full_grads.bytes() : 0);
    for (const auto* pool : {&values, &grad_slots, &reduced})
      for (const Tensor& t : *pool) n += t.bytes();
    for (const Wire& w : wires) n += (w.send.defined() ? w.send.bytes() : 0) + w.recv.bytes();
    return static_cast<int64_t>(n);
  }

  static int take(std::vector<int>& pool, const char* what) {
    if (pool.empty()) fail(std::string("fsdp: no free ") + what + " buffer (the schedule's count is wrong: a bug)");
    const int i = pool.back();
    pool.pop_back();
    return i;
  }

  // Parameter i of bucket k whole, in a param-major region (p1 whole, p2 whole, ...).
  Tensor whole(const Tensor& region, size_t k, size_t i) const {
    const nn::Param& p = model.params()[i];
    const int64_t at = S * (off[i] - chunk_off[k]);
    return region.slice(at, at + shape_numel(p.shape)).reshape(p.shape);
  }

  // Bucket k's whole gradient in full_grads (param-major, as a gradient slot holds it).
  Tensor grad_region(size_t k) const { return full_grads.slice(S * chunk_off[k], S * (chunk_off[k] + chunk_n[k])); }

  // Bucket k between rank-major layout (the wire: [rank 0: p1 | p2 ...][rank 1: ...]) and
  // param-major (compute), casting to dst's dtype: copy-out after a gather, copy-in before a
  // reduce-scatter.
  void permute(const Bucket& b, size_t k, const Tensor& src, Tensor& dst, bool to_param_major) const {
    const int64_t C = chunk_n[k];
    for (size_t i = b.first; i < b.end; ++i) {
      const int64_t in_chunk = off[i] - chunk_off[k];
      for (int q = 0; q < S; ++q) {
        const int64_t wire = q * C + in_chunk, param = S * in_chunk + q * sn[i];
        const int64_t from = to_param_major ? wire : param, to = to_param_major ? param : wire;
        Tensor d = dst.slice(to, to + sn[i]);
        ops::cast(src.slice(from, from + sn[i]), d);
      }
    }
  }

  void wait_timed(comm::Work& w) {
    exposed.start();
    w.wait();
    exposed.stop(&exposed_s);
  }

  void run(const std::vector<Op>& ops, const BucketPlan& plan) {
    for (const Op& op : ops) {
      const size_t k = op.bucket;
      const Bucket& b = plan[k];
      const int64_t C = chunk_n[k];
      switch (op.kind) {
        case OpKind::gather: {
          value_of[k] = take(free_values, "bucket");
          const int w = take(free_wires, "gather");
          wire_of[k] = w;
          Wire& wb = wires[static_cast<size_t>(w)];
          Tensor src = shard_values.slice(chunk_off[k], chunk_off[k] + C);
          if (cfg.param_dtype != DType::f32) {
            Tensor send = wb.send.slice(0, C);
            ops::cast(src, send);
            src = send;
          }
          gathers[k] = shard->all_gather(comm::buffer_of(src), comm::buffer_of(wb.recv.slice(0, C * S)), comm::Mode::async);
          ag_bytes += static_cast<double>(C * S) * static_cast<double>(dtype_size(cfg.param_dtype));
          break;
        }
        case OpKind::wait_gather: {
          wait_timed(gathers[k]);
          // The layers' weights: f32, or (the model's bf16 weights, nn::bf16_weights() inside its
          // pass) bf16 in the first half of the same bucket buffer, bound as Param::half: the
          // bf16 gather feeds the GEMMs as it came.
          const bool half = nn::bf16_weights();
          Tensor value = values[static_cast<size_t>(value_of[k])];
          if (half) value = value.view(DType::bf16);
          permute(b, k, wires[static_cast<size_t>(wire_of[k])].recv, value, true);
          free_wires.push_back(wire_of[k]);
          wire_of[k] = -1;
          for (size_t i = b.first; i < b.end; ++i) (half ? model.params()[i].half : model.params()[i].value) = whole(value, k, i);
          break;
        }
        case OpKind::release: {
          free_values.push_back(value_of[k]);
          value_of[k] = -1;
          for (size_t i = b.first; i < b.end; ++i) model.params()[i].value = model.params()[i].half = Tensor();
          break;
        }
        case OpKind::open_grad: {
          Tensor region;
          if (full_grads.defined()) {  // zeroed by zero_grad, accumulating over the micro-batches
            region = grad_region(k);
          } else {
            const int g = take(free_grads, "gradient");
            grad_of[k] = g;
            region = grad_slots[static_cast<size_t>(g)].slice(0, C * S);
            ops::fill(region, 0.0);
          }
          for (size_t i = b.first; i < b.end; ++i) model.params()[i].grad = whole(region, k, i);
          break;
        }
        case OpKind::reduce: {
          if (full_grads.defined() && !last_micro) {  // kept for the next micro-batch
            for (size_t i = b.first; i < b.end; ++i) model.params()[i].grad = Tensor();
            break;
          }
          const Tensor grad = full_grads.defined() ? grad_region(k) : grad_slots[static_cast<size_t>(grad_of[k])];
          // The send is a bucket buffer (the one this bucket's values just left, when released
          // right before), in the reduce dtype.
          const int v = take(free_values, "bucket"), r = take(free_reduced, "reduce-scatter");
          send_of[k] = v, reduced_of[k] = r;
          Tensor send = values[static_cast<size_t>(v)].view(cfg.reduce_dtype).slice(0, C * S);
          permute(b, k, grad, send, false);
          for (size_t i = b.first; i < b.end; ++i) model.params()[i].grad = Tensor();
          if (grad_of[k] >= 0) free_grads.push_back(grad_of[k]);
          grad_of[k] = -1;
          reduces[k] = shard->reduce_scatter(comm::buffer_of(send), comm::buffer_of(reduced[static_cast<size_t>(r)].slice(0, C)),
                                             comm::ReduceOp::sum, comm::Mode::async);
          rs_bytes += static_cast<double>(C * S) * static_cast<double>(dtype_size(cfg.reduce_dtype));
          break;
        }
        case OpKind::wait_reduce: {
          if (send_of[k] < 0) break;  // not issued (--keep-unsharded-grad before the last micro-batch)
          wait_timed(reduces[k]);
          free_values.push_back(send_of[k]);
          free_reduced.push_back(reduced_of[k]);
          Tensor recv = reduced[static_cast<size_t>(reduced_of[k])].slice(0, C);
          send_of[k] = reduced_of[k] = -1;
          if (recv_f32.defined()) {
            Tensor f = recv_f32.slice(0, C);
            ops::cast(recv, f);
            recv = f;
          }
          Tensor g = shard_grads.slice(chunk_off[k], chunk_off[k] + C);
          ops::add(g, recv, g);
          if (comp && last_micro) {  // HSDP, compressed
            compress_ready(k);
          } else if (replica && last_micro) {  // HSDP: the shard gradient summed over the groups
            for (const auto& [b0, b1] : replica_runs[k]) {  // all of it but the optimizer's own
              Tensor part = shard_grads.slice(b0, b1);
              replica_works.push_back(
                  replica->all_reduce(comm::buffer_of(part), comm::buffer_of(part), comm::ReduceOp::sum, comm::Mode::async));
              ar_bytes += static_cast<double>(b1 - b0) * 4;
            }
          }
          break;
        }
      }
    }
  }
};

void validate_compressor(const compress::Config& compressor, int replicate, const std::string& buckets) {
  if (compressor.kind != compress::Kind::none && replicate <= 1)
    fail_usage("--compressor {} compresses the all-reduce across replica groups: it needs --replicate > 1",
               name_of(compressor.kind));
  if (compressor.kind == compress::Kind::auto_ && buckets == "auto")
    fail_usage("--compressor auto decides per bucket of the plan, and --buckets auto plans again after the first two "
               "steps of every run (a resume's too): give --buckets block, N or a plan file (--print-plan writes one)");
}

Fsdp::Fsdp(nn::Model& model, comm::Communicator& world, comm::Communicator& host, FsdpConfig cfg,
           std::optional<compress::Config> compressor, std::vector<char> local) {
  if (model.storage() != nn::Storage::external) fail("Fsdp: the model must have external parameter storage");
  validate(cfg, world.size());
  const bool any_local = std::any_of(local.begin(), local.end(), [](char c) { return c != 0; });
  if (compressor && any_local)
    fail_usage("--compressor {} does not fit --preconditioner dion --dion-sync factors: both aggregate across the replica "
               "groups (use --dion-sync gradients to compress the others' gradients)", name_of(compressor->kind));
  impl_ = std::make_unique<Impl>(model, world, host, cfg);
  impl_->local = std::move(local);
  impl_->any_local = any_local;
  impl_->layout(params_, rows_);
  plan_ = plan_from_spec(model, cfg.buckets);
  impl_->build(plan_);
  if (compressor) {
    impl_->ccfg = std::move(compressor);
    impl_->make_compressor(params_, rows_, plan_);
  }
  impl_->measuring = cfg.buckets == "auto" || cfg.print_plan;
  if (impl_->measuring) {
    impl_->fwd_s.assign(static_cast<size_t>(model.num_blocks()), 0);
    impl_->bwd_s.assign(static_cast<size_t>(model.num_blocks()), 0);
  }
}

Fsdp::~Fsdp() = default;

void Fsdp::init(uint64_t seed) {
  Impl& m = *impl_;
  int64_t largest = 0;
  for (const nn::Param& p : m.model.params()) largest = std::max(largest, shape_numel(p.shape));
  Tensor tmp = Tensor::empty({largest}, DType::f32, m.dev);
  for (size_t i = 0; i < params_.size(); ++i) {
    const nn::Param& full = m.model.params()[i];
    Tensor t = tmp.slice(0, shape_numel(full.shape)).reshape(full.shape);
    m.model.init_param(i, seed, t);
    const int64_t o = rows_[i].offsets[static_cast<size_t>(m.sr)], n = rows_[i].lengths[static_cast<size_t>(m.sr)];
    if (n > 0) params_[i].value.copy_from(t.slice(o, o + n));
  }
}

void Fsdp::zero_grad() {
  Impl& m = *impl_;
  ops::fill(m.shard_grads, 0.0);
  if (m.full_grads.defined()) ops::fill(m.full_grads, 0.0);
  m.ag_bytes = m.rs_bytes = m.ar_bytes = m.exposed_s = 0;
  if (m.measuring) {
    std::fill(m.fwd_s.begin(), m.fwd_s.end(), 0.0);
    std::fill(m.bwd_s.begin(), m.bwd_s.end(), 0.0);
    m.passes = 0;
  }
}

void Fsdp::begin(int64_t step) {
  Impl& m = *impl_;
  m.last_micro = true;
  if (m.comp) {
    m.comp->begin(params_, step);
    std::fill(m.ready.begin(), m.ready.end(), 0);
    m.next_ready = 0;
  }
}

void Fsdp::finish() {
  Impl& m = *impl_;
  if (m.comp) {  // its collectives in flight completed, the rest run (exposed)
    m.exposed.start();
    m.comp->finish();
    m.exposed.stop(&m.exposed_s);
    m.ar_bytes = static_cast<double>(m.comp->last_bytes().sent);
  }
  for (comm::Work& w : m.replica_works) m.wait_timed(w);
  m.replica_works.clear();
  m.last_micro = false;
}

// The step's timings, after the trainer's wait for the GPU: nothing left to wait for.
void Fsdp::collect_timings() {
  impl_->exposed.collect();
  impl_->blocks.collect();
}

void Fsdp::clip_grad_norm(double max_norm, Tensor& norm) {
  Impl& m = *impl_;
  // Over the gradients HSDP sums (the optimizer's own differ between the replica groups).
  std::vector<Tensor> parts;
  for (const auto& runs : m.replica_runs)
    for (const auto& [b0, b1] : runs) parts.push_back(m.shard_grads.slice(b0, b1));
  if (!m.any_local) parts = {m.shard_grads};
  optim::global_norm(parts, norm);  // this rank's shards'
  if (m.S > 1) {  // the shard group's: sqrt of the sum of the squares, on the device
    ops::mul(norm, norm, norm);
    m.shard->all_reduce(comm::buffer_of(norm), comm::buffer_of(norm), comm::ReduceOp::sum).wait();
    ops::sqrt(norm, norm);
  }
  if (max_norm > 0)
    for (Tensor& p : parts) ops::clip_scale(p, norm, max_norm);
}

comm::Communicator* Fsdp::replica_comm() { return impl_->replica.get(); }

void Fsdp::metrics(nlohmann::ordered_json& j) const {
  const Impl& m = *impl_;
  j["comm_bytes"] = m.ag_bytes + m.rs_bytes + m.ar_bytes;
  if (m.comp) {  // the replica hop's
    const compress::Bytes b = m.comp->last_bytes();
    j["comm_bytes_uncompressed"] = b.uncompressed;
    j["compression_ratio"] = b.sent > 0 ? static_cast<double>(b.uncompressed) / static_cast<double>(b.sent) : 1.0;
    if (const nlohmann::json p = m.comp->plan(); !p.is_null()) j["compress_ranks"] = p["ranks"];
  }
  j["all_gather_bytes"] = m.ag_bytes;
  j["reduce_scatter_bytes"] = m.rs_bytes;
  if (m.replica) j["all_reduce_bytes"] = m.ar_bytes;
  j["exposed_comm_ms"] = m.exposed_s * 1e3;
  j["shard_bytes"] = m.shard_values.bytes() + m.shard_grads.bytes();
  j["arena_bytes"] = m.arena_bytes();
}

comm::Communicator& Fsdp::optimizer_comm() { return *impl_->shard; }

std::vector<PlacedTensor> Fsdp::state() { return model_state(impl_->model); }

std::vector<PlacedTensor> Fsdp::sync_state() {
  if (!impl_->comp) return {};
  return prefixed("compress/", impl_->comp->state());
}

std::vector<PlacedTensor> Fsdp::saved_sync_state() {
  Impl& m = *impl_;
  if (m.comp) m.comp->before_save();  // auto: its per-rank sums alike on every rank (one copy is saved)
  std::vector<PlacedTensor> s = sync_state();
  // The error buffers (sharded, one per replica): their mean over the replicas, which is what
  // the writing shard group saves. PowerSGD's and randomk's later steps depend on them only
  // through that mean (compress/compressor.h), so every replica takes it, in place: the run
  // goes on as it would have (up to f32 rounding) and a resume continues it bit for bit.
  int64_t copies = 0;
  for (const PlacedTensor& t : s)
    if (t.placement == Placement::sharded && t.resize != Resize::mean) copies += t.value.numel();
  if (copies > 0 && (!m.saved_error.defined() || m.saved_error.numel() < copies))
    m.saved_error = Tensor::empty({copies}, DType::f32, m.dev);
  int64_t off = 0;
  for (PlacedTensor& t : s) {
    if (t.placement != Placement::sharded || t.value.numel() == 0) continue;
    Tensor dst = t.value;
    if (t.resize != Resize::mean) {
      dst = m.saved_error.slice(off, off + t.value.numel()).reshape(t.value.shape());
      off += t.value.numel();
    }
    m.replica->all_reduce(comm::buffer_of(t.value), comm::buffer_of(dst), comm::ReduceOp::avg, comm::Mode::sync).wait();
    t.value = dst;
  }
  return s;
}

comm::Communicator* Fsdp::checkpoint_comm() {
  Impl& m = *impl_;
  // One shard group writes (HSDP's groups hold the same shards): group 0, the ranks [0, S).
  return m.host_world.rank() < m.S ? m.host_shard.get() : nullptr;
}

void Fsdp::before_forward(int block, nn::Pass pass) {
  Impl& m = *impl_;
  if (pass == nn::Pass::recompute) return;
  if (pass == nn::Pass::evaluate && block == 0)
    for (int s : m.value_of)
      if (s >= 0) fail("fsdp: evaluate() while a training forward awaits its backward is not supported");
  m.run((pass == nn::Pass::train ? m.train : m.eval).at[kBeforeForward][static_cast<size_t>(block)], plan_);
  if (m.measuring && pass == nn::Pass::train) m.blocks.start();
}

void Fsdp::after_forward(int block, nn::Pass pass) {
  Impl& m = *impl_;
  if (pass == nn::Pass::recompute) return;
  if (m.measuring && pass == nn::Pass::train) {
    m.blocks.stop(&m.fwd_s[static_cast<size_t>(block)]);
    m.passes += block == 0;
  }
  m.run((pass == nn::Pass::train ? m.train : m.eval).at[kAfterForward][static_cast<size_t>(block)], plan_);
}

void Fsdp::before_backward(int block) {
  Impl& m = *impl_;
  m.run(m.train.at[kBeforeBackward][static_cast<size_t>(block)], plan_);
  if (m.measuring) m.blocks.start();
}

void Fsdp::after_backward(int block) {
  Impl& m = *impl_;
  if (m.comp && m.last_micro) m.comp->progress();
  if (m.measuring) m.blocks.stop(&m.bwd_s[static_cast<size_t>(block)]);
  m.run(m.train.at[kAfterBackward][static_cast<size_t>(block)], plan_);
}

void Fsdp::before_step(int64_t) {
  Impl& m = *impl_;
  if (m.measuring) m.settle_plan(*this);
}

bool Fsdp::plan_final() const {
  const Impl& m = *impl_;
  return !m.measuring && (!m.comp || m.comp->plan_final());
}

std::string Fsdp::restore_note(Restored outcome, const RestoreSource& from) const {
  const Impl& m = *impl_;
  return m.comp ? m.comp->restore_note(outcome, from) : "";
}

// Costs: the collectives calibrated once; per-block compute from the second step on the measuring
// plan (the first one allocates activation buffers and warms caches); measuring ends with it.
void Fsdp::Impl::settle_plan(Fsdp& f) {
  Impl& m = *this;
  BucketPlan& plan_ = f.plan_;
  if (m.steps_seen == 0) {
    double lo = 1e300, total = 0;
    for (double x : m.wire.gather) lo = std::min(lo, x), total += x;
    m.costs = fsdp::calibrate(*m.shard, m.host_world, m.cfg, std::max(lo, 1024.0), std::max(0.3 * total, 2 * lo), m.dev);
  }
  if (m.steps_seen++ < 2) return;
  // One pass's costs (the prediction runs one forward and one backward), from the last step's.
  m.costs.forward_s = m.fwd_s;
  m.costs.backward_s = m.bwd_s;
  for (auto* v : {&m.costs.forward_s, &m.costs.backward_s})
    for (double& x : *v) x /= static_cast<double>(std::max<int64_t>(1, m.passes));
  for (auto* v : {&m.costs.forward_s, &m.costs.backward_s})
    m.host_world.all_reduce({v->data(), v->size(), DType::f64, {}}, {v->data(), v->size(), DType::f64, {}},
                            comm::ReduceOp::max, comm::Mode::sync).wait();
  m.measuring = false;
  if (m.cfg.buckets == "auto") {
    plan_ = plan_auto(m.model, m.wire, m.costs, m.cfg);
    m.build(plan_);
    if (m.comp) m.make_compressor(f.params_, f.rows_, plan_);
    spdlog::info("fsdp: automatic bucket plan of {} bucket(s) for {} blocks", plan_.size(), m.model.num_blocks());
  }
}

nlohmann::json Fsdp::plan() const {
  const Impl& m = *impl_;
  return fsdp::plan_report(plan_, m.model, m.wire, m.costs, m.cfg, m.S, m.comp ? m.comp->plan() : nlohmann::json());
}

}  // namespace dtk::parallel
