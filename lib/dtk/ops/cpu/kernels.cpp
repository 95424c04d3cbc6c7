// The CPU backend's kernels (ops/kernels.h): CPUID, OpenBLAS's core and the choice of a better
// one by executing the program again with OPENBLAS_CORETYPE, and the verification of the kernels
// that run against plain-loop references.
#include "dtk/ops/kernels.h"

#include <cblas.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <strings.h>
#include <vector>

#include "dtk/ops/cpu/internal.h"

namespace dtk::ops {

namespace {

// ---------------------------------------------------------------------------- CPUID

#if defined(__x86_64__) || defined(__i386__)
struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};
Regs cpuid(unsigned leaf, unsigned sub = 0) {
  Regs r;
  if (!__get_cpuid_count(leaf, sub, &r.a, &r.b, &r.c, &r.d)) return {};
  return r;
}
bool bit(unsigned v, int i) { return (v >> i) & 1u; }

CpuFeatures read_cpu_features() {
  CpuFeatures f;
  const Regs v = cpuid(0);
  char vendor[13] = {};
  std::memcpy(vendor, &v.b, 4);
  std::memcpy(vendor + 4, &v.d, 4);
  std::memcpy(vendor + 8, &v.c, 4);
  f.vendor = vendor;
  if (cpuid(0x80000000).a >= 0x80000004) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      const Regs r = cpuid(0x80000002 + i);
      std::memcpy(brand + 16 * i, &r, 16);
    }
    f.name = brand;
    f.name.erase(0, f.name.find_first_not_of(' '));
    f.name.erase(f.name.find_last_not_of(' ') + 1);
  }
  const Regs l1 = cpuid(1);
  const int family = (l1.a >> 8) & 0xf, model = (l1.a >> 4) & 0xf;
  f.family = family == 0xf ? family + static_cast<int>((l1.a >> 20) & 0xff) : family;
  f.model = family == 0x6 || family == 0xf ? static_cast<int>(((l1.a >> 16) & 0xf) << 4) + model : model;
  // What the operating system saves on a context switch (XCR0): SSE and AVX (bits 1, 2), the
  // AVX-512 opmask and upper ZMM registers (5, 6, 7), AMX's tile configuration and data (17, 18).
  uint64_t xcr0 = 0;
  if (bit(l1.c, 27)) {  // OSXSAVE: xgetbv is available
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (uint64_t(hi) << 32) | lo;
  }
  const bool os_avx = (xcr0 & 0x6) == 0x6, os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;
  const bool os_amx = (xcr0 & (3ull << 17)) == (3ull << 17);
  f.sse3 = bit(l1.c, 0);
  f.ssse3 = bit(l1.c, 9);
  f.sse4_2 = bit(l1.c, 20);
  f.avx = bit(l1.c, 28) && os_avx;
  f.fma = bit(l1.c, 12) && os_avx;
  if (v.a >= 7) {
    const Regs l7 = cpuid(7, 0);
    f.avx2 = bit(l7.b, 5) && os_avx;
    f.avx512f = bit(l7.b, 16) && os_avx512;
    f.avx512dq = bit(l7.b, 17) && os_avx512;
    f.avx512cd = bit(l7.b, 28) && os_avx512;
    f.avx512bw = bit(l7.b, 30) && os_avx512;
    f.avx512vl = bit(l7.b, 31) && os_avx512;
    f.amx_bf16 = bit(l7.d, 22) && os_amx;
    f.amx_tile = bit(l7.d, 24) && os_amx;
    f.amx_int8 = bit(l7.d, 25) && os_amx;
    if (l7.a >= 1) f.avx512_bf16 = bit(cpuid(7, 1).a, 5) && os_avx512;
  }
  return f;
}
#else
CpuFeatures read_cpu_features() { return {}; }  // no x86 features: OpenBLAS's choice stands
#endif

// ---------------------------------------------------------------------------- the core ladder

bool iequals(std::string_view a, std::string_view b) {  // OpenBLAS matches core names so
  return a.size() == b.size() && strncasecmp(a.data(), b.data(), a.size()) == 0;
}

