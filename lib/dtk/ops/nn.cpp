// Public neural-network ops (ops.h): argument checks, then the backend of the tensors' device.
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "dtk/ops/backend.h"
#include "dtk/ops/check.h"

namespace dtk::ops {

std::shared_ptr<const RopeTable> rope_table(int64_t T, int64_t hd, double theta, int64_t pos0) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int64_t, double, int64_t>, std::shared_ptr<const RopeTable>> cache;
  const auto key = std::make_tuple(T, hd, theta, pos0);
  std::lock_guard lock(mu);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  if (cache.size() >= 64) cache.clear();  // unusual: many lengths; start over rather than grow without bound
  auto t = std::make_shared<RopeTable>();
  const int64_t half = hd / 2;
  for (int64_t p = 0; p < T; ++p) {
    const double pos = static_cast<double>(pos0 + p);
    for (int64_t i = 0; i < half; ++i) {
      const double angle = pos * rope_frequency(i, hd, theta);
      t->cos.push_back(std::cos(angle));
      t->sin.push_back(std::sin(angle));
    }
  }
  t->cosf.assign(t->cos.begin(), t->cos.end());
  t->sinf.assign(t->sin.begin(), t->sin.end());
  cache.emplace(key, t);
  return t;
}

namespace {

// `t` has the dtype, device and shape of `ref`.
void check_same(const char* op, const Tensor& ref, const Tensor& t, const char* name) {
  detail::check_like(op, ref, t, name);
  detail::check_shape(op, t, ref.shape(), name);
}

// Float x with at least one dimension: the row ops work on its last dim.
void check_rows(const char* op, const Tensor& x, const char* name) {
  detail::check_float(op, x, name);
  if (x.ndim() < 1) fail_usage(std::string(op) + ": " + name + " needs at least one dimension, got " + x.str());
}

void check_numel(const char* op, const Tensor& t, int64_t want, const char* name) {
  if (t.numel() != want)
    fail_usage("{}: {} must have {} elements, got {}", op, name, want, t.str());
}

void check_cross_entropy(const char* op, const Tensor& logits, const Tensor& targets) {
  detail::check_float_or_bf16(op, logits, "logits");
  if (logits.ndim() != 2 || logits.dim(1) < 1)
    fail_usage(std::string(op) + ": logits must be [N, V] with V >= 1, got " + logits.str());
  detail::check_type(op, targets, DType::i32, "targets");
  detail::check_on(op, logits, targets, "targets");
  check_numel(op, targets, logits.dim(0), "targets");
}

void check_attention(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse) {
  detail::check_defined(op, q, "q");
  const bool bf16 = q.dtype() == DType::bf16;
  if (q.dtype() != DType::f32 && q.dtype() != DType::f64 && !bf16)
    fail_usage(std::string(op) + ": q must be f32, f64 or bf16, got " + q.str());
  if (q.ndim() != 4) fail_usage(std::string(op) + ": q must be [B, T, H, hd], got " + q.str());
  detail::check_defined(op, k, "k");
  if (k.ndim() != 4 || k.dim(0) != q.dim(0) || k.dim(1) != q.dim(1) || k.dim(3) != q.dim(3) || k.dim(2) < 1)
    fail_usage(std::string(op) + ": k must be [B, T, Hkv, hd] like q " + q.str() + ", got " + k.str());
  if (k.dtype() != q.dtype() || k.device() != q.device())
    fail_usage(std::string(op) + ": k must have the dtype and device of q " + q.str() + ", got " + k.str());
  if (q.dim(2) % k.dim(2) != 0)
    fail_usage("{}: the query heads ({}) must be a multiple of the key/value heads ({})", op, q.dim(2), k.dim(2));
  check_same(op, k, v, "v");
  detail::check_defined(op, lse, "lse");
  if (bf16 && lse.dtype() != DType::f32)
    fail_usage(std::string(op) + ": lse must be f32 when q is bf16, got " + lse.str());
  if (lse.dtype() != DType::f32 && lse.dtype() != q.dtype())
    fail_usage(std::string(op) + ": lse must be f32 or the dtype of q, got " + lse.str());
  detail::check_on(op, q, lse, "lse");
  detail::check_shape(op, lse, {q.dim(0), q.dim(2), q.dim(1)}, "lse");
  // The bf16 CUDA kernels are compiled for these two head dims (the CPU accepts the same).
  if (bf16 && q.dim(3) != 64 && q.dim(3) != 128)
    fail_usage("{}: bf16 attention supports head dims 64 and 128, got hd = {} in q {}", op, q.dim(3), q.str());
}

}  // namespace

