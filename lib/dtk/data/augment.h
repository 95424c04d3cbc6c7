// Training-time augmentation of image batches, as the CIFAR ResNet papers train: a random crop
// of the image zero-padded by `pad` pixels on every side (a shift of the image by dy, dx in
// [-pad, pad], the uncovered border zero) and a horizontal flip with probability 1/2.
//
// Every sample's draw is a function of (seed, step, the sample's index in the dataset) alone
// (Philox-4x32-10), so a batch is augmented the same whatever the world size and the
// micro-batching, and a resumed run augments exactly as an uninterrupted one.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "dtk/core/enums.h"
#include "dtk/nn/model.h"

namespace dtk::data {

enum class Augment { none, crop_flip };
DTK_ENUM_NAMES(Augment, {Augment::none, "none"}, {Augment::crop_flip, "crop-flip"})

// One sample's draw: the image moves by (dy, dx) (a pixel at (h, w) comes from (h + dy, w + dx)
// of the original, flipped first when `flip`).
struct CropFlip {
  int64_t dy = 0, dx = 0;
  bool flip = false;
};
CropFlip draw_crop_flip(uint64_t seed, int64_t step, int64_t index, int64_t pad);

// Augments the host batch in place: inputs f32 [B, C, H, W] (images as image files give them),
// indices[b] the dataset index of sample b. pad >= 0.
void augment(nn::Batch& batch, Augment kind, int64_t channels, int64_t height, int64_t width,
             std::span<const int64_t> indices, uint64_t seed, int64_t step, int64_t pad = 4);

}  // namespace dtk::data
