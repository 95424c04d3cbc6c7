// Eigenvalue-corrected Shampoo (SOAP, Vyas et al. 2024; Meta's EigenvalueCorrectedShampoo;
// shampoo.h): the same Kronecker factors, their eigenbases Q_k recomputed at the root steps, and
// Adam run in those bases: V = b V + (1 - b) (G x_k Q_k^T)^2 every step, and
// P = [(Mh x_k Q_k^T) / (sqrt(V / bc) + e)] x_k Q_k.
#include <algorithm>
#include <cmath>

#include "dtk/optim/shampoo_internal.h"

namespace dtk::optim::shampoo {
namespace {

class Corrected final : public Factored {
 public:
  using Factored::Factored;

  const char* amortized_name() const override { return "eigenbasis"; }
  // The factors' scratch; ping2 and pong2; with f64 bases the f64 gradient, products and side.
  void allocate_scratch(const std::vector<Group>& groups, int64_t elements) override {
    Factored::allocate_scratch(groups, elements);
    Scratch& sc = cx_.sc;
    for (Tensor* t : {&sc.ping2, &sc.pong2}) *t = Tensor::empty({elements}, DType::f32, cx_.device);
    if (cx_.cfg.basis_dtype == DType::f64)
      for (Tensor* t : {&sc.grad64, &sc.ping64, &sc.pong64, &sc.side64})
        if (!t->defined()) *t = Tensor::empty({elements}, DType::f64, cx_.device);
  }

  // The order of the bases' columns, which dtk before 2026-11-29 kept descending with qr.
  void describe(nlohmann::json& config) const override { config["eigenbasis_order"] = "ascending"; }

  // A checkpoint of dtk before the ascending order, with qr bases (columns by descending
  // estimate): every basis's columns reversed, and with them every block's second moment
  // (positional: reversing each mode's index reverses the block's flat index). The same
  // preconditioner, in the reference's order.
  std::string restored(std::vector<Group>& groups, const nlohmann::json& saved) override {
    if (saved.contains("eigenbasis_order") || saved.value("root_method", std::string()) != "qr") return "";
    const auto reversed = [](Tensor& t, int64_t rows, int64_t cols) {  // each row's elements in reverse
      std::vector<double> v = t.to_doubles();
      for (int64_t r = 0; r < rows; ++r) std::reverse(v.begin() + r * cols, v.begin() + (r + 1) * cols);
      t.copy_from(Tensor::from_doubles(v, t.shape(), t.dtype(), t.device()));
    };
    for (Group& gr : groups) {
      if (!gr.corrected.defined()) continue;  // diagonal groups
      for (Tensor& Q : gr.basis) reversed(Q, Q.numel() / Q.dim(-1), Q.dim(-1));
      reversed(gr.corrected, gr.corrected.dim(0), gr.n);
    }
    return "its eigenvalue-corrected qr bases were kept in descending order (dtk before 2026-11-29): reversed, "
           "with the second moment, into the reference's ascending order";
  }

  // Factors zero, bases identity (Adam until the first basis), the second moment zero; bases and
  // second moment in basis_dtype.
  void allocate(Group& gr) override {
    allocate_factors(gr);
    const int64_t B = static_cast<int64_t>(gr.blocks.size());
    const DType dt = cx_.cfg.basis_dtype;
    for (int k = 0; k < gr.order; ++k) {
      const int64_t b = gr.dims[static_cast<size_t>(k)];
      gr.basis.push_back(Tensor::empty({B, b, b}, dt, cx_.device));
      fill_identity(gr.basis.back(), cx_.device);
    }
    gr.corrected = Tensor::zeros({B, gr.n}, dt, cx_.device);
  }

  void update(Group& gr, int64_t c0, int64_t c1, const Tensor& G, int64_t t) override { update_factors(gr, c0, c1, G, t); }

