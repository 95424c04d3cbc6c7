// dtk::ops — every tensor operation the models, optimizers and compressors need. One interface,
// two backends: each function checks its arguments (shapes, dtypes, devices: a UsageError that
// names the op and the tensor), then runs the cpu/ or cuda/ implementation of the device its
// tensors live on. All tensors of one call live on one device. Tensors are contiguous row-major.
//
// Conventions: outputs are passed in, allocated by the caller (no allocation on the hot path),
// and may alias an input where the doc says "in place allowed". "float" means f32 or f64, with
// every floating tensor of one call in the same dtype unless stated. Backward functions
// overwrite their outputs unless the doc says "accumulates" (+=).
//
// Mixed precision (the models' --precision bf16): where an op's doc says "mixes", the tensors it
// names may each be bf16 instead of f32 (f64 never mixes). Such an op reads bf16 as f32 (exact),
// computes in f32 and rounds each bf16 output once, to nearest even, when it stores it: on both
// backends, at the same points.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dtk/core/enums.h"
#include "dtk/core/tensor.h"

namespace dtk::ops {

// How gemm (and the convolutions through it) multiply f32 operands. exact: true f32 products.
// bf16 (f32 operands only): each element of A and B rounded to bf16 (RNE), the products then
// exact in f32 and accumulated in f32: what bf16 operands give, for models whose weights and
// activations stay f32 (resnet under --precision bf16).
// tf32 (f32 operands only; f64 and bf16 ignore it): each element of A and B rounded to TF32 (10
// explicit mantissa bits, to nearest, ties away from zero: round_tf32 in core/half.h) before the
// products, which are then exact in f32, accumulated in f32: cuBLAS's
// CUBLAS_COMPUTE_32F_FAST_TF32 on tensor cores, PyTorch's allow_tf32. The CPU rounds copies of the
// operands and runs the f32 BLAS on them. For the models' weight products (--precision tf32)
// only: optimizers, compressors and the linear algebra below always multiply exactly.
enum class Math { exact, tf32, bf16 };
DTK_ENUM_NAMES(Math, {Math::exact, "exact"}, {Math::tf32, "tf32"}, {Math::bf16, "bf16"})

// ---------------------------------------------------------------------------- elementwise
// Shapes equal (numel equal is enough); float. In place allowed (out may be a or b).
void add(const Tensor& a, const Tensor& b, Tensor& out);       // a + b; a, b and out mix
void sub(const Tensor& a, const Tensor& b, Tensor& out);       // a - b
void mul(const Tensor& a, const Tensor& b, Tensor& out);       // a * b
void div(const Tensor& a, const Tensor& b, Tensor& out);       // a / b
void add_scalar(const Tensor& a, double s, Tensor& out);       // a + s
void scale(const Tensor& a, double s, Tensor& out);            // s * a
void axpy(double alpha, const Tensor& x, Tensor& y);           // y += alpha * x
void lerp(const Tensor& a, const Tensor& b, double w, Tensor& out);  // a + w * (b - a)
void sqrt(const Tensor& a, Tensor& out);
void rsqrt(const Tensor& a, Tensor& out);                      // 1 / sqrt(a)
void pow(const Tensor& a, double p, Tensor& out);              // a^p (a >= 0 for fractional p)
void sign(const Tensor& a, Tensor& out);                       // -1, 0 or 1
void abs(const Tensor& a, Tensor& out);
void clamp(const Tensor& a, double lo, double hi, Tensor& out);
void where(const Tensor& cond_u8, const Tensor& a, const Tensor& b, Tensor& out);  // cond ? a : b
void fill(Tensor& out, double v);                              // any dtype
void cast(const Tensor& src, Tensor& dst);                     // any dtype to any; bf16/f16 RNE

// ---------------------------------------------------------------------------- fused updates
// SGD as PyTorch defines it: g = grad + weight_decay * p; buf = momentum * buf + g;
// g = nesterov ? g + momentum * buf : buf; p -= lr * g. With momentum 0, buf may be undefined.
void sgd_step(Tensor& param, const Tensor& grad, Tensor& momentum_buf, double lr, double momentum,
              double weight_decay, bool nesterov);
// AdamW (decoupled weight decay, bias correction; step counts from 1):
// p -= lr * wd * p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= lr * (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps).
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step);
// Gradient clipping with the norm on the device: x *= max_norm / norm (the factor formed in double,
// then in x's dtype) when norm (f64 [1] on x's device) is finite and above max_norm > 0; else x
// stays. The host reads nothing.
void clip_scale(Tensor& x, const Tensor& norm, double max_norm);

