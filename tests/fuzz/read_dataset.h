// What the data-file fuzz targets do with a file: open it for a model, describe it, and read
// batches of its first, middle and last samples, as the training loop reads them.
#pragma once
#include <string>

#include "dtk/data/dataset.h"
#include "fuzz.h"

namespace dtk::fuzz {

inline void read_dataset(const std::string& path, const nn::ModelConfig& m) {
  const auto d = data::open_dataset(path, m, false, 0);
  (void)d->describe().dump();
  (void)d->optimal_loss();
  if (const int64_t n = d->size(); n > 0) {
    const int64_t idx[] = {0, n / 2, n - 1};
    (void)d->get(idx);
  }
}

}  // namespace dtk::fuzz
