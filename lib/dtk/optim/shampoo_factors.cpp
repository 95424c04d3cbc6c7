// The Kronecker factors of Shampoo's root and eigenvalue-corrected preconditioners, and the
// amortized computation over them (shampoo_internal.h, Factored).
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>

#include "dtk/optim/shampoo_internal.h"

namespace dtk::optim::shampoo {

Tensor upload_i64(const std::vector<int64_t>& v, Device d) {
  return Tensor::from_host(v.data(), {static_cast<int64_t>(v.size())}, DType::i64, d);
}

void copy_into(Tensor dst, const Tensor& src) { dst.copy_from_async(src, cuda::current_stream()); }

void fill_identity(Tensor& batch, Device device) {
  const int64_t B = batch.dim(0), b = batch.dim(1);
  const int64_t tile = std::clamp<int64_t>(kChunkElements / (b * b), 1, std::max<int64_t>(B, 1));
  std::vector<float> eye(static_cast<size_t>(tile * b * b), 0.0f);
  for (int64_t t = 0; t < tile; ++t)
    for (int64_t i = 0; i < b; ++i) eye[static_cast<size_t>(t * b * b + i * b + i)] = 1.0f;
  const Tensor src = Tensor::from_host(eye.data(), {tile, b, b}, DType::f32, device);
  for (int64_t s = 0; s < B; s += tile) {
    const int64_t e = std::min(B, s + tile);
    Tensor dst = batch.slice(s, e);
    ops::cast(src.slice(0, e - s), dst);  // exact into f64 bases too
  }
}

void Factored::allocate_scratch(const std::vector<Group>& groups, int64_t elements) {
  if (cx_.cfg.factor_dtype != DType::f64) return;
  Scratch& sc = cx_.sc;
  sc.grad64 = Tensor::empty({elements}, DType::f64, cx_.device);
  if (std::any_of(groups.begin(), groups.end(), [](const Group& g) { return !g.rotate.empty(); })) {
    sc.ping64 = Tensor::empty({elements}, DType::f64, cx_.device);
    sc.pong64 = Tensor::empty({elements}, DType::f64, cx_.device);
  }
}

void Factored::allocate_factors(Group& gr) {
  const int64_t B = static_cast<int64_t>(gr.blocks.size());
  for (int k = 0; k < gr.order; ++k) {
    const int64_t b = gr.dims[static_cast<size_t>(k)];
    gr.factor.push_back(Tensor::zeros({B, b, b}, cx_.cfg.factor_dtype, cx_.device));
  }
  // Rotations for the factors of order >= 3: [C, r, c] -> [C, c, r] with r = b_k.
  if (gr.order >= 3)
    for (int k = 0; k + 1 < gr.order; ++k) {
      const int64_t r = gr.dims[static_cast<size_t>(k)], c = gr.n / r;
      std::vector<int64_t> idx(static_cast<size_t>(gr.chunk * gr.n));
      for (int64_t bi = 0; bi < gr.chunk; ++bi)
        for (int64_t j = 0; j < c; ++j)
          for (int64_t i = 0; i < r; ++i) idx[static_cast<size_t>(bi * gr.n + j * r + i)] = bi * gr.n + i * c + j;
      gr.rotate.push_back(upload_i64(idx, cx_.device));
    }
}

void Factored::update_factors(Group& gr, int64_t c0, int64_t c1, const Tensor& G, int64_t t) {
  if (gr.order == 0 || (t - 1) % cx_.cfg.factor_update_every != 0) return;
  const int64_t Bc = c1 - c0, n = gr.n;
  Scratch& sc = cx_.sc;
  Tensor X = G;
  if (cx_.cfg.factor_dtype == DType::f64) {
    X = rows(sc.grad64, Bc, n);
    ops::cast(G, X);
  }
  const double alpha = cx_.cfg.beta2 == 1 ? 1.0 : 1.0 - cx_.cfg.beta2, beta = cx_.cfg.beta2;
  const auto& d = gr.dims;
  if (gr.order == 1) {
    const Tensor v = X.reshape({Bc, n, 1});
    Tensor F = gr.factor[0].slice(c0, c1);
    ops::syrk(false, alpha, v, beta, F);
  } else if (gr.order == 2) {
    const Tensor m = X.reshape({Bc, d[0], d[1]});
    Tensor F0 = gr.factor[0].slice(c0, c1), F1 = gr.factor[1].slice(c0, c1);
    ops::syrk(false, alpha, m, beta, F0);
    ops::syrk(true, alpha, m, beta, F1);
  } else {
    // Unfold along dim k by rotating the dims: [b_k, rest] -> [rest, b_k] = [b_{k+1}, ...].
    Tensor cur = X;
    for (int k = 0; k < gr.order; ++k) {
      const int64_t b = d[static_cast<size_t>(k)];
      const Tensor m = cur.reshape({Bc, b, n / b});
      Tensor F = gr.factor[static_cast<size_t>(k)].slice(c0, c1);
      ops::syrk(false, alpha, m, beta, F);
      if (k + 1 < gr.order) {
        Tensor& buf = cx_.cfg.factor_dtype == DType::f64 ? (k % 2 ? sc.pong64 : sc.ping64) : (k % 2 ? sc.pong : sc.ping);
        Tensor next = buf.slice(0, Bc * n);
        ops::gather(cur.flatten(), gr.rotate[static_cast<size_t>(k)].slice(0, Bc * n), next);
        cur = next;
      }
    }
  }
}

// Each product contracts the leading dim and appends the new one at the end, so after K products
// the dims are back in order. With M_k = Q_k (columns: a basis), back = false gives the
// coordinates in the bases (Q_k^T on every mode) and back = true returns from them. Neither
// buffer may hold X0.
Tensor Factored::modes(const Group& gr, int64_t c0, int64_t c1, const std::vector<Tensor>& mats, const Tensor& X0,
                       bool back, const Tensor& buf0, const Tensor& buf1) const {
  const int64_t Bc = c1 - c0, n = gr.n;
  Tensor X = X0;
  for (int k = 0; k < gr.order; ++k) {
    const int64_t b = gr.dims[static_cast<size_t>(k)];
    Tensor Y = (k % 2 ? buf1 : buf0).slice(0, Bc * n).reshape({Bc, n / b, b});
    ops::gemm(true, back, 1.0, X.reshape({Bc, b, n / b}), mats[static_cast<size_t>(k)].slice(c0, c1), 0.0, Y);
    X = Y;
  }
  return X.reshape({Bc, n});
}

double Factored::factor_correction(int64_t t) const {
  if (!cx_.cfg.use_bias_correction || cx_.cfg.beta2 >= 1) return 1.0;
  const int64_t u = (t - 1) / cx_.cfg.factor_update_every + 1;
  return 1.0 / (1.0 - std::pow(cx_.cfg.beta2, static_cast<double>(u)));
}

// The batched roots of ops::inverse_roots in the factor dtype, by root_method.
ops::RootOptions Factored::root_options() const {
  const ShampooConfig& c = cx_.cfg;
  ops::RootOptions o;
  o.method = c.root_method;
  o.eps = c.epsilon;
  o.max_iters = c.newton_max_iters;
  o.tolerance = c.newton_tolerance;
  o.qr_max_iterations = c.qr_max_iterations;
  o.qr_tolerance = c.qr_tolerance;
  o.rank_rtol = c.rank_rtol;
  o.rank_atol = c.rank_atol;
  if (o.method == RootMethod::pseudo_inverse) o.eps = 0;  // the rank cutoff replaces it
  return o;
}

// A chunk's factors F (blocks [c, c + nb) of the group) with NaN or Inf: marked (from index at in
// nonfinite) and recorded for the driver's agreement; true when there is one.
bool Factored::nonfinite_factors(const Group& gr, int64_t c, const Tensor& F, int k, std::vector<char>& nonfinite,
                                 int64_t at) {
  if (ops::count_nonfinite(F) == 0) return false;
  for (int64_t i = 0; i < F.dim(0); ++i)
    if (ops::count_nonfinite(F.select(i)) > 0) {
      nonfinite[static_cast<size_t>(at + i)] = 1;
      cx_.nan_code = std::min(cx_.nan_code, Context::encode(gr.blocks[static_cast<size_t>(c + i)], k));
    }
  return true;  // an error on every rank follows
}

// Consecutive failures per block of the chunk at c0: reset on success; the kMaxFailures-th is
// recorded for the driver's agreement, earlier ones warned about.
void Factored::count_failures(Group& gr, int64_t c0, const std::vector<char>& failed, const std::vector<char>& nonfinite,
                              int64_t t) {
  const int64_t Bc = static_cast<int64_t>(failed.size());
  int64_t* fails = gr.failures.ptr<int64_t>();
  for (int64_t i = 0; i < Bc; ++i) {
    if (nonfinite[static_cast<size_t>(i)]) continue;
    int64_t& f = fails[c0 + i];
    if (!failed[static_cast<size_t>(i)]) {
      f = 0;
      continue;
    }
    ++f;
    const int bi = gr.blocks[static_cast<size_t>(c0 + i)];
    if (f >= kMaxFailures) {
      cx_.fatal_code = std::min(cx_.fatal_code, Context::encode(bi, 0));
    } else {
      spdlog::warn("shampoo: the {} of {} failed at step {} (failure {} in a row); it keeps its previous one",
                   amortized_name(), cx_.block_label(bi), t, f);
    }
  }
}

}  // namespace dtk::optim::shampoo
