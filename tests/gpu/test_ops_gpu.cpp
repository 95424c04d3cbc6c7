// The CUDA ops against the CPU ops: the same inputs (Philox fills on the CPU, copied to the GPU),
// results compared with a relative error per dtype, and the deterministic ops run twice and
// compared bit for bit. Each op prints one line for scripts/gpu-check:
//   gpu-check: <op> <dtype> max_rel_err=<x> tol=<y> PASS|FAIL
// The relative error of an element is |gpu - cpu| / max(|cpu|, 1): relative for large values,
// absolute near zero, where a relative error means nothing (a sum that cancels to 1e-9).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/cuda/lazy.h"
#include "dtk/ops/ops.h"

namespace dtk {
namespace {

const Device kGpu = Device::cuda(0);
constexpr DType kFloats[] = {DType::f32, DType::f64};
const std::vector<int64_t> kSizes = {1, 7, 1000, 4097, (1 << 20) + 3};

#define SKIP_WITHOUT_GPU() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no GPU"

bool mapped(const std::string& library) {
  std::ifstream f("/proc/self/maps");
  std::stringstream all;
  all << f.rdbuf();
  return all.str().find(library) != std::string::npos;
}

// cuBLAS and cuSOLVER are not in a process that has not used them (CPU work only: the GPU tests
// skip without a GPU), and load on first use; no GPU is needed for that.
TEST(GpuOps, LibrariesLoadOnFirstUse) {
  if (cuda::device_count() == 0) {
    Tensor a = Tensor::zeros({64, 64}, DType::f32), c = Tensor::empty({64, 64}, DType::f32);
    ops::gemm(false, false, 1.0, a, a, 0.0, c);
    EXPECT_FALSE(mapped("libcublas")) << "cuBLAS loaded by CPU work";
    EXPECT_FALSE(mapped("libcusolver")) << "cuSOLVER loaded by CPU work";
  }
  EXPECT_STREQ(DTK_CUBLAS(cublasGetStatusString)(CUBLAS_STATUS_SUCCESS), "success");
  int version = 0;
  EXPECT_EQ(DTK_CUSOLVER(cusolverGetVersion)(&version), CUSOLVER_STATUS_SUCCESS);
  EXPECT_EQ(version / 1000, CUSOLVER_VER_MAJOR);  // major * 1000 + minor * 100 + patch
  EXPECT_TRUE(mapped("libcublas"));
  EXPECT_TRUE(mapped("libcusolver"));
  EXPECT_THROW(ops::cuda::lazy::symbol("libcublas.so." DTK_LAZY_STR(CUBLAS_VER_MAJOR), "noSuchFunction"), Error);
  EXPECT_THROW(ops::cuda::lazy::symbol("libdtk-no-such-library.so", "f"), Error);
}

Tensor uniform(const Shape& s, DType t, uint64_t seed, double lo = -1, double hi = 1) {
  Tensor x = Tensor::empty(s, t);
  ops::uniform_(x, seed, 0, lo, hi);
  return x;
}
Tensor like(const Tensor& t, Device d) { return Tensor::empty(t.shape(), t.dtype(), d); }
Tensor gpu(const Tensor& t) { return t.to(kGpu); }

// Integer tensor (i32 / i64) of values in [lo, hi), from a Philox fill.
Tensor random_ints(int64_t n, int64_t lo, int64_t hi, DType t, uint64_t seed) {
  std::vector<double> u = uniform({n}, DType::f64, seed, 0, 1).to_doubles();
  for (double& v : u) v = static_cast<double>(lo + std::min<int64_t>(hi - lo - 1, static_cast<int64_t>(v * (hi - lo))));
  return Tensor::from_doubles(u, {n}, t);
}

double max_rel_err(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = got.to_doubles(), w = want.to_doubles();
  if (g.size() != w.size()) return std::numeric_limits<double>::infinity();
  double e = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (g[i] == w[i] || (std::isnan(g[i]) && std::isnan(w[i]))) continue;
    const double d = std::abs(g[i] - w[i]) / std::max(std::abs(w[i]), 1.0);
    e = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(e, d);
  }
  return e;
}

bool bit_identical(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_doubles(), y = b.to_doubles();
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i)
    if (std::memcmp(&x[i], &y[i], sizeof(double)) != 0) return false;
  return true;
}

