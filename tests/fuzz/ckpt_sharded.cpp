// Fuzz target: the index of a sharded state (index.h5: virtual datasets over the rank files,
// shard_offsets/shard_lengths, shard_world_size, state_id) over the two rank files of
// tests/data/ckpt-f8dadf6/fsdp, read through ckpt::Reader like a full checkpoint.
// Seeds: that state's index.h5 and fsdp-shampoo's (corpus/ckpt_sharded/).
#include <filesystem>

#include "dtk/ckpt/checkpoint.h"
#include "fuzz.h"
#include "read_all.h"

namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fs::path dir = [] {
    const fs::path d = dtk::fuzz::scratch() / "sharded";
    fs::create_directories(d);
    for (const char* f : {"rank-00000.h5", "rank-00001.h5"})
      fs::copy_file(fs::path(DTK_FUZZ_DATA) / "fsdp" / f, d / f, fs::copy_options::overwrite_existing);
    return d;
  }();
  dtk::fuzz::write_file(dir / "index.h5", data, size);
  dtk::fuzz::expect_usage_errors([&] { dtk::fuzz::read_all(dtk::ckpt::Reader(dir)); });
  return 0;
}
