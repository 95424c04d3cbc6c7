// blas-rate: one library's GEMM (or eigh) rate, for bench/bench-kernels, which runs it once per
// library and kernel choice in a process of its own (OpenBLAS takes OPENBLAS_CORETYPE only when
// it is loaded), interleaved. The library is loaded with dlopen, so that libraries that export
// the same cblas_sgemm never meet in one process.
//   blas-rate LIBRARY KIND M N K [REPS]
//     KIND: cblas-sgemm, cblas-dgemm (any CBLAS: OpenBLAS, BLIS), dnnl-sgemm (oneDNN),
//           lapacke-ssyevd (M x M; LIBRARY the LAPACKE it calls)
// The product is row-major C = A B^T (dtk's linear layers, y = x W^T) for M x N x K; prints
// "GFLOPS SECONDS CPU_GFLOPS": the rate and time by the median over REPS (default 5, after one
// warm-up) of wall-clock time, and the rate by the median of the process's CPU time, which
// another process on the core does not change (with one thread, the single-thread rate:
// tests/tools/cpu_kernels.sh). The threads are the libraries' own settings (OMP_NUM_THREADS,
// BLIS_NUM_THREADS).
#include <dlfcn.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace {

using SgemmC = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
using DgemmC = void (*)(int, int, int, int, int, int, double, const double*, int, const double*, int, double, double*,
                        int);
using SgemmDnnl = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                          float, float*, int64_t);
using Syevd = int (*)(int, char, char, int, float*, int, float*);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS's enum values
constexpr int kLapackRowMajor = 101;

void* symbol(void* lib, const char* name) {
  void* s = dlsym(lib, name);
  if (s == nullptr) {
    std::fprintf(stderr, "blas-rate: %s: %s\n", name, dlerror());
    std::exit(1);
  }
  return s;
}

double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename T>
std::vector<T> values(size_t n, unsigned seed) {
  std::vector<T> v(n);
  for (auto& e : v) {
    seed = seed * 1664525u + 1013904223u;
    e = static_cast<T>(static_cast<int>(seed >> 20) % 2001 - 1000) / T(1000);
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: blas-rate LIBRARY KIND M N K [REPS]\n");
    return 2;
  }
  const std::string kind = argv[2];
  const int m = std::atoi(argv[3]), n = std::atoi(argv[4]), k = std::atoi(argv[5]);
  const int reps = argc > 6 ? std::atoi(argv[6]) : 5;
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "blas-rate: %s\n", dlerror());
    return 1;
  }
  std::vector<float> a = values<float>(size_t(m) * k, 1), b = values<float>(size_t(n) * k, 2), c(size_t(m) * n);
  std::vector<double> ad(a.begin(), a.end()), bd(b.begin(), b.end()), cd(c.size());
  std::vector<float> sym, work, w;
  double flops = 2.0 * m * n * k;
  std::function<void()> call;
  if (kind == "cblas-sgemm") {
    auto f = reinterpret_cast<SgemmC>(symbol(lib, "cblas_sgemm"));
    call = [&, f] { f(kRowMajor, kNoTrans, kTrans, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n); };
  } else if (kind == "cblas-dgemm") {
    auto f = reinterpret_cast<DgemmC>(symbol(lib, "cblas_dgemm"));
    call = [&, f] { f(kRowMajor, kNoTrans, kTrans, m, n, k, 1.0, ad.data(), k, bd.data(), k, 0.0, cd.data(), n); };
  } else if (kind == "dnnl-sgemm") {
    auto f = reinterpret_cast<SgemmDnnl>(symbol(lib, "dnnl_sgemm"));
    call = [&, f] { f('N', 'T', m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n); };
  } else if (kind == "lapacke-ssyevd") {
    auto f = reinterpret_cast<Syevd>(symbol(lib, "LAPACKE_ssyevd"));
    sym = values<float>(size_t(m) * m, 3);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < i; ++j) sym[size_t(j) * m + i] = sym[size_t(i) * m + j];
    w.resize(m);
    flops = 9.0 * m * m * m;  // ~ the flops of a symmetric eigendecomposition with vectors (for a rate)
    call = [&, f] {
      work = sym;
      if (f(kLapackRowMajor, 'V', 'L', m, work.data(), m, w.data()) != 0) {
        std::fprintf(stderr, "blas-rate: ssyevd failed\n");
        std::exit(1);
      }
    };
  } else {
    std::fprintf(stderr, "blas-rate: unknown kind '%s'\n", kind.c_str());
    return 2;
  }
  call();  // warm-up: the library's buffers and threads
  std::vector<double> wall, cpu;
  for (int r = 0; r < reps; ++r) {
    const double c0 = cpu_seconds();
    const auto t0 = std::chrono::steady_clock::now();
    call();
    wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    cpu.push_back(cpu_seconds() - c0);
  }
  const double med = median(wall);
  std::printf("%.1f %.6f %.1f\n", flops / med / 1e9, med, flops / median(cpu) / 1e9);
  return 0;
}