double tol(DType t, double f32_tol) { return t == DType::f64 ? 1e-12 : f32_tol; }

void report(const std::string& op, DType t, double err, double tolerance) {
  const bool pass = err <= tolerance;
  std::printf("gpu-check: %s %s max_rel_err=%.3e tol=%.1e %s\n", op.c_str(), std::string(dtype_name(t)).c_str(), err,
              tolerance, pass ? "PASS" : "FAIL");
  EXPECT_LE(err, tolerance) << op << " " << dtype_name(t);
}

void report_determinism(const std::string& op, DType t, bool same) {
  std::printf("gpu-check: %s-determinism %s max_rel_err=%.3e tol=0 %s\n", op.c_str(),
              std::string(dtype_name(t)).c_str(), same ? 0.0 : 1.0, same ? "PASS" : "FAIL");
  EXPECT_TRUE(same) << op << " is not bit-identical run to run";
}

// ------------------------------------------------------------------------------ elementwise
// An op over three inputs (a in [-1, 1], p in [0.1, 2] for sqrt/pow/div, c a u8 condition); run
// on CPU and GPU, on aligned tensors and on views one element in (the unvectorised path).
using ElemFn = std::function<void(const Tensor& a, const Tensor& p, const Tensor& c, Tensor& out)>;

void check_elementwise(const std::string& name, const ElemFn& fn, double f32_tol) {
  for (DType t : kFloats) {
    double err = 0;
    for (int64_t n : kSizes) {
      for (int64_t shift : {0, 1}) {
        const Tensor a = uniform({n + shift}, t, 1).slice(shift, n + shift);
        const Tensor p = uniform({n + shift}, t, 2, 0.1, 2).slice(shift, n + shift);
        Tensor c = Tensor::empty({n + shift}, DType::u8);
        ops::cast(uniform({n + shift}, DType::f32, 3, 0, 2), c);
        c = c.slice(shift, n + shift);
        Tensor want = like(a, Device::cpu()), got = Tensor::empty({n + shift}, t, kGpu).slice(shift, n + shift);
        fn(a, p, c, want);
        fn(gpu(a), gpu(p), gpu(c), got);
        err = std::max(err, max_rel_err(got, want));
      }
    }
    report(name, t, err, tol(t, f32_tol));
  }
}

TEST(GpuOps, Elementwise) {
  SKIP_WITHOUT_GPU();
  using T = const Tensor&;
  check_elementwise("add", [](T a, T p, T, Tensor& o) { ops::add(a, p, o); }, 1e-6);
  check_elementwise("sub", [](T a, T p, T, Tensor& o) { ops::sub(a, p, o); }, 1e-6);
  check_elementwise("mul", [](T a, T p, T, Tensor& o) { ops::mul(a, p, o); }, 1e-6);
  check_elementwise("div", [](T a, T p, T, Tensor& o) { ops::div(a, p, o); }, 1e-6);
  check_elementwise("add_scalar", [](T a, T, T, Tensor& o) { ops::add_scalar(a, 0.75, o); }, 1e-6);
  check_elementwise("scale", [](T a, T, T, Tensor& o) { ops::scale(a, -1.5, o); }, 1e-6);
  check_elementwise("axpy", [](T a, T p, T, Tensor& o) { o.copy_from(p); ops::axpy(0.3, a, o); }, 1e-6);
  check_elementwise("lerp", [](T a, T p, T, Tensor& o) { ops::lerp(a, p, 0.25, o); }, 1e-6);
  check_elementwise("sqrt", [](T, T p, T, Tensor& o) { ops::sqrt(p, o); }, 1e-6);
  check_elementwise("rsqrt", [](T, T p, T, Tensor& o) { ops::rsqrt(p, o); }, 1e-6);
  check_elementwise("pow", [](T, T p, T, Tensor& o) { ops::pow(p, 1.7, o); }, 1e-6);
  check_elementwise("sign", [](T a, T, T, Tensor& o) { ops::sign(a, o); }, 0);
  check_elementwise("abs", [](T a, T, T, Tensor& o) { ops::abs(a, o); }, 0);
  check_elementwise("clamp", [](T a, T, T, Tensor& o) { ops::clamp(a, -0.5, 0.25, o); }, 0);
  check_elementwise("where", [](T a, T p, T c, Tensor& o) { ops::where(c, a, p, o); }, 0);
  // in place: out is the input
  check_elementwise("add(in place)", [](T a, T p, T, Tensor& o) { o.copy_from(a); ops::add(o, p, o); }, 1e-6);
}

