// The functions each backend implements, declared once for both: ops/cpu/ (namespace
// dtk::ops::cpu) and ops/cuda/ (namespace dtk::ops::cuda). The public functions of ops.h check
// their arguments and then call the backend of the tensors' device, so a backend function may
// assume: shapes, dtypes and devices as ops.h documents them, all tensors contiguous.
#pragma once
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include "dtk/ops/ops.h"

namespace dtk::ops {
// RoPE's frequency of pair i of a head of hd: theta^(-2i/hd), on the host for both backends, so
// that both rotate by the same angle, position * frequency. A device pow may differ from the
// host's by 2 ulp, which a position of thousands turns into 1e-12 of an angle: more than the
// rest of the op's error in f64.
inline double rope_frequency(int64_t i, int64_t hd, double theta) {
  return std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
}

// cos and sin of every (position, pair) of a RoPE call, [T, hd / 2] row-major, computed on the
// host in double once per (T, hd, theta, pos0) and kept (with f32 copies): the same few tables
// serve every layer and step, and both backends rotate by the same values (the CUDA backend keeps
// device copies of them).
struct RopeTable {
  std::vector<double> cos, sin;
  std::vector<float> cosf, sinf;
};
std::shared_ptr<const RopeTable> rope_table(int64_t T, int64_t hd, double theta, int64_t pos0);
}  // namespace dtk::ops

