// gemm-rate: the single-thread SGEMM rate of the kernels this process runs, by thread CPU time
// (so that another process on the core does not lower it), for tests/tools/cpu_kernels.sh.
// Chooses the kernels first, as every program that computes does (ops/kernels.h).
// Prints "CORE GFLOPS": the core OpenBLAS runs and the best of 5 timings of a 512^3 product.
#include <cblas.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "dtk/ops/kernels.h"

namespace {
double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}
}  // namespace

int main(int, char** argv) {
  dtk::ops::select_cpu_kernels(argv);
  dtk::ops::set_cpu_threads(1);  // every flop on this thread: its CPU time is the product's
  constexpr int n = 512;
  std::vector<float> a(size_t(n) * n), b(a.size()), c(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>(i % 17) / 17.0f - 0.5f;
    b[i] = static_cast<float>(i % 13) / 13.0f - 0.5f;
  }
  double best = 1e30;
  for (int rep = 0; rep < 6; ++rep) {  // the first warms up
    const double t0 = thread_seconds();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    if (rep > 0) best = std::min(best, thread_seconds() - t0);
  }
  std::printf("%s %.1f\n", openblas_get_corename(), 2.0 * n * n * n / best / 1e9);
  return 0;
}
