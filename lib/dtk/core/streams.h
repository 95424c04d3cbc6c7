// Every random stream that a run's --seed drives, in one place: the Philox key (or counter
// range) each one draws from, so that no two share random numbers.
//
//   stream                         key                                   counter
//   model initialisation           seed                                  parameter index << 40 + element
//   synthetic data: the chain,     data_key(seed, kChain...)             sample index, position
//     each sample stream, the
//     mixture's means, streams and
//     Bayes-loss estimate
//   the data order (epochs)        data_key(seed, kSampler)              epoch, index
//   augmentation (crop, flip)      augment_key(seed)                     sample index, step
//   PowerSGD's Q and its guard,    compressor_key(seed, kQ...)           per draw
//   randomk's coordinates
//
// Three derivations, not one: each is what its stream has drawn since it was written, and a
// run resumed from a checkpoint continues its data order, its synthetic data and its
// compressor's redraws from the seed it recorded. One derivation for all would change the
// numbers of every run on synthetic data and make an older checkpoint's resume differ from the
// run it continues, for no gain: the keys below are already distinct for every seed (Philox
// with a tag, a 64-bit xor, and splitmix64, each on its own tags; tests/unit/test_streams.cpp).
#pragma once
#include <cstdint>

#include "dtk/core/philox.h"

namespace dtk::streams {

// Synthetic data and the data order: Philox-10 of (tag, "dtk!") under the seed's two words.
inline constexpr uint32_t kChain = 0x100, kChainStream = 0x200,  // + stream
    kMixtureMeans = 0x300, kMixtureStream = 0x400,               // + stream
    kMixtureBayes = 0x500, kSampler = 0x600;
inline uint64_t data_key(uint64_t seed, uint32_t tag) {
  const philox::U4 w = philox::philox4x32_10(philox::U4{{tag, 0x64746b21u /* "dtk!" */, 0u, 0u}},
                                             static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return (static_cast<uint64_t>(w.x[1]) << 32) | w.x[0];
}

// Augmentation: the seed with a tag of its own.
inline constexpr uint64_t kAugment = 0x61756741756741ull;  // "AugAug"
inline uint64_t augment_key(uint64_t seed) { return seed ^ kAugment; }

// The compressors' shared streams: splitmix64 of the seed mixed with the domain, well-spread
// keys for nearby seeds (and, keyed again by the step, randomk's per-step draws).
inline constexpr uint64_t kQ = 0x5053474451494e49ull;        // PowerSGD's Q: initialisation and redraws
inline constexpr uint64_t kQGuard = 0x505347445a45524full;   // Q columns redrawn after a zero
inline constexpr uint64_t kRandomK = 0x52414e444f4d4bull;    // randomk coordinates
inline uint64_t compressor_key(uint64_t seed, uint64_t domain) {
  uint64_t z = seed ^ (domain * 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace dtk::streams
