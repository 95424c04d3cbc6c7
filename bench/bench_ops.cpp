// bench-ops: dtk::ops against baselines measured in the same run (bench/bench-ops).
//   GEMM: dtk::ops::gemm vs OpenBLAS cblas_?gemm called directly (CPU), and vs cuBLAS called
//         directly (CUDA, f32 and bf16) when a GPU exists; GFLOP/s and the ratio dtk / direct.
//   Bandwidth: ops::add, scale, axpy, reduce sum and adamw_step as a fraction of a same-size
//         copy (memcpy on the CPU, a device-to-device copy on the GPU), counting the bytes each
//         op must read and write.
//   Fusion: a llama layer's QKV and w1|w3 products as one dtk::ops::gemm over the weights laid
//         end to end against one per weight, forward and backward as nn::Linear runs them (the
//         fusions docs/DESIGN.md leaves unbuilt until a GPU shows them to pay): llama-small's
//         shapes in f32 on the CPU, llama3-1b's in bf16 on the GPU; the median and range of the
//         per-round ratios fused / separate (a pair a round, the order alternating).
// Each figure is the best of several rounds, the op and its baseline interleaved, so that load
// from other processes hits both alike. Output: a table on stdout.
//   bench-ops [--quick] [--cpu-only]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "dtk/core/device.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/kernels.h"
#include "dtk/ops/ops.h"

#ifdef DTK_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  bool quick = false;
  bool cpu_only = false;
};

// Seconds per call of f: `reps` calls per round, best of `rounds`; sync() ends a timed region
// (a device synchronisation on the GPU, nothing on the CPU).
double time_best(const std::function<void()>& f, const std::function<void()>& sync, int reps, int rounds) {
  f();  // warm-up: first-touch, handle creation, workspace
  sync();
  double best = 1e300;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = Clock::now();
    for (int i = 0; i < reps; ++i) f();
    sync();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count() / reps);
  }
  return best;
}

// Time a and b interleaved round by round (best of each).
std::pair<double, double> time_pair(const std::function<void()>& a, const std::function<void()>& b,
                                    const std::function<void()>& sync, int reps, int rounds) {
  double ta = 1e300, tb = 1e300;
  for (int r = 0; r < rounds; ++r) {
    ta = std::min(ta, time_best(a, sync, reps, 1));
    tb = std::min(tb, time_best(b, sync, reps, 1));
  }
  return {ta, tb};
}

int reps_for(double flops_or_bytes, double per_second, double target_s) {
  return std::clamp(static_cast<int>(target_s * per_second / std::max(flops_or_bytes, 1.0)), 1, 1000);
}

struct GemmSize {
  int m, n, k;
};

void bench_cpu_gemm(const Options& opt) {
  std::printf("# GEMM on the CPU: dtk::ops::gemm vs cblas_?gemm called directly (row-major, C = A B)\n");
  std::printf("# %-6s %6s %6s %6s %12s %12s %8s\n", "dtype", "m", "n", "k", "dtk GF/s", "blas GF/s", "ratio");
  std::vector<GemmSize> sizes = {{256, 256, 256}, {1024, 1024, 1024}, {2048, 2048, 2048}, {4096, 1024, 1024}};
  if (opt.quick) sizes = {{256, 256, 256}, {1024, 1024, 1024}};
  for (dtk::DType t : {dtk::DType::f32, dtk::DType::f64}) {
    for (const GemmSize& s : sizes) {
      dtk::Tensor a = dtk::Tensor::empty({s.m, s.k}, t), b = dtk::Tensor::empty({s.k, s.n}, t);
      dtk::Tensor c = dtk::Tensor::zeros({s.m, s.n}, t);
      dtk::ops::uniform_(a, 1, 0, -1, 1);
      dtk::ops::uniform_(b, 2, 0, -1, 1);
      const double flops = 2.0 * s.m * s.n * s.k;
      auto dtk_call = [&] { dtk::ops::gemm(false, false, 1.0, a, b, 0.0, c); };
      auto blas_call = [&] {
        if (t == dtk::DType::f32)
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s.m, s.n, s.k, 1.0f, a.ptr<float>(), s.k,
                      b.ptr<float>(), s.n, 0.0f, c.ptr<float>(), s.n);
        else
          cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s.m, s.n, s.k, 1.0, a.ptr<double>(), s.k,
                      b.ptr<double>(), s.n, 0.0, c.ptr<double>(), s.n);
      };
      const int reps = reps_for(flops, 50e9, opt.quick ? 0.05 : 0.2);
      const auto [td, tb] = time_pair(dtk_call, blas_call, [] {}, reps, opt.quick ? 2 : 3);
      std::printf("  %-6s %6d %6d %6d %12.1f %12.1f %8.3f\n", std::string(dtk::dtype_name(t)).c_str(), s.m, s.n, s.k,
                  flops / td / 1e9, flops / tb / 1e9, tb / td);
      std::fflush(stdout);
    }
  }
}

