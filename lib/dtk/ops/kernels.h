// dtk::ops — the CPU backend's kernels: the processor's features, the BLAS, and the choice of
// the BLAS's kernels that a program makes at start-up.
//
// Debian's OpenBLAS is one library with kernels for many x86 generations, its "cores" (Prescott,
// Haswell, SkylakeX, Cooperlake, ...); it picks one when it is loaded, by the processor's vendor,
// family and model. A processor newer than the library gets its generic Prescott kernels (SSE3):
// Debian 12's 0.3.21 does not know Intel's family 6 model 207 and ran dtk's llama-small 4.1x
// slower there (docs/cpu-kernels.md). OpenBLAS reads OPENBLAS_CORETYPE only while it is loaded, so a program that
// computes calls select_cpu_kernels() first, before MPI starts: when OpenBLAS's core is below
// what the processor can run (CPUID's features, preferred_core), it executes the program again,
// once, with OPENBLAS_CORETYPE naming the best core the library has for those features. The same
// environment, arguments and process id: a launcher (mpiexec, srun) sees nothing of it. A user's
// own OPENBLAS_CORETYPE is always respected.
//
// Every process then verifies the kernels it runs (verify_blas: small sgemm/dgemm in the four
// transpositions and ssyevd/dsyevd, a few milliseconds, against plain-loop references). Kernels
// that dtk chose and that disagree are dropped: the program runs again with OpenBLAS's own choice,
// and says so; a disagreement of OpenBLAS's own or the user's choice is a warning.
#pragma once
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace dtk::ops {

// What the processor can run: CPUID's feature bits, each also enabled by the operating system
// (XCR0: a vector register state it does not save cannot be used).
struct CpuFeatures {
  std::string vendor;  // "GenuineIntel", "AuthenticAMD"; empty off x86-64
  std::string name;    // the brand string: "Intel(R) Xeon(R) Processor"
  int family = 0, model = 0;  // display family and model (with the extended fields)
  bool sse3 = false, ssse3 = false, sse4_2 = false, avx = false, avx2 = false, fma = false;
  bool avx512f = false, avx512cd = false, avx512bw = false, avx512dq = false, avx512vl = false;
  bool avx512_bf16 = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  // F, CD, BW, DQ and VL: what OpenBLAS's SkylakeX kernels (and everything after) use.
  bool avx512() const { return avx512f && avx512cd && avx512bw && avx512dq && avx512vl; }
  // "Intel(R) Xeon(R) Processor (family 6 model 207): SSE4.2 AVX AVX2 FMA AVX-512 (F CD BW DQ VL BF16) AMX (TILE BF16 INT8)"
  std::string describe() const;
};
CpuFeatures cpu_features();  // this processor's, read once

// The OpenBLAS core to ask for (OPENBLAS_CORETYPE), or "" to keep OpenBLAS's own choice: the best
// core by features that the library has (library_has), when OpenBLAS's core is below it. The
// ladder is OpenBLAS's own for processors it does not know, from 0.3.22 on (dynamic.c):
// SapphireRapids with AMX-BF16, Cooperlake with AVX-512 BF16, SkylakeX with AVX-512, Haswell with
// AVX2 and FMA, Sandybridge with AVX, else Prescott. A core is "below" when its kernels need fewer
// of these features (Zen's are Haswell's level); cores OpenBLAS picks only for their own
// processors (Bulldozer to Excavator) are never replaced.
std::string preferred_core(const CpuFeatures& cpu, std::string_view openblas_core,
                           const std::function<bool(std::string_view)>& library_has);

// Runs the BLAS and LAPACK that the CPU backend calls on small problems and compares them with
// references computed in plain loops: "" when they agree, else what disagreed, in words.
std::string verify_blas();

// Chooses the kernels as the header comment says, once per process: the first call may execute
// the program again (argv: main's, unchanged); later calls choose nothing. Returns what runs, for
// --version: "BLAS: " blas_description() "\nCPU: " cpu_features().describe().
std::string select_cpu_kernels(char** argv);

// "OpenBLAS 0.3.21 (OpenMP build, 2 threads), Cooperlake kernels chosen by dtk (OpenBLAS chose
// Prescott)": the library, its threading and the threads it uses now, the core and who chose it.
// With threads false, without the thread count.
std::string blas_description(bool threads = true);
// What the choice found wrong, one line each: kernels that disagreed with the references, an
// OPENBLAS_CORETYPE that OpenBLAS did not take, OpenBLAS's pthread build (its threads compete with
// dtk's OpenMP threads for the cores).
std::vector<std::string> cpu_kernel_warnings();

// The threads the CPU backend's loops and OpenBLAS use (OpenMP's max threads, for this thread).
void set_cpu_threads(int n);

}  // namespace dtk::ops
