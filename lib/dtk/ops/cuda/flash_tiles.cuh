// The bf16 flash attention's building blocks (flash_attention.cu): its tile sizes and launch
// parameters, PTX wrappers (cp.async, ldmatrix, mma.sync m16n8k16), swizzled shared-memory tiles
// and the fragment moves between them. Included by flash_attention.cu alone.
#pragma once
#include <cstdint>

namespace dtk::ops::cuda {
namespace {
namespace flash {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlock = 64;  // rows of the dQ and dK/dV kernels' tiles; hd 64's forward key tiles
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

struct Params {
  const uint16_t* q;     // [B, T, H, HD] bf16
  const uint16_t* k;     // [B, T, Hkv, HD]
  const uint16_t* v;     // [B, T, Hkv, HD]
  const uint16_t* o;     // out [B, T, H, HD] (backward: input)
  const uint16_t* dout;  // [B, T, H, HD] (backward)
  const float* lse;      // [B, H, T] (backward: input)
  float* delta;          // [B, H, T] (backward: the delta kernel writes it, the others read it)
  uint16_t* out;         // forward: out
  float* lse_out;        // forward: lse
  uint16_t* dq;
  uint16_t* dk;
  uint16_t* dv;
  int T, H, Hkv;
  float scale;       // 1 / sqrt(HD)
  float scale_log2;  // scale * log2(e)
};

// ------------------------------------------------------------------------------- PTX wrappers
// cp.async and bf16 mma need sm_80. A build that also targets older GPUs compiles these wrappers
// to a trap there; the launches refuse such a GPU first (require_sm80).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define DTK_FLASH_ASM(...) __trap()
#define DTK_FLASH_PURE_ASM(...) __trap()
#else
#define DTK_FLASH_ASM(...) asm volatile(__VA_ARGS__)
#define DTK_FLASH_PURE_ASM(...) asm(__VA_ARGS__)
#endif

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; with valid false, 16 zero bytes (nothing is read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  [[maybe_unused]] const int n = valid ? 16 : 0;  // bytes read; the rest zero-filled
  DTK_FLASH_ASM("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { DTK_FLASH_ASM("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  DTK_FLASH_ASM("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8m..8m+7 give the row addresses of matrix m, register m receives
// (row lane / 4, cols 2 (lane % 4), +1) of matrix m, or with .trans (rows 2 (lane % 4), +1, col lane / 4).
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  DTK_FLASH_ASM("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t (&r)[4]) {
  DTK_FLASH_ASM("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// c += a b: a 16x16 (row), b 16x8 (col) bf16, c 16x8 f32.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  DTK_FLASH_PURE_ASM("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to bf16 (to nearest even), lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  uint32_t r = 0;
  DTK_FLASH_PURE_ASM("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float bf16_value(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// ------------------------------------------------------------------------------- shared tiles
// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of HD-element rows.
template <int HD>
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return static_cast<uint32_t>((row * HD + ((chunk ^ (row & 7)) << 3)) * 2);
}

// Copies rows row0 .. row0 + ROWS - 1 of a [T, HD] matrix (row stride ld elements) into the
// swizzled tile at dst; rows >= T are zero-filled. All threads of the CTA take part.
template <int HD, int ROWS>
__device__ __forceinline__ void load_tile(uint32_t dst, const uint16_t* src, int64_t ld, int row0, int T) {
  constexpr int kChunks = HD / 8;
  static_assert(ROWS * kChunks % kThreads == 0, "whole passes of the CTA");
#pragma unroll
  for (int it = 0; it < ROWS * kChunks / kThreads; ++it) {
    const int c = it * kThreads + static_cast<int>(threadIdx.x);
    const int r = c / kChunks, ch = c % kChunks;
    const bool valid = row0 + r < T;
    const uint16_t* from = src + (valid ? static_cast<int64_t>(row0 + r) * ld + ch * 8 : 0);
    cp_async16(dst + swz<HD>(r, ch), from, valid);
  }
}

// A fragments (16x16, k-block kb) of rows row0..row0+15 of a tile: matrices (rows +0, chunk 2kb),
// (rows +8, chunk 2kb), (rows +0, chunk 2kb+1), (rows +8, chunk 2kb+1).
template <int HD>
__device__ __forceinline__ void load_a(uint32_t tile, int row0, int kb, int lane, uint32_t (&a)[4]) {
  ldsm_x4(tile + swz<HD>(row0 + (lane & 15), 2 * kb + (lane >> 4)), a);
}

// B fragments of two n-tiles for S-like products (B[k][n] = tile[n][k]: rows are n, the k-block's
// 16 columns are k): n rows n0..n0+15, k-block kb. b[0], b[1]: n-tile n0; b[2], b[3]: n0 + 8.
template <int HD>
__device__ __forceinline__ void load_b(uint32_t tile, int n0, int kb, int lane, uint32_t (&b)[4]) {
  ldsm_x4(tile + swz<HD>(n0 + (lane & 7) + ((lane >> 4) << 3), 2 * kb + ((lane >> 3) & 1)), b);
}

// B fragments of two n-tiles for P V-like products (B[k][n] = tile[k][n]: rows are k): k rows
// k0..k0+15, columns 16 np .. 16 np + 15. b[0], b[1]: columns 16 np..+7; b[2], b[3]: +8..+15.
template <int HD>
__device__ __forceinline__ void load_b_trans(uint32_t tile, int k0, int np, int lane, uint32_t (&b)[4]) {
  ldsm_x4_t(tile + swz<HD>(k0 + (lane & 15), 2 * np + (lane >> 4)), b);
}

// The A fragment of k-block kb built from f32 accumulator tiles c[2 kb] and c[2 kb + 1].
template <int N>
__device__ __forceinline__ void acc_to_a(const float (&c)[N][4], int kb, uint32_t (&a)[4]) {
  a[0] = pack_bf16(c[2 * kb][0], c[2 * kb][1]);
  a[1] = pack_bf16(c[2 * kb][2], c[2 * kb][3]);
  a[2] = pack_bf16(c[2 * kb + 1][0], c[2 * kb + 1][1]);
  a[3] = pack_bf16(c[2 * kb + 1][2], c[2 * kb + 1][3]);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(kFull, x, 1));
  return fmaxf(x, __shfl_xor_sync(kFull, x, 2));
}
// Every lane of the quad gets the same bits: (a + b) + (c + d) in both orders is the same sum.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(kFull, x, 1);
  return x + __shfl_xor_sync(kFull, x, 2);
}

// Stores the warp's 16 accumulator rows (from row0, HD columns) as bf16, each row divided by
// (divide) or multiplied by f[r] first; rows >= T skipped. Lane 4 g + t holds rows g + 8 r,
// columns 8 n + 2 t and 8 n + 2 t + 1: one 4-byte store per pair.
template <int HD>
__device__ __forceinline__ void store_rows(uint16_t* base, int64_t ld, int row0, int T, const float (&acc)[HD / 8][4],
                                           const float (&f)[2], bool divide, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row >= T) continue;
    uint16_t* p = base + static_cast<int64_t>(row) * ld + 2 * t;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      const float x = acc[n][2 * r], y = acc[n][2 * r + 1];
      const uint32_t w = divide ? pack_bf16(x / f[r], y / f[r]) : pack_bf16(x * f[r], y * f[r]);
      *reinterpret_cast<uint32_t*>(p + 8 * n) = w;
    }
  }
}

}  // namespace flash
}  // namespace
}  // namespace dtk::ops::cuda
