// Fuzz target: a token file (data::open_dataset on an HDF5 file with `tokens` and vocab_size,
// as data-pack text writes it) for a llama of vocab 65536 and seq_len 8, then batches of its
// first, middle and last samples, as the training loop reads them.
// Seeds: data-pack outputs (corpus/token_file/).
#include "dtk/data/dataset.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = dtk::fuzz::scratch() / "tokens.h5";
  dtk::fuzz::write_file(path, data, size);
  dtk::nn::ModelConfig m;
  m.arch = dtk::nn::Arch::llama;
  m.vocab = 65536;
  m.seq_len = 8;
  dtk::fuzz::expect_usage_errors([&] {
    const auto d = dtk::data::open_dataset(path.string(), m, false, 0);
    (void)d->describe().dump();
    (void)d->optimal_loss();
    if (const int64_t n = d->size(); n > 0) {
      const int64_t idx[] = {0, n / 2, n - 1};
      (void)d->get(idx);
    }
  });
  return 0;
}