// Bytes each elementwise op must move per element (reads + writes), in units of the element.
struct BwOp {
  const char* name;
  int words;  // elements read + written per index
  std::function<void()> run;
};

void bench_bandwidth(dtk::Device d, const Options& opt) {
  const int64_t n = opt.quick ? (int64_t(1) << 22) : (d.is_cuda() ? (int64_t(1) << 26) : (int64_t(1) << 24));
  const dtk::DType t = dtk::DType::f32;
  dtk::Tensor a = dtk::Tensor::empty({n}, t, d), b = dtk::Tensor::empty({n}, t, d), out = dtk::Tensor::empty({n}, t, d);
  dtk::Tensor m = dtk::Tensor::zeros({n}, t, d), v = dtk::Tensor::zeros({n}, t, d), sum = dtk::Tensor::empty({1}, t, d);
  dtk::ops::uniform_(a, 3, 0, -1, 1);
  dtk::ops::uniform_(b, 4, 0, -1, 1);
  std::function<void()> sync = [] {};
  std::function<void()> copy;
  if (d.is_cuda()) {
    sync = [] { dtk::cuda::stream_synchronize(dtk::cuda::current_stream()); };
    copy = [&] { dtk::cuda::memcpy_async(out.data(), a.data(), out.bytes(), dtk::cuda::current_stream()); };
  } else {
    copy = [&] { std::memcpy(out.data(), a.data(), out.bytes()); };
  }
  int64_t step = 0;
  const std::vector<BwOp> ops = {
      {"add", 3, [&] { dtk::ops::add(a, b, out); }},
      {"scale", 2, [&] { dtk::ops::scale(a, 0.5, out); }},
      {"axpy", 3, [&] { dtk::ops::axpy(1e-3, a, out); }},
      {"reduce_sum", 1, [&] { dtk::ops::reduce(dtk::ops::Reduce::sum, dtk::ops::Axis::all, a, sum); }},
      // p, g, m, v read; p, m, v written
      {"adamw_step", 7, [&] { dtk::ops::adamw_step(out, b, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.01, ++step); }},
  };
  const double bytes_copy = 2.0 * n * 4;
  const double guess = d.is_cuda() ? 2e12 : 5e9;
  std::printf("# bandwidth on %s, f32, %lld elements: op GB/s over %s GB/s\n", d.str().c_str(),
              static_cast<long long>(n), d.is_cuda() ? "device-to-device copy" : "memcpy");
  std::printf("# %-12s %10s %10s %8s\n", "op", "op GB/s", "copy GB/s", "fraction");
  for (const BwOp& op : ops) {
    const double bytes = double(op.words) * n * 4;
    const int reps = reps_for(bytes, guess, opt.quick ? 0.05 : 0.2);
    const auto [top, tcopy] = time_pair(op.run, copy, sync, reps, opt.quick ? 2 : 4);
    const double gop = bytes / top / 1e9, gcopy = bytes_copy / tcopy / 1e9;
    std::printf("  %-12s %10.1f %10.1f %8.3f\n", op.name, gop, gcopy, gop / gcopy);
    std::fflush(stdout);
  }
}

// One layer's products that a fusion would merge: `rows` tokens of `in` features into the
// outputs `outs` (q, k, v; or w1, w3), each y = x W^T, dW += dy^T x, dx (+)= dy W as nn::Linear
// does, one gemm each (separate) or one over the concatenation (fused: W [sum outs, in] whose
// row blocks are the separate weights, y and dy [rows, sum outs]). Weights and activations in
// t, the weight gradient in f32 (the model's f32 grads).
struct FusionCase {
  const char* name;
  int64_t rows, in;
  std::vector<int64_t> outs;
};

