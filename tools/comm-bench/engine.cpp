#include "engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "dtk/ckpt/checkpoint.h"
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

// The q-quantile of sorted values, interpolated linearly between the two nearest (numpy's
// default): the median of an even count is the mean of the middle two.
double quantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  if (lo + 1 >= sorted.size()) return sorted.back();
  return sorted[lo] + (pos - static_cast<double>(lo)) * (sorted[lo + 1] - sorted[lo]);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return quantile(v, 0.5);
}

// P[X >= k] for X ~ Binomial(n, p): the chance that a rank is last in k or more of n iterations
// when each of the ranks is last with probability p = 1 / ranks.
double binomial_tail(int k, int n, double p) {
  double sum = 0;
  for (int j = std::max(k, 0); j <= n; ++j)
    sum += std::exp(std::lgamma(n + 1.0) - std::lgamma(j + 1.0) - std::lgamma(n - j + 1.0) + j * std::log(p) +
                    (n - j) * std::log1p(-p));
  return std::min(sum, 1.0);
}

// A rank is called a straggler at a size when it was last to arrive in more iterations than
// chance explains and by a margin that matters (median lateness at least kStragglerShare of the
// median time). Chance: each of n ranks last with probability 1/n in each iteration; p bounds the
// chance that any of them is last as often (n times one rank's binomial tail, Bonferroni's bound,
// since the rank is the one that was last most often), and must be below kStragglerP.
constexpr double kStragglerP = 1e-3;
constexpr double kStragglerShare = 0.1;

// Who arrived last, over the timed iterations of one size (Collective::everyone_waits).
struct Arrival {
  int rank = 0;         // the rank that was last most often (the lowest of a tie)
  int last = 0;         // in how many iterations
  double late_us = 0;   // median over those iterations of the others' median time in the operation minus its own
  double p = 1;         // min(1, ranks x binomial_tail(last, iterations, 1 / ranks))
  bool straggler = false;
};

struct Row {
  std::string_view op;
  uint64_t bytes = 0;
  size_t count = 0;
  double time_us = 0, algbw = 0, busbw = 0;
  int64_t wrong = 0;
  // The per-iteration distribution: an iteration's time is the largest of the ranks' (per_iter
  // false when not measured: --async on GPU buffers).
  bool per_iter = false;
  double min_us = 0, median_us = 0, p99_us = 0, max_us = 0;
  std::optional<Arrival> arrival;  // with more than one rank, for operations where everyone waits
  // [rank][2 iters]: the iteration's time on that rank, then the part of it spent before the call
  std::vector<double> iterations;
};

std::optional<Arrival> last_arrivals(const std::vector<double>& t, int ranks, int iters, double median_time) {
  if (ranks < 2 || iters < 1) return std::nullopt;
  std::vector<int> last(ranks, 0);
  std::vector<std::vector<double>> late(ranks);
  std::vector<double> inside(ranks), others;
  for (int k = 0; k < iters; ++k) {
    for (int r = 0; r < ranks; ++r) inside[r] = t[r * 2 * iters + k] - t[r * 2 * iters + iters + k];
    const int who = static_cast<int>(std::min_element(inside.begin(), inside.end()) - inside.begin());
    others.clear();
    for (int r = 0; r < ranks; ++r)
      if (r != who) others.push_back(inside[r]);
    ++last[who];
    late[who].push_back(median(others) - inside[who]);
  }
  Arrival a;
  a.rank = static_cast<int>(std::max_element(last.begin(), last.end()) - last.begin());
  a.last = last[a.rank];
  a.late_us = median(late[a.rank]);
  a.p = std::min(1.0, ranks * binomial_tail(a.last, iters, 1.0 / ranks));
  a.straggler = a.p < kStragglerP && a.late_us >= kStragglerShare * median_time;
  return a;
}