TEST(GpuOps, Activations) {
  SKIP_WITHOUT_GPU();
  using T = const Tensor&;
  // a scaled to [-4, 4] for the activations: the interesting part of their curves
  auto wide = [](T a) {
    Tensor x = like(a, a.device());
    ops::scale(a, 4.0, x);
    return x;
  };
  check_elementwise("silu_forward", [&](T a, T, T, Tensor& o) { ops::silu_forward(wide(a), o); }, 1e-5);
  check_elementwise("silu_backward", [&](T a, T p, T, Tensor& o) { ops::silu_backward(wide(a), p, o); }, 1e-5);
  check_elementwise("gelu_forward", [&](T a, T, T, Tensor& o) { ops::gelu_forward(wide(a), o); }, 1e-5);
  check_elementwise("gelu_backward", [&](T a, T p, T, Tensor& o) { ops::gelu_backward(wide(a), p, o); }, 1e-5);
  check_elementwise("relu_forward", [&](T a, T, T, Tensor& o) { ops::relu_forward(a, o); }, 0);
  check_elementwise("relu_backward", [&](T a, T p, T, Tensor& o) { ops::relu_backward(a, p, o); }, 0);
  check_elementwise("swiglu_forward", [&](T a, T p, T, Tensor& o) { ops::swiglu_forward(wide(a), p, o); }, 1e-5);
  for (bool want_da : {true, false}) {
    check_elementwise(want_da ? "swiglu_backward(da)" : "swiglu_backward(db)",
                      [&](T a, T p, T, Tensor& o) {
                        Tensor other = like(o, o.device());
                        const Tensor x = wide(a), dy = wide(p);
                        if (want_da)
                          ops::swiglu_backward(x, p, dy, o, other);
                        else
                          ops::swiglu_backward(x, p, dy, other, o);
                      },
                      1e-5);
  }
}

// ------------------------------------------------------------------------------ optimizers
TEST(GpuOps, Optimizers) {
  SKIP_WITHOUT_GPU();
  for (DType t : kFloats) {
    double sgd_err = 0, adam_err = 0;
    for (int64_t n : kSizes) {
      const Tensor p0 = uniform({n}, t, 10), g = uniform({n}, t, 11), s0 = uniform({n}, t, 12, 0, 1);
      for (int variant = 0; variant < 3; ++variant) {  // momentum + nesterov, momentum, none
        const double momentum = variant == 2 ? 0.0 : 0.9;
        Tensor pc = p0.clone(), bc = s0.clone(), pg = gpu(p0), bg = gpu(s0);
        Tensor none_c, none_g;
        for (int step = 0; step < 3; ++step) {
          ops::sgd_step(pc, g, variant == 2 ? none_c : bc, 0.1, momentum, 0.01, variant == 0);
          ops::sgd_step(pg, gpu(g), variant == 2 ? none_g : bg, 0.1, momentum, 0.01, variant == 0);
        }
        sgd_err = std::max({sgd_err, max_rel_err(pg, pc), max_rel_err(bg, bc)});
      }
      Tensor pc = p0.clone(), mc = g.clone(), vc = s0.clone();
      Tensor pg = gpu(p0), mg = gpu(g), vg = gpu(s0), gg = gpu(g);
      for (int64_t step = 1; step <= 3; ++step) {
        ops::adamw_step(pc, g, mc, vc, 1e-3, 0.9, 0.999, 1e-8, 0.1, step);
        ops::adamw_step(pg, gg, mg, vg, 1e-3, 0.9, 0.999, 1e-8, 0.1, step);
      }
      adam_err = std::max({adam_err, max_rel_err(pg, pc), max_rel_err(mg, mc), max_rel_err(vg, vc)});
    }
    report("sgd_step", t, sgd_err, tol(t, 1e-6));
    report("adamw_step", t, adam_err, tol(t, 1e-6));
  }
}

