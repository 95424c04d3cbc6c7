// Fuzz target: a classification file (data::open_dataset on an HDF5 file with `images` u8
// [N,H,W,C] or `features` f32 [N,D], and `labels`), as the trainers open it, for an mlp of
// input_dim 4 (data-pack synthetic --kind classes' features; an mlp takes images of 4 values
// too) and, for images, a resnet-8 whose input shape is the images' own (data::image_shape, how
// --input-shape defaults); then a batch of its first, middle and last samples. Seeds: data-pack outputs (corpus/image_file/).
#include <vector>

#include "dtk/data/dataset.h"
#include "dtk/nn/model.h"
#include "read_dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = dtk::fuzz::scratch() / "images.h5";
  dtk::fuzz::write_file(path, data, size);
  dtk::nn::ModelConfig mlp;
  mlp.arch = dtk::nn::Arch::mlp;
  mlp.input_dim = 4;
  mlp.classes = 10;
  mlp.hidden = {8};
  std::vector<dtk::nn::ModelConfig> models = {mlp};
  dtk::fuzz::expect_usage_errors([&] {
    if (const auto shape = dtk::data::image_shape(path.string()); !shape.empty()) {
      dtk::nn::ModelConfig resnet = dtk::nn::preset("resnet-8");
      resnet.input_shape = shape;
      models.push_back(resnet);
    }
  });
  for (const dtk::nn::ModelConfig& m : models)
    dtk::fuzz::expect_usage_errors([&] {
      dtk::fuzz::read_dataset(path.string(), m);
    });
  return 0;
}
