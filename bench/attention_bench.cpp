// attention-bench: dtk's causal attention on the GPU (ops::attention_forward / _backward: the
// flash kernels for bf16, the CUDA-core kernels for f32), timed as bench/pytorch_attention.py
// times PyTorch's SDPA, so that the two JSON lines compare.
//   attention-bench [--batch B] [--seq T] [--heads H] [--kv-heads Hkv] [--head-dim hd]
//                   [--iters N] [--dtype bf16|f32]      (defaults 4 2048 16 16 128 20 bf16)
// Inputs: Philox normals made on the GPU (q, k, v, dout). Three warm-up forward + backward pairs,
// then N forwards back to back between two CUDA events on the ops' stream, then N backwards the
// same way. FLOPs as FlashAttention counts them for causal attention: forward 4 B H T^2 hd / 2,
// backward 2.5 times that. Prints one line of JSON:
//   {"impl":"dtk","dtype":..,"B":..,"T":..,"H":..,"Hkv":..,"hd":..,"fwd_ms":..,"bwd_ms":..,
//    "fwd_tflops":..,"bwd_tflops":..,"fwdbwd_tflops":..}
// Exit status 0; 2 for a bad option; 77 (skipped) without a GPU; 1 for an error.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>

#include "dtk/core/device.h"
#include "dtk/core/tensor.h"
#include "dtk/ops/ops.h"

namespace {

struct Options {
  int64_t batch = 4, seq = 2048, heads = 16, kv_heads = 16, head_dim = 128, iters = 20;
  std::string dtype = "bf16";
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "attention-bench: %s\nusage: attention-bench [--batch B] [--seq T] [--heads H] [--kv-heads Hkv] "
               "[--head-dim hd] [--iters N] [--dtype bf16|f32]\n",
               why.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") usage("causal attention timing, one JSON line");
    if (i + 1 >= argc) usage(a + " needs a value");
    const std::string val = argv[++i];
    if (a == "--dtype") {
      if (val != "bf16" && val != "f32") usage("--dtype must be bf16 or f32, got " + val);
      o.dtype = val;
      continue;
    }
    char* end = nullptr;
    const long long n = std::strtoll(val.c_str(), &end, 10);
    if (end == val.c_str() || *end != '\0' || n < 1) usage(a + " needs a positive integer, got " + val);
    if (a == "--batch") o.batch = n;
    else if (a == "--seq") o.seq = n;
    else if (a == "--heads") o.heads = n;
    else if (a == "--kv-heads") o.kv_heads = n;
    else if (a == "--head-dim") o.head_dim = n;
    else if (a == "--iters") o.iters = n;
    else usage("unknown option " + a);
  }
  if (o.heads % o.kv_heads != 0) usage("--heads must be a multiple of --kv-heads");
  return o;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

int run(const Options& o) {
  using namespace dtk;
  const Device gpu = Device::cuda(0);
  const DType t = o.dtype == "bf16" ? DType::bf16 : DType::f32;
  const Shape qs{o.batch, o.seq, o.heads, o.head_dim}, ks{o.batch, o.seq, o.kv_heads, o.head_dim};
  auto normal = [&](const Shape& s, uint64_t seed) {
    Tensor x = Tensor::empty(s, t, gpu);
    ops::normal_(x, seed, 0);
    return x;
  };
  const Tensor q = normal(qs, 1), k = normal(ks, 2), v = normal(ks, 3), dout = normal(qs, 4);
  Tensor out = Tensor::empty(qs, t, gpu), lse = Tensor::empty({o.batch, o.heads, o.seq}, DType::f32, gpu);
  Tensor dq = Tensor::empty(qs, t, gpu), dk = Tensor::empty(ks, t, gpu), dv = Tensor::empty(ks, t, gpu);
  auto forward = [&] { ops::attention_forward(q, k, v, out, lse); };
  auto backward = [&] { ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv); };

  const auto s = static_cast<cudaStream_t>(cuda::current_stream().handle);
  for (int w = 0; w < 3; ++w) {
    forward();
    backward();
  }
  check(cudaStreamSynchronize(s), "warm-up");
  cudaEvent_t e0, e1, e2;
  check(cudaEventCreate(&e0), "cudaEventCreate");
  check(cudaEventCreate(&e1), "cudaEventCreate");
  check(cudaEventCreate(&e2), "cudaEventCreate");
  check(cudaEventRecord(e0, s), "cudaEventRecord");
  for (int64_t i = 0; i < o.iters; ++i) forward();
  check(cudaEventRecord(e1, s), "cudaEventRecord");
  for (int64_t i = 0; i < o.iters; ++i) backward();
  check(cudaEventRecord(e2, s), "cudaEventRecord");
  check(cudaEventSynchronize(e2), "cudaEventSynchronize");
  float fwd = 0, bwd = 0;
  check(cudaEventElapsedTime(&fwd, e0, e1), "cudaEventElapsedTime");
  check(cudaEventElapsedTime(&bwd, e1, e2), "cudaEventElapsedTime");
  for (cudaEvent_t e : {e0, e1, e2}) cudaEventDestroy(e);
  const double fwd_ms = fwd / static_cast<double>(o.iters), bwd_ms = bwd / static_cast<double>(o.iters);
  const double flops = 4.0 * static_cast<double>(o.batch * o.heads) * static_cast<double>(o.seq) *
                       static_cast<double>(o.seq) * static_cast<double>(o.head_dim) / 2;
  std::printf(
      "{\"impl\":\"dtk\",\"dtype\":\"%s\",\"B\":%lld,\"T\":%lld,\"H\":%lld,\"Hkv\":%lld,\"hd\":%lld,\"fwd_ms\":%.4f,"
      "\"bwd_ms\":%.4f,\"fwd_tflops\":%.1f,\"bwd_tflops\":%.1f,\"fwdbwd_tflops\":%.1f}\n",
      o.dtype.c_str(), static_cast<long long>(o.batch), static_cast<long long>(o.seq), static_cast<long long>(o.heads),
      static_cast<long long>(o.kv_heads), static_cast<long long>(o.head_dim), fwd_ms, bwd_ms, flops / fwd_ms / 1e9,
      2.5 * flops / bwd_ms / 1e9, 3.5 * flops / (fwd_ms + bwd_ms) / 1e9);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (dtk::cuda::device_count() == 0) {
    std::printf("attention-bench: no GPU, skipped\n");
    return 77;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention-bench: %s\n", e.what());
    return 1;
  }
}
