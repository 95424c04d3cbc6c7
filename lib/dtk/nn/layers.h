// dtk::nn layers: explicit forward and backward, as in llm.c. A layer is bound to its Params
// (pointers into a Model's parameter list; rebinding is cheap, which is how activation
// checkpointing reuses one set of activation buffers for every transformer layer). forward saves
// what backward needs: handles to its inputs (views, not copies: the caller keeps an input
// unchanged until the backward) and its own intermediate activations in Buffers. backward
// accumulates (+=) into the parameters' grads and writes the input gradient into a tensor the
// caller passes (overwritten unless the doc says it accumulates). A layer's tensors live on its
// parameters' device and have their dtype (f32, or f64 for gradient checks), except under bf16
// weights (ComputeScope below), where activations may be bf16 as each layer's doc says.
//
// Selective activation checkpointing keeps a layer's expensive activations (matmul and attention
// outputs) and recomputes the cheap ones before its backward: a layer can be told to keep a cheap
// activation in a Buffer shared with other layers (set_*_buffer; each forward overwrites it) and
// to recompute it into the tensor its backward reads (recompute_*, or forward again for a norm).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "dtk/core/tensor.h"
#include "dtk/nn/model.h"
#include "dtk/ops/ops.h"

namespace dtk::nn {

// The arithmetic of the layers, which the model sets for the duration of its forward, backward
// and evaluate from its Precision, as PyTorch's autocast is a thread's context (exact f32 weights
// outside them): the math of the weight GEMMs (Linear's three products, Conv2d's; bias products
// stay exact), and whether the layers read the bf16 copies of their weights (Param::half: Linear,
// Embedding and RMSNorm; Model::uses_bf16_weights).
ops::Math gemm_math();
bool bf16_weights();
class ComputeScope {
 public:
  ComputeScope(ops::Math m, bool bf16_weights);
  ~ComputeScope();
  ComputeScope(const ComputeScope&) = delete;
  ComputeScope& operator=(const ComputeScope&) = delete;

 private:
  ops::Math saved_math_;
  bool saved_bf16_;
};
// The tensor a layer computes with for parameter p: its bf16 copy under bf16_weights(), else its value.
const Tensor& weight_of(const Param& p);

// Where the loss of a pass goes, which the model's driver sets for its forward and evaluate as
// it sets ComputeScope: with acc, CrossEntropy adds weight * (mean loss) to acc (f64 [1] on the
// logits' device) and leaves it there, so that the host need not wait for the GPU to read it
// (Model::forward's accumulating form; the trainer reads once per step). host_targets: the host's
// copy of the batch's targets (Batch::host_targets), which CrossEntropy checks and counts instead
// of copying the device's back.
struct LossSink {
  Tensor* acc = nullptr;
  double weight = 1;
  Tensor host_targets;
};
const LossSink& loss_sink();
class LossScope {
 public:
  explicit LossScope(LossSink sink);
  ~LossScope();
  LossScope(const LossScope&) = delete;
  LossScope& operator=(const LossScope&) = delete;

 private:
  LossSink saved_;
};

// A reusable allocation: get() returns a view of the requested shape, allocating only when the
// held storage is too small or of another dtype or device.
class Buffer {
 public:
  Tensor get(const Shape& shape, DType t, Device d);
  void release() { store_ = Tensor(); }
  size_t bytes() const { return store_.defined() ? store_.bytes() : 0; }

 private:
  Tensor store_;
};

// Numbered scratch buffers shared by the backwards of many layers (only one backward runs at a
// time). A layer's backward takes the first slot it may use; it uses a documented number of slots.
class Workspace {
 public:
  Tensor get(size_t slot, const Shape& shape, DType t, Device d) { return buffer(slot).get(shape, t, d); }
  Buffer& buffer(size_t slot);
  void release() { slots_.clear(); }
  size_t bytes() const;

 private:
  std::vector<Buffer> slots_;
};

// y [.., out] = x [.., in] W^T + b, W [out, in] (PyTorch's layout), b [out] optional.
// Under bf16_weights() the products take bf16 operands (W's copy; x as given when bf16, else
// cast to a bf16 copy that the layer keeps for its backward, as autocast does) with f32
// accumulation; y, dx and dy may each be f32 or bf16 (a non-bf16 dy is cast first), the weight
// gradient accumulates in f32.
class Linear {
 public:
  void bind(Param* weight, Param* bias = nullptr);
  bool bound() const { return w_ != nullptr; }
  int64_t in_features() const;
  int64_t out_features() const;
  // x with in_features as its last dim; y with rows(x) * out_features elements. Saves x.
  void forward(const Tensor& x, Tensor& y);
  // dW += dy^T x; db += column sums of dy; dx = dy W (dx += dy W when accumulate_dx), if dx given.
  void backward(const Tensor& dy, Tensor* dx, bool accumulate_dx = false);
  void release();

