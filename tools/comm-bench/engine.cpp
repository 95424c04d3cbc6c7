#include "engine.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>

#include "dtk/cli/cli.h"
#include "dtk/comm/cost.h"
#include "dtk/core/error.h"

namespace dtk::bench {
namespace {
using comm::Buffer;
using comm::Mode;

// One allocation on the benchmark's device, with a host mirror for filling and checking.
class Memory {
 public:
  Memory(size_t bytes, Device d) : device_(d), bytes_(bytes ? bytes : 1), host_(std::malloc(bytes_)) {
    if (!host_) fail("comm-bench: cannot allocate " + cli::format_size(bytes_) + " of host memory");
    data_ = d.is_cuda() ? cuda::malloc_device(bytes_) : host_;
  }
  ~Memory() {
    if (device_.is_cuda()) cuda::free_device(data_);
    std::free(host_);
  }
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;

  Buffer slice(DType t, size_t offset, size_t count) const {
    return Buffer{static_cast<char*>(data_) + offset * dtype_size(t), count, t, device_};
  }
  void* host() const { return host_; }
  void upload(size_t bytes) const {
    if (device_.is_cuda()) cuda::memcpy(data_, host_, bytes);
  }
  void download(size_t bytes) const {
    if (device_.is_cuda()) cuda::memcpy(host_, data_, bytes);
  }

 private:
  Device device_;
  size_t bytes_;
  void* host_;
  void* data_;
};

double round_to(DType t, double v) {
  double out = 0;
  unsigned char tmp[8];
  store_from_double(t, tmp, 0, v);
  out = load_as_double(t, tmp, 0);
  return out;
}

double epsilon(DType t) {
  switch (t) {
    case DType::f64: return 0x1p-52;
    case DType::f32: return 0x1p-23;
    case DType::f16: return 0x1p-10;
    case DType::bf16: return 0x1p-7;
    default: return 0;
  }
}

struct Row {
  std::string_view op;
  uint64_t bytes;
  size_t count;
  double time_us, algbw, busbw;
  int64_t wrong;
};

class Engine {
 public:
  Engine(comm::Runtime& rt, const Options& o) : rt_(rt), o_(o) {
    device_ = rt.bind_device(o.device);
    comm_ = rt.world(o.backend, device_);
    host_ = rt.world(rt.mpi_initialized() ? comm::Backend::mpi : comm::Backend::local);
    params_.op = o.redop;
    params_.root = o.root;
    params_.dtype = o.dtype;
    params_.rank = comm_->rank();
    params_.nranks = comm_->size();
  }

  int run() {
    const auto sizes = sweep_sizes(o_);
    const std::string me = comm::Runtime::hostname() + " " +
                           (device_.is_cuda() ? device_.str() + " " + cuda::device_name(device_.index) : "cpu");
    const auto names = rt_.gather_strings(me);
    if (rank0() && !o_.json) print_header(names);

    nlohmann::json results = nlohmann::json::array();
    nlohmann::json peaks = nlohmann::json::object();
    nlohmann::json fits = nlohmann::json::object();
    int64_t wrong_total = 0;
    for (const Collective* c : o_.ops) {
      if (rank0() && !o_.json && o_.ops.size() > 1) std::printf("#\n# %s\n", std::string(c->name).c_str());
      if (rank0() && !o_.json) print_columns();
      allocate(*c, sizes.empty() ? 0 : sizes.back());
      double peak = 0;
      std::vector<comm::Sample> samples;
      for (uint64_t size : sizes) {
        const Row row = measure(*c, size);
        wrong_total += row.wrong;
        peak = std::max(peak, row.busbw);
        samples.push_back({static_cast<double>(row.bytes), row.time_us * 1e-6});
        if (!rank0()) continue;
        if (o_.json)
          results.push_back({{"op", c->name},
                             {"size", row.bytes},
                             {"count", row.count},
                             {"type", dtype_name(o_.dtype)},
                             {"redop", c->reduces ? comm::reduce_op_name(o_.redop) : "none"},
                             {"root", c->rooted ? o_.root : -1},
                             {"time_us", row.time_us},
                             {"algbw_gbps", row.algbw},
                             {"busbw_gbps", row.busbw},
                             {"wrong", row.wrong}});
        else
          print_row(*c, row);
      }
      peaks[std::string(c->name)] = peak;
      if (rank0() && !o_.json) std::printf("# peak busbw (%s): %.3f GB/s\n", std::string(c->name).c_str(), peak);
      if (o_.fit && rank0()) fits[std::string(c->name)] = report_fit(*c, samples);
    }

    if (rank0()) {
      if (o_.json) {
        nlohmann::json doc = config_json(names);
        doc["results"] = results;
        doc["peak_busbw_gbps"] = peaks;
        if (o_.fit) doc["fit"] = fits;
        doc["wrong"] = wrong_total;
        std::printf("%s\n", doc.dump(2).c_str());
      } else {
        std::printf("# wrong elements: %lld%s\n", static_cast<long long>(wrong_total),
                    o_.check ? "" : " (not checked: -c 0)");
      }
      std::fflush(stdout);
    }
    if (wrong_total) spdlog::error("{} wrong elements", wrong_total);
    return wrong_total ? 1 : 0;
  }