// The clip factor read on the device (optim's clip_grad_norm): below, at and above the norm, a
// NaN norm (nothing scaled), against the CPU's.
TEST(GpuOps, ClipScale) {
  SKIP_WITHOUT_GPU();
  for (DType t : kFloats) {
    double err = 0;
    for (double norm : {0.5, 2.0, 3.0, std::numeric_limits<double>::quiet_NaN()}) {
      const Tensor x = uniform({4097}, t, 13);
      Tensor xc = x.clone(), xg = gpu(x);
      const Tensor nc = Tensor::from_doubles({norm}, {1}, DType::f64);
      ops::clip_scale(xc, nc, 2.0);
      ops::clip_scale(xg, gpu(nc), 2.0);
      err = std::max(err, max_rel_err(xg, xc));
    }
    report("clip_scale", t, err, tol(t, 0));
  }
}

// Uploads through HostUpload's pinned ring, more of them than it has blocks and of growing sizes,
// queued without the host waiting: each arrives whole; the host's tensor may change right after.
// The ring grows while the GPU is busy (the copies queue behind a long product), then, the GPU
// idle, reuses its blocks (larger tensors: each block grown), none of them waiting for the GPU.
TEST(GpuOps, HostUploadRing) {
  SKIP_WITHOUT_GPU();
  HostUpload up(kGpu);
  std::vector<Tensor> sent, got;
  const Tensor a = gpu(uniform({4096, 4096}, DType::f32, 99));
  Tensor c = Tensor::empty({4096, 4096}, DType::f32, kGpu);
  for (int round = 0; round < 2; ++round) {
    if (round == 0)
      for (int i = 0; i < 32; ++i) ops::gemm(false, false, 1.0, a, a, 0.0, c);  // 4.4 TFLOP queued
    else
      cuda::stream_synchronize(cuda::current_stream());
    const uint64_t stalls = cuda::host_stalls();
    for (int i = 0; i < 11; ++i) {
      Tensor h = uniform({1000 * (i + 1) * (round + 1)}, DType::f32, 100 + i + 20 * round);
      sent.push_back(h.clone());
      got.push_back(up(h));
      ops::fill(h, -1.0);  // the pinned copy was taken: the upload does not see this
    }
    EXPECT_EQ(cuda::host_stalls(), stalls) << "round " << round << ": an upload waited for the GPU";
  }
  double err = 0;
  for (size_t i = 0; i < sent.size(); ++i) err = std::max(err, max_rel_err(got[i], sent[i]));
  report("host_upload", DType::f32, err, 0);
}

// ------------------------------------------------------------------------------ reductions
TEST(GpuOps, Reductions) {
  SKIP_WITHOUT_GPU();
  const std::pair<ops::Reduce, const char*> kinds[] = {
      {ops::Reduce::sum, "sum"},     {ops::Reduce::mean, "mean"},   {ops::Reduce::max, "max"},
      {ops::Reduce::min, "min"},     {ops::Reduce::norm2, "norm2"}, {ops::Reduce::absmax, "absmax"}};
  const std::vector<Shape> shapes = {{1, 1}, {7, 1}, {1, 7}, {1000, 7}, {7, 1000}, {4097, 33}, {33, 4097},
                                     {3, (1 << 20) + 3}, {(1 << 20) + 3, 2}};
  for (DType t : kFloats) {
    for (const auto& [kind, kname] : kinds) {
      for (ops::Axis axis : {ops::Axis::all, ops::Axis::rows, ops::Axis::cols}) {
        const char* aname = axis == ops::Axis::all ? "all" : (axis == ops::Axis::rows ? "rows" : "cols");
        double err = 0;
        bool deterministic = true;
        for (const Shape& s : shapes) {
          const Tensor a = uniform(s, t, 20);
          const Shape os = axis == ops::Axis::all ? Shape{1} : Shape{axis == ops::Axis::rows ? s[0] : s[1]};
          Tensor want = Tensor::empty(os, t), got = Tensor::empty(os, t, kGpu), again = Tensor::empty(os, t, kGpu);
          const Tensor ag = gpu(a);
          ops::reduce(kind, axis, a, want);
          ops::reduce(kind, axis, ag, got);
          ops::reduce(kind, axis, ag, again);
          err = std::max(err, max_rel_err(got, want));
          deterministic = deterministic && bit_identical(got, again);
        }
        const std::string op = std::string("reduce(") + kname + "," + aname + ")";
        report(op, t, err, tol(t, 1e-6));
        report_determinism(op, t, deterministic);
      }
    }
    // the empty sum is 0
    Tensor empty = Tensor::empty({0}, t, kGpu), out = Tensor::empty({1}, t, kGpu);
    ops::reduce(ops::Reduce::sum, ops::Axis::all, empty, out);
    EXPECT_EQ(out.item(), 0.0);
  }
}