  // The bases of the bias-corrected factors: eigh, or qr warm-started from the current bases (the
  // first time the identity, as Meta's SOAP). A block whose computation fails is computed again
  // alone in f64 from the same bases (Meta's retry_double_precision), else keeps its bases.
  void amortized_step(Group& gr, int64_t c0, int64_t c1, int64_t t) override {
    const ops::RootOptions o = root_options();
    const bool warm = o.method == RootMethod::qr;  // eigh takes no starting basis
    amortized(gr, c0, c1, t, [&](int k, int64_t r0, const Tensor& Fc, std::vector<char>& failed) {
      const int64_t nb = Fc.dim(0), b = Fc.dim(1);
      Tensor Q = gr.basis[static_cast<size_t>(k)].slice(c0 + r0, c0 + r0 + nb);
      Tensor Qn = Tensor::empty({nb, b, b}, Fc.dtype(), cx_.device);
      if (warm) ops::cast(Q, Qn);
      take_or_retry(ops::eigenbases(Fc, o, Qn), Fc, Qn, Q, failed, r0,
                    [&](int64_t i, const Tensor& Fd, Tensor& Qd) {
                      if (warm) ops::cast(Q.slice(i, i + 1), Qd);
                      return ops::eigenbases(Fd, o, Qd)[0] != 0;
                    });
    });
  }

  // Every step the second moment of G in the (current) bases; then the direction from the start
  // step on, or before it when there is no grafting direction to take (Adam in the identity bases).
  // With f64 bases the rotations, the second moment and the division are f64, the direction
  // rounded to f32 once at the end.
  Tensor direction(Group& gr, int64_t c0, int64_t c1, const Tensor& G, const Tensor& Mh, int64_t t,
                   bool precond) override {
    update_moment(gr, c0, c1, G);
    if (!precond && cx_.cfg.grafting != Grafting::none) return {};
    const int64_t Bc = c1 - c0, n = gr.n;
    Scratch& sc = cx_.sc;
    const bool wide = cx_.cfg.basis_dtype == DType::f64;
    Tensor Pr = in_bases(gr, c0, c1, widened(Mh));
    const bool correct = cx_.cfg.use_bias_correction && cx_.ec_beta2 < 1;
    Tensor den = rows(wide ? sc.side64 : sc.ping2, Bc, n);
    ops::scale(gr.corrected.slice(c0, c1), correct ? 1.0 / (1.0 - std::pow(cx_.ec_beta2, static_cast<double>(t))) : 1.0, den);
    ops::sqrt(den, den);
    ops::add_scalar(den, cx_.ec_epsilon, den);
    ops::div(Pr, den, Pr);
    // The way back (every mode: Q_k) alternates over two buffers that Pr is not in: ping2 and
    // pong2, or (f64) side64 and grad64, both done with (den, and Mh widened).
    Tensor P = gr.order == 0 ? Pr
                             : modes(gr, c0, c1, gr.basis, Pr, true, wide ? sc.side64 : sc.ping2, wide ? sc.grad64 : sc.pong2);
    if (!wide) return P;
    Tensor out = rows(sc.ping2, Bc, n);
    ops::cast(P, out);
    return out;
  }

 private:
  // X [Bc, n] as the bases' dtype: itself, or (f64 bases) widened into grad64.
  Tensor widened(const Tensor& X) const {
    if (cx_.cfg.basis_dtype != DType::f64) return X;
    Tensor w = rows(cx_.sc.grad64, X.dim(0), X.dim(1));
    ops::cast(X, w);
    return w;
  }

  // X [Bc, n] (the bases' dtype) of the chunk [c0, c1) in its blocks' bases (every mode: Q_k^T),
  // in scratch (ping or pong, f64: ping64 or pong64; a copy in ping for scalar blocks).
  Tensor in_bases(const Group& gr, int64_t c0, int64_t c1, const Tensor& X) const {
    const Scratch& sc = cx_.sc;
    const bool wide = X.dtype() == DType::f64;
    const Tensor& a = wide ? sc.ping64 : sc.ping;
    if (gr.order > 0) return modes(gr, c0, c1, gr.basis, X, false, a, wide ? sc.pong64 : sc.pong);
    Tensor out = rows(a, c1 - c0, gr.n);
    copy_into(out, X);
    return out;
  }

  // V = b V + (1 - b) (G in the bases)^2 (b = 1: the sum).
  void update_moment(Group& gr, int64_t c0, int64_t c1, const Tensor& G) {
    Tensor Gr = in_bases(gr, c0, c1, widened(G));
    ops::mul(Gr, Gr, Gr);
    Tensor V = gr.corrected.slice(c0, c1);
    if (cx_.ec_beta2 == 1)
      ops::add(V, Gr, V);
    else
      ops::lerp(V, Gr, 1.0 - cx_.ec_beta2, V);
  }
};

}  // namespace

std::unique_ptr<BlockPreconditioner> make_corrected(Context& cx) { return std::make_unique<Corrected>(cx); }

}  // namespace dtk::optim::shampoo
