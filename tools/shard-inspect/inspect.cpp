// The read-only subcommands: ls, show, stats, verify.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>

#include "command.h"
#include "dtk/cli/cli.h"
#include "dtk/core/error.h"

namespace dtk::inspect {
namespace {

// Options of a subcommand that reads one checkpoint and prints a table or JSON.
class ReadCommand : public Command {
 protected:
  void add_input(CLI::App& sub) {
    sub.add_option("CKPT", input_, "a checkpoint file, a sharded state's directory or its index.h5")->required();
    sub.add_flag("--json", json_, "print one JSON document instead of the table");
  }
  void validate() override { in_ = open_input(input_); }

  std::string input_;
  bool json_ = false;
  std::unique_ptr<ckpt::Reader> in_;
};

// ---------------------------------------------------------------------------- ls

class Ls : public ReadCommand {
 public:
  void add_options(CLI::App& sub) override { add_input(sub); }
  int run() override {
    size_t total = 0;
    for (const auto& t : in_->tensors()) total += t.bytes();
    const auto& ts = in_->tensors();
    if (json_) {
      nlohmann::json j = {{"path", in_->path().string()}, {"sharded", in_->sharded()}};
      if (in_->sharded()) j["shard_world_size"] = in_->shard_files().size();
      j["tensors"] = nlohmann::json::array();
      for (const auto& t : ts) j["tensors"].push_back(tensor_json(t));
      j["total"] = {{"tensors", ts.size()}, {"bytes", total}};
      print_json(j);
      return 0;
    }
    Table table({"name", "dtype", "shape", "sharding", "bytes"});
    for (const auto& t : ts)
      table.add({t.name, std::string(dtype_name(t.dtype)), shape_str(t.shape), sharding(t), std::to_string(t.bytes())});
    table.print();
    std::cout << "# total: " << ts.size() << " tensors, " << total << " bytes (" << cli::format_size(total) << ")";
    if (in_->sharded()) std::cout << ", " << in_->shard_files().size() << " shard files";
    std::cout << '\n';
    return 0;
  }
};

// ---------------------------------------------------------------------------- show

class Show : public ReadCommand {
 public:
  void add_options(CLI::App& sub) override { add_input(sub); }
  int run() override {
    const ckpt::Metadata& m = in_->metadata();
    size_t total = 0;
    for (const auto& t : in_->tensors()) total += t.bytes();
    nlohmann::json j = {{"path", in_->path().string()},
                        {"format", ckpt::kFormat},
                        {"schema_version", ckpt::kSchemaVersion},
                        {"program", m.program},
                        {"program_version", m.program_version},
                        {"step", m.step},
                        {"world_size", m.world_size},
                        {"created", m.created},
                        {"model_config", m.model_config},
                        {"optim_config", m.optim_config},
                        {"data_position", m.data_position},
                        {"rng_state", m.rng_state},
                        {"extra", m.extra},
                        {"sharded", in_->sharded()},
                        {"tensors", in_->tensors().size()},
                        {"bytes", total}};
    nlohmann::json shards = nlohmann::json::array();
    for (const auto& f : in_->shard_files()) shards.push_back(f.filename().string());
    if (in_->sharded()) {
      j["shard_world_size"] = shards.size();
      j["shard_files"] = shards;
    }
    if (json_) {
      print_json(j);
      return 0;
    }
    Table table({"key", "value"});
    for (const auto& [k, v] : j.items()) {
      if (k == "shard_files") continue;
      table.add({k, v.is_string() ? v.get<std::string>() : v.dump()});
    }
    for (const auto& s : shards) table.add({"shard_file", s.get<std::string>()});
    table.print();
    return 0;
  }
};

// ---------------------------------------------------------------------------- stats

// Statistics of the finite elements, accumulated chunk by chunk in f64: counts, extremes, the
// mean and sum of squared deviations (merged as Chan et al.), and the L2 norm scaled as LAPACK's
// dnrm2 so that it neither overflows nor underflows.
struct Stats {
  int64_t numel = 0, finite = 0, nan = 0, inf = 0;
  double min = std::numeric_limits<double>::infinity(), max = -std::numeric_limits<double>::infinity();
  double mean = 0, m2 = 0, scale = 0, ssq = 0;

