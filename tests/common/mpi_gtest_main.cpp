// GoogleTest main for tests that run under mpiexec: the CPU kernels chosen before MPI starts (as
// every program that computes chooses them: ops/kernels.h), one comm runtime for the process,
// output from rank 0 only, and an exit code that is non-zero on every rank when any rank failed.
#include <gtest/gtest.h>

#include <cstdlib>

#include "dtk/comm/comm.h"
#include "dtk/ops/kernels.h"

int main(int argc, char** argv) {
  dtk::ops::select_cpu_kernels(argv);
  dtk::comm::Runtime rt(&argc, &argv, {});
  ::testing::InitGoogleTest(&argc, argv);
  if (rt.rank() != 0 && !std::getenv("DTK_TEST_ALL_RANKS")) {  // set it to see every rank's output
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int failed = RUN_ALL_TESTS() != 0;
  const int any = rt.max_over_ranks(failed);
  if (any && !failed && rt.rank() != 0) std::fprintf(stderr, "rank %d: passed, but another rank failed\n", rt.rank());
  return any;
}
