// The CPU kernels' choice (ops/kernels.h): the core ladder by features, CPUID against the
// kernel's /proc/cpuinfo, and the verification of the kernels this process runs.
#include <cblas.h>
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <utility>

#include "dtk/ops/kernels.h"

using dtk::ops::CpuFeatures;
using dtk::ops::preferred_core;

namespace {

CpuFeatures with(std::initializer_list<bool CpuFeatures::*> on) {
  CpuFeatures f;
  f.vendor = "GenuineIntel";
  f.sse3 = f.ssse3 = f.sse4_2 = true;
  for (auto m : on) f.*m = true;
  return f;
}
const CpuFeatures kSse = with({});
const CpuFeatures kAvx = with({&CpuFeatures::avx});
const CpuFeatures kAvx2 = with({&CpuFeatures::avx, &CpuFeatures::avx2, &CpuFeatures::fma});
const CpuFeatures kAvx512 = with({&CpuFeatures::avx, &CpuFeatures::avx2, &CpuFeatures::fma, &CpuFeatures::avx512f,
                                  &CpuFeatures::avx512cd, &CpuFeatures::avx512bw, &CpuFeatures::avx512dq,
                                  &CpuFeatures::avx512vl});
CpuFeatures plus(CpuFeatures f, std::initializer_list<bool CpuFeatures::*> on) {
  for (auto m : on) f.*m = true;
  return f;
}
const CpuFeatures kBf16 = plus(kAvx512, {&CpuFeatures::avx512_bf16});
const CpuFeatures kAmx = plus(kBf16, {&CpuFeatures::amx_tile, &CpuFeatures::amx_bf16, &CpuFeatures::amx_int8});

// Debian 12's OpenBLAS 0.3.21 (no SapphireRapids), and everything.
bool debian12(std::string_view core) { return core != "SapphireRapids"; }
bool every(std::string_view) { return true; }

}  // namespace

TEST(CpuKernels, GenericCoreIsReplacedByTheBestTheLibraryHas) {
  // The case of issue 43: Intel family 6 model 207, unknown to 0.3.21, got Prescott.
  EXPECT_EQ(preferred_core(kAmx, "Prescott", debian12), "Cooperlake");
  EXPECT_EQ(preferred_core(kAmx, "Prescott", every), "SapphireRapids");
  EXPECT_EQ(preferred_core(kBf16, "Prescott", every), "Cooperlake");
  EXPECT_EQ(preferred_core(kAvx512, "Prescott", every), "SkylakeX");
  EXPECT_EQ(preferred_core(kAvx2, "Prescott", every), "Haswell");
  EXPECT_EQ(preferred_core(kAvx, "Nehalem", every), "Sandybridge");
  EXPECT_EQ(preferred_core(kAvx2, "Core2", every), "Haswell");
  // A library built without the best core: the next one down.
  EXPECT_EQ(preferred_core(kBf16, "Prescott", [](std::string_view c) { return c != "Cooperlake"; }), "SkylakeX");
  // A library with no kernel tables (not DYNAMIC_ARCH): nothing to ask for.
  EXPECT_EQ(preferred_core(kBf16, "Prescott", [](std::string_view) { return false; }), "");
  // Case as OpenBLAS writes it or not.
  EXPECT_EQ(preferred_core(kAvx2, "PRESCOTT", every), "Haswell");
}

TEST(CpuKernels, OpenBlasChoiceStandsWhenItMatchesTheFeatures) {
  EXPECT_EQ(preferred_core(kBf16, "Cooperlake", every), "");
  EXPECT_EQ(preferred_core(kAvx512, "SkylakeX", every), "");
  EXPECT_EQ(preferred_core(kAvx2, "Haswell", every), "");
  EXPECT_EQ(preferred_core(kAvx2, "Zen", every), "");  // Zen's kernels are Haswell's level
  EXPECT_EQ(preferred_core(kSse, "Prescott", every), "");
  // A better core than the features (OpenBLAS knows the model, or the user forced it): kept.
  EXPECT_EQ(preferred_core(kAvx2, "SkylakeX", every), "");
  // Cores OpenBLAS gives only to their own processors are never replaced.
  EXPECT_EQ(preferred_core(kAvx2, "Excavator", every), "");
  EXPECT_EQ(preferred_core(kAvx, "Bulldozer", every), "");
  EXPECT_EQ(preferred_core(kAvx512, "SomethingNew", every), "");
}

TEST(CpuKernels, ZenWithAvx512IsMovedUp) {
  // Zen 4 under 0.3.21 (it knew Zen, not Zen 4's AVX-512); 0.3.22 gives it Cooperlake itself.
  EXPECT_EQ(preferred_core(kBf16, "Zen", debian12), "Cooperlake");
}

TEST(CpuKernels, PartialFeatureSetsDoNotCount) {
  // AVX-512 F alone (no BW/DQ/VL) is not SkylakeX's level.
  EXPECT_EQ(preferred_core(plus(kAvx2, {&CpuFeatures::avx512f}), "Prescott", every), "Haswell");
  // AVX2 without FMA is not Haswell's.
  EXPECT_EQ(preferred_core(with({&CpuFeatures::avx, &CpuFeatures::avx2}), "Prescott", every), "Sandybridge");
}

// CPUID as this process decodes it against the flags Linux shows for the same processor.
TEST(CpuKernels, CpuidAgreesWithProcCpuinfo) {
  std::ifstream in("/proc/cpuinfo");
  std::string line, flags;
  while (std::getline(in, line))
    if (line.rfind("flags", 0) == 0) {
      flags = line.substr(line.find(':') + 1);
      break;
    }
  const CpuFeatures f = dtk::ops::cpu_features();
  if (flags.empty() || f.vendor.empty()) GTEST_SKIP() << "no x86 /proc/cpuinfo flags";
  std::set<std::string> have;
  std::istringstream words(flags);
  for (std::string w; words >> w;) have.insert(w);
  const std::pair<bool CpuFeatures::*, const char*> kFlags[] = {
      {&CpuFeatures::sse4_2, "sse4_2"},     {&CpuFeatures::avx, "avx"},           {&CpuFeatures::avx2, "avx2"},
      {&CpuFeatures::fma, "fma"},           {&CpuFeatures::avx512f, "avx512f"},   {&CpuFeatures::avx512bw, "avx512bw"},
      {&CpuFeatures::avx512dq, "avx512dq"}, {&CpuFeatures::avx512vl, "avx512vl"}, {&CpuFeatures::avx512cd, "avx512cd"},
      {&CpuFeatures::avx512_bf16, "avx512_bf16"}, {&CpuFeatures::amx_tile, "amx_tile"},
      {&CpuFeatures::amx_bf16, "amx_bf16"}};
  for (const auto& [member, flag] : kFlags) EXPECT_EQ(f.*member, have.count(flag) > 0) << flag;
  EXPECT_NE(f.describe().find(std::to_string(f.model)), std::string::npos);
}

TEST(CpuKernels, TheKernelsThatRunAgreeWithTheReference) {
  EXPECT_EQ(dtk::ops::verify_blas(), "");
  const std::string d = dtk::ops::blas_description();
  EXPECT_NE(d.find(std::string(", ") + openblas_get_corename() + " kernels, "), std::string::npos) << d;
  EXPECT_EQ(d.rfind("OpenBLAS ", 0), 0u) << d;
}