// OpenBLAS's x86 cores by the features their kernels use (ops/kernels.h): the ladder of
// preferred_core, best first, with the level a processor needs for each.
struct Rung {
  std::string_view core;
  int level;
};
constexpr Rung kLadder[] = {{"SapphireRapids", 5}, {"Cooperlake", 4}, {"SkylakeX", 3},
                            {"Haswell", 2},        {"Sandybridge", 1}, {"Prescott", 0}};

int feature_level(const CpuFeatures& f) {
  if (f.avx512() && f.avx512_bf16 && f.amx_tile && f.amx_bf16) return 5;
  if (f.avx512() && f.avx512_bf16) return 4;
  if (f.avx512()) return 3;
  if (f.avx2 && f.fma) return 2;
  if (f.avx) return 1;
  return 0;
}

// The level of the kernels of an OpenBLAS core; -1 for the cores OpenBLAS picks only for the
// processors they are named after (AMD's Bulldozer to Excavator), which dtk never replaces.
int core_level(std::string_view core) {
  auto is = [&](std::string_view name) { return iequals(core, name); };
  for (const Rung& r : kLadder)
    if (is(r.core)) return r.level;
  if (is("Zen")) return 2;  // Haswell's kernels, tuned
  for (std::string_view sse : {"Katmai", "Coppermine", "Northwood", "Banias", "Atom", "Core2", "Penryn", "Dunnington",
                               "Nehalem", "Athlon", "Opteron", "Opteron_SSE3", "Barcelona", "Nano", "Bobcat"})
    if (is(sse)) return 0;
  return -1;
}

// ---------------------------------------------------------------------------- OpenBLAS

std::string openblas_core() { return openblas_get_corename(); }

// "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ..." -> "OpenBLAS 0.3.21"
std::string openblas_version() {
  const std::string config = openblas_get_config();
  const size_t second = config.find(' ', config.find(' ') + 1);
  return config.substr(0, second);
}

// A DYNAMIC_ARCH OpenBLAS exports a kernel table per core it was built with (gotoblas_HASWELL ...).
bool openblas_has_core(std::string_view core) {
  std::string symbol = "gotoblas_";
  for (const char ch : core) symbol += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return dlsym(RTLD_DEFAULT, symbol.c_str()) != nullptr;
}

std::string threading() {
  switch (openblas_get_parallel()) {
    case 0: return "sequential build";
    case 1: return "pthread build";
    default: return "OpenMP build";
  }
}

// ---------------------------------------------------------------------------- verification

// Values in [-1, 1] that f32 holds exactly (multiples of 2^-12), from a fixed LCG.
std::vector<double> test_values(size_t n, uint32_t seed) {
  std::vector<double> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (double& e : v) {
    x = x * 1664525u + 1013904223u;
    e = static_cast<double>(static_cast<int>((x >> 8) % 8193) - 4096) / 4096.0;
  }
  return v;
}

// The testing aid DTK_TEST_BLAS_WRONG=CORE: the kernels of CORE are taken for wrong (one element
// of a product is changed before the comparison), so that a test can see the fallback.
bool pretend_wrong() {
  const char* w = std::getenv("DTK_TEST_BLAS_WRONG");
  return w != nullptr && iequals(w, openblas_core());
}

// The product A B (m x k times k x n) of test_values and sum |a||b| per element, in f64 plain
// loops: the reference of check_gemm, computed once per shape for both precisions.
struct GemmReference {
  int m, n, k;
  std::vector<double> a, b, c0, ab, mag;
  GemmReference(int m_, int n_, int k_)
      : m(m_), n(n_), k(k_), a(test_values(size_t(m) * k, 1)), b(test_values(size_t(k) * n, 2)),
        c0(test_values(size_t(m) * n, 3)), ab(size_t(m) * n, 0.0), mag(size_t(m) * n, 0.0) {
    for (int i = 0; i < m; ++i)
      for (int l = 0; l < k; ++l)
        for (int j = 0; j < n; ++j) {
          ab[size_t(i) * n + j] += a[size_t(i) * k + l] * b[size_t(l) * n + j];
          mag[size_t(i) * n + j] += std::abs(a[size_t(i) * k + l] * b[size_t(l) * n + j]);
        }
  }
};

