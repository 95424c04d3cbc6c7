// Fuzz target: a classification file (data::open_dataset on an HDF5 file with `images` u8
// [N,H,W,C] or `features` f32 [N,D], and `labels`), as the trainers open it: a resnet-8 whose
// input shape is the images' own (data::image_shape, how --input-shape defaults), else an mlp of
// input_dim 4 (data-pack synthetic --kind classes' features); then a batch of its first, middle
// and last samples. Seeds: data-pack outputs (corpus/image_file/).
#include "dtk/data/dataset.h"
#include "dtk/nn/model.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = dtk::fuzz::scratch() / "images.h5";
  dtk::fuzz::write_file(path, data, size);
  dtk::fuzz::expect_usage_errors([&] {
    dtk::nn::ModelConfig m;
    if (const auto shape = dtk::data::image_shape(path.string()); !shape.empty()) {
      m = dtk::nn::preset("resnet-8");
      m.input_shape = shape;
    } else {
      m.arch = dtk::nn::Arch::mlp;
      m.input_dim = 4;
      m.classes = 10;
      m.hidden = {8};
    }
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