 private:
  bool rank0() const { return rt_.rank() == 0; }

  // The alpha-beta fit of one collective's sweep (comm/cost.h): printed as comment lines, and
  // returned for the JSON document. Bandwidth is algorithmic (bytes as in the size column).
  nlohmann::json report_fit(const Collective& c, const std::vector<comm::Sample>& samples) const {
    const comm::CostModel m = comm::fit_cost(samples);
    const double err = comm::max_relative_error(m, samples);
    const double gbps = m.gbps();
    const std::string name(c.name);
    nlohmann::json predicted = nlohmann::json::array();
    for (uint64_t b : o_.predict) predicted.push_back({{"size", b}, {"time_us", m.seconds(static_cast<double>(b)) * 1e6}});
    if (!o_.json) {
      std::printf("# fit (%s): time = %.3f us + bytes / %.3f GB/s; largest error over the sweep %.1f%%\n", name.c_str(),
                  m.alpha_s * 1e6, gbps, err * 100);
      for (const auto& p : predicted)
        std::printf("# predicted (%s): %llu B in %.2f us\n", name.c_str(),
                    static_cast<unsigned long long>(p["size"].get<uint64_t>()), p["time_us"].get<double>());
      std::fflush(stdout);
    }
    return {{"alpha_us", m.alpha_s * 1e6}, {"algbw_gbps", gbps}, {"max_rel_err", err}, {"predicted", predicted}};
  }
  Mode mode() const { return o_.async ? Mode::async : Mode::sync; }

  bool inplace(const Collective& c) const {
    return c.layout == Layout::inplace_only || (c.layout == Layout::either && o_.inplace);
  }

  size_t count_for(const Collective& c, uint64_t bytes) const {
    const size_t g = c.granularity(params_.nranks);
    return bytes / dtype_size(o_.dtype) / g * g;
  }

  void allocate(const Collective& c, uint64_t max_bytes) {
    const Counts n = c.counts(count_for(c, max_bytes), params_.nranks);
    const size_t es = dtype_size(o_.dtype);
    a_ = std::make_unique<Memory>(std::max(n.send, n.recv) * es, device_);
    b_ = std::make_unique<Memory>(n.recv * es, device_);
  }

