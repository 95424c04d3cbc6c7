// GoogleTest main for the one-process tests: the CPU kernels chosen first, as every program that
// computes chooses them (ops/kernels.h), so that the tests run the kernels the programs run.
#include <gtest/gtest.h>

#include "dtk/ops/kernels.h"

int main(int argc, char** argv) {
  dtk::ops::select_cpu_kernels(argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