  void add(const double* x, int64_t n) {
    numel += n;
    int64_t c = 0;
    double sum = 0, amax = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(x[i])) {
        ++nan;
      } else if (std::isinf(x[i])) {
        ++inf;
      } else {
        ++c;
        sum += x[i];
        min = std::min(min, x[i]);
        max = std::max(max, x[i]);
        amax = std::max(amax, std::fabs(x[i]));
      }
    }
    if (c == 0) return;
    const double cmean = sum / static_cast<double>(c);
    double cm2 = 0, cssq = 0;
    for (int64_t i = 0; i < n; ++i)
      if (std::isfinite(x[i])) {
        cm2 += (x[i] - cmean) * (x[i] - cmean);
        if (amax > 0) cssq += (x[i] / amax) * (x[i] / amax);
      }
    const double na = static_cast<double>(finite), nb = static_cast<double>(c), nt = na + nb;
    const double delta = cmean - mean;
    mean += delta * nb / nt;
    m2 += cm2 + delta * delta * na * nb / nt;
    finite += c;
    if (amax > scale) {
      ssq = (scale > 0 ? ssq * (scale / amax) * (scale / amax) : 0) + cssq;
      scale = amax;
    } else if (amax > 0) {
      ssq += cssq * (amax / scale) * (amax / scale);
    }
  }
  double l2() const { return scale * std::sqrt(ssq); }
  double std_dev() const { return finite ? std::sqrt(m2 / static_cast<double>(finite)) : std::nan(""); }
};

class StatsCmd : public ReadCommand {
 public:
  void add_options(CLI::App& sub) override {
    add_input(sub);
    sub.add_option("NAME", names_, "only these tensors, or groups ending in / (model/); default all");
  }
  void validate() override {
    ReadCommand::validate();
    check_names(names_, {in_.get()});
  }
  int run() override {
    std::vector<const ckpt::TensorInfo*> ts;
    for (const auto& t : in_->tensors())
      if (names_.empty() || selected(t.name, names_)) ts.push_back(&t);
    Table table({"name", "dtype", "numel", "l2", "min", "max", "mean", "std", "nan", "inf"});
    nlohmann::json j = nlohmann::json::array();
    for (const auto* t : ts) {
      Stats s;
      for_each_chunk(*in_, *t, rows_per_chunk(*t, 8, kChunkBytes / 2), [&](int64_t, const Tensor& rows) {
        const Tensor d = to_f64(rows);
        s.add(d.ptr<double>(), d.numel());
      });
      const bool any = s.finite > 0;
      const double nan = std::nan("");
      const double mn = any ? s.min : nan, mx = any ? s.max : nan, mean = any ? s.mean : nan;
      if (json_)
        j.push_back({{"name", t->name}, {"dtype", dtype_name(t->dtype)}, {"shape", t->shape}, {"numel", s.numel},
                     {"l2", json_num(s.l2())}, {"min", json_num(mn)}, {"max", json_num(mx)},
                     {"mean", json_num(mean)}, {"std", json_num(s.std_dev())}, {"nan", s.nan}, {"inf", s.inf}});
      else
        table.add({t->name, std::string(dtype_name(t->dtype)), std::to_string(s.numel), num(s.l2()), num(mn), num(mx),
                   num(mean), num(s.std_dev()), std::to_string(s.nan), std::to_string(s.inf)});
    }
    if (json_)
      print_json({{"path", in_->path().string()}, {"tensors", j}});
    else
      table.print();
    return 0;
  }

 private:
  std::vector<std::string> names_;
};

// ---------------------------------------------------------------------------- verify