#define DTK_OPS_BACKEND_DECLARATIONS                                                                           \
  void add(const Tensor& a, const Tensor& b, Tensor& out);                                                      \
  void sub(const Tensor& a, const Tensor& b, Tensor& out);                                                      \
  void mul(const Tensor& a, const Tensor& b, Tensor& out);                                                      \
  void div(const Tensor& a, const Tensor& b, Tensor& out);                                                      \
  void add_scalar(const Tensor& a, double s, Tensor& out);                                                      \
  void scale(const Tensor& a, double s, Tensor& out);                                                           \
  void axpy(double alpha, const Tensor& x, Tensor& y);                                                          \
  void lerp(const Tensor& a, const Tensor& b, double w, Tensor& out);                                           \
  void sqrt(const Tensor& a, Tensor& out);                                                                      \
  void rsqrt(const Tensor& a, Tensor& out);                                                                     \
  void pow(const Tensor& a, double p, Tensor& out);                                                             \
  void sign(const Tensor& a, Tensor& out);                                                                      \
  void abs(const Tensor& a, Tensor& out);                                                                       \
  void clamp(const Tensor& a, double lo, double hi, Tensor& out);                                               \
  void where(const Tensor& cond_u8, const Tensor& a, const Tensor& b, Tensor& out);                             \
  void fill(Tensor& out, double v);                                                                             \
  void cast(const Tensor& src, Tensor& dst);                                                                    \
  void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, double lr, double momentum,            \
                double weight_decay, bool nesterov);                                                            \
  void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr, double beta1,            \
                  double beta2, double eps, double weight_decay, int64_t step);                                 \
  void clip_scale(Tensor& x, const Tensor& norm, double max_norm);                                              \
  void reduce(Reduce kind, Axis axis, const Tensor& a, Tensor& out);                                            \
  int64_t count_nonfinite(const Tensor& a);                                                                     \
  void softmax_forward(const Tensor& x, Tensor& y);                                                             \
  void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx);                                         \
  void log_softmax_forward(const Tensor& x, Tensor& y);                                                         \
  void log_softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx);                                     \
  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor& lse);         \
  void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, double scale,     \
                              Tensor& dlogits);                                                                \
  /* x = a + b (b null: x is a, not written), then y = rmsnorm(x); both ops::rmsnorm_forward ops */         \
  void rmsnorm_forward(const Tensor& a, const Tensor* b, const Tensor& w, double eps, Tensor& x, Tensor& y,      \
                       Tensor& rstd);                                                                           \
  void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,     \
                        Tensor& dw, bool accumulate);                                                           \
  void silu_forward(const Tensor& x, Tensor& y);                                                                \
  void silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);                                            \
  void gelu_forward(const Tensor& x, Tensor& y);                                                                \
  void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);                                            \
  void relu_forward(const Tensor& x, Tensor& y);                                                                \
  void relu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);                                            \
  void swiglu_forward(const Tensor& a, const Tensor& b, Tensor& y);                                             \
  void swiglu_backward(const Tensor& a, const Tensor& b, const Tensor& dy, Tensor& da, Tensor& db);             \
  void rope(const Tensor& x, double theta, int64_t pos0, bool inverse, Tensor& y);                              \
  void rope_qk(Tensor& q, Tensor& k, double theta, int64_t pos0, bool inverse);                                 \
  void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out);                                  \
  void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);                               \
  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse);          \
  void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,                 \
                          const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv);           \
  void im2col(const Tensor& x, const Window& win, Tensor& cols);                                                \
  void col2im(const Tensor& cols, const Window& win, Tensor& dx);                                               \
  void maxpool2d_forward(const Tensor& x, const Window& win, Tensor& y, Tensor& argmax);                        \
  void maxpool2d_backward(const Tensor& argmax, const Tensor& dy, const Window& win, Tensor& dx);                \
  void batchnorm_reduce(const Tensor& x, Tensor& sums);                                                         \
  void batchnorm_forward(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& gamma,         \
                         const Tensor& beta, Tensor& y);                                                        \
  void batchnorm_backward_reduce(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,   \
                                 Tensor& sums);                                                                 \
  void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,          \
                          const Tensor& gamma, const Tensor& sums, double count, Tensor& dx);                   \
  void topk_abs(const Tensor& x, int64_t k, Tensor& values, Tensor& indices);                                   \
  void gather(const Tensor& x, const Tensor& indices, Tensor& out);                                             \
  void scatter_add(const Tensor& indices, const Tensor& values, Tensor& out);                                   \
  void uniform_(Tensor& out, uint64_t seed, uint64_t offset, double lo, double hi);                             \
  void normal_(Tensor& out, uint64_t seed, uint64_t offset, double mean, double std);                           \
  void gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b, double beta, Tensor& c,    \
            Math math);                                                                                         \
  void syrk(bool trans, double alpha, const Tensor& a, double beta, Tensor& c);                                 \
  void symmetrize(Tensor& c);                                                                                   \
  void orthonormalize_mgs(Tensor& a, double eps);                                                               \
  void orthonormalize_qr(Tensor& a);                                                                            \
  void eigh(const Tensor& a, Tensor& w, Tensor& v);                                                             \
  bool inverse_root(const Tensor& a, double p, const RootOptions& opts, Tensor& out);

namespace dtk::ops {
// Whether a mixed-precision op (ops.h) got a bf16 tensor among ts (null entries: absent tensors).
inline bool any_bf16(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t && t->defined() && t->dtype() == DType::bf16) return true;
  return false;
}

// Batch norm's x [N, C, ...]: the elements per (n, c) pair, the product of the dims after C
// (both backends view x as [N, C, L]).
inline int64_t channel_size(const Tensor& x) {
  int64_t L = 1;
  for (int d = 2; d < x.ndim(); ++d) L *= x.dim(d);
  return L;
}
}  // namespace dtk::ops

namespace dtk::ops::cpu {
DTK_OPS_BACKEND_DECLARATIONS
}
#ifdef DTK_HAVE_CUDA
namespace dtk::ops::cuda {
DTK_OPS_BACKEND_DECLARATIONS
}
// Runs the backend of `t`'s device: DTK_DISPATCH(t, add(a, b, out)). Without the CUDA backend
// no tensor can live on a GPU (allocation fails first), so the cpu backend is the only one.
#define DTK_DISPATCH(t, call) ((t).is_cuda() ? ::dtk::ops::cuda::call : ::dtk::ops::cpu::call)
#else
#define DTK_DISPATCH(t, call) (::dtk::ops::cpu::call)
#endif
