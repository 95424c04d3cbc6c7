// Layers with explicit forward and backward (layers.h). Everything runs through dtk::ops, so the
// same code runs on the CPU and on CUDA.
#include "dtk/nn/layers.h"

#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "dtk/core/error.h"
#include "dtk/ops/ops.h"

namespace dtk::nn {

namespace {

// t viewed as a matrix [rows, n].
Tensor as_rows(const Tensor& t, int64_t n, const char* op, const char* name) {
  if (n <= 0 || t.numel() % n != 0)
    fail_usage("{}: {} {} does not have rows of {}", op, name, t.str(), n);
  return t.reshape({t.numel() / n, n});
}

void need_bound(const void* p, const char* layer) {
  if (p == nullptr) fail(std::string(layer) + ": used before bind()");
}

// t itself when it has dtype d, else a copy cast into buf: autocast's casts (a Linear's f32
// input to bf16; an f32 residual gradient rounded where it enters bf16 layers).
Tensor as_dtype(const Tensor& t, DType d, Buffer& buf) {
  if (t.dtype() == d) return t;
  Tensor c = buf.get(t.shape(), d, t.device());
  ops::cast(t, c);
  return c;
}

}  // namespace

// ---------------------------------------------------------------------------- GEMM arithmetic

namespace {
thread_local ops::Math current_gemm_math = ops::Math::exact;
thread_local bool current_bf16_weights = false;
}  // namespace

ops::Math gemm_math() { return current_gemm_math; }
bool bf16_weights() { return current_bf16_weights; }

ComputeScope::ComputeScope(ops::Math m, bool bf16) : saved_math_(current_gemm_math), saved_bf16_(current_bf16_weights) {
  current_gemm_math = m;
  current_bf16_weights = bf16;
}
ComputeScope::~ComputeScope() {
  current_gemm_math = saved_math_;
  current_bf16_weights = saved_bf16_;
}

namespace {
thread_local LossSink current_loss_sink;
}  // namespace

const LossSink& loss_sink() { return current_loss_sink; }
LossScope::LossScope(LossSink sink) : saved_(std::move(current_loss_sink)) { current_loss_sink = std::move(sink); }
LossScope::~LossScope() { current_loss_sink = std::move(saved_); }

const Tensor& weight_of(const Param& p) {
  if (!current_bf16_weights) return p.value;
  if (!p.half.defined()) fail("bf16 weights: " + p.name + " has no bf16 copy bound");
  return p.half;
}

// ---------------------------------------------------------------------------- buffers

Tensor Buffer::get(const Shape& shape, DType t, Device d) {
  const int64_t n = shape_numel(shape);
  if (!store_.defined() || store_.numel() < n || store_.dtype() != t || store_.device() != d)
    store_ = Tensor::empty({n}, t, d);
  return store_.slice(0, n).reshape(shape);
}

Buffer& Workspace::buffer(size_t slot) {
  if (slot >= slots_.size()) slots_.resize(slot + 1);
  return slots_[slot];
}

size_t Workspace::bytes() const {
  size_t n = 0;
  for (const Buffer& b : slots_) n += b.bytes();
  return n;
}

const int32_t* host_ids(const Tensor& t, Buffer& staging, int64_t lo, int64_t hi, const char* what) {
  if (!t.defined() || t.dtype() != DType::i32)
    fail_usage(std::string(what) + " must be i32, got " + (t.defined() ? t.str() : "an undefined tensor"));
  const int32_t* p = t.ptr<int32_t>();
  if (t.is_cuda()) {  // (the copy waits for the work queued on the current stream)
    Tensor h = staging.get({t.numel()}, DType::i32, Device::cpu());
    h.copy_from(t);
    p = h.ptr<int32_t>();
  }
  for (int64_t i = 0; i < t.numel(); ++i)
    if (p[i] < lo || p[i] >= hi)
      fail_usage("{}: element {} is {}, outside [{}, {})", what, i, p[i], lo, hi);
  return p;
}

// ---------------------------------------------------------------------------- Linear

void Linear::bind(Param* weight, Param* bias) {
  w_ = weight;
  b_ = bias;
}

int64_t Linear::in_features() const { return w_ ? w_->shape[1] : 0; }
int64_t Linear::out_features() const { return w_ ? w_->shape[0] : 0; }

void Linear::forward(const Tensor& x, Tensor& y) {
  need_bound(w_, "Linear");
  const Tensor& W = weight_of(*w_);
  x_ = as_rows(x, W.dim(1), "Linear.forward", "x");
  if (W.dtype() == DType::bf16) x_ = as_dtype(x_, DType::bf16, x16_);  // autocast's cast, kept for backward
  Tensor y2 = as_rows(y, W.dim(0), "Linear.forward", "y");
  if (y2.dim(0) != x_.dim(0))
    fail_usage("Linear.forward: y {} must have {} rows like x {}", y.str(), x_.dim(0), x.str());
  ops::gemm(false, true, 1.0, x_, W, 0.0, y2, gemm_math());  // y = x W^T
  if (b_) {
    Tensor ones = ones_.get({x_.dim(0), 1}, W.dtype(), W.device());
    ops::fill(ones, 1.0);
    ops::gemm(false, false, 1.0, ones, weight_of(*b_).reshape({1, W.dim(0)}), 1.0, y2);  // y += 1 b^T
  }
}

void Linear::backward(const Tensor& dy, Tensor* dx, bool accumulate_dx) {
  need_bound(w_, "Linear");
  if (!x_.defined()) fail("Linear.backward: no forward to differentiate");
  const Tensor& W = weight_of(*w_);
  Tensor dy2 = as_dtype(as_rows(dy, W.dim(0), "Linear.backward", "dy"), x_.dtype(), dy16_);
  if (dy2.dim(0) != x_.dim(0))
    fail_usage("Linear.backward: dy {} must have the {} rows of x", dy.str(), x_.dim(0));
  ops::gemm(true, false, 1.0, dy2, x_, 1.0, w_->grad, gemm_math());  // dW += dy^T x
  if (b_) {
    Tensor ones = ones_.get({x_.dim(0), 1}, W.dtype(), W.device());  // filled by forward
    Tensor db = b_->grad.reshape({W.dim(0), 1});
    ops::gemm(true, false, 1.0, dy2, ones, 1.0, db);  // db += dy^T 1
  }
  if (dx) {
    Tensor dx2 = as_rows(*dx, W.dim(1), "Linear.backward", "dx");
    ops::gemm(false, false, 1.0, dy2, W, accumulate_dx ? 1.0 : 0.0, dx2, gemm_math());  // dx (+)= dy W
  }
}

void Linear::release() {
  x_ = Tensor();
  for (Buffer* b : {&ones_, &x16_, &dy16_}) b->release();
}

// ---------------------------------------------------------------------------- Embedding

void Embedding::bind(Param* table) { table_ = table; }

void Embedding::forward(const Tensor& ids, Tensor& out) {
  need_bound(table_, "Embedding");
  ids_ = ids;
  ops::embedding_forward(weight_of(*table_), ids, out);
}

void Embedding::backward(const Tensor& dout) {
  need_bound(table_, "Embedding");
  if (!ids_.defined()) fail("Embedding.backward: no forward to differentiate");
  ops::embedding_backward(ids_, dout, table_->grad);
}

// ---------------------------------------------------------------------------- RMSNorm

void RMSNorm::bind(Param* weight, double eps) {
  w_ = weight;
  eps_ = eps;
}

void RMSNorm::forward(const Tensor& x, Tensor& y) {
  need_bound(w_, "RMSNorm");
  const int64_t D = shape_numel(w_->shape);
  x_ = x;
  rstd_ = rstd_buf().get({as_rows(x, D, "RMSNorm.forward", "x").dim(0)}, x.dtype(), x.device());  // x's: f32 or f64
  ops::rmsnorm_forward(x, weight_of(*w_), eps_, y, rstd_);
}

void RMSNorm::forward_add(const Tensor& a, const Tensor& b, Tensor& x, Tensor& y) {
  need_bound(w_, "RMSNorm");
  const int64_t D = shape_numel(w_->shape);
  rstd_ = rstd_buf().get({as_rows(a, D, "RMSNorm.forward_add", "a").dim(0)}, a.dtype(), a.device());
  ops::add_rmsnorm_forward(a, b, weight_of(*w_), eps_, x, y, rstd_);
  x_ = x;
}

void RMSNorm::backward(const Tensor& dy, Tensor& dx, bool accumulate) {
  need_bound(w_, "RMSNorm");
  if (!x_.defined()) fail("RMSNorm.backward: no forward to differentiate");
  ops::rmsnorm_backward(x_, weight_of(*w_), rstd_, dy, dx, w_->grad, accumulate);
}

void RMSNorm::release() {
  x_ = rstd_ = Tensor();
  rstd_buf_.release();  // a shared buffer is its owner's to release
}

// ---------------------------------------------------------------------------- Attention

void Attention::bind(Param* wq, Param* wk, Param* wv, Param* wo, const AttentionDims& dims) {
  wq_.bind(wq);
  wk_.bind(wk);
  wv_.bind(wv);
  wo_.bind(wo);
  d_ = dims;
}

void Attention::forward(const Tensor& x, Tensor& y) {
  if (x.ndim() != 3) fail_usage("Attention.forward: x must be [B, T, D], got " + x.str());
  const int64_t B = x.dim(0), T = x.dim(1);
  const DType dt = x.dtype();  // the activations' dtype (bf16 under bf16 weights: xn is)
  const Device dev = x.device();
  q_ = q_buf_.get({B, T, d_.n_heads, d_.head_dim}, dt, dev);
  k_ = k_buf_.get({B, T, d_.n_kv_heads, d_.head_dim}, dt, dev);
  v_ = v_buf_.get({B, T, d_.n_kv_heads, d_.head_dim}, dt, dev);
  wq_.forward(x, q_);
  wk_.forward(x, k_);
  wv_.forward(x, v_);
  ops::rope_qk(q_, k_, d_.rope_theta, 0, false);
  out_ = out_buf_.get(q_.shape(), dt, dev);
  lse_ = lse_buf_.get({B, d_.n_heads, T}, dt == DType::bf16 ? DType::f32 : dt, dev);
  if (widened()) {  // bf16 at a head dim without a bf16 kernel: f32 attention on widened copies
    for (auto [src, buf, dst] : {std::tuple{&q_, &q32_buf_, &q32_}, std::tuple{&k_, &k32_buf_, &k32_},
                                 std::tuple{&v_, &v32_buf_, &v32_}, std::tuple{&out_, &out32_buf_, &out32_}}) {
      *dst = buf->get(src->shape(), DType::f32, dev);
      if (src != &out_) ops::cast(*src, *dst);
    }
    ops::attention_forward(q32_, k32_, v32_, out32_, lse_);
    ops::cast(out32_, out_);
  } else {
    ops::attention_forward(q_, k_, v_, out_, lse_);
  }
  wo_.forward(out_, y);
}

bool Attention::widened() const {
  return q_.dtype() == DType::bf16 && d_.head_dim != 64 && d_.head_dim != 128;
}

void Attention::recompute_output(Tensor& y) {
  if (!out_.defined()) fail("Attention.recompute_output: no forward to recompute from");
  wo_.forward(out_, y);
}

void Attention::backward(const Tensor& dy, Tensor& dx, Workspace& ws, size_t slot0) {
  if (!q_.defined()) fail("Attention.backward: no forward to differentiate");
  const DType dt = q_.dtype();
  const Device dev = q_.device();
  Tensor dout = ws.get(slot0, q_.shape(), dt, dev);
  wo_.backward(as_dtype(dy, dt, ws.buffer(slot0 + 4)), &dout);  // dWo += dy^T out; dout = dy Wo
  Tensor dq = ws.get(slot0 + 1, q_.shape(), dt, dev);
  Tensor dk = ws.get(slot0 + 2, k_.shape(), dt, dev);
  Tensor dv = ws.get(slot0 + 3, v_.shape(), dt, dev);
  if (widened()) {  // as forward: in f32, each gradient rounded to bf16 once
    Tensor dout32 = ws.get(slot0 + 5, q_.shape(), DType::f32, dev), dq32 = ws.get(slot0 + 6, q_.shape(), DType::f32, dev);
    Tensor dk32 = ws.get(slot0 + 7, k_.shape(), DType::f32, dev), dv32 = ws.get(slot0 + 8, v_.shape(), DType::f32, dev);
    ops::cast(dout, dout32);
    ops::attention_backward(q32_, k32_, v32_, out32_, lse_, dout32, dq32, dk32, dv32);
    ops::cast(dq32, dq);
    ops::cast(dk32, dk);
    ops::cast(dv32, dv);
  } else {
    ops::attention_backward(q_, k_, v_, out_, lse_, dout, dq, dk, dv);
  }
  // RoPE is a rotation: its backward rotates the gradient back.
  ops::rope_qk(dq, dk, d_.rope_theta, 0, true);
  wq_.backward(dq, &dx, false);
  wk_.backward(dk, &dx, true);
  wv_.backward(dv, &dx, true);
}

void Attention::release() {
  for (Linear* l : {&wq_, &wk_, &wv_, &wo_}) l->release();
  for (Buffer* b : {&q_buf_, &k_buf_, &v_buf_, &out_buf_, &lse_buf_, &q32_buf_, &k32_buf_, &v32_buf_, &out32_buf_})
    b->release();
  q_ = k_ = v_ = out_ = lse_ = q32_ = k32_ = v32_ = out32_ = Tensor();
}

// ---------------------------------------------------------------------------- FeedForward

void FeedForward::bind(Param* w1, Param* w2, Param* w3) {
  w1_.bind(w1);
  w2_.bind(w2);
  w3_.bind(w3);
}

void FeedForward::forward(const Tensor& x, Tensor& y) {
  if (!w1_.bound()) fail("FeedForward: used before bind()");
  const int64_t F = w1_.out_features();
  const int64_t N = as_rows(x, w1_.in_features(), "FeedForward.forward", "x").dim(0);
  a_ = a_buf_.get({N, F}, x.dtype(), x.device());
  b_ = b_buf_.get({N, F}, x.dtype(), x.device());
  g_ = (g_shared_ ? *g_shared_ : g_buf_).get({N, F}, x.dtype(), x.device());
  w1_.forward(x, a_);
  w3_.forward(x, b_);
  ops::swiglu_forward(a_, b_, g_);
  w2_.forward(g_, y);
}

void FeedForward::recompute_g() {
  if (!a_.defined()) fail("FeedForward.recompute_g: no forward to recompute from");
  ops::swiglu_forward(a_, b_, g_);
}

void FeedForward::backward(const Tensor& dy, Tensor& dx, Workspace& ws, size_t slot0) {
  if (!a_.defined()) fail("FeedForward.backward: no forward to differentiate");
  const DType dt = a_.dtype();
  const Device dev = a_.device();
  Tensor dg = ws.get(slot0, a_.shape(), dt, dev);
  w2_.backward(as_dtype(dy, dt, ws.buffer(slot0 + 3)), &dg);  // dW2 += dy^T g; dg = dy W2
  Tensor da = ws.get(slot0 + 1, a_.shape(), dt, dev);
  Tensor db = ws.get(slot0 + 2, a_.shape(), dt, dev);
  ops::swiglu_backward(a_, b_, dg, da, db);
  w1_.backward(da, &dx, false);
  w3_.backward(db, &dx, true);
}

void FeedForward::release() {
  for (Linear* l : {&w1_, &w2_, &w3_}) l->release();
  for (Buffer* b : {&a_buf_, &b_buf_, &g_buf_}) b->release();  // not a shared g: its owner's
  a_ = b_ = g_ = Tensor();
}

// ---------------------------------------------------------------------------- CrossEntropy

double CrossEntropy::forward(const Tensor& logits, const Tensor& targets) {
  if (logits.ndim() != 2) fail_usage("CrossEntropy.forward: logits must be [N, V], got " + logits.str());
  const int64_t N = logits.dim(0), V = logits.dim(1);
  if (!targets.defined() || targets.numel() != N)
    fail_usage("CrossEntropy.forward: targets must have {} elements, got {}", N,
               targets.defined() ? targets.str() : "an undefined tensor");
  const LossSink& sink = loss_sink();
  const bool mirrored = sink.host_targets.defined() && sink.host_targets.numel() == N;
  const int32_t* t = host_ids(mirrored ? sink.host_targets : targets, host_targets_, -1, V, "targets");
  count_ = 0;
  for (int64_t i = 0; i < N; ++i) count_ += t[i] >= 0;
  logits_ = logits;
  targets_ = targets.reshape({N});
  const DType lt = logits.dtype() == DType::bf16 ? DType::f32 : logits.dtype();  // the loss in f32 for bf16 logits
  losses_ = losses_buf_.get({N}, lt, logits.device());
  lse_ = lse_buf_.get({N}, lt, logits.device());
  ops::cross_entropy_forward(logits_, targets_, losses_, lse_);
  if (count_ == 0) return sink.acc ? NAN : 0.0;
  // The sum into our own buffers (ops::reduce_all and Tensor::item allocate).
  Tensor sum = sum_buf_.get({1}, lt, logits.device());
  ops::reduce(ops::Reduce::sum, ops::Axis::all, losses_, sum);
  if (sink.acc) {  // acc += weight * sum / count, in f64 on the device
    if (sum.dtype() != DType::f64) {
      Tensor s64 = sum64_buf_.get({1}, DType::f64, logits.device());
      ops::cast(sum, s64);
      sum = s64;
    }
    ops::axpy(sink.weight / static_cast<double>(count_), sum, *sink.acc);
    return NAN;
  }
  if (sum.is_cuda()) {
    Tensor h = host_sum_.get({1}, sum.dtype(), Device::cpu());
    h.copy_from(sum);
    sum = h;
  }
  return load_as_double(sum.dtype(), sum.data(), 0) / static_cast<double>(count_);
}

void CrossEntropy::backward(double scale, Tensor& dlogits) {
  if (!logits_.defined()) fail("CrossEntropy.backward: no forward to differentiate");
  const double s = count_ > 0 ? scale / static_cast<double>(count_) : 0.0;
  ops::cross_entropy_backward(logits_, targets_, lse_, s, dlogits);
}

int64_t CrossEntropy::correct() {
  if (!logits_.defined()) fail("CrossEntropy.correct: no forward");
  const int64_t N = logits_.dim(0), V = logits_.dim(1);
  Tensor logits = logits_, targets = targets_;
  if (logits.is_cuda() || logits.dtype() == DType::bf16) {  // on the host, bf16 widened to f32
    logits = host_logits_.get(logits_.shape(), logits_.dtype() == DType::f64 ? DType::f64 : DType::f32, Device::cpu());
    if (logits_.dtype() == DType::bf16) {
      Tensor h = logits_.to(Device::cpu());
      ops::cast(h, logits);
    } else {
      logits.copy_from(logits_);
    }
    targets = host_targets_.get({N}, DType::i32, Device::cpu());
    targets.copy_from(targets_);
  }
  const int32_t* t = targets.ptr<int32_t>();
  int64_t c = 0;
  auto count = [&](const auto* l) {
    for (int64_t i = 0; i < N; ++i) {
      if (t[i] < 0) continue;
      const auto* row = l + i * V;
      int64_t best = 0;
      for (int64_t v = 1; v < V; ++v)
        if (row[v] > row[best]) best = v;
      c += best == t[i];
    }
  };
  if (logits.dtype() == DType::f64) count(logits.ptr<double>());
  else count(logits.ptr<float>());
  return c;
}

void CrossEntropy::release() {
  logits_ = targets_ = losses_ = lse_ = Tensor();
  for (Buffer* b : {&losses_buf_, &lse_buf_, &host_targets_, &sum_buf_, &sum64_buf_, &host_sum_, &host_logits_}) b->release();
}

// ---------------------------------------------------------------------------- Conv2d

void Conv2d::bind(Param* weight, const ops::Window& win) {
  if (weight->shape.size() != 4 || weight->shape[2] != win.kh || weight->shape[3] != win.kw)
    fail_usage("Conv2d: {} {} must be [K, C, {}, {}]", weight->name, shape_str(weight->shape), win.kh, win.kw);
  w_ = weight;
  win_ = win;
}

Shape Conv2d::out_shape(const Shape& x) const {
  if (!w_) fail("Conv2d: used before bind()");
  if (x.size() != 4) fail_usage("Conv2d: x must be [N, C, H, W], got " + shape_str(x));
  return {x[0], w_->shape[0], win_.out_h(x[2]), win_.out_w(x[3])};
}

void Conv2d::forward(const Tensor& x, Tensor& y) {
  const Shape out = out_shape(x.shape());
  const Tensor& W = w_->value;
  Tensor cols = cols_.get({x.dim(1) * win_.kh * win_.kw, out[2] * out[3]}, W.dtype(), W.device());
  ops::conv2d_forward(x, W, win_, cols, y, gemm_math());
  x_ = x;
}

void Conv2d::backward(const Tensor& dy, Tensor* dx) {
  if (!x_.defined()) fail("Conv2d.backward: no forward to differentiate");
  const Tensor& W = w_->value;
  const Shape cs{x_.dim(1) * win_.kh * win_.kw, dy.dim(2) * dy.dim(3)};
  Tensor cols = cols_.get(cs, W.dtype(), W.device()), dcols = dcols_.get(cs, W.dtype(), W.device());
  ops::conv2d_backward(x_, W, dy, win_, cols, dcols, w_->grad, dx, gemm_math());
}

void Conv2d::release() {
  x_ = Tensor();
  cols_.release();
  dcols_.release();
}

// ---------------------------------------------------------------------------- BatchNorm2d

void BatchNorm2d::bind(Param* weight, Param* bias, Tensor running_mean, Tensor running_var, double eps, double momentum) {
  const Shape c{weight->shape.empty() ? 0 : weight->shape[0]};
  if (weight->shape.size() != 1 || bias->shape != c || running_mean.shape() != c || running_var.shape() != c)
    fail_usage("BatchNorm2d: " + weight->name + ", " + bias->name + " and the running statistics must all be [C], got " +
               shape_str(weight->shape) + ", " + shape_str(bias->shape) + ", " + running_mean.str() + ", " +
               running_var.str());
  w_ = weight;
  b_ = bias;
  running_mean_ = std::move(running_mean);
  running_var_ = std::move(running_var);
  eps_ = eps;
  momentum_ = momentum;
}

void BatchNorm2d::forward(const Tensor& x, Tensor& y, Pass pass) {
  if (!w_) fail("BatchNorm2d: used before bind()");
  if (x.ndim() < 2 || x.dim(1) != w_->shape[0])
    fail_usage("BatchNorm2d: x must be [N, {}, ...], got {}", w_->shape[0], x.str());
  const int64_t C = x.dim(1);
  const DType t = x.dtype();
  const Device d = x.device();
  if (pass == Pass::evaluate) {  // the running statistics; nothing saved (a pending backward keeps its own)
    Tensor invstd = eval_buf_.get({C}, t, d);
    ops::add_scalar(running_var_, eps_, invstd);
    ops::rsqrt(invstd, invstd);
    ops::batchnorm_forward(x, running_mean_, invstd, w_->value, b_->value, y);
    return;
  }
  Tensor sums = sums_buf_.get({2, C}, DType::f64, d);
  ops::batchnorm_reduce(x, sums);
  double count = C > 0 ? static_cast<double>(x.numel() / C) : 0;
  if (sync_) sync_(sums, count);
  if (count <= 1)
    fail_usage("BatchNorm2d: training needs more than one value per channel, got " + x.str() +
               " (a larger batch or --micro-batch)");
  // mean and biased variance in f64 (E[x^2] - mean^2 from f64 sums), then in the model's dtype.
  Tensor m64 = f64_buf_[0].get({C}, DType::f64, d), v64 = f64_buf_[1].get({C}, DType::f64, d);
  Tensor tmp = f64_buf_[2].get({C}, DType::f64, d);
  ops::scale(sums.select(0), 1.0 / count, m64);
  ops::mul(m64, m64, tmp);
  ops::scale(sums.select(1), 1.0 / count, v64);
  ops::sub(v64, tmp, v64);
  ops::clamp(v64, 0.0, std::numeric_limits<double>::max(), v64);  // rounding below zero
  mean_ = mean_buf_.get({C}, t, d);
  ops::cast(m64, mean_);
  ops::add_scalar(v64, eps_, tmp);
  ops::rsqrt(tmp, tmp);
  invstd_ = invstd_buf_.get({C}, t, d);
  ops::cast(tmp, invstd_);
  if (pass == Pass::train) {  // not again when activation checkpointing recomputes the forward
    ops::lerp(running_mean_, mean_, momentum_, running_mean_);
    ops::scale(v64, count / (count - 1), tmp);  // unbiased
    Tensor v = grad_buf_.get({C}, t, d);
    ops::cast(tmp, v);
    ops::lerp(running_var_, v, momentum_, running_var_);
  }
  ops::batchnorm_forward(x, mean_, invstd_, w_->value, b_->value, y);
  x_ = x;
  count_ = count;
}

void BatchNorm2d::backward(const Tensor& dy, Tensor& dx) {
  if (!x_.defined()) fail("BatchNorm2d.backward: no forward to differentiate");
  const int64_t C = x_.dim(1);
  Tensor sums = sums_buf_.get({2, C}, DType::f64, x_.device());
  ops::batchnorm_backward_reduce(dy, x_, mean_, invstd_, sums);
  // This rank's dbeta = sum dy and dgamma = sum dy xhat: the gradient sum over ranks completes them.
  Tensor g = grad_buf_.get({C}, x_.dtype(), x_.device());
  ops::cast(sums.select(0), g);
  ops::axpy(1.0, g, b_->grad);
  ops::cast(sums.select(1), g);
  ops::axpy(1.0, g, w_->grad);
  if (sync_) {  // the input gradient needs the sums over every rank that shared the statistics
    double ignored = static_cast<double>(x_.numel() / C);
    sync_(sums, ignored);
  }
  ops::batchnorm_backward(dy, x_, mean_, invstd_, w_->value, sums, count_, dx);
}

void BatchNorm2d::release() {
  x_ = mean_ = invstd_ = Tensor();
  for (Buffer* b : {&sums_buf_, &mean_buf_, &invstd_buf_, &eval_buf_, &f64_buf_[0], &f64_buf_[1], &f64_buf_[2], &grad_buf_})
    b->release();
}

// ---------------------------------------------------------------------------- GlobalAvgPool

void GlobalAvgPool::forward(const Tensor& x, Tensor& y) {
  if (x.ndim() != 4 || y.shape() != Shape{x.dim(0), x.dim(1)})
    fail_usage("GlobalAvgPool: x must be [N, C, H, W] and y [N, C], got " + x.str() + " and " + y.str());
  const int64_t NC = x.dim(0) * x.dim(1);
  Tensor y1 = y.reshape({NC});
  ops::reduce(ops::Reduce::mean, ops::Axis::rows, x.reshape({NC, x.dim(2) * x.dim(3)}), y1);
  shape_ = x.shape();
}

void GlobalAvgPool::backward(const Tensor& dy, Tensor& dx) {
  if (shape_.empty()) fail("GlobalAvgPool.backward: no forward");
  const int64_t NC = shape_[0] * shape_[1], HW = shape_[2] * shape_[3];
  if (dx.shape() != shape_) fail_usage("GlobalAvgPool.backward: dx must be " + shape_str(shape_) + ", got " + dx.str());
  Tensor ones = ones_.get({1, HW}, dx.dtype(), dx.device());
  ops::fill(ones, 1.0);
  Tensor dx2 = dx.reshape({NC, HW});
  ops::gemm(false, false, 1.0 / static_cast<double>(HW), dy.reshape({NC, 1}), ones, 0.0, dx2);
}

void GlobalAvgPool::release() {
  shape_.clear();
  ones_.release();
}

// ---------------------------------------------------------------------------- LinearLoss

double LinearLoss::forward(const Tensor& x, const Tensor& targets) {
  logits_ = logits_buf_.get({x.numel() / x.dim(-1), fc_.out_features()}, x.dtype(), x.device());
  fc_.forward(x, logits_);
  return loss_.forward(logits_, targets);
}

void LinearLoss::backward(double scale, Tensor* dx) {
  if (!logits_.defined()) fail("LinearLoss.backward: no forward to differentiate");
  loss_.backward(scale, logits_);  // in place: the logits become their gradient
  fc_.backward(logits_, dx);
  logits_ = Tensor();  // spent
}

}  // namespace dtk::nn