TEST(GpuOps, CountNonfinite) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    bool ok = true;
    for (int64_t n : kSizes) {
      std::vector<double> v = uniform({n}, DType::f64, 30).to_doubles();
      int64_t expected = 0;
      for (int64_t i = 0; i < n; i += 97) {
        v[i] = (i / 97) % 3 == 0 ? std::nan("") : ((i / 97) % 3 == 1 ? INFINITY : -INFINITY);
        ++expected;
      }
      const Tensor x = Tensor::from_doubles(v, {n}, t);
      const int64_t got = ops::count_nonfinite(gpu(x));
      ok = ok && got == expected && ops::count_nonfinite(x) == expected;
    }
    report("count_nonfinite", t, ok ? 0 : 1, 0);
  }
}

// ------------------------------------------------------------------------------ nn
const std::vector<Shape> kRowShapes = {{1, 1},       {7, 1000},   {3, 4097},    {1000, 7}, {2, 3, 257},
                                       {16, 32000}, {2048, 2048}, {64, 4096}, {16, 8192}};

TEST(GpuOps, Softmax) {
  SKIP_WITHOUT_GPU();
  for (DType t : kFloats) {
    for (bool log : {false, true}) {
      double ferr = 0, berr = 0;
      for (const Shape& s : kRowShapes) {
        Tensor x = uniform(s, t, 40, -5, 5), dy = uniform(s, t, 41);
        Tensor yc = like(x, Device::cpu()), yg = like(x, kGpu), dxc = like(x, Device::cpu()), dxg = like(x, kGpu);
        if (log) {
          ops::log_softmax_forward(x, yc);
          ops::log_softmax_forward(gpu(x), yg);
          ops::log_softmax_backward(yc, dy, dxc);
          ops::log_softmax_backward(gpu(yc), gpu(dy), dxg);
        } else {
          ops::softmax_forward(x, yc);
          ops::softmax_forward(gpu(x), yg);
          ops::softmax_backward(yc, dy, dxc);
          ops::softmax_backward(gpu(yc), gpu(dy), dxg);
        }
        ferr = std::max(ferr, max_rel_err(yg, yc));
        berr = std::max(berr, max_rel_err(dxg, dxc));
      }
      report(log ? "log_softmax_forward" : "softmax_forward", t, ferr, tol(t, 1e-5));
      report(log ? "log_softmax_backward" : "softmax_backward", t, berr, tol(t, 1e-5));
    }
  }
}

TEST(GpuOps, CrossEntropy) {
  SKIP_WITHOUT_GPU();
  for (DType t : kFloats) {
    double ferr = 0, berr = 0;
    for (const auto& [N, V] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {7, 1000}, {1000, 7}, {64, 32000}}) {
      const Tensor logits = uniform({N, V}, t, 50, -5, 5);
      std::vector<double> tv = random_ints(N, 0, V, DType::i32, 51).to_doubles();
      for (int64_t i = 3; i < N; i += 5) tv[i] = -1;  // ignored rows
      const Tensor targets = Tensor::from_doubles(tv, {N}, DType::i32);
      Tensor lc = Tensor::empty({N}, t), lg = Tensor::empty({N}, t, kGpu);
      Tensor sc = Tensor::empty({N}, t), sg = Tensor::empty({N}, t, kGpu);
      Tensor dc = like(logits, Device::cpu()), dg = like(logits, kGpu);
      ops::cross_entropy_forward(logits, targets, lc, sc);
      ops::cross_entropy_forward(gpu(logits), gpu(targets), lg, sg);
      ops::cross_entropy_backward(logits, targets, sc, 1.0 / N, dc);
      ops::cross_entropy_backward(gpu(logits), gpu(targets), sg, 1.0 / N, dg);
      ferr = std::max({ferr, max_rel_err(lg, lc), max_rel_err(sg, sc)});
      berr = std::max(berr, max_rel_err(dg, dc));
    }
    report("cross_entropy_forward", t, ferr, tol(t, 1e-5));
    report("cross_entropy_backward", t, berr, tol(t, 1e-5));
  }
}

