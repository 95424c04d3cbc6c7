// Fuzz target: a full checkpoint file (ckpt::Reader, man 5 dtk-checkpoint) and every tensor in it.
// Seeds: tests/data's checkpoints (corpus/ckpt_file/).
#include "dtk/ckpt/checkpoint.h"
#include "fuzz.h"
#include "read_all.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = dtk::fuzz::scratch() / "step-00000001.h5";
  dtk::fuzz::write_file(path, data, size);
  dtk::fuzz::expect_usage_errors([&] { dtk::fuzz::read_all(dtk::ckpt::Reader(path)); });
  return 0;
}