// C = op(A) op(B) + beta C0 by the BLAS, in the four transpositions (beta 0 and 0.5), against
// the reference; the bound is a few units of roundoff of sum |a||b| per element.
template <typename T>
std::string check_gemm(const GemmReference& r) {
  const int m = r.m, n = r.n, k = r.k;
  const double eps = std::numeric_limits<T>::epsilon();
  const char* name = sizeof(T) == 4 ? "sgemm" : "dgemm";
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2;
    const double beta = t == 1 || t == 2 ? 0.5 : 0.0;
    // op(A) = A: stored as A, or as A^T with the transposition asked for.
    std::vector<T> as(r.a.size()), bs(r.b.size()), c(r.c0.begin(), r.c0.end());
    for (int i = 0; i < m; ++i)
      for (int l = 0; l < k; ++l) as[ta ? size_t(l) * m + i : size_t(i) * k + l] = static_cast<T>(r.a[size_t(i) * k + l]);
    for (int l = 0; l < k; ++l)
      for (int j = 0; j < n; ++j) bs[tb ? size_t(j) * k + l : size_t(l) * n + j] = static_cast<T>(r.b[size_t(l) * n + j]);
    cpu::blas_gemm(ta, tb, m, n, k, 1.0, as.data(), ta ? m : k, bs.data(), tb ? k : n, beta, c.data(), n);
    if (t == 0 && pretend_wrong()) c[0] += 1;
    for (size_t e = 0; e < c.size(); ++e) {
      const double want = r.ab[e] + beta * r.c0[e];
      const double bound = 4 * (k + 2) * eps * (r.mag[e] + std::abs(beta * r.c0[e])) + std::numeric_limits<T>::min();
      if (!(std::abs(static_cast<double>(c[e]) - want) <= bound))
        return fmt::format("{} ({}, {}) {}x{}x{}: element ({}, {}) is {:.9g} where the reference is {:.9g}", name,
                           ta ? "A^T" : "A", tb ? "B^T" : "B", m, n, k, e / n, e % n, static_cast<double>(c[e]), want);
    }
  }
  return {};
}

// The symmetric eigendecomposition A = V diag(w) V^T by LAPACK (the call ops::eigh makes),
// checked by its residuals in f64 plain loops: A v_j = w_j v_j, V^T V = I, w ascending. Together
// they prove the decomposition right whatever computed it.
template <typename T>
std::string check_eigh(int n) {
  std::vector<double> a = test_values(size_t(n) * n, 4);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < i; ++j) a[size_t(j) * n + i] = a[size_t(i) * n + j];
  std::vector<T> v(a.begin(), a.end()), w(n);
  const char* name = sizeof(T) == 4 ? "ssyevd" : "dsyevd";
  if (const lapack_int info = cpu::syevd(n, v.data(), w.data()); info != 0)
    return fmt::format("{} {}x{}: LAPACK's info is {}", name, n, n, info);
  double norm = 0;
  for (const double e : a) norm = std::max(norm, std::abs(e));
  norm *= n;  // >= the spectral norm
  const double tol = 64.0 * n * std::numeric_limits<T>::epsilon();
  for (int j = 0; j < n; ++j) {
    if (j > 0 && !(w[j] >= w[j - 1])) return fmt::format("{} {}x{}: eigenvalues not ascending at {}", name, n, n, j);
    for (int i = 0; i < n; ++i) {
      double av = 0, vv = 0;
      for (int l = 0; l < n; ++l) {
        av += a[size_t(i) * n + l] * v[size_t(l) * n + j];
        vv += static_cast<double>(v[size_t(l) * n + i]) * v[size_t(l) * n + j];
      }
      if (!(std::abs(av - static_cast<double>(w[j]) * v[size_t(i) * n + j]) <= tol * norm))
        return fmt::format("{} {}x{}: eigenpair {} has a residual of {:.3g} (A's norm {:.3g})", name, n, n, j,
                           std::abs(av - static_cast<double>(w[j]) * v[size_t(i) * n + j]), norm);
      if (!(std::abs(vv - (i == j ? 1.0 : 0.0)) <= tol))
        return fmt::format("{} {}x{}: eigenvectors {} and {} are not orthonormal ({:.3g})", name, n, n, i, j, vv);
    }
  }
  return {};
}