 private:
  Param* w_ = nullptr;
  Param* b_ = nullptr;
  Tensor x_;
  Buffer ones_;         // [rows, 1] of ones: the bias as a rank-1 gemm
  Buffer x16_, dy16_;  // bf16 weights: x and dy cast to bf16 when they come in f32
};

// out [.., D] = table[ids], ids i32 (any shape), table [V, D].
class Embedding {
 public:
  void bind(Param* table);
  void forward(const Tensor& ids, Tensor& out);  // saves ids
  void backward(const Tensor& dout);             // dtable += scatter of dout
  void release() { ids_ = Tensor(); }

 private:
  Param* table_ = nullptr;
  Tensor ids_;
};

// y = x / sqrt(mean(x^2) + eps) * w over the last dim.
class RMSNorm {
 public:
  void bind(Param* weight, double eps);
  // rstd in `shared` instead of the layer's own buffer (null: its own again). Selective
  // checkpointing recomputes rstd by calling forward (forward_add) again with the same tensors.
  void set_rstd_buffer(Buffer* shared) { rstd_shared_ = shared; }
  void forward(const Tensor& x, Tensor& y);  // saves x and rstd
  // With the residual add fused in: x = a + b (x may be a or b), y = norm(x); saves x and rstd.
  void forward_add(const Tensor& a, const Tensor& b, Tensor& x, Tensor& y);
  // dx overwritten, or with accumulate added to (the residual stream's gradient); dw +=
  void backward(const Tensor& dy, Tensor& dx, bool accumulate = false);
  void release();

 private:
  Buffer& rstd_buf() { return rstd_shared_ ? *rstd_shared_ : rstd_buf_; }

  Param* w_ = nullptr;
  double eps_ = 1e-5;
  Tensor x_, rstd_;
  Buffer rstd_buf_;
  Buffer* rstd_shared_ = nullptr;  // not owned
};

struct AttentionDims {
  int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0;
  double rope_theta = 10000.0;
};

// Causal self-attention with RoPE and grouped-query heads: q = rope(x Wq^T), k = rope(x Wk^T),
// v = x Wv^T, y = attention(q, k, v) Wo^T. x and y [B, T, D]; positions 0..T-1.
class Attention {
 public:
  void bind(Param* wq, Param* wk, Param* wv, Param* wo, const AttentionDims& dims);
  void forward(const Tensor& x, Tensor& y);  // saves x, q, k, v (after RoPE), out, lse
  // y = out Wo^T again from the saved out: forward's last gemm on the same inputs, so the same
  // values (selective checkpointing recomputes the residual stream from it rather than keep it).
  void recompute_output(Tensor& y);
  // dx overwritten (f32 or bf16; dy too: cast to the activations' dtype first when it differs).
  // Uses workspace slots slot0 .. slot0 + 8.
  void backward(const Tensor& dy, Tensor& dx, Workspace& ws, size_t slot0 = 0);
  void release();
  static constexpr size_t kSlots = 9;

 private:
  // bf16 activations at a head dim the bf16 attention kernels do not take (64 and 128 only, ops.h):
  // attention runs in f32 on widened copies of q, k and v (kept for the backward) and its outputs
  // and gradients are rounded to bf16 once, on both backends alike.
  bool widened() const;

  Linear wq_, wk_, wv_, wo_;
  AttentionDims d_;
  Buffer q_buf_, k_buf_, v_buf_, out_buf_, lse_buf_, q32_buf_, k32_buf_, v32_buf_, out32_buf_;
  Tensor q_, k_, v_, out_, lse_;      // the saved views
  Tensor q32_, k32_, v32_, out32_;  // widened()
};

// SwiGLU feed-forward: y = w2(silu(w1 x) * w3 x); w1, w3 [hidden, D], w2 [D, hidden].
class FeedForward {
 public:
  void bind(Param* w1, Param* w2, Param* w3);
  // g in `shared` instead of the layer's own buffer (null: its own again).
  void set_g_buffer(Buffer* shared) { g_shared_ = shared; }
  void forward(const Tensor& x, Tensor& y);  // saves x, a = w1 x, b = w3 x, g = silu(a) * b
  // g = silu(a) * b again from the saved a and b into the saved g (which another layer's forward
  // may have overwritten in a shared buffer): forward's op on the same inputs, the same values.
  void recompute_g();
  // dx overwritten (as Attention's). Uses workspace slots slot0 .. slot0 + 3.
  void backward(const Tensor& dy, Tensor& dx, Workspace& ws, size_t slot0 = 0);
  void release();
  static constexpr size_t kSlots = 4;

 private:
  Linear w1_, w2_, w3_;
  Buffer a_buf_, b_buf_, g_buf_;
  Buffer* g_shared_ = nullptr;  // not owned
  Tensor a_, b_, g_;            // the saved views
};

// Mean cross-entropy of logits [N, V] against targets i32 [N] (any shape with N elements);
// targets -1 are ignored and not counted. The targets are checked and counted on the host: the
// loss sink's host copy when it has one (loss_sink()), else a copy of device targets (a few bytes
// per row, and a wait for the GPU).
class CrossEntropy {
 public:
  // The mean loss; NaN when the loss sink has an accumulator (the loss went there). Saves logits
  // and targets.
  double forward(const Tensor& logits, const Tensor& targets);
  // dlogits = scale * d(mean loss)/d(logits), overwritten.
  void backward(double scale, Tensor& dlogits);
  int64_t count() const { return count_; }
  // Of the last forward's counted targets, how many are the row's largest logit (top-1; the first
  // index among equal logits). Copies the logits to the host (N V elements): for classifiers.
  int64_t correct();
  void release();

