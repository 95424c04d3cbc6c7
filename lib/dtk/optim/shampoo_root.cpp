// Shampoo's own preconditioner (shampoo.h): the inverse roots R_k = (F_k / bc + eps I)^(-1/p) of
// the Kronecker factors, recomputed at the root steps (ops::inverse_roots: eigh, the coupled
// Newton iteration, warm-started QR iterations, or the pseudo-inverse), and the direction
// P = Mh x_0 R_0 ... x_{K-1} R_{K-1} from the start step on.
#include "dtk/optim/shampoo_internal.h"

namespace dtk::optim::shampoo {
namespace {

class Root final : public Factored {
 public:
  using Factored::Factored;

  const char* amortized_name() const override { return "inverse root"; }

  // Factors zero, roots identity; root_method qr: a basis per factor, zero until the first root
  // (a full eigh).
  void allocate(Group& gr) override {
    allocate_factors(gr);
    const int64_t B = static_cast<int64_t>(gr.blocks.size());
    for (int k = 0; k < gr.order; ++k) {
      const int64_t b = gr.dims[static_cast<size_t>(k)];
      gr.root.push_back(Tensor::empty({B, b, b}, DType::f32, cx_.device));
      fill_identity(gr.root.back(), cx_.device);
      if (cx_.cfg.root_method == RootMethod::qr) gr.basis.push_back(Tensor::zeros({B, b, b}, cx_.cfg.factor_dtype, cx_.device));
    }
  }

  void update(Group& gr, int64_t c0, int64_t c1, const Tensor& G, int64_t t) override { update_factors(gr, c0, c1, G, t); }

  // A block whose root fails is retried in f64, else keeps its previous root.
  void amortized_step(Group& gr, int64_t c0, int64_t c1, int64_t t) override {
    const double p = cx_.cfg.exponent_override > 0 ? cx_.cfg.exponent_override : 2.0 * gr.order;
    amortized(gr, c0, c1, t, [&](int k, int64_t r0, const Tensor& Fc, std::vector<char>& failed) {
      const int64_t nb = Fc.dim(0), b = Fc.dim(1);
      Tensor out = Tensor::empty({nb, b, b}, cx_.cfg.factor_dtype, cx_.device);
      Tensor Q;  // qr: the kept bases (a failed block's is zeroed: it restarts from a full eigh)
      if (cx_.cfg.root_method == RootMethod::qr) Q = gr.basis[static_cast<size_t>(k)].slice(c0 + r0, c0 + r0 + nb);
      const std::vector<char> ok = ops::inverse_roots(Fc, p, root_options(), out, Q.defined() ? &Q : nullptr);
      Tensor R = gr.root[static_cast<size_t>(k)].slice(c0 + r0, c0 + r0 + nb);
      // A failed block: again in f64 by an eigendecomposition with the same rule (the
      // pseudo-inverse's, or epsilon and the shift); qr's from no basis (a full eigh), whose
      // basis is kept for the next warm start, as that of a block that had not failed.
      ops::RootOptions o64 = root_options();
      if (o64.method != RootMethod::pseudo_inverse && o64.method != RootMethod::qr) o64.method = RootMethod::eigh;
      take_or_retry(ok, Fc, out, R, failed, r0, [&](int64_t i, const Tensor& Fd, Tensor& Od) {
        if (o64.method != RootMethod::qr) return ops::inverse_roots(Fd, p, o64, Od)[0] != 0;
        Tensor Bd = Tensor::zeros(Fd.shape(), DType::f64, cx_.device);
        if (ops::inverse_roots(Fd, p, o64, Od, &Bd)[0] == 0) return false;
        Tensor Qi = Q.select(i);
        ops::cast(Bd.select(0), Qi);
        return true;
      });
      // Exactly symmetric (V diag V^T is so only to rounding), as checkpoints store it packed.
      ops::symmetrize(R);
    });
  }

  Tensor direction(Group& gr, int64_t c0, int64_t c1, const Tensor&, const Tensor& Mh, int64_t, bool precond) override {
    if (!precond) return {};
    return modes(gr, c0, c1, gr.root, Mh, false, cx_.sc.ping, cx_.sc.pong);
  }
};

}  // namespace

std::unique_ptr<BlockPreconditioner> make_root(Context& cx) { return std::make_unique<Root>(cx); }

}  // namespace dtk::optim::shampoo