// ---------------------------------------------------------------------------- reductions
enum class Reduce { sum, mean, max, min, norm2, absmax };  // norm2: sqrt(sum x^2)
enum class Axis { all, rows, cols };  // rows: one result per row of a 2-D tensor; cols: per column
// out: [1] for all, [rows] for rows, [cols] for cols; same dtype and device as a. Empty input:
// sum/norm2 0, mean NaN, max/min/absmax an error.
void reduce(Reduce kind, Axis axis, const Tensor& a, Tensor& out);
double reduce_all(Reduce kind, const Tensor& a);  // the value on the host (synchronises)
int64_t count_nonfinite(const Tensor& a);         // NaN and Inf elements (float of any width)
double dot(const Tensor& a, const Tensor& b);     // sum a * b, on the host

// ---------------------------------------------------------------------------- neural network
// Rows are the leading dims flattened; n the last dim.
void softmax_forward(const Tensor& x, Tensor& y);
void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx);  // dx = y * (dy - sum(dy * y))
void log_softmax_forward(const Tensor& x, Tensor& y);
void log_softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx);  // dx = dy - exp(y) sum(dy)
// Cross entropy of logits [N, V] against targets i32 [N] (-1: ignored, loss 0): lse [N] =
// logsumexp(row), kept for the backward, and losses [N] = lse - row[target]. Backward, one read of
// each row: dlogits = (exp(row - lse) - onehot(target)) * scale, 0 for ignored rows (scale is
// usually 1 / number of counted targets). logits and losses mix (bf16 logits, f32 losses; lse
// has the losses' dtype); dlogits has the logits' dtype and may be logits itself (in place).
void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor& lse);
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, double scale,
                            Tensor& dlogits);
// RMSNorm over the last dim D: y = x * rstd * w, rstd [rows] = 1 / sqrt(mean(x^2) + eps), saved.
// x and rstd f32 or f64, one dtype; w and y mix with x (the statistics stay in x's dtype).
void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd);
// The residual add fused in (one pass over memory instead of two): x = a + b, then as
// rmsnorm_forward(x, ...). x may be a or b; a and x share x's dtype, b mixes.
void add_rmsnorm_forward(const Tensor& a, const Tensor& b, const Tensor& w, double eps, Tensor& x, Tensor& y,
                         Tensor& rstd);
// dx overwritten, or with accumulate, added to (dx += ..., a residual stream's gradient: the
// add fused in); dw accumulates (+=) over rows. x, rstd, dx and dw one dtype; w and dy mix.
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor& dw,
                      bool accumulate = false);