void softmax_forward(const Tensor& x, Tensor& y) {
  check_rows("softmax_forward", x, "x");
  check_same("softmax_forward", x, y, "y");
  DTK_DISPATCH(x, softmax_forward(x, y));
}

void softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  check_rows("softmax_backward", y, "y");
  check_same("softmax_backward", y, dy, "dy");
  check_same("softmax_backward", y, dx, "dx");
  DTK_DISPATCH(y, softmax_backward(y, dy, dx));
}

void log_softmax_forward(const Tensor& x, Tensor& y) {
  check_rows("log_softmax_forward", x, "x");
  check_same("log_softmax_forward", x, y, "y");
  DTK_DISPATCH(x, log_softmax_forward(x, y));
}

void log_softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  check_rows("log_softmax_backward", y, "y");
  check_same("log_softmax_backward", y, dy, "dy");
  check_same("log_softmax_backward", y, dx, "dx");
  DTK_DISPATCH(y, log_softmax_backward(y, dy, dx));
}

namespace {
// A per-row vector of cross entropy (losses, lse): float, the logits' dtype (f32 for bf16) and
// device, one element a row.
void check_row_vector(const char* op, const Tensor& logits, const Tensor& t, const char* name) {
  detail::check_defined(op, t, name);
  detail::check_float(op, t, name);
  if (!detail::dtypes_mix(t.dtype(), logits.dtype()) || t.device() != logits.device())
    fail_usage("{}: {} must have the dtype (f32 for bf16) and device of logits {}, got {}", op, name, logits.str(),
               t.str());
  check_numel(op, t, logits.dim(0), name);
}
}  // namespace

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor& lse) {
  check_cross_entropy("cross_entropy_forward", logits, targets);
  check_row_vector("cross_entropy_forward", logits, losses, "losses");
  check_row_vector("cross_entropy_forward", logits, lse, "lse");
  DTK_DISPATCH(logits, cross_entropy_forward(logits, targets, losses, lse));
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, double scale,
                            Tensor& dlogits) {
  check_cross_entropy("cross_entropy_backward", logits, targets);
  check_same("cross_entropy_backward", logits, dlogits, "dlogits");
  check_row_vector("cross_entropy_backward", logits, lse, "lse");
  DTK_DISPATCH(logits, cross_entropy_backward(logits, targets, lse, scale, dlogits));
}

namespace {
void rmsnorm_checks(const char* op, const Tensor& x, const Tensor& w, double eps, const Tensor& y, const Tensor& rstd) {
  const std::string o(op);
  check_rows(op, x, "x");
  const int64_t D = x.dim(-1);
  detail::check_shape(op, w, {D}, "w");
  detail::check_like_mixed(op, x, y, "y");
  detail::check_shape(op, y, x.shape(), "y");
  detail::check_defined(op, rstd, "rstd");
  if (!detail::dtypes_mix(w.dtype(), x.dtype()) || w.device() != x.device())
    fail_usage(o + ": w must have the dtype (or bf16 for f32) and device of x " + x.str() + ", got " + w.str());
  if (rstd.dtype() != x.dtype() || rstd.device() != x.device())
    fail_usage(o + ": rstd must have the dtype and device of x " + x.str() + ", got " + rstd.str());
  check_numel(op, rstd, D == 0 ? 0 : x.numel() / D, "rstd");
  if (!(eps >= 0)) fail_usage(o + ": eps must be non-negative");
}
}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  rmsnorm_checks("rmsnorm_forward", x, w, eps, y, rstd);
  Tensor unwritten = x;
  DTK_DISPATCH(x, rmsnorm_forward(x, nullptr, w, eps, unwritten, y, rstd));
}

