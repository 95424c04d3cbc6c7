// Distributed Shampoo's configuration and its plan (shampoo.h): the options' checks, how a
// parameter is cut into blocks, which rank owns which block, and which step recomputes which
// block's roots. Pure functions of the shapes and the world size; the step is shampoo.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/optim/shampoo.h"
#include "dtk/optim/shampoo_internal.h"

namespace dtk::optim {

// ------------------------------------------------------------------------------ config

void ShampooConfig::validate() const {
  auto bad = [](std::string_view opt, std::string_view need, const auto& got) {
    fail_usage("shampoo: {} must be {}, got {}", opt, need, got);
  };
  auto num = [](double v) { return nlohmann::json(v).dump(); };
  if (name != Kind::shampoo) bad("name", "shampoo", std::string(name_of(name)));
  if (max_preconditioner_dim < 1) bad("max_preconditioner_dim", ">= 1", max_preconditioner_dim);
  if (!(beta2 >= 0 && beta2 <= 1)) bad("beta2", "in [0, 1]", num(beta2));
  if (factor_dtype != DType::f32 && factor_dtype != DType::f64) bad("factor_dtype", "f32 or f64", std::string(dtype_name(factor_dtype)));
  if (basis_dtype != DType::f32 && basis_dtype != DType::f64) bad("basis_dtype", "f32 or f64", std::string(dtype_name(basis_dtype)));
  if (!(epsilon >= 0) || !std::isfinite(epsilon)) bad("epsilon", "finite and >= 0", num(epsilon));
  if (epsilon == 0 && preconditioner == Preconditioner::root && root_method != RootMethod::pseudo_inverse)
    fail_usage("shampoo: --shampoo-epsilon 0 needs --root-method pseudo-inverse (the roots of singular factors are not finite)");
  if (preconditioner == Preconditioner::eigenvalue_corrected && !((ec_epsilon < 0 ? epsilon : ec_epsilon) > 0))
    fail_usage("shampoo: --preconditioner eigenvalue-corrected needs --ec-epsilon (or --shampoo-epsilon) above 0");
  if (precondition_frequency < 1) bad("precondition_frequency", ">= 1", precondition_frequency);
  if (start_preconditioning_step < 1 && start_preconditioning_step != -1)
    bad("start_preconditioning_step", ">= 1 (or -1: precondition_frequency)", start_preconditioning_step);
  if (start_preconditioning_step != -1 && start_preconditioning_step < precondition_frequency)  // as the reference
    bad("start_preconditioning_step", fmt::format(">= precondition_frequency ({})", precondition_frequency),
        start_preconditioning_step);
  if (!(exponent_override >= 0) || !std::isfinite(exponent_override))
    bad("exponent_override", "finite and >= 0 (0: 2 * order)", num(exponent_override));
  if (qr_max_iterations < 0) bad("qr_max_iterations", ">= 0", qr_max_iterations);
  if (!(qr_tolerance >= 0 && qr_tolerance <= 1)) bad("qr_tolerance", "in [0, 1]", num(qr_tolerance));
  if (root_spread < 1 || root_spread > precondition_frequency)
    bad("root_spread", fmt::format("in [1, precondition_frequency ({})]", precondition_frequency), root_spread);
  if (root_method == RootMethod::newton) {
    if (exponent_override != 0 && (exponent_override != std::floor(exponent_override) || exponent_override > 64))
      bad("exponent_override", "an integer in [1, 64] with root_method newton", num(exponent_override));
    if (newton_max_iters < 1) bad("newton_max_iters", ">= 1", newton_max_iters);
    if (!(newton_tolerance > 0)) bad("newton_tolerance", "> 0", num(newton_tolerance));
  }
  if (!(grafting_beta2 >= 0 && grafting_beta2 < 1)) bad("grafting_beta2", "in [0, 1)", num(grafting_beta2));
  if (!(grafting_epsilon > 0) || !std::isfinite(grafting_epsilon)) bad("grafting_epsilon", "finite and > 0", num(grafting_epsilon));
  if (grafting_scope == GraftingScope::diagonal && grafting == Grafting::none)
    fail_usage("shampoo: --grafting-scope diagonal needs a --grafting method (the diagonal blocks' direction)");
  if (grafting_scope == GraftingScope::diagonal && preconditioner == Preconditioner::dion)
    fail_usage("shampoo: --grafting-scope diagonal does not fit --preconditioner dion (its matrices are never grafted: "
               "that is already the scope)");
  if (!(beta1 >= 0 && beta1 < 1)) bad("beta1", "in [0, 1)", num(beta1));
  if (!(momentum >= 0 && momentum < 1)) bad("momentum", "in [0, 1)", num(momentum));
  if (nesterov && momentum == 0) fail_usage("shampoo: nesterov needs a momentum above 0");
  if (!(weight_decay >= 0) || !std::isfinite(weight_decay)) bad("weight_decay", "finite and >= 0", num(weight_decay));
  if (factor_update_every < 1) bad("factor_update_every", ">= 1", factor_update_every);
  if (root_method == RootMethod::pseudo_inverse) {
    if (epsilon != 0 && epsilon != ShampooConfig{}.epsilon)
      fail_usage("shampoo: --shampoo-epsilon {} does not fit --root-method pseudo-inverse (its rank cutoff replaces "
                 "epsilon: --rank-rtol, --rank-atol)", num(epsilon));
    if (!std::isfinite(rank_rtol)) bad("rank_rtol", "finite (< 0: n * machine epsilon)", num(rank_rtol));
    if (!(rank_atol >= 0) || !std::isfinite(rank_atol)) bad("rank_atol", "finite and >= 0", num(rank_atol));
  }
  if (!(ec_beta2 < 0 || ec_beta2 <= 1) || !std::isfinite(ec_beta2)) bad("ec_beta2", "in [0, 1] (< 0: beta2)", num(ec_beta2));
  if (!std::isfinite(ec_epsilon)) bad("ec_epsilon", "finite (< 0: epsilon)", num(ec_epsilon));
  if (newton_schulz_steps < 1) bad("newton_schulz_steps", ">= 1", newton_schulz_steps);
  for (const std::string& d : diagonal_params)
    if (d.empty()) bad("diagonal_params", "non-empty names", "an empty one");
  // Options that do not fit the preconditioner: one line naming both (the CLI's spellings).
  const ShampooConfig def;
  const std::string pre = fmt::format("--preconditioner {}", name_of(preconditioner));
  auto misfit = [&](bool set, const std::string& option) {
    if (set) fail_usage("shampoo: {} does not fit {}", option, pre);
  };
  const bool rank_set = rank_rtol != def.rank_rtol || rank_atol != def.rank_atol;
  const bool ec_set = ec_beta2 != def.ec_beta2 || ec_epsilon != def.ec_epsilon;
  auto spectral_opts = [&] {
    misfit(spectral_method != def.spectral_method, fmt::format("--spectral-method {}", name_of(spectral_method)));
    misfit(newton_schulz_steps != def.newton_schulz_steps, "--newton-schulz-steps");
    misfit(spectral_scale != def.spectral_scale, fmt::format("--spectral-scale {}", name_of(spectral_scale)));
  };
  if (root_method != RootMethod::pseudo_inverse && rank_set)
    fail_usage("shampoo: --rank-rtol and --rank-atol need --root-method pseudo-inverse (it is {})", name_of(root_method));
  switch (preconditioner) {
    case Preconditioner::root:
      misfit(ec_set, ec_beta2 != def.ec_beta2 ? "--ec-beta2" : "--ec-epsilon");
      misfit(basis_dtype != def.basis_dtype, "--basis-dtype f64");
      spectral_opts();
      break;
    case Preconditioner::eigenvalue_corrected:
      misfit(exponent_override != 0, "--exponent-override");
      misfit(root_method != RootMethod::eigh && root_method != RootMethod::qr,
             fmt::format("--root-method {}", name_of(root_method)));
      spectral_opts();
      break;
    case Preconditioner::spectral:
    case Preconditioner::dion:  // no factors, no root steps
      misfit(root_method != RootMethod::eigh, fmt::format("--root-method {}", name_of(root_method)));
      misfit(exponent_override != 0, "--exponent-override");
      misfit(factor_update_every != 1, "--factor-update-every");
      misfit(start_preconditioning_step != -1, "--start-preconditioning-step");
      misfit(precondition_frequency != def.precondition_frequency && precondition_frequency != 1,
             "--precondition-frequency");
      misfit(root_spread != 1, "--root-spread");
      misfit(factor_dtype != DType::f32, "--factor-dtype f64");
      misfit(ec_set, ec_beta2 != def.ec_beta2 ? "--ec-beta2" : "--ec-epsilon");
      misfit(basis_dtype != def.basis_dtype, "--basis-dtype f64");
      if (preconditioner == Preconditioner::spectral) break;
      misfit(spectral_method != def.spectral_method, fmt::format("--spectral-method {}", name_of(spectral_method)));
      misfit(newton_schulz_steps != def.newton_schulz_steps, "--newton-schulz-steps");
      if (momentum > 0)
        fail_usage("shampoo: --momentum does not fit --preconditioner dion (its buffer M is the momentum: --beta1)");
      break;
  }
  if (preconditioner != Preconditioner::dion) {
    misfit(dion_rank_fraction != def.dion_rank_fraction, "--dion-rank-fraction");
    misfit(dion_rank != def.dion_rank, "--dion-rank");
    misfit(dion_sync != def.dion_sync, fmt::format("--dion-sync {}", name_of(dion_sync)));
  }
  if (!(dion_rank_fraction > 0 && dion_rank_fraction <= 1)) bad("dion_rank_fraction", "in (0, 1]", num(dion_rank_fraction));
  if (dion_rank < 0) bad("dion_rank", ">= 0 (0: by dion_rank_fraction)", dion_rank);
  if (trainers_per_group < 0) bad("trainers_per_group", ">= 0 (0: the whole world)", trainers_per_group);
  if (communication_dtype != DType::f32 && communication_dtype != DType::bf16)
    bad("communication_dtype", "f32 or bf16", std::string(dtype_name(communication_dtype)));
}

// ------------------------------------------------------------------------------ Dion's matrices

bool named_diagonal(const ShampooConfig& c, const std::string& name) {
  return std::any_of(c.diagonal_params.begin(), c.diagonal_params.end(),
                     [&](const std::string& d) { return name.find(d) != std::string::npos; });
}

bool dion_matrix(const ShampooConfig& c, const std::string& name, const Shape& shape) {
  if (c.preconditioner != Preconditioner::dion || named_diagonal(c, name)) return false;
  return std::count_if(shape.begin(), shape.end(), [](int64_t d) { return d > 1; }) >= 2 &&
         std::none_of(shape.begin(), shape.end(), [](int64_t d) { return d == 0; });
}

int64_t dion_rank(const ShampooConfig& c, int64_t m, int64_t n) {
  const int64_t k = std::min(m, n);
  const int64_t r = c.dion_rank > 0 ? c.dion_rank
                                    : static_cast<int64_t>(std::ceil(c.dion_rank_fraction * static_cast<double>(k) - 1e-9));
  return std::clamp<int64_t>(r, 1, k);
}

std::vector<char> dion_local_gradients(const ShampooConfig& c, const std::vector<nn::Param>& params) {
  std::vector<char> out;
  for (const nn::Param& p : params)
    out.push_back(c.dion_sync == DionSync::factors && dion_matrix(c, p.name, p.shape) ? 1 : 0);
  return out;
}

// ------------------------------------------------------------------------------ blocking

ShampooBlocking shampoo_blocking(const Shape& shape, int64_t max_dim, bool matrix_view) {
  if (max_dim < 1) fail_usage("shampoo: max_preconditioner_dim must be >= 1, got {}", max_dim);
  ShampooBlocking b;
  Shape sq;
  for (int64_t d : shape) {
    if (d < 0) fail_usage("shampoo: negative dimension in " + shape_str(shape));
    if (d == 0) return b;  // no elements: no blocks
    if (d != 1) sq.push_back(d);
  }
  if (matrix_view) {  // [d0, product of the rest] (Muon's view(d0, -1))
    if (!sq.empty()) b.merged.push_back(sq[0]);
    if (sq.size() > 1) b.merged.push_back(std::accumulate(sq.begin() + 1, sq.end(), int64_t{1}, std::multiplies<>()));
  } else {
    // Merge from the last dim backwards while the product stays <= max_dim.
    for (auto it = sq.rbegin(); it != sq.rend(); ++it) {
      if (!b.merged.empty() && b.merged.back() <= max_dim / *it)
        b.merged.back() *= *it;
      else
        b.merged.push_back(*it);
    }
    std::reverse(b.merged.begin(), b.merged.end());
  }
  const size_t k = b.merged.size();
  std::vector<int64_t> grid(k), idx(k, 0);
  for (size_t i = 0; i < k; ++i) grid[i] = (b.merged[i] + max_dim - 1) / max_dim;
  while (true) {
    Shape s(k);
    std::vector<int64_t> off(k);
    for (size_t i = 0; i < k; ++i) {
      off[i] = idx[i] * max_dim;
      s[i] = std::min(max_dim, b.merged[i] - off[i]);
    }
    b.block_shapes.push_back(s);
    b.offsets.push_back(off);
    size_t i = k;
    while (i > 0) {
      --i;
      if (++idx[i] < grid[i]) break;
      idx[i] = 0;
      if (i == 0) return b;
    }
    if (k == 0) return b;
  }
}

std::vector<int> shampoo_assign(const std::vector<int64_t>& sizes, int ranks) {
  if (ranks < 1) fail_usage("shampoo_assign: ranks must be >= 1");
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return sizes[a] > sizes[b]; });
  std::vector<int64_t> load(static_cast<size_t>(ranks), 0);
  std::vector<int> out(sizes.size(), 0);
  for (size_t i : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    out[i] = r;
    load[static_cast<size_t>(r)] += sizes[i];
  }
  return out;
}