// ---------------------------------------------------------------------------- the choice

// Carried from a process to the one it executes (never set by hand): "CORE", OpenBLAS's own
// choice, when dtk set OPENBLAS_CORETYPE; "CORE;REJECTED;WHY" when dtk's choice REJECTED failed
// verification and the program runs again with OpenBLAS's own.
constexpr const char* kCarry = "DTK_BLAS_CHOICE";

enum class Chooser { openblas, dtk, user };
struct Choice {
  bool selected = false;  // select_cpu_kernels has run
  // Before select_cpu_kernels (a program that does not choose): OpenBLAS's or the user's.
  Chooser by = std::getenv("OPENBLAS_CORETYPE") ? Chooser::user : Chooser::openblas;
  std::string detected;  // Chooser::dtk: OpenBLAS's own choice
  std::string rejected;  // Chooser::openblas: dtk's choice, which failed verification
  std::vector<std::string> warnings;
};
Choice& choice() {
  static Choice c;
  return c;
}

// Runs this program again with the environment as it is now; returns only when it cannot.
std::string execute_again(char** argv) {
  std::vector<char> path(4096);
  const ssize_t n = readlink("/proc/self/exe", path.data(), path.size() - 1);
  if (n <= 0) return fmt::format("cannot read /proc/self/exe ({})", std::strerror(errno));
  path[static_cast<size_t>(n)] = '\0';
  std::fflush(nullptr);
  execv(path.data(), argv);
  return fmt::format("cannot execute {} again ({})", path.data(), std::strerror(errno));
}

// The choice of select_cpu_kernels, once per process (ops/kernels.h).
void choose(Choice& c, char** argv) {
  const std::string core = openblas_core();
  const char* user = std::getenv("OPENBLAS_CORETYPE");
  auto not_taken = [&] {
    if (user == nullptr || !iequals(user, core))
      c.warnings.push_back(fmt::format("OpenBLAS did not take OPENBLAS_CORETYPE={}: its {} kernels run",
                                       user ? user : "", core));
  };
  if (const char* carried = std::getenv(kCarry); carried != nullptr) {  // executed by dtk's choice
    const std::string carry = carried;
    unsetenv(kCarry);
    const size_t semi = carry.find(';');
    c.detected = carry.substr(0, semi);
    if (semi == std::string::npos) {
      c.by = Chooser::dtk;
      not_taken();
      const std::string why = verify_blas();
      if (why.empty()) return;
      // Wrong: once more with OpenBLAS's own choice, which the next process verifies in turn.
      setenv(kCarry, fmt::format("{};{};{}", c.detected, core, why).c_str(), 1);
      unsetenv("OPENBLAS_CORETYPE");
      const std::string failed = execute_again(argv);
      unsetenv(kCarry);
      c.warnings.push_back(fmt::format("OpenBLAS's {} kernels disagree with the reference ({}), and returning to "
                                       "OpenBLAS's own choice failed: {}; results may be wrong",
                                       core, why, failed));
      return;
    }
    const std::string rest = carry.substr(semi + 1);
    const size_t semi2 = rest.find(';');
    c.by = Chooser::openblas;
    c.rejected = rest.substr(0, semi2);
    c.warnings.push_back(fmt::format("OpenBLAS's {} kernels disagreed with the reference at start-up ({}): running "
                                     "OpenBLAS's own choice, {}; OPENBLAS_CORETYPE chooses another",
                                     c.rejected, rest.substr(semi2 + 1), core));
  } else if (user != nullptr) {
    c.by = Chooser::user;
    not_taken();
  } else {
    c.by = Chooser::openblas;
    if (const std::string want = preferred_core(cpu_features(), core, openblas_has_core); !want.empty()) {
      setenv("OPENBLAS_CORETYPE", want.c_str(), 1);
      setenv(kCarry, core.c_str(), 1);
      const std::string failed = execute_again(argv);  // returns only when it failed
      unsetenv("OPENBLAS_CORETYPE");
      unsetenv(kCarry);
      c.warnings.push_back(fmt::format("OpenBLAS runs its {} kernels on a processor that can run its {} kernels, and "
                                       "choosing them failed: {}; set OPENBLAS_CORETYPE={}",
                                       core, want, failed, want));
    }
  }
  if (const std::string why = verify_blas(); !why.empty())
    c.warnings.push_back(fmt::format("OpenBLAS's {} kernels disagree with the reference at start-up ({}): results may "
                                     "be wrong; OPENBLAS_CORETYPE chooses another core",
                                     core, why));
}

}  // namespace