  Row measure(const Collective& c, uint64_t size) {
    const size_t count = count_for(c, size);
    const Counts n = c.counts(count, params_.nranks);
    const size_t es = dtype_size(o_.dtype);
    Buffer send, recv;
    const bool same = inplace(c);
    size_t send_off = 0, recv_off = 0;
    if (same) {
      c.inplace_offsets(n, params_, &send_off, &recv_off);
      send = a_->slice(o_.dtype, send_off, n.send);
      recv = a_->slice(o_.dtype, recv_off, n.recv);
    } else {
      send = a_->slice(o_.dtype, 0, n.send);
      recv = b_->slice(o_.dtype, 0, n.recv);
    }

    int64_t wrong = 0;
    for (int k = 0; k < o_.check; ++k) wrong += check_once(c, n, send, recv, same, send_off, recv_off);

    for (int k = 0; k < o_.warmup; ++k) c.run(*comm_, send, recv, params_, mode()).wait();
    comm_->barrier(Mode::sync);
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < o_.iters; ++k) c.run(*comm_, send, recv, params_, mode()).wait();
    // NCCL's wait() only orders the GPU's stream: the clock stops once the device is done, not
    // when the last operation was queued (--async would report the enqueue rate).
    if (device_.is_cuda()) cuda::stream_synchronize(cuda::current_stream(), "the timed collectives");
    const auto t1 = std::chrono::steady_clock::now();
    double us = std::chrono::duration<double, std::micro>(t1 - t0).count() / o_.iters;

    // Agree on the time (mean, min or max over ranks) and on the wrong count (sum).
    comm::ReduceOp agg = o_.agg == TimeAgg::max   ? comm::ReduceOp::max
                         : o_.agg == TimeAgg::min ? comm::ReduceOp::min
                                                  : comm::ReduceOp::avg;
    host_->all_reduce({&us, 1, DType::f64, Device::cpu()}, {&us, 1, DType::f64, Device::cpu()}, agg, Mode::sync);
    host_->all_reduce({&wrong, 1, DType::i64, Device::cpu()}, {&wrong, 1, DType::i64, Device::cpu()},
                      comm::ReduceOp::sum, Mode::sync);

    const uint64_t bytes = std::max(n.send, n.recv) * es;
    const double algbw = us > 0 ? static_cast<double>(bytes) / (us * 1e3) : 0;  // GB/s
    return Row{c.name, bytes, count, us, algbw, algbw * c.bus_factor(params_.nranks), wrong};
  }

  // One checked run: inputs that reduce exactly, a sentinel where results go, and a comparison
  // of every received element with what it must be.
  int64_t check_once(const Collective& c, const Counts& n, const Buffer& send, const Buffer& recv, bool same,
                     size_t send_off, size_t recv_off) {
    const DType t = o_.dtype;
    const size_t es = dtype_size(t);
    constexpr double kSentinel = 113;
    if (same) {
      const size_t total = std::max(n.send, n.recv);
      for (size_t i = 0; i < total; ++i) store_from_double(t, a_->host(), i, kSentinel);
      for (size_t i = 0; i < n.send; ++i) store_from_double(t, a_->host(), send_off + i, input_value(t, params_.rank, i));
      a_->upload(total * es);
    } else {
      for (size_t i = 0; i < n.send; ++i) store_from_double(t, a_->host(), i, input_value(t, params_.rank, i));
      for (size_t i = 0; i < n.recv; ++i) store_from_double(t, b_->host(), i, kSentinel);
      a_->upload(n.send * es);
      b_->upload(n.recv * es);
    }
    c.run(*comm_, send, recv, params_, mode()).wait();

    const Memory& m = same ? *a_ : *b_;
    const size_t off = same ? recv_off : 0;
    m.download((off + n.recv) * es);
    const bool tolerant = c.reduces && o_.redop == comm::ReduceOp::avg && dtype_is_float(t);
    const double tol = tolerant ? 4.0 * params_.nranks * epsilon(t) : 0;
    int64_t wrong = 0;
    for (size_t i = 0; i < n.recv; ++i) {
      const double want = round_to(t, c.expected(params_, n, i));
      const double got = load_as_double(t, m.host(), off + i);
      if (!(std::fabs(got - want) <= tol)) ++wrong;
    }
    return wrong;
  }