double round_ns(double us) { return std::round(us * 1e3) / 1e3; }

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
    nlohmann::json iterations = nlohmann::json::array();  // --iters-json's results
    nlohmann::json peaks = nlohmann::json::object();
    nlohmann::json fits = nlohmann::json::object();
    int64_t wrong_total = 0;
    for (const Collective* c : o_.ops) {
      if (rank0() && !o_.json && o_.ops.size() > 1) std::printf("#\n# %s\n", std::string(c->name).c_str());
      if (rank0() && !o_.json) print_columns();
      allocate(*c, sizes.empty() ? 0 : sizes.back());
      double peak = 0;
      std::vector<comm::Sample> samples;
      std::vector<Row> rows;
      for (uint64_t size : sizes) {
        Row row = measure(*c, size);
        wrong_total += row.wrong;
        peak = std::max(peak, row.busbw);
        samples.push_back({static_cast<double>(row.bytes), row.time_us * 1e-6});
        if (!rank0()) continue;
        if (!o_.iters_json.empty()) iterations.push_back(iterations_json(*c, row));
        row.iterations.clear();  // reported above; the rows keep only their summaries
        if (o_.json)
          results.push_back(row_json(*c, row));
        else
          print_row(*c, row);
        rows.push_back(std::move(row));
      }
      peaks[std::string(c->name)] = peak;
      if (rank0() && !o_.json) {
        std::printf("# peak busbw (%s): %.3f GB/s\n", std::string(c->name).c_str(), peak);
        print_arrivals(*c, rows);
      }
      if (o_.fit && rank0()) fits[std::string(c->name)] = report_fit(*c, samples);
    }

    if (rank0() && !o_.iters_json.empty()) {
      nlohmann::json doc = config_json(names);
      doc["results"] = std::move(iterations);
      ckpt::write_file_atomic(o_.iters_json, doc.dump() + "\n");
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

  // The alpha-beta fit of one collective's sweep (comm/cost.h, two regimes where one line does
  // not fit): printed as comment lines, and returned for the JSON document. Bandwidth is
  // algorithmic (bytes as in the size column).
  nlohmann::json report_fit(const Collective& c, const std::vector<comm::Sample>& samples) const {
    const comm::CostFit f = comm::fit_cost_regimes(samples);
    const comm::CostModel& m = f.model;
    const double err = f.max_relative_error(samples);
    const double gbps = m.gbps();
    const std::string name(c.name);
    nlohmann::json predicted = nlohmann::json::array();
    for (uint64_t b : o_.predict) predicted.push_back({{"size", b}, {"time_us", f.seconds(static_cast<double>(b)) * 1e6}});
    if (!o_.json) {
      std::printf("# fit (%s): time = %.3f us + bytes / %.3f GB/s", name.c_str(), m.alpha_s * 1e6, gbps);
      if (f.knee_bytes > 0)
        std::printf(" from %.0f B up; below, %.3f us + bytes / %.3f GB/s (two regimes: a burst, a latency floor or a "
                    "protocol switch)", f.knee_bytes, f.below.alpha_s * 1e6, f.below.gbps());
      std::printf("; largest error over the sweep %.1f%%\n", err * 100);
      for (const auto& p : predicted)
        std::printf("# predicted (%s): %llu B in %.2f us\n", name.c_str(),
                    static_cast<unsigned long long>(p["size"].get<uint64_t>()), p["time_us"].get<double>());
      std::fflush(stdout);
    }
    nlohmann::json j = {{"alpha_us", m.alpha_s * 1e6}, {"algbw_gbps", gbps}, {"max_rel_err", err}, {"knee_bytes", f.knee_bytes}};
    if (f.knee_bytes > 0) j["below"] = {{"alpha_us", f.below.alpha_s * 1e6}, {"algbw_gbps", f.below.gbps()}};
    j["predicted"] = predicted;
    return j;
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
    // Each timed iteration is stamped where it ends: its time on this rank runs from the end of
    // the one before (of the barrier, for the first), so the times add up to the loop's. own:
    // the part before the call (the injected delay), not spent in the operation.
    using clock = std::chrono::steady_clock;
    const auto micros = [](clock::time_point a, clock::time_point b) {
      return std::chrono::duration<double, std::micro>(b - a).count();
    };
    const int iters = o_.iters;
    const bool delayed = params_.rank == o_.delay.rank;
    const auto delay = std::chrono::duration_cast<clock::duration>(std::chrono::duration<double, std::micro>(o_.delay.us));
    std::vector<double> mine(2 * static_cast<size_t>(iters), 0.0);  // times, then own parts
    comm_->barrier(Mode::sync).wait();
    const auto t0 = clock::now();
    auto prev = t0;
    for (int k = 0; k < iters; ++k) {
      if (delayed) {
        std::this_thread::sleep_for(delay);
        mine[iters + k] = micros(prev, clock::now());
      }
      c.run(*comm_, send, recv, params_, mode()).wait();
      const auto end = clock::now();
      mine[k] = micros(prev, end);
      prev = end;
    }
    // NCCL's wait() only orders the GPU's stream: the clock stops once the device is done, not
    // when the last operation was queued (--async would report the enqueue rate, and the
    // per-iteration stamps the enqueue times: not measured then).
    // On host buffers the loop ends at the last stamp: the mean is exactly the iterations' mean.
    if (device_.is_cuda()) {
      cuda::stream_synchronize(cuda::current_stream(), "the timed collectives");
      prev = clock::now();
    }
    double us = micros(t0, prev) / iters;

    // Agree on the time (mean, min or max over ranks) and on the wrong count (sum).
    comm::ReduceOp agg = o_.agg == TimeAgg::max   ? comm::ReduceOp::max
                         : o_.agg == TimeAgg::min ? comm::ReduceOp::min
                                                  : comm::ReduceOp::avg;
    host_->all_reduce({&us, 1, DType::f64, Device::cpu()}, {&us, 1, DType::f64, Device::cpu()}, agg, Mode::sync).wait();
    host_->all_reduce({&wrong, 1, DType::i64, Device::cpu()}, {&wrong, 1, DType::i64, Device::cpu()},
                      comm::ReduceOp::sum, Mode::sync).wait();

    const uint64_t bytes = std::max(n.send, n.recv) * es;
    const double algbw = us > 0 ? static_cast<double>(bytes) / (us * 1e3) : 0;  // GB/s
    Row row;
    row.op = c.name;
    row.bytes = bytes;
    row.count = count;
    row.time_us = us;
    row.algbw = algbw;
    row.busbw = algbw * c.bus_factor(params_.nranks);
    row.wrong = wrong;

    // Every rank's iterations, on every rank (rank 0 reports them).
    const int ranks = params_.nranks;
    row.iterations.assign(mine.size() * ranks, 0.0);
    host_->all_gather({mine.data(), mine.size(), DType::f64, Device::cpu()},
                      {row.iterations.data(), row.iterations.size(), DType::f64, Device::cpu()}, Mode::sync).wait();
    row.per_iter = per_iteration();
    if (row.per_iter) {
      std::vector<double> slowest(iters, 0.0);  // an iteration takes as long as its slowest rank
      for (int k = 0; k < iters; ++k)
        for (int r = 0; r < ranks; ++r) slowest[k] = std::max(slowest[k], row.iterations[r * 2 * iters + k]);
      std::sort(slowest.begin(), slowest.end());
      row.min_us = slowest.front();
      row.median_us = quantile(slowest, 0.5);
      row.p99_us = quantile(slowest, 0.99);
      row.max_us = slowest.back();
      if (c.everyone_waits) row.arrival = last_arrivals(row.iterations, ranks, iters, row.median_us);
    }
    return row;
  }

  // Whether the host's clock sees each iteration end: not with --async on GPU buffers, where
  // the iterations queue up on the GPU.
  bool per_iteration() const { return !(o_.async && device_.is_cuda()); }

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
    std::printf("# %d iterations after %d warm-up, %d checked; time is the %s over ranks; min to max: "
                "over the iterations, each its slowest rank's time\n", o_.iters, o_.warmup,
                o_.check, o_.agg == TimeAgg::mean ? "mean" : o_.agg == TimeAgg::min ? "min" : "max");
    for (size_t r = 0; r < names.size(); ++r) std::printf("#   rank %2zu: %s\n", r, names[r].c_str());
    if (o_.delay.rank >= 0)
      std::printf("# %s: rank %d sleeps %.0f us before each timed iteration (a testing aid)\n", kDelayEnv,
                  o_.delay.rank, o_.delay.us);
    std::string zero;  // the operations whose bus factor is 0 on this many ranks
    for (const Collective* c : o_.ops)
      if (c->bus_factor(params_.nranks) == 0) zero += (zero.empty() ? "" : ", ") + std::string(c->name);
    if (!zero.empty())
      std::printf("# %d rank: busbw = algbw x bus factor is 0 for %s (nothing crosses a link); run more ranks to "
                  "measure the network\n", params_.nranks, zero.c_str());
  }

  // The per-iteration columns come after the older ones, whose positions scripts rely on.
  static void print_columns() {
    std::printf("#%13s %12s %6s %6s %5s %11s %9s %9s %7s %11s %11s %11s %11s\n", "size", "count", "type", "redop",
                "root", "time", "algbw", "busbw", "#wrong", "min", "median", "p99", "max");
    std::printf("#%13s %12s %6s %6s %5s %11s %9s %9s %7s %11s %11s %11s %11s\n", "(B)", "(elements)", "", "", "",
                "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(us)", "(us)");
  }

  void print_row(const Collective& c, const Row& r) const {
    std::printf("%14llu %12zu %6s %6s %5d %11.2f %9.3f %9.3f %7lld", static_cast<unsigned long long>(r.bytes),
                r.count, std::string(dtype_name(o_.dtype)).c_str(),
                c.reduces ? std::string(comm::reduce_op_name(o_.redop)).c_str() : "none", c.rooted ? o_.root : -1,
                r.time_us, r.algbw, r.busbw, static_cast<long long>(r.wrong));
    if (r.per_iter)
      std::printf(" %11.2f %11.2f %11.2f %11.2f\n", r.min_us, r.median_us, r.p99_us, r.max_us);
    else
      std::printf(" %11s %11s %11s %11s\n", "-", "-", "-", "-");
    std::fflush(stdout);
  }

  // After an operation's table: the sizes where one rank was a straggler (see Arrival), one line
  // each, or "none". The rank that was last most often at every size is in --json; printed for
  // every size it would name ranks that were last by chance (each of two ranks half the time).
  void print_arrivals(const Collective& c, const std::vector<Row>& rows) const {
    const std::string name(c.name);
    if (params_.nranks < 2 || rows.empty()) return;
    if (!per_iteration()) {
      std::printf("# straggler (%s): not measured (--async on GPU buffers)\n", name.c_str());
    } else if (!c.everyone_waits) {
      std::printf("# straggler (%s): not inferred (the root waits for no one)\n", name.c_str());
    } else {
      int found = 0;
      for (const Row& r : rows) {
        const Arrival& a = *r.arrival;
        if (!a.straggler) continue;
        ++found;
        std::printf("# straggler (%s) %llu B: rank %d, last to arrive in %d/%d iterations (p %.2g), %.2f us late "
                    "(median; %.1f%% of the median time)\n",
                    name.c_str(), static_cast<unsigned long long>(r.bytes), a.rank, a.last, o_.iters, a.p, a.late_us,
                    100 * a.late_us / r.median_us);
      }
      if (!found) std::printf("# straggler (%s): none\n", name.c_str());
    }
    std::fflush(stdout);
  }

  nlohmann::json row_json(const Collective& c, const Row& r) const {
    nlohmann::json j = {{"op", c.name},
                        {"size", r.bytes},
                        {"count", r.count},
                        {"type", dtype_name(o_.dtype)},
                        {"redop", c.reduces ? comm::reduce_op_name(o_.redop) : "none"},
                        {"root", c.rooted ? o_.root : -1},
                        {"time_us", r.time_us},
                        {"algbw_gbps", r.algbw},
                        {"busbw_gbps", r.busbw},
                        {"wrong", r.wrong}};
    for (const auto& [key, v] : {std::pair{"time_min_us", r.min_us}, std::pair{"time_median_us", r.median_us},
                                 std::pair{"time_p99_us", r.p99_us}, std::pair{"time_max_us", r.max_us}})
      j[key] = r.per_iter ? nlohmann::json(v) : nlohmann::json(nullptr);
    if (r.arrival) {
      const Arrival& a = *r.arrival;
      j["last_to_arrive"] = {{"rank", a.rank},       {"iterations", a.last}, {"of", o_.iters},
                             {"late_us", a.late_us}, {"p", a.p},             {"straggler", a.straggler}};
    } else {
      j["last_to_arrive"] = nullptr;
    }
    return j;
  }

  // One size's iterations for --iters-json: [iteration][rank] arrays, to the nanosecond.
  nlohmann::json iterations_json(const Collective& c, const Row& r) const {
    const int iters = o_.iters, ranks = params_.nranks;
    nlohmann::json time = nlohmann::json::array(), own = nlohmann::json::array();
    for (int k = 0; k < iters; ++k) {
      nlohmann::json t = nlohmann::json::array(), o = nlohmann::json::array();
      for (int q = 0; q < ranks; ++q) {
        t.push_back(round_ns(r.iterations[q * 2 * iters + k]));
        o.push_back(round_ns(r.iterations[q * 2 * iters + iters + k]));
      }
      time.push_back(std::move(t));
      own.push_back(std::move(o));
    }
    return {{"op", c.name}, {"size", r.bytes}, {"count", r.count}, {"time_us", std::move(time)},
            {"before_call_us", std::move(own)}};
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
              {"max_bytes", o_.max_bytes},
              {"delay", o_.delay.rank < 0 ? nlohmann::json(nullptr)
                                          : nlohmann::json{{"rank", o_.delay.rank}, {"us", o_.delay.us}}}}},
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

Delay parse_delay(const char* value, int nranks) {
  Delay d;
  if (!value || !*value) return d;
  const std::string_view v(value);
  const size_t colon = v.find(':');
  int rank = -1;
  double us = -1;
  bool ok = colon != std::string_view::npos;
  if (ok) {
    const auto r = std::from_chars(v.data(), v.data() + colon, rank);
    const auto t = std::from_chars(v.data() + colon + 1, v.data() + v.size(), us);
    ok = r.ec == std::errc() && r.ptr == v.data() + colon && t.ec == std::errc() && t.ptr == v.data() + v.size() &&
         std::isfinite(us) && us >= 0;
  }
  if (!ok) fail_usage("{}={}: expected RANK:MICROSECONDS, as 1:50000", kDelayEnv, v);
  if (rank < 0 || rank >= nranks) fail_usage("{}={}: rank {} is not a rank of this job of {}", kDelayEnv, v, rank, nranks);
  d.rank = rank;
  d.us = us;
  return d;
}

int run_benchmark(comm::Runtime& rt, const Options& o) { return Engine(rt, o).run(); }

}  // namespace dtk::bench