// Activations, elementwise; backward: dx = dy * f'(x). In place allowed.
void silu_forward(const Tensor& x, Tensor& y);  // x * sigmoid(x)
void silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
void gelu_forward(const Tensor& x, Tensor& y);  // tanh approximation (GPT-2)
void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);
void relu_forward(const Tensor& x, Tensor& y);
void relu_backward(const Tensor& x, const Tensor& dy, Tensor& dx);  // dy where x > 0
// SwiGLU gate: y = silu(a) * b; backward gives da and db (overwritten). f32, f64 or bf16, all
// tensors one dtype (bf16: f32 arithmetic, each output rounded once).
void swiglu_forward(const Tensor& a, const Tensor& b, Tensor& y);
void swiglu_backward(const Tensor& a, const Tensor& b, const Tensor& dy, Tensor& da, Tensor& db);
// RoPE on x [B, T, H, hd] (hd even): pair (2i, 2i+1) of each head at position t = pos0 + t_index
// rotated by angle t * theta^(-2i/hd). inverse rotates by minus the angle (the backward). In place allowed.
// f32, f64 or bf16 (x and y one dtype; bf16 rotated in f32 and rounded once).
void rope(const Tensor& x, double theta, int64_t pos0, bool inverse, Tensor& y);
// rope on q [B, T, Hq, hd] and k [B, T, Hk, hd] (attention's, one dtype) in place, as two rope
// calls would, in one launch on the GPU.
void rope_qk(Tensor& q, Tensor& k, double theta, int64_t pos0, bool inverse);
// Embedding: out [N, D] = table[ids]; ids i32 [N] (any shape, flattened) in [0, V). table and
// out mix (a bf16 table into an f32 residual stream); dout and dtable one dtype, f32 or f64.
void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);  // accumulates (+=)
// Causal self-attention, softmax scale 1/sqrt(hd), grouped-query: q [B, T, H, hd], k and v
// [B, T, Hkv, hd] with H % Hkv == 0 (query head h reads kv head h / (H / Hkv)); out [B, T, H, hd];
// lse [B, H, T] (f32 or the dtype of q) saves the log-sum-exp of each score row for the backward.
// f32 and f64 compute in that dtype. bf16: q, k, v, out, dout, dq, dk, dv all bf16, lse f32, hd 64
// or 128 (the CUDA kernels are FlashAttention-2's, on tensor cores); both backends round at these
// points and nowhere else. Forward: S = scale Q K^T accumulated in f32; online softmax in f32
// (running max m, running sum l of the f32 P); P = exp(S - m) in f32, rounded to bf16 for P V;
// O accumulated in f32, divided by l at the end, rounded to bf16 when stored; lse = m + log l
// (f32). Backward: D = rowsum(dout * out) in f32 from the bf16 values; P = exp(S - lse) in f32;
// dv = sum P^T dout with P rounded to bf16; dP = dout V^T in f32; dS = P (dP - D) in f32, rounded
// to bf16 for dq = scale dS K and dk = scale dS^T Q; dq, dk, dv accumulated in f32 (dk and dv of a
// kv head over all the query heads of its group) and rounded to bf16 once, when stored. The CPU
// takes each row's softmax in one block (m the row's max), the GPU in tiles of 32 or 64 keys, so
// P's bf16 rounding may differ by a step between them. Deterministic on both: no atomics, fixed
// orders.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv);

// ---------------------------------------------------------------------------- convolutional nets
// Images are NCHW. A window: kernel kh x kw, stride and zero padding per dimension (PyTorch's
// Conv2d and MaxPool2d without dilation, groups or ceil_mode). An H x W input gives P x Q outputs,
// P = (H + 2 pad_h - kh) / stride_h + 1 (floor), Q likewise; both must be at least 1.
struct Window {
  int64_t kh = 1, kw = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
  int64_t out_h(int64_t h) const { return (h + 2 * pad_h - kh) / stride_h + 1; }
  int64_t out_w(int64_t w) const { return (w + 2 * pad_w - kw) / stride_w + 1; }
};
// Unfolds one image x [C, H, W] into cols [C kh kw, P Q]: row (c, i, j) (row-major), column
// (p, q) holds x[c, p stride_h - pad_h + i, q stride_w - pad_w + j], 0 outside the image.
void im2col(const Tensor& x, const Window& win, Tensor& cols);
// The adjoint of im2col: dx [C, H, W] (overwritten), each element the sum of the cols entries
// that im2col copies it to, added in row-major order of cols (deterministic, no atomics).
void col2im(const Tensor& cols, const Window& win, Tensor& dx);
// Convolution without bias, one image at a time through im2col and gemm: x [N, C, H, W],
// w [K, C, kh, kw] (win's kernel), y [N, K, P, Q]; cols [C kh kw, P Q] is scratch.
// math: gemm's, for the products.
void conv2d_forward(const Tensor& x, const Tensor& w, const Window& win, Tensor& cols, Tensor& y,
                    Math math = Math::exact);