std::vector<int> shampoo_root_phases(const std::vector<Shape>& block_dims, int64_t spread) {
  if (spread < 1) fail_usage("shampoo_root_phases: spread must be >= 1");
  std::vector<int64_t> cost;
  cost.reserve(block_dims.size());
  for (const Shape& d : block_dims) {
    int64_t c = 0;
    for (int64_t b : d) c += b * b * b;
    cost.push_back(c);
  }
  return shampoo_assign(cost, static_cast<int>(spread));
}

namespace shampoo {

double spectral_scale_factor(const ShampooConfig& c, int64_t r, int64_t cols) {
  const double rd = static_cast<double>(r), cd = static_cast<double>(cols);
  switch (c.spectral_scale) {
    case SpectralScale::none: return 1.0;
    case SpectralScale::muon: return std::sqrt(std::max(1.0, rd / cd));
    case SpectralScale::rms: return 0.2 * std::sqrt(std::max(rd, cd));
    case SpectralScale::fan: return std::sqrt(rd / cd);
    case SpectralScale::auto_: break;
  }
  return c.preconditioner == Preconditioner::dion ? std::sqrt(rd / cd) : std::sqrt(std::max(1.0, rd / cd));
}

Shape strides_of(const Shape& s) {
  Shape st(s.size(), 1);
  for (size_t i = s.size(); i-- > 1;) st[i - 1] = st[i] * s[i];
  return st;
}


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

}  // namespace shampoo

}  // namespace dtk::optim