void bench_fusion(dtk::Device d, dtk::DType t, const std::vector<FusionCase>& cases, const Options& opt) {
  std::function<void()> sync = [] {};
#ifdef DTK_HAVE_CUDA
  if (d.is_cuda()) sync = [] { dtk::cuda::stream_synchronize(dtk::cuda::current_stream()); };
#endif
  const int rounds = opt.quick ? 5 : 9;
  std::printf("# fusion on %s, %s: a layer's products forward and backward, one gemm over the weights laid end to\n"
              "# end against one per weight; the median [range] of %d interleaved pairs' time ratios\n",
              d.str().c_str(), std::string(dtk::dtype_name(t)).c_str(), rounds);
  std::printf("# %-6s %6s %6s %-16s %11s %11s %22s\n", "layer", "rows", "in", "outs", "fused ms", "separate ms",
              "fused / separate");
  for (const FusionCase& c : cases) {
    int64_t total = 0;
    for (int64_t o : c.outs) total += o;
    dtk::Tensor w = dtk::Tensor::empty({total, c.in}, t, d), dw = dtk::Tensor::zeros({total, c.in}, dtk::DType::f32, d);
    dtk::Tensor x = dtk::Tensor::empty({c.rows, c.in}, t, d), dx = dtk::Tensor::empty({c.rows, c.in}, t, d);
    dtk::Tensor y = dtk::Tensor::empty({c.rows, total}, t, d), dy = dtk::Tensor::empty({c.rows, total}, t, d);
    for (auto [u, seed] : {std::pair{&w, 5}, {&x, 6}, {&dy, 7}}) dtk::ops::uniform_(*u, seed, 0, -0.05, 0.05);
    std::vector<dtk::Tensor> ws, dws, ys, dys;  // the separate layers' own tensors (q_, k_, v_ are distinct buffers)
    int64_t at = 0;
    for (int64_t o : c.outs) {
      ws.push_back(w.slice(at, at + o));
      dws.push_back(dw.slice(at, at + o));
      ys.push_back(dtk::Tensor::empty({c.rows, o}, t, d));
      dys.push_back(dtk::Tensor::empty({c.rows, o}, t, d));
      dtk::ops::uniform_(dys.back(), 8 + at, 0, -0.05, 0.05);
      at += o;
    }
    auto fused = [&] {
      dtk::ops::gemm(false, true, 1.0, x, w, 0.0, y);
      dtk::ops::gemm(true, false, 1.0, dy, x, 1.0, dw);
      dtk::ops::gemm(false, false, 1.0, dy, w, 0.0, dx);
    };
    auto separate = [&] {
      for (size_t i = 0; i < ws.size(); ++i) dtk::ops::gemm(false, true, 1.0, x, ws[i], 0.0, ys[i]);
      for (size_t i = 0; i < ws.size(); ++i) {
        dtk::ops::gemm(true, false, 1.0, dys[i], x, 1.0, dws[i]);
        dtk::ops::gemm(false, false, 1.0, dys[i], ws[i], i ? 1.0 : 0.0, dx);
      }
    };
    const double flops = 6.0 * double(c.rows) * double(total) * double(c.in);
    const int reps = reps_for(flops, d.is_cuda() ? 300e12 : 50e9, opt.quick ? 0.05 : 0.2);
    std::vector<double> ratio;
    double tf = 1e300, ts = 1e300;
    for (int r = 0; r < rounds; ++r) {  // a pair a round, the order alternating
      double a, b;
      if (r % 2) b = time_best(separate, sync, reps, 1), a = time_best(fused, sync, reps, 1);
      else a = time_best(fused, sync, reps, 1), b = time_best(separate, sync, reps, 1);
      tf = std::min(tf, a);
      ts = std::min(ts, b);
      ratio.push_back(a / b);
    }
    std::sort(ratio.begin(), ratio.end());
    std::string outs;
    for (int64_t o : c.outs) outs += (outs.empty() ? "" : "+") + std::to_string(o);
    std::printf("  %-6s %6lld %6lld %-16s %11.3f %11.3f %8.3f [%.3f-%.3f]\n", c.name, static_cast<long long>(c.rows),
                static_cast<long long>(c.in), outs.c_str(), tf * 1e3, ts * 1e3, ratio[ratio.size() / 2],
                ratio.front(), ratio.back());
    std::fflush(stdout);
  }
}

#ifdef DTK_HAVE_CUDA
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "bench-ops: %s failed: %s\n", what, cublasGetStatusString(s));
    std::exit(1);
  }
}

