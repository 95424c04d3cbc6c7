// The random streams of one seed (core/streams.h) draw under distinct keys.
#include <gtest/gtest.h>

#include <set>

#include "dtk/core/streams.h"

namespace dtk {
namespace {

TEST(Streams, EveryStreamOfASeedHasItsOwnKey) {
  using namespace streams;
  for (uint64_t seed : {0ull, 1ull, 2ull, 42ull, 0xffffffffull, 0x100000000ull, ~0ull}) {
    std::set<uint64_t> keys = {seed};  // model initialisation keys Philox with the seed itself
    size_t n = 1;
    for (uint32_t tag : {kChain, kChainStream, kChainStream + 1, kMixtureMeans, kMixtureStream, kMixtureStream + 1,
                         kMixtureBayes, kSampler}) {
      keys.insert(data_key(seed, tag));
      ++n;
    }
    for (uint64_t domain : {kQ, kQGuard, kRandomK}) {
      keys.insert(compressor_key(seed, domain));
      ++n;
    }
    keys.insert(augment_key(seed));
    ++n;
    EXPECT_EQ(keys.size(), n) << "seed " << seed;
  }
  // Nearby seeds give unrelated keys.
  EXPECT_NE(data_key(0, kSampler) ^ data_key(1, kSampler), 1u);
  EXPECT_NE(compressor_key(0, kQ) ^ compressor_key(1, kQ), 1u);
}

}  // namespace
}  // namespace dtk
