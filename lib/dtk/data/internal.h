// Internal to dtk::data: the dataset kinds behind open_dataset (their keys: core/streams.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "dtk/data/dataset.h"

namespace dtk::data::detail {

// Uniform in [0, 1) with 53 bits from two words.
double unit(uint32_t a, uint32_t b);

// The synthetic datasets (validation selects the disjoint validation stream).
std::unique_ptr<Dataset> make_markov_dataset(const nn::ModelConfig& model, bool validation, uint64_t seed);
std::unique_ptr<Dataset> make_mixture_dataset(const nn::ModelConfig& model, bool validation, uint64_t seed);
// The index of the first value of x[0, n) that is NaN or infinite; n when all are finite. One
// branch-free pass per block (the common case, all finite, costs a read and a compare).
size_t first_non_finite(const float* x, size_t n);

// A token or classification file, checked against the model.
std::unique_ptr<Dataset> open_file_dataset(const std::string& path, const nn::ModelConfig& model);

// The number of samples a synthetic dataset has: a fixed large number (2^40).
inline constexpr int64_t kSyntheticSamples = int64_t{1} << 40;

}  // namespace dtk::data::detail
