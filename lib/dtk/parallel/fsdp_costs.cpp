// FSDP's costs and their report (fsdp_schedule.h): the collectives calibrated on the shard group,
// and the plan as --print-plan prints it, with the prediction the measured costs give.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "dtk/core/device.h"
#include "dtk/parallel/fsdp_schedule.h"

namespace dtk::parallel::fsdp {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

Costs calibrate(comm::Communicator& shard, comm::Communicator& host, const FsdpConfig& cfg, double lo_bytes,
                double hi_bytes, Device dev) {
  Costs c;
  const int S = shard.size();
  if (S == 1) return c;  // nothing to communicate: zero costs
  const int kSizes = 8, kReps = 3;
  auto sweep = [&](bool gather) {
    const DType t = gather ? cfg.param_dtype : cfg.reduce_dtype;
    const double es = static_cast<double>(dtype_size(t));
    const int64_t max_chunk = std::max<int64_t>(1, static_cast<int64_t>(hi_bytes / es / S));
    Tensor small = Tensor::zeros({max_chunk}, t, dev), big = Tensor::zeros({max_chunk * S}, t, dev);
    if (dev.is_cuda()) cuda::stream_synchronize(cuda::current_stream(), "the calibration's buffers");
    std::vector<comm::Sample> samples;
    for (int i = 0; i < kSizes; ++i) {
      const double bytes = lo_bytes * std::pow(hi_bytes / lo_bytes, static_cast<double>(i) / (kSizes - 1));
      const int64_t n = std::clamp<int64_t>(static_cast<int64_t>(bytes / es / S), 1, max_chunk);
      std::vector<double> times;
      for (int rep = 0; rep <= kReps; ++rep) {
        host.barrier().wait();
        const auto t0 = Clock::now();
        comm::Work w = gather ? shard.all_gather(comm::buffer_of(small.slice(0, n)), comm::buffer_of(big.slice(0, n * S)), comm::Mode::async)
                              : shard.reduce_scatter(comm::buffer_of(big.slice(0, n * S)), comm::buffer_of(small.slice(0, n)),
                                                     comm::ReduceOp::sum, comm::Mode::async);
        w.synchronize();  // the host waits for the device: the collective's time, not its launch's
        if (rep > 0) times.push_back(since(t0));  // the first is a warm-up
      }
      std::sort(times.begin(), times.end());
      double t = times[times.size() / 2];
      host.all_reduce({&t, 1, DType::f64, {}}, {&t, 1, DType::f64, {}}, comm::ReduceOp::max, comm::Mode::sync).wait();
      samples.push_back({static_cast<double>(n * S) * es, t});
    }
    return comm::fit_cost(samples);
  };
  c.all_gather = sweep(true);
  c.reduce_scatter = sweep(false);
  return c;
}

nlohmann::json plan_report(const BucketPlan& plan, const nn::Model& model, const WireBytes& wire, const Costs& costs,
                           const FsdpConfig& cfg, int shard_group, nlohmann::json compressor) {
  nlohmann::json buckets = nlohmann::json::array();
  for (const Bucket& b : plan) {
    buckets.push_back({{"blocks", {b.first_block, b.last_block}},
                       {"params", {b.first, b.end}},
                       {"first", model.params()[b.first].name},
                       {"last", model.params()[b.end - 1].name},
                       {"all_gather_bytes", bucket_sum(wire.gather, b)},
                       {"reduce_scatter_bytes", bucket_sum(wire.reduce, b)}});
  }
  nlohmann::json j = {{"buckets", buckets},
                      {"shard_group", shard_group},
                      {"replicate", cfg.replicate},
                      {"param_dtype", dtype_name(cfg.param_dtype)},
                      {"reduce_dtype", dtype_name(cfg.reduce_dtype)},
                      {"prefetch", cfg.prefetch},
                      {"overlap", cfg.overlap}};
  if (!compressor.is_null()) j["compressor"] = std::move(compressor);  // --compressor auto's decisions (compress/auto.h)
  if (!costs.forward_s.empty()) {
    const Prediction p = predict(plan, wire, costs, cfg, model.num_blocks());
    const Prediction none = predict(plan, wire, costs, [&] {
      FsdpConfig c = cfg;
      c.overlap = false;
      return c;
    }(), model.num_blocks());
    double fwd = 0, bwd = 0;
    for (double x : costs.forward_s) fwd += x;
    for (double x : costs.backward_s) bwd += x;
    j["predicted"] = {{"exposed_comm_ms", p.exposed_s * 1e3},
                      {"step_ms", p.step_s * 1e3},
                      {"no_overlap_step_ms", none.step_s * 1e3},
                      {"compute_ms", (fwd + bwd) * 1e3}};
    j["costs"] = {{"all_gather", {{"alpha_us", costs.all_gather.alpha_s * 1e6}, {"algbw_gbps", costs.all_gather.gbps()}}},
                  {"reduce_scatter",
                   {{"alpha_us", costs.reduce_scatter.alpha_s * 1e6}, {"algbw_gbps", costs.reduce_scatter.gbps()}}},
                  {"forward_ms", costs.forward_s},
                  {"backward_ms", costs.backward_s}};
    for (auto& x : j["costs"]["forward_ms"]) x = x.get<double>() * 1e3;
    for (auto& x : j["costs"]["backward_ms"]) x = x.get<double>() * 1e3;
  }
  return j;
}

}  // namespace dtk::parallel::fsdp