TEST(GpuOps, RmsNorm) {
  SKIP_WITHOUT_GPU();
  for (DType t : kFloats) {
    double ferr = 0, berr = 0, werr = 0;
    bool deterministic = true;
    for (const Shape& s : kRowShapes) {
      const int64_t D = s.back();
      const Tensor x = uniform(s, t, 60), w = uniform({D}, t, 61, 0.5, 1.5), dy = uniform(s, t, 62);
      const Tensor dw0 = uniform({D}, t, 63);  // dw accumulates onto this
      const int64_t R = x.numel() / D;
      Tensor yc = like(x, Device::cpu()), yg = like(x, kGpu), rc = Tensor::empty({R}, t), rg = Tensor::empty({R}, t, kGpu);
      ops::rmsnorm_forward(x, w, 1e-5, yc, rc);
      ops::rmsnorm_forward(gpu(x), gpu(w), 1e-5, yg, rg);
      Tensor dxc = like(x, Device::cpu()), dxg = like(x, kGpu), dwc = dw0.clone(), dwg = gpu(dw0), dwg2 = gpu(dw0);
      ops::rmsnorm_backward(x, w, rc, dy, dxc, dwc);
      ops::rmsnorm_backward(gpu(x), gpu(w), gpu(rc), gpu(dy), dxg, dwg);
      ops::rmsnorm_backward(gpu(x), gpu(w), gpu(rc), gpu(dy), dxg, dwg2);
      // dx over dy (in place, as the contract allows): the same bits as into its own tensor
      Tensor inplace = gpu(dy), dwg3 = gpu(dw0);
      ops::rmsnorm_backward(gpu(x), gpu(w), gpu(rc), inplace, inplace, dwg3);
      deterministic = deterministic && bit_identical(inplace, dxg) && bit_identical(dwg3, dwg);
      // the fused residual add, and the backward accumulating into a residual gradient
      const Tensor b = uniform(s, t, 64);
      Tensor xc = like(x, Device::cpu()), xg = like(x, kGpu), ya = like(x, Device::cpu()), yag = like(x, kGpu);
      ops::add_rmsnorm_forward(x, b, w, 1e-5, xc, ya, rc);
      ops::add_rmsnorm_forward(gpu(x), gpu(b), gpu(w), 1e-5, xg, yag, rg);
      Tensor accc = b.clone(), accg = gpu(b), dwa = dw0.clone(), dwag = gpu(dw0);
      ops::rmsnorm_backward(xc, w, rc, dy, accc, dwa, true);
      ops::rmsnorm_backward(xg, gpu(w), rg, gpu(dy), accg, dwag, true);
      ferr = std::max({ferr, max_rel_err(yg, yc), max_rel_err(xg, xc), max_rel_err(yag, ya)});
      berr = std::max({berr, max_rel_err(dxg, dxc), max_rel_err(accg, accc)});
      werr = std::max(werr, max_rel_err(dwg, dwc));
      deterministic = deterministic && bit_identical(dwg, dwg2);
    }
    report("rmsnorm_forward", t, ferr, tol(t, 1e-5));
    report("rmsnorm_backward(dx)", t, berr, tol(t, 1e-5));
    report("rmsnorm_backward(dw)", t, werr, tol(t, 1e-5));
    report_determinism("rmsnorm_backward(dw)", t, deterministic);
  }
}

// Both backends rotate by the same host-computed table of cos and sin (rope_table), so only the
// two products and the sum of the rotation differ (nvcc contracts them into an FMA, the CPU build
// does not): a few ulp of |x| <= 1 (f64 well within 1e-12 at positions up to 4101).
TEST(GpuOps, Rope) {
  SKIP_WITHOUT_GPU();
  for (DType t : kFloats) {
    double err = 0;
    for (const Shape& s : std::vector<Shape>{{1, 1, 1, 2}, {2, 7, 3, 8}, {1, 1000, 2, 64}, {2, 4097, 1, 16}}) {
      for (bool inverse : {false, true}) {
        const Tensor x = uniform(s, t, 70);
        Tensor yc = like(x, Device::cpu()), yg = gpu(x);
        ops::rope(x, 10000.0, 5, inverse, yc);
        ops::rope(yg, 10000.0, 5, inverse, yg);  // in place
        err = std::max(err, max_rel_err(yg, yc));
      }
    }
    report("rope", t, err, tol(t, 1e-5));
    // q and k in one launch (GQA: k with fewer heads), against the CPU's two passes
    double qk = 0;
    for (bool inverse : {false, true}) {
      const Tensor q = uniform({2, 300, 4, 64}, t, 71), k = uniform({2, 300, 1, 64}, t, 72);
      Tensor qc = q.clone(), kc = k.clone(), qg = gpu(q), kg = gpu(k);
      ops::rope_qk(qc, kc, 500000.0, 3, inverse);
      ops::rope_qk(qg, kg, 500000.0, 3, inverse);
      qk = std::max({qk, max_rel_err(qg, qc), max_rel_err(kg, kc)});
    }
    report("rope_qk", t, qk, tol(t, 1e-5));
  }
}