void add_rmsnorm_forward(const Tensor& a, const Tensor& b, const Tensor& w, double eps, Tensor& x, Tensor& y,
                         Tensor& rstd) {
  detail::check_like_mixed("add_rmsnorm_forward", a, b, "b");
  detail::check_shape("add_rmsnorm_forward", b, a.shape(), "b");
  check_same("add_rmsnorm_forward", a, x, "x");
  rmsnorm_checks("add_rmsnorm_forward", a, w, eps, y, rstd);
  DTK_DISPATCH(a, rmsnorm_forward(a, &b, w, eps, x, y, rstd));
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                      Tensor& dw, bool accumulate) {
  check_rows("rmsnorm_backward", x, "x");
  const int64_t D = x.dim(-1);
  detail::check_shape("rmsnorm_backward", w, {D}, "w");
  if (!detail::dtypes_mix(w.dtype(), x.dtype()) || w.device() != x.device())
    fail_usage("rmsnorm_backward: w must have the dtype (or bf16 for f32) and device of x " + x.str() + ", got " +
               w.str());
  detail::check_defined("rmsnorm_backward", rstd, "rstd");
  if (rstd.dtype() != x.dtype() || rstd.device() != x.device())
    fail_usage("rmsnorm_backward: rstd must have the dtype and device of x " + x.str() + ", got " + rstd.str());
  check_numel("rmsnorm_backward", rstd, D == 0 ? 0 : x.numel() / D, "rstd");
  detail::check_like_mixed("rmsnorm_backward", x, dy, "dy");
  detail::check_shape("rmsnorm_backward", dy, x.shape(), "dy");
  check_same("rmsnorm_backward", x, dx, "dx");
  detail::check_kind("rmsnorm_backward", x, dw, "dw");
  detail::check_shape("rmsnorm_backward", dw, w.shape(), "dw");
  DTK_DISPATCH(x, rmsnorm_backward(x, w, rstd, dy, dx, dw, accumulate));
}

void silu_forward(const Tensor& x, Tensor& y) {
  detail::check_float("silu_forward", x, "x");
  detail::check_like("silu_forward", x, y, "y");
  DTK_DISPATCH(x, silu_forward(x, y));
}

void silu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  detail::check_float("silu_backward", x, "x");
  detail::check_like("silu_backward", x, dy, "dy");
  detail::check_like("silu_backward", x, dx, "dx");
  DTK_DISPATCH(x, silu_backward(x, dy, dx));
}

void gelu_forward(const Tensor& x, Tensor& y) {
  detail::check_float("gelu_forward", x, "x");
  detail::check_like("gelu_forward", x, y, "y");
  DTK_DISPATCH(x, gelu_forward(x, y));
}

void gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  detail::check_float("gelu_backward", x, "x");
  detail::check_like("gelu_backward", x, dy, "dy");
  detail::check_like("gelu_backward", x, dx, "dx");
  DTK_DISPATCH(x, gelu_backward(x, dy, dx));
}

void relu_forward(const Tensor& x, Tensor& y) {
  detail::check_float("relu_forward", x, "x");
  detail::check_like("relu_forward", x, y, "y");
  DTK_DISPATCH(x, relu_forward(x, y));
}

void relu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) {
  detail::check_float("relu_backward", x, "x");
  detail::check_like("relu_backward", x, dy, "dy");
  detail::check_like("relu_backward", x, dx, "dx");
  DTK_DISPATCH(x, relu_backward(x, dy, dx));
}

void swiglu_forward(const Tensor& a, const Tensor& b, Tensor& y) {
  detail::check_float_or_bf16("swiglu_forward", a, "a");
  detail::check_like("swiglu_forward", a, b, "b");
  detail::check_like("swiglu_forward", a, y, "y");
  DTK_DISPATCH(a, swiglu_forward(a, b, y));
}

