// diff: two checkpoints compared tensor by tensor, like h5diff (exit 0 same, 1 different).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <set>

#include "command.h"
#include "dtk/cli/checks.h"
#include "dtk/core/error.h"

namespace dtk::inspect {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Differences of one tensor, accumulated chunk by chunk. Elements are equal when their values
// are (NaN equals NaN); otherwise |a - b| is the absolute and |a - b| / |b| the relative
// difference, and the element counts as different unless |a - b| <= atol + rtol * |b|.
struct Difference {
  double max_abs = 0, max_rel = 0;
  int64_t differing = 0;

  void add(const Tensor& a, const Tensor& b, double rtol, double atol) {
    if (a.dtype() == b.dtype() && std::memcmp(a.data(), b.data(), a.bytes()) == 0) return;
    const Tensor x = to_f64(a), y = to_f64(b);
    const double* xa = x.ptr<double>();
    const double* ya = y.ptr<double>();
    const bool i64 = a.dtype() == DType::i64 && b.dtype() == DType::i64;  // beyond 2^53 f64 is not exact
    for (int64_t i = 0, n = x.numel(); i < n; ++i) {
      double d = 0;
      if (i64 && a.ptr<int64_t>()[i] != b.ptr<int64_t>()[i]) {
        d = std::fabs(static_cast<double>(static_cast<__int128>(a.ptr<int64_t>()[i]) - b.ptr<int64_t>()[i]));
      } else if (xa[i] == ya[i] || (std::isnan(xa[i]) && std::isnan(ya[i]))) {
        continue;
      } else {
        d = std::isnan(xa[i]) || std::isnan(ya[i]) ? kInf : std::fabs(xa[i] - ya[i]);
      }
      const double ref = std::fabs(ya[i]);
      max_abs = std::max(max_abs, d);
      max_rel = std::max(max_rel, ref > 0 ? d / ref : kInf);
      if (!(d <= atol + rtol * ref)) ++differing;
    }
  }
};

class Diff : public Command {
 public:
  void add_options(CLI::App& sub) override {
    sub.add_option("A", a_path_, "the first checkpoint")->required();
    sub.add_option("B", b_path_, "the second checkpoint (the reference of relative differences)")->required();
    sub.add_option("NAME", names_, "only these tensors, or groups ending in / (model/); default all");
    sub.add_option("--rtol", rtol_, "relative tolerance: |a - b| <= atol + rtol * |b| counts as the same")
        ->check(cli::at_least(0));
    sub.add_option("--atol", atol_, "absolute tolerance")->check(cli::at_least(0));
    sub.add_flag("-q,--quiet", quiet_, "print nothing; the exit status tells");
    sub.add_flag("--json", json_, "print one JSON document instead of the table");
  }
  void validate() override {
    a_ = open_input(a_path_);
    b_ = open_input(b_path_);
    check_names(names_, {a_.get(), b_.get()});
  }
  int run() override {
    std::set<std::string> names;
    for (const auto* r : {a_.get(), b_.get()})
      for (const auto& t : r->tensors())
        if (names_.empty() || selected(t.name, names_))
          names.insert(t.name);
    Table table({"name", "result", "max_abs", "max_rel", "differing", "a", "b"});
    nlohmann::json rows = nlohmann::json::array(), only_a = nlohmann::json::array(), only_b = nlohmann::json::array();
    int64_t compared = 0, different = 0;
    for (const auto& name : names) {
      const bool in_a = a_->contains(name), in_b = b_->contains(name);
      if (!in_a || !in_b) {
        (in_a ? only_a : only_b).push_back(name);
        ++different;
        const auto& t = in_a ? a_->info(name) : b_->info(name);
        const std::string desc = std::string(dtype_name(t.dtype)) + shape_str(t.shape);
        table.add({name, in_a ? "only-in-a" : "only-in-b", "-", "-", "-", in_a ? desc : "-", in_b ? desc : "-"});
        continue;
      }
      const auto& ta = a_->info(name);
      const auto& tb = b_->info(name);
      const std::string da = std::string(dtype_name(ta.dtype)) + shape_str(ta.shape);
      const std::string db = std::string(dtype_name(tb.dtype)) + shape_str(tb.shape);
      nlohmann::json row = {{"name", name}, {"a", {{"dtype", dtype_name(ta.dtype)}, {"shape", ta.shape}}},
                            {"b", {{"dtype", dtype_name(tb.dtype)}, {"shape", tb.shape}}}};
      ++compared;
      if (ta.shape != tb.shape) {
        ++different;
        row["result"] = "shape";
        rows.push_back(row);
        table.add({name, "shape", "-", "-", "-", da, db});
        continue;
      }
      const Difference d = compare(ta, tb);
      std::string result = d.differing > 0 ? "different" : d.max_abs > 0 ? "close" : "same";
      if (ta.dtype != tb.dtype) result = "dtype";
      if (result == "different" || result == "dtype") ++different;
      row.update({{"result", result}, {"max_abs", json_num(d.max_abs)}, {"max_rel", json_num(d.max_rel)},
                  {"differing", d.differing}});
      rows.push_back(row);
      table.add({name, result, num(d.max_abs), num(d.max_rel), std::to_string(d.differing), da, db});
    }
    const bool same = different == 0;
    if (json_ && !quiet_) {
      print_json({{"a", a_->path().string()}, {"b", b_->path().string()}, {"rtol", rtol_}, {"atol", atol_},
                  {"same", same}, {"compared", compared}, {"different", different}, {"tensors", rows},
                  {"only_in_a", only_a}, {"only_in_b", only_b}});
    } else if (!quiet_) {
      table.print();
      std::cout << "# " << compared << " tensors compared, " << different << " different (" << only_a.size()
                << " only in A, " << only_b.size() << " only in B); rtol " << rtol_ << ", atol " << atol_ << '\n';
    }
    return same ? 0 : 1;
  }

 private:
  Difference compare(const ckpt::TensorInfo& ta, const ckpt::TensorInfo& tb) const {
    Difference d;
    const size_t elem = std::max<size_t>({dtype_size(ta.dtype), dtype_size(tb.dtype), 8});
    const int64_t chunk = rows_per_chunk(ta, elem, kChunkBytes / 4);
    for_each_chunk(*a_, ta, chunk, [&](int64_t row0, const Tensor& ra) {
      Tensor rb = Tensor::empty(ra.shape(), tb.dtype);
      b_->read_rows(tb.name, row0, rb);
      d.add(ra, rb, rtol_, atol_);
    });
    return d;
  }

  std::string a_path_, b_path_;
  std::vector<std::string> names_;
  double rtol_ = 0, atol_ = 0;
  bool quiet_ = false, json_ = false;
  std::unique_ptr<ckpt::Reader> a_, b_;
};

}  // namespace

std::unique_ptr<Command> make_diff() { return std::make_unique<Diff>(); }

}  // namespace dtk::inspect