class Verify : public ReadCommand {
 public:
  void add_options(CLI::App& sub) override { add_input(sub); }
  int run() override {
    nlohmann::json tensors = nlohmann::json::array();
    Table table({"name", "dtype", "shape", "bytes", "result"});
    size_t bytes = 0;
    std::string current;
    try {
      if (in_->sharded()) check_shards();
      for (const auto& t : in_->tensors()) {
        current = t.name;
        for_each_chunk(*in_, t, rows_per_chunk(t, dtype_size(t.dtype), kChunkBytes), [](int64_t, const Tensor&) {});
        bytes += t.bytes();
        tensors.push_back({{"name", t.name}, {"bytes", t.bytes()}, {"ok", true}});
        table.add({t.name, std::string(dtype_name(t.dtype)), shape_str(t.shape), std::to_string(t.bytes()), "ok"});
      }
    } catch (const Error& e) {
      if (!current.empty()) {
        tensors.push_back({{"name", current}, {"ok", false}});
        table.add({current, "", "", "", "FAILED"});
      }
      if (json_)
        print_json({{"path", in_->path().string()}, {"ok", false}, {"error", e.what()}, {"tensors", tensors}});
      else
        table.print();
      fail_usage(e.what());
    }
    const size_t nshards = in_->shard_files().size();
    if (json_) {
      print_json({{"path", in_->path().string()}, {"ok", true}, {"tensors", tensors}, {"shard_files", nshards},
                  {"bytes", bytes}});
    } else {
      table.print();
      std::cout << "# ok: " << in_->tensors().size() << " tensors, " << bytes << " bytes";
      if (in_->sharded()) std::cout << ", " << nshards << " shard files";
      std::cout << '\n';
    }
    return 0;
  }

 private:
  // Every rank file opens as a checkpoint of the same run and holds every shard the index maps
  // to it, with the right dtype and shape; the shards of each tensor tile its rows.
  void check_shards() {
    const ckpt::Metadata& m = in_->metadata();
    const auto files = in_->shard_files();
    const int64_t n = static_cast<int64_t>(files.size());
    std::vector<std::unique_ptr<ckpt::Reader>> ranks;
    for (const auto& f : files) {
      ranks.push_back(std::make_unique<ckpt::Reader>(f));
      const ckpt::Metadata& rm = ranks.back()->metadata();
      if (rm.program != m.program || rm.step != m.step || rm.world_size != m.world_size || rm.created != m.created)
        fail_usage("{}: metadata (program {}, step {}, created {}) does not match the index's (program {}, step {}, "
                   "created {})",
                   f.string(), rm.program, rm.step, rm.created, m.program, m.step, m.created);
    }
    auto expect = [&](int64_t r, const ckpt::TensorInfo& t, const Shape& shape) {
      const ckpt::Reader& rf = *ranks[static_cast<size_t>(r)];
      const std::string where = files[static_cast<size_t>(r)].string() + ": " + t.name;
      if (!rf.contains(t.name)) fail_usage(where + ": shard is missing");
      const ckpt::TensorInfo& s = rf.info(t.name);
      if (s.dtype != t.dtype || s.shape != shape)
        fail_usage(where + ": shard is " + std::string(dtype_name(s.dtype)) + shape_str(s.shape) + ", expected " +
                   std::string(dtype_name(t.dtype)) + shape_str(shape));
    };
    for (const auto& t : in_->tensors()) {
      const std::string where = in_->path().string() + ": " + t.name;
      if (t.sharded()) {
        if (static_cast<int64_t>(t.shard_offsets.size()) != n || static_cast<int64_t>(t.shard_lengths.size()) != n)
          fail_usage("{}: {} shard offsets for {} rank files", where, t.shard_offsets.size(), n);
        if (t.shape.empty()) fail_usage(where + ": a 0-d tensor cannot be sharded");
        int64_t next = 0;
        for (int64_t r = 0; r < n; ++r) {
          if (t.shard_offsets[r] != next || t.shard_lengths[r] < 0)
            fail_usage("{}: rank {}'s rows start at {}, expected {}", where, r, t.shard_offsets[r], next);
          next += t.shard_lengths[r];
          Shape local = t.shape;
          local[0] = t.shard_lengths[r];
          expect(r, t, local);
        }
        if (next != t.shape[0])
          fail_usage("{}: the shards hold {} rows of {}", where, next, t.shape[0]);
      } else {
        if (t.owner < 0 || t.owner >= n) fail_usage(where + ": not mapped to one of the rank files");
        expect(t.owner, t, t.shape);
      }
    }
  }
};

}  // namespace

std::unique_ptr<Command> make_ls() { return std::make_unique<Ls>(); }
std::unique_ptr<Command> make_show() { return std::make_unique<Show>(); }
std::unique_ptr<Command> make_stats() { return std::make_unique<StatsCmd>(); }
std::unique_ptr<Command> make_verify() { return std::make_unique<Verify>(); }

}  // namespace dtk::inspect
