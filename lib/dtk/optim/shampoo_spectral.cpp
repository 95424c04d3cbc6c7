// Spectral descent (Muon, Jordan et al. 2024; Meta's SpectralDescent; shampoo.h): every order-2
// block [r, c] takes P = s U V^T of its filtered gradient Mh, by quintic Newton-Schulz
// iterations (ops::newton_schulz) or exactly (X (X^T X)^(+1/2) in f64). No factors, no root steps.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "dtk/optim/shampoo_internal.h"

namespace dtk::optim::shampoo {
namespace {

class Spectral final : public BlockPreconditioner {
 public:
  using BlockPreconditioner::BlockPreconditioner;

  const char* amortized_name() const override { return "orthogonalisation"; }
  void allocate_scratch(const std::vector<Group>&, int64_t elements) override {  // ping2, pong2
    for (Tensor* t : {&cx_.sc.ping2, &cx_.sc.pong2}) *t = Tensor::empty({elements}, DType::f32, cx_.device);
  }
  void allocate(Group&) override {}
  void update(Group&, int64_t, int64_t, const Tensor&, int64_t) override {}
  void amortized_step(Group&, int64_t, int64_t, int64_t) override {}

  // s U V^T of each block Mh [r, c] of the chunk.
  Tensor direction(Group& gr, int64_t c0, int64_t c1, const Tensor&, const Tensor& M, int64_t, bool) override {
    const int64_t Bc = c1 - c0, r = gr.dims[0], c = gr.dims[1], n = gr.n;
    const int64_t m = std::min(r, c);
    Scratch& sc = cx_.sc;
    Tensor X = rows(sc.ping2, Bc, n), Y = rows(sc.pong2, Bc, n);
    const double scale = spectral_scale_factor(cx_.cfg, r, c);
    if (cx_.cfg.spectral_method == SpectralMethod::exact && exact(Bc, r, c, M, X)) {
      ops::scale(X, scale, X);
      return X;
    }
    // X = M / max(||M||_F, 1e-8) per block.
    Tensor nr = sc.norm_b.slice(0, Bc), S = rows(sc.ping, Bc, n);
    ops::reduce(ops::Reduce::norm2, ops::Axis::rows, M, nr);
    ops::clamp(nr, 1e-8, std::numeric_limits<double>::infinity(), nr);
    cx_.broadcast_blocks(nr, n, S);
    ops::div(M, S, X);
    Tensor A = sc.ping.slice(0, Bc * m * m).reshape({Bc, m, m}), B = sc.pong.slice(0, Bc * m * m).reshape({Bc, m, m});
    X = ops::newton_schulz(X.reshape({Bc, r, c}), Y.reshape({Bc, r, c}), A, B, cx_.cfg.newton_schulz_steps).reshape({Bc, n});
    ops::scale(X, scale, X);
    return X;
  }

 private:
  // U V^T of each block of M [Bc, r, c] into out, in f64: X (X^T X)^(+1/2) (tall) or
  // (X X^T)^(+1/2) X, the pseudo-inverse root dropping singular values at or below about
  // sqrt(m eps) of the largest. False (out unspecified) when a block fails: Newton-Schulz then.
  bool exact(int64_t Bc, int64_t r, int64_t c, const Tensor& M, Tensor& out) {
    const bool tall = r > c;
    const int64_t m = tall ? c : r;
    const Device d = cx_.device;
    Tensor X = Tensor::empty({Bc, r, c}, DType::f64, d), G = Tensor::empty({Bc, m, m}, DType::f64, d);
    Tensor R = Tensor::empty({Bc, m, m}, DType::f64, d), O = Tensor::empty({Bc, r, c}, DType::f64, d);
    ops::cast(M.reshape({Bc, r, c}), X);
    ops::gemm(tall, !tall, 1.0, X, X, 0.0, G);
    ops::RootOptions o;
    o.method = RootMethod::pseudo_inverse;
    o.eps = 0;
    const std::vector<char> ok = ops::inverse_roots(G, 2.0, o, R);
    if (!std::all_of(ok.begin(), ok.end(), [](char v) { return v != 0; })) {
      if (!warned_) spdlog::warn("shampoo: the exact orthogonalisation failed; Newton-Schulz iterations instead");
      warned_ = true;
      return false;
    }
    if (tall)
      ops::gemm(false, false, 1.0, X, R, 0.0, O);
    else
      ops::gemm(false, false, 1.0, R, X, 0.0, O);
    Tensor o3 = out.reshape({Bc, r, c});
    ops::cast(O, o3);
    return true;
  }

  bool warned_ = false;
};

}  // namespace

std::unique_ptr<BlockPreconditioner> make_spectral(Context& cx) { return std::make_unique<Spectral>(cx); }

}  // namespace dtk::optim::shampoo