TEST(GpuOps, Embedding) {
  SKIP_WITHOUT_GPU();
  for (DType t : kFloats) {
    double ferr = 0, berr = 0;
    bool deterministic = true;
    for (const auto& [N, V, D] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {1, 1, 1}, {7, 3, 5}, {4097, 1000, 64}, {(1 << 16) + 3, 50, 7}}) {
      const Tensor table = uniform({V, D}, t, 80), dout = uniform({N, D}, t, 81);
      const Tensor ids = random_ints(N, 0, V, DType::i32, 82);
      Tensor oc = Tensor::empty({N, D}, t), og = Tensor::empty({N, D}, t, kGpu);
      ops::embedding_forward(table, ids, oc);
      ops::embedding_forward(gpu(table), gpu(ids), og);
      Tensor dtc = table.clone(), dtg = gpu(table), dtg2 = gpu(table);
      ops::embedding_backward(ids, dout, dtc);
      ops::embedding_backward(gpu(ids), gpu(dout), dtg);
      ops::embedding_backward(gpu(ids), gpu(dout), dtg2);
      ferr = std::max(ferr, max_rel_err(og, oc));
      berr = std::max(berr, max_rel_err(dtg, dtc));
      deterministic = deterministic && bit_identical(dtg, dtg2);
    }
    report("embedding_forward", t, ferr, 0);
    report("embedding_backward", t, berr, tol(t, 1e-5));
    report_determinism("embedding_backward", t, deterministic);
  }
}

// ------------------------------------------------------------------------------ attention
TEST(GpuOps, Attention) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int64_t B, T, H, Hkv, hd;
  };
  const Case cases[] = {{1, 1, 1, 1, 8},  {2, 7, 4, 2, 16},  {1, 100, 4, 1, 64},
                        {1, 65, 2, 2, 160}, {1, 9, 2, 1, 300}, {1, 1000, 2, 2, 128}};
  for (DType t : kFloats) {
    double ferr = 0, berr = 0;
    bool deterministic = true;
    for (const Case& c : cases) {
      const Tensor q = uniform({c.B, c.T, c.H, c.hd}, t, 90), k = uniform({c.B, c.T, c.Hkv, c.hd}, t, 91);
      const Tensor v = uniform({c.B, c.T, c.Hkv, c.hd}, t, 92), dout = uniform({c.B, c.T, c.H, c.hd}, t, 93);
      const Tensor qg = gpu(q), kg = gpu(k), vg = gpu(v), dg = gpu(dout);
      Tensor oc = like(q, Device::cpu()), og = like(q, kGpu), og2 = like(q, kGpu);
      Tensor lc = Tensor::empty({c.B, c.H, c.T}, t), lg = Tensor::empty({c.B, c.H, c.T}, t, kGpu);
      Tensor lg2 = like(lg, kGpu);
      ops::attention_forward(q, k, v, oc, lc);
      ops::attention_forward(qg, kg, vg, og, lg);
      ops::attention_forward(qg, kg, vg, og2, lg2);
      ferr = std::max({ferr, max_rel_err(og, oc), max_rel_err(lg, lc)});
      deterministic = deterministic && bit_identical(og, og2) && bit_identical(lg, lg2);

      Tensor dqc = like(q, Device::cpu()), dkc = like(k, Device::cpu()), dvc = like(v, Device::cpu());
      Tensor dqg = like(q, kGpu), dkg = like(k, kGpu), dvg = like(v, kGpu);
      Tensor dqg2 = like(q, kGpu), dkg2 = like(k, kGpu), dvg2 = like(v, kGpu);
      ops::attention_backward(q, k, v, oc, lc, dout, dqc, dkc, dvc);
      ops::attention_backward(qg, kg, vg, og, lg, dg, dqg, dkg, dvg);
      ops::attention_backward(qg, kg, vg, og, lg, dg, dqg2, dkg2, dvg2);
      berr = std::max({berr, max_rel_err(dqg, dqc), max_rel_err(dkg, dkc), max_rel_err(dvg, dvc)});
      deterministic = deterministic && bit_identical(dqg, dqg2) && bit_identical(dkg, dkg2) &&
                      bit_identical(dvg, dvg2);
    }
    report("attention_forward", t, ferr, tol(t, 1e-5));
    report("attention_backward", t, berr, tol(t, 1e-4));
    report_determinism("attention", t, deterministic);
  }
  // lse in f32 while q is f64 (the contract allows it): checked against the CPU with an f32 tolerance
  const Tensor q = uniform({1, 33, 2, 32}, DType::f64, 94), k = uniform({1, 33, 1, 32}, DType::f64, 95);
  const Tensor v = uniform({1, 33, 1, 32}, DType::f64, 96);
  Tensor oc = like(q, Device::cpu()), og = like(q, kGpu);
  Tensor lc = Tensor::empty({1, 2, 33}, DType::f32), lg = Tensor::empty({1, 2, 33}, DType::f32, kGpu);
  ops::attention_forward(q, k, v, oc, lc);
  ops::attention_forward(gpu(q), gpu(k), gpu(v), og, lg);
  report("attention_forward(lse f32)", DType::f64, std::max(max_rel_err(og, oc), max_rel_err(lg, lc)), 1e-6);
}