// dw += the weight gradient (accumulates); dx (when given, overwritten) the input gradient.
// cols and dcols [C kh kw, P Q] are scratch.
void conv2d_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Window& win, Tensor& cols,
                     Tensor& dcols, Tensor& dw, Tensor* dx, Math math = Math::exact);
// Max pooling: y [N, C, P, Q] the maximum of each window of x [N, C, H, W] (padding never wins);
// argmax i32 [N, C, P, Q] the winner's index h W + w within its channel (the first in row-major
// window order among equal values; a NaN wins).
void maxpool2d_forward(const Tensor& x, const Window& win, Tensor& y, Tensor& argmax);
// dx [N, C, H, W] (overwritten): each input the sum of dy over the windows it won, in row-major
// order of the outputs (deterministic, no atomics).
void maxpool2d_backward(const Tensor& argmax, const Tensor& dy, const Window& win, Tensor& dx);
// Batch normalisation over dim 1 (channels) of x [N, C, ...] (the rest flattened to L): each
// channel's statistics over its N L elements. The reductions give f64 [2, C] sums, which ranks
// can all-reduce for statistics over the whole batch (SyncBatchNorm).
// sums[0][c] = sum of x, sums[1][c] = sum of x^2 (accumulated in f64).
void batchnorm_reduce(const Tensor& x, Tensor& sums);
// y = (x - mean[c]) invstd[c] gamma[c] + beta[c]; mean, invstd, gamma, beta [C] of x's dtype.
// In place allowed (y may be x).
void batchnorm_forward(const Tensor& x, const Tensor& mean, const Tensor& invstd, const Tensor& gamma,
                       const Tensor& beta, Tensor& y);
// sums[0][c] = sum of dy, sums[1][c] = sum of dy (x - mean[c]) invstd[c] (f64 [2, C]).
void batchnorm_backward_reduce(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                               Tensor& sums);
// dx = gamma[c] invstd[c] (dy - sums[0][c] / count - (x - mean[c]) invstd[c] sums[1][c] / count),
// count the number of elements per channel the statistics were taken over (all ranks' with
// SyncBatchNorm); overwritten.
void batchnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                        const Tensor& gamma, const Tensor& sums, double count, Tensor& dx);

// ---------------------------------------------------------------------------- selection
// The k elements of largest magnitude of x (flattened): values (their signed values, f32/f64 as
// x) and indices i64, by decreasing magnitude, ties by lower index.
void topk_abs(const Tensor& x, int64_t k, Tensor& values, Tensor& indices);
// k distinct indices in [0, n), drawn from Philox (seed, offset): the same on every rank and
// device; sorted ascending. Returned on device d.
Tensor randomk_indices(int64_t n, int64_t k, uint64_t seed, uint64_t offset, Device d);
void gather(const Tensor& x, const Tensor& indices, Tensor& out);        // out[j] = x[idx[j]]
void scatter_add(const Tensor& indices, const Tensor& values, Tensor& out);  // out[idx[j]] += v[j]

// ---------------------------------------------------------------------------- random fills
// Philox-4x32-10 (core/philox.h): element i of the tensor draws counter (offset + i) under key
// seed; bit-identical on CPU and GPU and on every rank. Float tensors (f32, f64, bf16, f16).
void uniform_(Tensor& out, uint64_t seed, uint64_t offset, double lo = 0, double hi = 1);
void normal_(Tensor& out, uint64_t seed, uint64_t offset, double mean = 0, double std = 1);

// ---------------------------------------------------------------------------- linear algebra
// C = alpha * op(A) op(B) + beta * C, op(X) = X or X^T. 2-D: A [m, k] (or [k, m] transposed),
// B [k, n] (or [n, k]), C [m, n]. 3-D: the same for every batch index (strided batched).
// f32 or f64 throughout; or A and B bf16 with C f32 or bf16 (f32 accumulation: alpha op(A) op(B)
// + beta C in f32, rounded once when C is bf16).
// math: see Math (the top of this file).
void gemm(bool trans_a, bool trans_b, double alpha, const Tensor& a, const Tensor& b, double beta, Tensor& c,
          Math math = Math::exact);