void bench_cuda_gemm(const Options& opt) {
  std::printf("# GEMM on %s: dtk::ops::gemm vs cuBLAS called directly (row-major C = A B as C^T = B^T A^T)\n",
              dtk::cuda::device_name(0).c_str());
  std::printf("# %-6s %6s %6s %6s %12s %12s %8s\n", "dtype", "m", "n", "k", "dtk TF/s", "cublas TF/s", "ratio");
  cublasHandle_t h = nullptr;
  check(cublasCreate(&h), "cublasCreate");
  check(cublasSetStream(h, static_cast<cudaStream_t>(dtk::cuda::current_stream().handle)), "cublasSetStream");
  const dtk::Device g = dtk::Device::cuda(0);
  std::vector<GemmSize> sizes = {{1024, 1024, 1024}, {4096, 4096, 4096}, {8192, 8192, 8192}, {4096, 1024, 1024}};
  if (opt.quick) sizes = {{1024, 1024, 1024}, {4096, 4096, 4096}};
  for (dtk::DType t : {dtk::DType::f32, dtk::DType::bf16}) {
    for (const GemmSize& s : sizes) {
      dtk::Tensor a = dtk::Tensor::empty({s.m, s.k}, t, g), b = dtk::Tensor::empty({s.k, s.n}, t, g);
      dtk::Tensor c = dtk::Tensor::zeros({s.m, s.n}, dtk::DType::f32, g);
      dtk::ops::uniform_(a, 1, 0, -1, 1);
      dtk::ops::uniform_(b, 2, 0, -1, 1);
      const double flops = 2.0 * s.m * s.n * s.k;
      const float one = 1, zero = 0;
      auto dtk_call = [&] { dtk::ops::gemm(false, false, 1.0, a, b, 0.0, c); };
      auto cublas_call = [&] {
        if (t == dtk::DType::f32)
          check(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, s.n, s.m, s.k, &one, b.ptr<float>(), s.n, a.ptr<float>(), s.k,
                            &zero, c.ptr<float>(), s.n),
                "cublasSgemm");
        else
          check(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, s.n, s.m, s.k, &one, b.data(), CUDA_R_16BF, s.n, a.data(),
                             CUDA_R_16BF, s.k, &zero, c.data(), CUDA_R_32F, s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "cublasGemmEx");
      };
      const int reps = reps_for(flops, t == dtk::DType::f32 ? 40e12 : 400e12, opt.quick ? 0.05 : 0.2);
      const auto [td, tc] = time_pair(dtk_call, cublas_call, [] { dtk::cuda::stream_synchronize(dtk::cuda::current_stream()); }, reps, 3);
      std::printf("  %-6s %6d %6d %6d %12.2f %12.2f %8.3f\n", std::string(dtk::dtype_name(t)).c_str(), s.m, s.n, s.k,
                  flops / td / 1e12, flops / tc / 1e12, tc / td);
      std::fflush(stdout);
    }
  }
  cublasDestroy(h);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  // The kernels, chosen as the programs choose them; every figure below was measured with these.
  std::string kernels = "# " + dtk::ops::select_cpu_kernels(argv);
  for (size_t at = kernels.find('\n'); at != std::string::npos; at = kernels.find('\n', at + 1)) kernels.insert(at + 1, "# ");
  std::printf("%s\n", kernels.c_str());
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      opt.quick = true;
    } else if (a == "--cpu-only") {
      opt.cpu_only = true;
    } else {
      std::fprintf(stderr, "usage: bench-ops [--quick] [--cpu-only]\n");
      return 2;
    }
  }
  try {
    bench_cpu_gemm(opt);
    bench_bandwidth(dtk::Device::cpu(), opt);
    // llama-small: batch 8 of 256 tokens, dim 512, 8 heads and 4 kv heads of 64, ffn 1408
    bench_fusion(dtk::Device::cpu(), dtk::DType::f32,
                 {{"qkv", 2048, 512, {512, 256, 256}}, {"w1|w3", 2048, 512, {1408, 1408}}}, opt);
#ifdef DTK_HAVE_CUDA
    if (!opt.cpu_only && dtk::cuda::device_count() > 0) {
      bench_cuda_gemm(opt);
      bench_bandwidth(dtk::Device::cuda(0), opt);
      // llama3-1b: batch 4 of 2048 tokens, dim 2048, 32 heads and 8 kv heads of 64, ffn 8192
      bench_fusion(dtk::Device::cuda(0), dtk::DType::bf16,
                   {{"qkv", 8192, 2048, {2048, 512, 512}}, {"w1|w3", 8192, 2048, {8192, 8192}}}, opt);
    } else {
      std::printf("# no GPU: CUDA figures skipped\n");
    }
#else
    std::printf("# built without CUDA: CUDA figures skipped\n");
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-ops: %s\n", e.what());
    return 1;
  }
  return 0;
}
