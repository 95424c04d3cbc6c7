// Fuzz target: a token file (data::open_dataset on an HDF5 file with `tokens` and vocab_size,
// as data-pack text writes it) for a llama of vocab 65536 and seq_len 8, then batches of its
// first, middle and last samples, as the training loop reads them.
// Seeds: data-pack outputs (corpus/token_file/).
#include "read_dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = dtk::fuzz::scratch() / "tokens.h5";
  dtk::fuzz::write_file(path, data, size);
  dtk::nn::ModelConfig m;
  m.arch = dtk::nn::Arch::llama;
  m.vocab = 65536;
  m.seq_len = 8;
  dtk::fuzz::expect_usage_errors([&] {
    dtk::fuzz::read_dataset(path.string(), m);
  });
  return 0;
}