// ---------------------------------------------------------------------------- public

std::string CpuFeatures::describe() const {
  if (vendor.empty()) return "not an x86-64 processor";
  std::string s = fmt::format("{} (family {} model {}):", name.empty() ? vendor : name, family, model);
  auto add = [&](bool on, std::string_view what) {
    if (on) s += fmt::format(" {}", what);
  };
  add(sse3, "SSE3");
  add(ssse3, "SSSE3");
  add(sse4_2, "SSE4.2");
  add(avx, "AVX");
  add(avx2, "AVX2");
  add(fma, "FMA");
  if (avx512f) {
    s += " AVX-512 (F";
    add(avx512cd, "CD");
    add(avx512bw, "BW");
    add(avx512dq, "DQ");
    add(avx512vl, "VL");
    add(avx512_bf16, "BF16");
    s += ")";
  }
  if (amx_tile) {
    s += " AMX (TILE";
    add(amx_bf16, "BF16");
    add(amx_int8, "INT8");
    s += ")";
  }
  return s;
}

CpuFeatures cpu_features() {
  static const CpuFeatures f = read_cpu_features();
  return f;
}

std::string preferred_core(const CpuFeatures& cpu, std::string_view openblas_core,
                           const std::function<bool(std::string_view)>& library_has) {
  const int current = core_level(openblas_core), level = feature_level(cpu);
  if (current < 0) return {};
  for (const Rung& r : kLadder)
    if (r.level <= level && r.level > current && library_has(r.core)) return std::string(r.core);
  return {};
}

std::string verify_blas() {
  // Odd sizes: partial tiles at every edge of OpenBLAS's blocking.
  for (const GemmReference& r : {GemmReference(67, 61, 129), GemmReference(96, 80, 136)})
    for (const std::string& why : {check_gemm<float>(r), check_gemm<double>(r)})
      if (!why.empty()) return why;
  for (const std::string& why : {check_eigh<float>(64), check_eigh<double>(64)})
    if (!why.empty()) return why;
  return {};
}

std::string select_cpu_kernels(char** argv) {
  Choice& c = choice();
  if (!c.selected) {
    c.selected = true;
    choose(c, argv);
  }
  return "BLAS: " + blas_description() + "\nCPU: " + cpu_features().describe();
}

std::string blas_description(bool threads) {
  const Choice& c = choice();
  const std::string core = openblas_core();
  const std::string who =
      c.by == Chooser::dtk    ? fmt::format("chosen by dtk (OpenBLAS chose {})", c.detected)
      : c.by == Chooser::user ? std::string("set by OPENBLAS_CORETYPE")
      : c.rejected.empty()    ? std::string("OpenBLAS's choice")
                              : fmt::format("OpenBLAS's choice (dtk's {} disagreed with the reference)", c.rejected);
  const std::string t = threads ? fmt::format(", {} thread{}", omp_get_max_threads(), omp_get_max_threads() == 1 ? "" : "s")
                                : "";
  return fmt::format("{} ({}{}), {} kernels, {}", openblas_version(), threading(), t, core, who);
}

std::vector<std::string> cpu_kernel_warnings() {
  std::vector<std::string> w = choice().warnings;
  if (openblas_get_parallel() == 1)
    w.push_back("OpenBLAS is its pthread build, whose threads compete with dtk's OpenMP threads for the cores "
                "(several times slower on small models); select the OpenMP build: scripts/install-deps does, or "
                "update-alternatives --set libopenblas.so.0-$(gcc -print-multiarch) "
                "/usr/lib/$(gcc -print-multiarch)/openblas-openmp/libopenblas.so.0");
  return w;
}

void set_cpu_threads(int n) {
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}

}  // namespace dtk::ops
