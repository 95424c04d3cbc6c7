#include "dtk/data/augment.h"

#include <algorithm>
#include <vector>

#include "dtk/core/error.h"
#include "dtk/core/philox.h"
#include "dtk/core/streams.h"

namespace dtk::data {

CropFlip draw_crop_flip(uint64_t seed, int64_t step, int64_t index, int64_t pad) {
  // Counter (index, step) under a key of its own (core/streams.h).
  const auto u = static_cast<uint64_t>(index), s = static_cast<uint64_t>(step), k = streams::augment_key(seed);
  const philox::U4 r = philox::philox4x32_10(
      philox::U4{{static_cast<uint32_t>(u), static_cast<uint32_t>(u >> 32), static_cast<uint32_t>(s),
                  static_cast<uint32_t>(s >> 32)}},
      static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32));
  const auto span = static_cast<uint64_t>(2 * pad + 1);
  return {static_cast<int64_t>(r.x[0] % span) - pad, static_cast<int64_t>(r.x[1] % span) - pad, (r.x[2] & 1u) != 0};
}

void augment(nn::Batch& batch, Augment kind, int64_t channels, int64_t height, int64_t width,
             std::span<const int64_t> indices, uint64_t seed, int64_t step, int64_t pad) {
  if (kind == Augment::none) return;
  const int64_t B = batch.inputs.dim(0), HW = height * width, D = channels * HW;
  if (batch.inputs.dtype() != DType::f32 || batch.inputs.numel() != B * D || static_cast<int64_t>(indices.size()) != B ||
      pad < 0)
    fail("augment: inputs {} are not {} images of {}x{}x{}", batch.inputs.str(), indices.size(), channels, height,
         width);
  float* x = batch.inputs.ptr<float>();
  std::vector<float> src(static_cast<size_t>(HW));
  for (int64_t b = 0; b < B; ++b) {
    const CropFlip d = draw_crop_flip(seed, step, indices[static_cast<size_t>(b)], pad);
    for (int64_t c = 0; c < channels; ++c) {
      float* img = x + b * D + c * HW;
      std::copy(img, img + HW, src.begin());
      for (int64_t h = 0; h < height; ++h)
        for (int64_t w = 0; w < width; ++w) {
          const int64_t sh = h + d.dy, sw0 = w + d.dx;
          const int64_t sw = d.flip ? width - 1 - sw0 : sw0;  // flip the original, then shift
          const bool inside = sh >= 0 && sh < height && sw0 >= 0 && sw0 < width;
          img[h * width + w] = inside ? src[static_cast<size_t>(sh * width + sw)] : 0.0f;
        }
    }
  }
}

}  // namespace dtk::data