// ------------------------------------------------------------------------------ selection
TEST(GpuOps, TopkAbs) {
  SKIP_WITHOUT_GPU();
  for (DType t : kFloats) {
    double err = 0;
    for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 1}, {7, 3}, {1000, 1000}, {4097, 100}, {(1 << 20) + 3, 1000}}) {
      // values on a coarse grid, so many magnitudes tie (ties must go to the lower index)
      std::vector<double> xv = uniform({n}, DType::f64, 100, -1, 1).to_doubles();
      for (double& x : xv) x = std::round(x * 50) / 50;
      const Tensor x = Tensor::from_doubles(xv, {n}, t);
      Tensor vc = Tensor::empty({k}, t), ic = Tensor::empty({k}, DType::i64);
      Tensor vg = Tensor::empty({k}, t, kGpu), ig = Tensor::empty({k}, DType::i64, kGpu);
      ops::topk_abs(x, k, vc, ic);
      ops::topk_abs(gpu(x), k, vg, ig);
      err = std::max({err, max_rel_err(vg, vc), ig.to_doubles() == ic.to_doubles() ? 0.0 : 1.0});
    }
    report("topk_abs", t, err, 0);
  }
}

TEST(GpuOps, GatherScatterAdd) {
  SKIP_WITHOUT_GPU();
  for (DType t : kFloats) {
    double gerr = 0, serr = 0;
    bool deterministic = true;
    for (int64_t n : kSizes) {
      for (DType it : {DType::i64}) {  // the index dtype topk_abs produces
        const int64_t m = n / 2 + 1;  // more indices than half of n: duplicates in scatter_add
        const Tensor x = uniform({n}, t, 110), idx = random_ints(m, 0, n, it, 111), vals = uniform({m}, t, 112);
        Tensor gc = Tensor::empty({m}, t), gg = Tensor::empty({m}, t, kGpu);
        ops::gather(x, idx, gc);
        ops::gather(gpu(x), gpu(idx), gg);
        Tensor sc = x.clone(), sg = gpu(x), sg2 = gpu(x);
        ops::scatter_add(idx, vals, sc);
        ops::scatter_add(gpu(idx), gpu(vals), sg);
        ops::scatter_add(gpu(idx), gpu(vals), sg2);
        gerr = std::max(gerr, max_rel_err(gg, gc));
        serr = std::max(serr, max_rel_err(sg, sc));
        deterministic = deterministic && bit_identical(sg, sg2);
      }
    }
    report("gather", t, gerr, 0);
    report("scatter_add", t, serr, tol(t, 1e-6));
    report_determinism("scatter_add", t, deterministic);
  }
}

}  // namespace
}  // namespace dtk