// C = alpha * A A^T + beta * C (trans: alpha * A^T A + beta * C), A [n, k] (or [k, n]), C [n, n],
// f32 or f64, 2-D or batched as gemm. Exactly symmetric: the lower triangle is computed (the CPU:
// BLAS ?syrk, half of gemm's products; CUDA: a strided-batched gemm, cuBLAS's ?syrk not being
// batched) and mirrored into the upper (symmetrize).
void syrk(bool trans, double alpha, const Tensor& a, double beta, Tensor& c);
// Copies the lower triangle of a square matrix [n, n] (or of each of [B, n, n]) into its upper
// triangle: exactly symmetric afterwards. f32 or f64.
void symmetrize(Tensor& c);
// Orthonormalise the columns of a [m, r] (or each matrix of [B, m, r]) in place.
// Modified Gram-Schmidt: a column whose norm is below eps becomes zero (never NaN).
void orthonormalize_mgs(Tensor& a, double eps = 1e-8);
// Householder QR (geqrf + orgqr): a becomes the thin Q, r <= m.
void orthonormalize_qr(Tensor& a);
// Symmetric eigendecomposition of a [n, n] (or [B, n, n]): eigenvalues w [n] ascending, and
// eigenvectors as the columns of v [n, n] (v[i][j] = component i of vector j). The lower
// triangle of a is read. Throws Error when the solver does not converge.
void eigh(const Tensor& a, Tensor& w, Tensor& v);
// Inverse roots (A + eps I)^(-1/p) of symmetric positive semi-definite A: by eigendecomposition,
// by the coupled Newton iteration, or (inverse_roots only) by QR iterations warm-started from a
// kept eigenbasis.
// pseudo_inverse (inverse_roots only): eigh without eps; eigenvalues at or below the cutoff
// max(rank_atol, rank_rtol * max(w_max, 0)) get the inverse power 0 (Meta's PseudoInverseConfig,
// torch.linalg.matrix_rank's rule; rank_rtol < 0: n times the dtype's machine epsilon).
enum class RootMethod { eigh, newton, qr, pseudo_inverse };
DTK_ENUM_NAMES(RootMethod, {RootMethod::eigh, "eigh"}, {RootMethod::newton, "newton"}, {RootMethod::qr, "qr"},
               {RootMethod::pseudo_inverse, "pseudo-inverse"})