void swiglu_backward(const Tensor& a, const Tensor& b, const Tensor& dy, Tensor& da, Tensor& db) {
  detail::check_float_or_bf16("swiglu_backward", a, "a");
  detail::check_like("swiglu_backward", a, b, "b");
  detail::check_like("swiglu_backward", a, dy, "dy");
  detail::check_like("swiglu_backward", a, da, "da");
  detail::check_like("swiglu_backward", a, db, "db");
  DTK_DISPATCH(a, swiglu_backward(a, b, dy, da, db));
}

namespace {
void check_rope(const char* op, const Tensor& x, const char* name, double theta, int64_t pos0) {
  detail::check_float_or_bf16(op, x, name);
  if (x.ndim() != 4) fail_usage("{}: {} must be [B, T, H, hd], got {}", op, name, x.str());
  if (x.dim(3) % 2 != 0) fail_usage("{}: the head dim must be even, got {}", op, x.str());
  if (!(theta > 0)) fail_usage("{}: theta must be positive", op);
  if (pos0 < 0) fail_usage("{}: pos0 must be non-negative, got {}", op, pos0);
}
}  // namespace

void rope(const Tensor& x, double theta, int64_t pos0, bool inverse, Tensor& y) {
  check_rope("rope", x, "x", theta, pos0);
  check_same("rope", x, y, "y");
  DTK_DISPATCH(x, rope(x, theta, pos0, inverse, y));
}

void rope_qk(Tensor& q, Tensor& k, double theta, int64_t pos0, bool inverse) {
  check_rope("rope_qk", q, "q", theta, pos0);
  check_rope("rope_qk", k, "k", theta, pos0);
  if (k.dtype() != q.dtype() || k.device() != q.device() || k.dim(0) != q.dim(0) || k.dim(1) != q.dim(1) ||
      k.dim(3) != q.dim(3))
    fail_usage("rope_qk: k {} must have q's {} batch, positions, head dim, dtype and device", k.str(), q.str());
  DTK_DISPATCH(q, rope_qk(q, k, theta, pos0, inverse));
}

void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  detail::check_float_or_bf16("embedding_forward", table, "table");
  if (table.ndim() != 2) fail_usage("embedding_forward: table must be [V, D], got " + table.str());
  detail::check_type("embedding_forward", ids, DType::i32, "ids");
  detail::check_on("embedding_forward", table, ids, "ids");
  detail::check_defined("embedding_forward", out, "out");
  if (!detail::dtypes_mix(out.dtype(), table.dtype()) || out.device() != table.device())
    fail_usage("embedding_forward: out must have the dtype (f32 and bf16 mix) and device of table " + table.str() +
               ", got " + out.str());
  check_numel("embedding_forward", out, ids.numel() * table.dim(1), "out");
  DTK_DISPATCH(table, embedding_forward(table, ids, out));
}

void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  detail::check_float("embedding_backward", dtable, "dtable");
  if (dtable.ndim() != 2) fail_usage("embedding_backward: dtable must be [V, D], got " + dtable.str());
  detail::check_type("embedding_backward", ids, DType::i32, "ids");
  detail::check_on("embedding_backward", dtable, ids, "ids");
  detail::check_defined("embedding_backward", dout, "dout");
  if (dout.dtype() != dtable.dtype() || dout.device() != dtable.device())
    fail_usage("embedding_backward: dout must have the dtype and device of dtable " + dtable.str() + ", got " +
               dout.str());
  check_numel("embedding_backward", dout, ids.numel() * dtable.dim(1), "dout");
  DTK_DISPATCH(dtable, embedding_backward(ids, dout, dtable));
}

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse) {
  check_attention("attention_forward", q, k, v, lse);
  check_same("attention_forward", q, out, "out");
  DTK_DISPATCH(q, attention_forward(q, k, v, out, lse));
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  check_attention("attention_backward", q, k, v, lse);
  check_same("attention_backward", q, out, "out");
  check_same("attention_backward", q, dout, "dout");
  check_same("attention_backward", q, dq, "dq");
  check_same("attention_backward", k, dk, "dk");
  check_same("attention_backward", k, dv, "dv");
  DTK_DISPATCH(q, attention_backward(q, k, v, out, lse, dout, dq, dk, dv));
}

}  // namespace dtk::ops