  void print_header(const std::vector<std::string>& names) const {
    std::printf("# %s\n", cli::version_string("comm-bench").c_str());
    std::printf("# backend %s (%s), device %s, %d ranks, dtype %s, redop %s, root %d%s\n",
                std::string(comm::backend_name(comm_->backend())).c_str(), o_.async ? "async" : "sync",
                o_.device.is_cuda() ? "cuda" : "cpu", params_.nranks, std::string(dtype_name(o_.dtype)).c_str(),
                std::string(comm::reduce_op_name(o_.redop)).c_str(), o_.root, o_.inplace ? ", in place" : "");
    std::printf("# %d iterations after %d warm-up, %d checked; time is the %s over ranks\n", o_.iters, o_.warmup,
                o_.check, o_.agg == TimeAgg::mean ? "mean" : o_.agg == TimeAgg::min ? "min" : "max");
    for (size_t r = 0; r < names.size(); ++r) std::printf("#   rank %2zu: %s\n", r, names[r].c_str());
    std::string zero;  // the operations whose bus factor is 0 on this many ranks
    for (const Collective* c : o_.ops)
      if (c->bus_factor(params_.nranks) == 0) zero += (zero.empty() ? "" : ", ") + std::string(c->name);
    if (!zero.empty())
      std::printf("# %d rank: busbw = algbw x bus factor is 0 for %s (nothing crosses a link); run more ranks to "
                  "measure the network\n", params_.nranks, zero.c_str());
  }

  static void print_columns() {
    std::printf("#%13s %12s %6s %6s %5s %11s %9s %9s %7s\n", "size", "count", "type", "redop", "root", "time",
                "algbw", "busbw", "#wrong");
    std::printf("#%13s %12s %6s %6s %5s %11s %9s %9s %7s\n", "(B)", "(elements)", "", "", "", "(us)", "(GB/s)",
                "(GB/s)", "");
  }

  void print_row(const Collective& c, const Row& r) const {
    std::printf("%14llu %12zu %6s %6s %5d %11.2f %9.3f %9.3f %7lld\n", static_cast<unsigned long long>(r.bytes),
                r.count, std::string(dtype_name(o_.dtype)).c_str(),
                c.reduces ? std::string(comm::reduce_op_name(o_.redop)).c_str() : "none", c.rooted ? o_.root : -1,
                r.time_us, r.algbw, r.busbw, static_cast<long long>(r.wrong));
    std::fflush(stdout);
  }

  nlohmann::json config_json(const std::vector<std::string>& names) const {
    nlohmann::json ops = nlohmann::json::array();
    for (const Collective* c : o_.ops) ops.push_back(c->name);
    nlohmann::json ranks = nlohmann::json::array();
    for (size_t r = 0; r < names.size(); ++r) ranks.push_back({{"rank", r}, {"name", names[r]}});
    return {{"program", "comm-bench"},
            {"version", cli::version_string("comm-bench")},
            {"config",
             {{"ops", ops},
              {"backend", comm::backend_name(comm_->backend())},
              {"mode", o_.async ? "async" : "sync"},
              {"device", o_.device.is_cuda() ? "cuda" : "cpu"},
              {"nranks", params_.nranks},
              {"dtype", dtype_name(o_.dtype)},
              {"redop", comm::reduce_op_name(o_.redop)},
              {"root", o_.root},
              {"inplace", o_.inplace},
              {"iters", o_.iters},
              {"warmup", o_.warmup},
              {"check_iters", o_.check},
              {"time", o_.agg == TimeAgg::mean ? "mean" : o_.agg == TimeAgg::min ? "min" : "max"},
              {"min_bytes", o_.min_bytes},
              {"max_bytes", o_.max_bytes}}},
            {"ranks", ranks}};
  }

  comm::Runtime& rt_;
  const Options& o_;
  Device device_;
  std::shared_ptr<comm::Communicator> comm_, host_;
  Params params_;
  std::unique_ptr<Memory> a_, b_;
};

}  // namespace

std::vector<uint64_t> sweep_sizes(const Options& o) {
  std::vector<uint64_t> out;
  uint64_t s = o.min_bytes;
  while (s <= o.max_bytes) {
    out.push_back(s);
    uint64_t next = o.step ? s + o.step : static_cast<uint64_t>(std::llround(static_cast<double>(s) * o.factor));
    if (next <= s) next = s ? s + 1 : dtype_size(o.dtype);  // from 0, or a factor too small to move
    s = next;
  }
  return out;
}

int run_benchmark(comm::Runtime& rt, const Options& o) { return Engine(rt, o).run(); }

}  // namespace dtk::bench
