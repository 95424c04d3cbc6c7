// Eigenvalue-corrected Shampoo (SOAP, Vyas et al. 2024; Meta's EigenvalueCorrectedShampoo;
// shampoo.h): the same Kronecker factors, their eigenbases Q_k recomputed at the root steps, and
// Adam run in those bases: V = b V + (1 - b) (G x_k Q_k^T)^2 every step, and
// P = [(Mh x_k Q_k^T) / (sqrt(V / bc) + e)] x_k Q_k.
#include <cmath>

#include "dtk/optim/shampoo_internal.h"

namespace dtk::optim::shampoo {
namespace {

class Corrected final : public Factored {
 public:
  using Factored::Factored;

  const char* amortized_name() const override { return "eigenbasis"; }
  bool needs_second_pair() const override { return true; }

  // Factors zero, bases identity (Adam until the first basis), the second moment zero.
  void allocate(Group& gr) override {
    allocate_factors(gr);
    const int64_t B = static_cast<int64_t>(gr.blocks.size());
    for (int k = 0; k < gr.order; ++k) {
      const int64_t b = gr.dims[static_cast<size_t>(k)];
      gr.basis.push_back(Tensor::empty({B, b, b}, DType::f32, cx_.device));
      fill_identity(gr.basis.back(), cx_.device);
    }
    gr.corrected = Tensor::zeros({B, gr.n}, DType::f32, cx_.device);
  }

  void update(Group& gr, int64_t c0, int64_t c1, const Tensor& G, int64_t t) override { update_factors(gr, c0, c1, G, t); }

  // The bases of the bias-corrected factors (eigh, or qr warm-started from the current bases, the
  // first time from none: a full eigh). A block whose computation fails is retried in f64 from no
  // basis (a full eigh, in the method's column order), else keeps its bases.
  void amortized_step(Group& gr, int64_t c0, int64_t c1, int64_t t) override {
    const ops::RootOptions o = root_options();
    const bool warm = o.method == RootMethod::qr && t != cx_.start;
    amortized(gr, c0, c1, t, [&](int k, int64_t r0, const Tensor& Fc, std::vector<char>& failed) {
      const int64_t nb = Fc.dim(0), b = Fc.dim(1);
      Tensor Q = gr.basis[static_cast<size_t>(k)].slice(c0 + r0, c0 + r0 + nb);
      Tensor Qn = Tensor::zeros({nb, b, b}, cx_.cfg.factor_dtype, cx_.device);
      if (warm) ops::cast(Q, Qn);
      take_or_retry(ops::eigenbases(Fc, o, Qn), Fc, Qn, Q, failed, r0,
                    [&](int64_t, const Tensor& Fd, Tensor& Qd) { return ops::eigenbases(Fd, o, Qd)[0] != 0; });
    });
  }

  // Every step the second moment of G in the (current) bases; then the direction from the start
  // step on, or before it when there is no grafting direction to take (Adam in the identity bases).
  Tensor direction(Group& gr, int64_t c0, int64_t c1, const Tensor& G, const Tensor& Mh, int64_t t,
                   bool precond) override {
    update_moment(gr, c0, c1, G);
    if (!precond && cx_.cfg.grafting != Grafting::none) return {};
    const int64_t Bc = c1 - c0, n = gr.n;
    Scratch& sc = cx_.sc;
    Tensor Pr = in_bases(gr, c0, c1, Mh);
    const bool correct = cx_.cfg.use_bias_correction && cx_.ec_beta2 < 1;
    Tensor den = rows(sc.ping2, Bc, n);
    ops::scale(gr.corrected.slice(c0, c1), correct ? 1.0 / (1.0 - std::pow(cx_.ec_beta2, static_cast<double>(t))) : 1.0, den);
    ops::sqrt(den, den);
    ops::add_scalar(den, cx_.ec_epsilon, den);
    ops::div(Pr, den, Pr);
    if (gr.order == 0) return Pr;
    return modes(gr, c0, c1, gr.basis, Pr, true, sc.ping2, sc.pong2);
  }

 private:
  // X [Bc, n] of the chunk [c0, c1) in its blocks' bases (every mode: Q_k^T), in scratch (ping or
  // pong; a copy in ping for scalar blocks).
  Tensor in_bases(const Group& gr, int64_t c0, int64_t c1, const Tensor& X) const {
    const Scratch& sc = cx_.sc;
    if (gr.order > 0) return modes(gr, c0, c1, gr.basis, X, false, sc.ping, sc.pong);
    Tensor out = rows(sc.ping, c1 - c0, gr.n);
    copy_into(out, X);
    return out;
  }

  // V = b V + (1 - b) (G in the bases)^2 (b = 1: the sum).
  void update_moment(Group& gr, int64_t c0, int64_t c1, const Tensor& G) {
    Tensor Gr = in_bases(gr, c0, c1, G);
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
