// cuBLAS and cuSOLVER, loaded on first use instead of at program start. Linked, they made every
// process resident in ~185 MiB more before it did anything, CPU-only runs included (cublasLt
// 150 MiB, nvJitLink 27 MiB through cusolver; VmRSS after dlopen of each, measured here), while
// cudart and NCCL cost 3 MiB together and stay linked.
//   DTK_CUBLAS(cublasSgemm)(handle, ...)    the function, resolved once per call site
#pragma once
#include <cublas_api.h>
#include <cusolver_common.h>

namespace dtk::ops::cuda::lazy {

// The address of `name` in `library` (dlopen'ed once, kept); fails naming both when either is missing.
void* symbol(const char* library, const char* name);

}  // namespace dtk::ops::cuda::lazy

#define DTK_LAZY_STR2(x) #x
#define DTK_LAZY_STR(x) DTK_LAZY_STR2(x)
// fn is expanded before it is named: cublasSgemm is a macro for cublasSgemm_v2, the symbol.
#define DTK_LAZY_AS(library, type, fn)                                                                   \
  ([]() {                                                                                                \
    static const auto f = reinterpret_cast<type>(::dtk::ops::cuda::lazy::symbol(library, DTK_LAZY_STR(fn))); \
    return f;                                                                                            \
  }())
#define DTK_LAZY(library, fn) DTK_LAZY_AS(library, decltype(&fn), fn)
#define DTK_CUBLAS_LIB "libcublas.so." DTK_LAZY_STR(CUBLAS_VER_MAJOR)
#define DTK_CUBLAS(fn) DTK_LAZY(DTK_CUBLAS_LIB, fn)
// For a function that C++ overloads (the C symbol is one of them): its pointer type spelled out.
#define DTK_CUBLAS_AS(type, fn) DTK_LAZY_AS(DTK_CUBLAS_LIB, type, fn)
#define DTK_CUSOLVER(fn) DTK_LAZY("libcusolver.so." DTK_LAZY_STR(CUSOLVER_VER_MAJOR), fn)
