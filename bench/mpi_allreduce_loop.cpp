// The baseline of bench/bench-comm: a plain MPI_Allreduce loop, timed exactly as comm-bench
// times (warm-up, barrier, back-to-back iterations, mean over ranks), with no dtk code in the path.
//   mpi-allreduce-loop MIN_BYTES MAX_BYTES FACTOR ITERS WARMUP
// prints one line per size: bytes time_us algbw_GBps busbw_GBps
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s MIN_BYTES MAX_BYTES FACTOR ITERS WARMUP\n", argv[0]);
    MPI_Finalize();
    return 2;
  }
  const size_t lo = std::strtoull(argv[1], nullptr, 10), hi = std::strtoull(argv[2], nullptr, 10);
  const size_t factor = std::strtoull(argv[3], nullptr, 10);
  const int iters = std::atoi(argv[4]), warmup = std::atoi(argv[5]);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  std::vector<float> send(hi / 4 + 1, 1.0f), recv(hi / 4 + 1);
  for (size_t bytes = lo; bytes <= hi; bytes *= factor) {
    const int count = static_cast<int>(bytes / 4);
    for (int k = 0; k < warmup; ++k) MPI_Allreduce(send.data(), recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < iters; ++k) MPI_Allreduce(send.data(), recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    const auto t1 = std::chrono::steady_clock::now();
    double us = std::chrono::duration<double, std::micro>(t1 - t0).count() / iters, sum = 0;
    MPI_Allreduce(&us, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    us = sum / n;
    const double algbw = static_cast<double>(bytes) / (us * 1e3);
    if (rank == 0) std::printf("%zu %.3f %.4f %.4f\n", bytes, us, algbw, algbw * 2.0 * (n - 1) / n);
    if (factor < 2) break;
  }
  MPI_Finalize();
  return 0;
}