struct RootOptions {
  RootMethod method = RootMethod::eigh;
  double eps = 1e-12;        // added to the diagonal (eigh) / the regularisation (newton)
  int max_iters = 100;       // newton
  double tolerance = 1e-6;   // newton: stop when max |M - I| < tolerance
  int qr_max_iterations = 1;   // qr: at most this many QR iterations per call
  double qr_tolerance = 0;     // qr: none once ||B - diag B||_F <= qr_tolerance ||B||_F
  double rank_rtol = -1;       // pseudo_inverse: relative cutoff (< 0: n * machine epsilon)
  double rank_atol = 0;        // pseudo_inverse: absolute cutoff
};
// The eigenvalue rule of every root formed from an eigendecomposition (inverse_root's eigh on
// both backends, inverse_roots' eigh and qr): with w the eigenvalues of A + eps I (n of them, any
// order) and w_0 the smallest, when w_0 < eps (A has a negative eigenvalue, in practice rounding
// of a PSD matrix) every eigenvalue is shifted up by eps - w_0, so the smallest becomes eps;
// otherwise none is changed. This is Distributed Shampoo's "make positive semidefinite, then add
// epsilon": lambda - min(lambda_min, 0) + eps. d_j = (w_j + shift)^(-1/p), and the root is
// V diag(d) V^T. Returns false (d unspecified) when an eigenvalue or a d_j is not finite
// (eps = 0 on a singular matrix). d may be w.
bool inverse_root_scales(const double* w, int64_t n, double p, double eps, double* d);
// out = (a + eps I)^(-1/p) for symmetric positive semi-definite a [n, n] (or each of [B, n, n]),
// computed in f64. eigh: the eigenvalue rule above. newton: coupled Newton iteration. Returns
// false (out untouched) when the method fails: no convergence, NaN or Inf. Not the qr method
// (a UsageError: it needs a basis, inverse_roots).
bool inverse_root(const Tensor& a, double p, const RootOptions& opts, Tensor& out);
// The inverse roots of a batch a [B, n, n] (f32 or f64) in a's own dtype, with batched ops (one
// batched eigendecomposition for the whole batch); returns ok [B]: 0 where matrix i failed (out[i]
// then unspecified), which a solver's failure (an Error) gives every matrix of the batch.
//   eigh: eigh(a) = V, w; the eigenvalue rule on w + eps; out = V diag(d) V^T.
//   newton: inverse_root on the batch; if that fails, on each matrix alone.
//   qr: the warm-started eigendecomposition (Distributed Shampoo's QREigendecompositionConfig)
//     from and into `basis` [B, n, n] (a's dtype; a zero matrix: none yet). A matrix without a
//     basis gets a full eigh (a batch where only some have none: one matrix at a time). Else,
//     with A = a + eps I, Q its basis and B = Q^T A Q: while fewer than qr_max_iterations
//     iterations have run and ||B - diag B||_F > qr_tolerance ||B||_F, Q = qr(A Q)
//     (Householder) and B = Q^T A Q. The estimates diag B - eps go through the eigenvalue rule,
//     out = Q diag(d) Q^T, and Q is kept with its columns in descending order of the estimates
//     (stable). The basis of a matrix that fails is zeroed: its next call starts from a full eigh.
std::vector<char> inverse_roots(const Tensor& a, double p, const RootOptions& opts, Tensor& out,
                                Tensor* basis = nullptr);
// The eigenbases of a batch a [B, n, n] (f32 or f64; symmetric) into basis [B, n, n] (columns):
// method eigh, by eigh (ascending eigenvalues), or qr, warm-started from basis as inverse_roots'
// qr (a zero basis: a full eigh) but with the columns by ascending estimate (Meta's SOAP), eps as
// there. Returns ok [B]:
// 0 where the solver failed or the basis is not finite (that basis is zeroed).
std::vector<char> eigenbases(const Tensor& a, const RootOptions& opts, Tensor& basis);
// Quintic Newton-Schulz iterations towards U V^T of each matrix of x [B, r, c] (f32, Frobenius
// norm at most 1: scale it first), with Jordan et al.'s coefficients (Muon): `steps` times
// A = X X^T, X = 3.4445 X + (-4.7750 A + 2.0315 A^2) X, for tall matrices (r > c) mirrored as
// A = X^T X, X = 3.4445 X + X (-4.7750 A + 2.0315 A^2). y [B, r, c] and a, b [B, m, m]
// (m = min(r, c)) are work space; returns x or y, whichever holds the result.
Tensor newton_schulz(Tensor x, Tensor y, Tensor a, Tensor b, int steps);

namespace testing {
// A fault-injection seam for tests: while one lives, the next `blocks` blocks of f32 batches
// that inverse_roots (eigh, pseudo-inverse, qr) and eigenbases solve report failure (ok 0, as a
// solver that did not converge), whatever they computed; f64 solves are untouched, so the f64
// retries of their callers (optim/shampoo_root.cpp, shampoo_corrected.cpp) run. Process-wide; one at a time.
class FailF32Solves {
 public:
  explicit FailF32Solves(int blocks);
  ~FailF32Solves();
  FailF32Solves(const FailF32Solves&) = delete;
  FailF32Solves& operator=(const FailF32Solves&) = delete;
  int remaining() const;  // blocks not yet failed
};
}  // namespace testing

}  // namespace dtk::ops