 private:
  Tensor logits_, targets_, losses_, lse_;
  Buffer losses_buf_, lse_buf_, host_targets_, sum_buf_, sum64_buf_, host_sum_, host_logits_;
  int64_t count_ = 0;
};

// The end of every model's head: logits = x W^T (+ b), then the mean cross-entropy over the
// targets (CrossEntropy's rules: -1 ignored).
class LinearLoss {
 public:
  void bind(Param* weight, Param* bias = nullptr) { fc_.bind(weight, bias); }
  int64_t out_features() const { return fc_.out_features(); }
  // x [.., in_features]; the mean loss. Saves what backward needs.
  double forward(const Tensor& x, const Tensor& targets);
  // Parameter grads += d(scale * loss)/d(params); dx = d(scale * loss)/dx (overwritten) when given.
  // The logits' gradient is written over the logits (cross_entropy_backward in place: one
  // [N, V] buffer, not two, which at a 128k vocabulary is most of the head's memory).
  void backward(double scale, Tensor* dx);
  // See CrossEntropy::correct; between forward and backward (backward overwrites the logits).
  int64_t correct() { return loss_.correct(); }

 private:
  Linear fc_;
  CrossEntropy loss_;
  Buffer logits_buf_;
  Tensor logits_;
};

// ---------------------------------------------------------------------------- convolutional nets
// Images NCHW, in the parameters' dtype and on their device.

// 2-D convolution without bias (ResNets put a batch norm after every convolution): x [N, C, H, W]
// -> y [N, K, P, Q] with w [K, C, kh, kw] (PyTorch's Conv2d, bias=False). im2col + gemm, one
// image at a time (ops::conv2d_*).
class Conv2d {
 public:
  // The window's kernel must be the weight's (kh, kw).
  void bind(Param* weight, const ops::Window& win);
  Shape out_shape(const Shape& x) const;  // [N, K, P, Q] for x [N, C, H, W]
  void forward(const Tensor& x, Tensor& y);  // saves x
  // dW += the weight gradient; dx (when given) overwritten.
  void backward(const Tensor& dy, Tensor* dx);
  void release();

 private:
  Param* w_ = nullptr;
  ops::Window win_;
  Tensor x_;
  Buffer cols_, dcols_;
};

// Batch normalisation over the channels of x [N, C, ...] (PyTorch's BatchNorm2d, affine, with
// running statistics). Training (Pass::train or recompute): each channel normalised by the
// batch's mean and biased variance over its N H W elements, and the running statistics moved
// towards the batch's by `momentum` (the running variance unbiased, n / (n - 1), as PyTorch);
// with a Sync, the statistics are those of every rank's batch together (SyncBatchNorm): the sums
// and the count are all-reduced. Evaluation: the running statistics, which are left unchanged.
class BatchNorm2d {
 public:
  // Sums f64 [2, C] and the element count, summed in place over the ranks that share statistics.
  using Sync = StatSync;
  // weight (gamma) and bias (beta) [C]; running_mean and running_var [C] of the parameters'
  // dtype and device (the model's buffers, updated in place).
  void bind(Param* weight, Param* bias, Tensor running_mean, Tensor running_var, double eps = 1e-5,
            double momentum = 0.1);
  void set_sync(Sync sync) { sync_ = std::move(sync); }
  void forward(const Tensor& x, Tensor& y, Pass pass);  // training saves x and the statistics
  // dgamma, dbeta += (this rank's share: a data-parallel gradient sum completes them); dx overwritten.
  void backward(const Tensor& dy, Tensor& dx);
  void release();

 private:
  Param *w_ = nullptr, *b_ = nullptr;
  Tensor running_mean_, running_var_;
  double eps_ = 1e-5, momentum_ = 0.1, count_ = 0;
  Sync sync_;
  Tensor x_, mean_, invstd_;
  Buffer sums_buf_, mean_buf_, invstd_buf_, eval_buf_, f64_buf_[3], grad_buf_;
};

// y [N, C] = the mean of each channel of x [N, C, H, W] (global average pooling); the backward
// spreads dy / (H W) over the channel.
class GlobalAvgPool {
 public:
  void forward(const Tensor& x, Tensor& y);  // remembers x's shape
  void backward(const Tensor& dy, Tensor& dx);  // dx [N, C, H, W] overwritten
  void release();

 private:
  Shape shape_;
  Buffer ones_;
};

// Validated host copy of integer ids (i32, any device): every id in [lo, hi) or a UsageError
// naming `what`. Returns a pointer into staging (or into t itself on the CPU).
const int32_t* host_ids(const Tensor& t, Buffer& staging, int64_t lo, int64_t hi, const char* what);

}  // namespace dtk::nn
