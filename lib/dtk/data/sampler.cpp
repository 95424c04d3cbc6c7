// The sampler: the global batch of step s is positions [s g, (s + 1) g) of an infinite sequence
// of epochs, epoch e being a pseudo-random permutation of [0, N) keyed by (seed, e). The
// permutation is a balanced Feistel network on the smallest even-bit domain 2^2h >= N (at most
// 4N), with Philox as round function, restricted to [0, N) by cycle-walking: a bijection that
// needs O(1) memory and O(1) expected time per index, whatever N is.
#include <limits>

#include "dtk/core/error.h"
#include "dtk/core/philox.h"
#include "dtk/core/streams.h"
#include "dtk/data/internal.h"

namespace dtk::data {
namespace {

constexpr int kRounds = 6;

struct Permutation {
  Permutation(int64_t n, uint64_t key, uint64_t epoch) : n(n), key(key), epoch(epoch) {
    int bits = 2;
    while (bits < 63 && (int64_t{1} << bits) < n) ++bits;
    half = (bits + 1) / 2;
    mask = (uint64_t{1} << half) - 1;
  }
  uint64_t round(uint64_t x) const {
    uint64_t l = x >> half, r = x & mask;
    for (int k = 0; k < kRounds; ++k) {
      const philox::U4 w = philox::philox4x32_10(
          philox::U4{{static_cast<uint32_t>(r), static_cast<uint32_t>(k), static_cast<uint32_t>(epoch),
                      static_cast<uint32_t>(epoch >> 32)}},
          static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
      const uint64_t f = ((static_cast<uint64_t>(w.x[1]) << 32) | w.x[0]) & mask;
      const uint64_t nl = r, nr = l ^ f;
      l = nl;
      r = nr;
    }
    return (l << half) | r;
  }
  int64_t operator()(int64_t i) const {
    if (n == 1) return 0;
    uint64_t x = static_cast<uint64_t>(i);
    do x = round(x);
    while (x >= static_cast<uint64_t>(n));
    return static_cast<int64_t>(x);
  }
  int64_t n;
  uint64_t key, epoch;
  int half = 1;
  uint64_t mask = 1;
};

}  // namespace

Sampler::Sampler(int64_t dataset_size, int64_t global_batch, uint64_t seed)
    : size_(dataset_size), global_batch_(global_batch), seed_(seed) {
  if (dataset_size < 1) fail_usage("the dataset has no samples");
  if (global_batch < 1) fail_usage("the global batch size must be positive ({})", global_batch);
}

std::vector<int64_t> Sampler::global_indices(int64_t step) const {
  if (step < 0) fail_usage("step {} is negative", step);
  if (step > std::numeric_limits<int64_t>::max() / global_batch_ - 1) fail_usage("step {} is too large", step);
  const uint64_t key = streams::data_key(seed_, streams::kSampler);
  std::vector<int64_t> out(static_cast<size_t>(global_batch_));
  const int64_t first = step * global_batch_;
  int64_t epoch = first / size_, off = first % size_;
  Permutation perm(size_, key, static_cast<uint64_t>(epoch));
  for (int64_t k = 0; k < global_batch_; ++k) {
    if (off == size_) {
      off = 0;
      perm = Permutation(size_, key, static_cast<uint64_t>(++epoch));
    }
    out[static_cast<size_t>(k)] = perm(off++);
  }
  return out;
}

std::pair<int64_t, int64_t> Sampler::shard(int64_t global_batch, int rank, int world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    fail_usage("rank {} is not in a world of {}", rank, world_size);
  if (global_batch < 0) fail_usage("negative global batch");
  const int64_t base = global_batch / world_size, extra = global_batch % world_size;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

}  // namespace dtk::data
