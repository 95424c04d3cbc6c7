// CUDA causal self-attention for bf16 on tensor cores, FlashAttention-2's scheme: what
// attention.cu runs when q is bf16 (head dims 64 and 128; nn.cpp checks that). The rounding
// points are ops.h's; the CPU backend (cpu/attention.cpp) implements the same ones.
//
// Instructions: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (inline PTX), its operands
// read from shared memory by ldmatrix (.trans for the operands used transposed), tiles copied
// global -> shared by cp.async. Not nvcuda::wmma: wmma leaves the accumulator's layout
// unspecified, and the online softmax must know which row each accumulator element is in, and
// turns P (an accumulator) into the A operand of P V in registers. mma.sync's layouts are fixed by
// the PTX ISA: lane l = 4 g + t holds C rows g and g + 8, columns 2t and 2t + 1 of a 16x8 tile;
// A (16x16) a0..a3 = (row g, cols 2t..2t+1), (g + 8, same), (g, 8 + 2t..), (g + 8, 8 + 2t..);
// B (16x8) b0, b1 = (k 2t..2t+1, col g), (k 8 + 2t.., col g). So the C tiles of columns
// 16k..16k+7 and 16k+8..16k+15 are, packed to bf16 pairs, exactly the A fragment of k-block k.
//
// Tiles, 4 warps (128 threads) per CTA; no data crosses warps, a row's max and sum reduce over
// the 4 lanes of its quad:
//   forward  128 query rows (32 per warp: two m16 tiles, so each K/V fragment read from shared
//            memory feeds two products) x key tiles of 32 (hd 128) or 64 (hd 64);
//   dQ       64 query rows (16 per warp) x 64-key tiles;
//   dK/dV    64 key rows (16 per warp) x 64-query tiles.
// A shared tile row of hd bf16 is hd / 8 chunks of 16 bytes, chunk c of row r stored at chunk
// c ^ (r mod 8): the 8 rows one ldmatrix phase reads (same chunk, 8 consecutive rows) fall in 8
// different bank groups. The streamed tiles (K and V in the forward and dQ kernels; Q, dO, lse and
// D in the dK/dV kernel) are double-buffered: tile n + 1 is copied while tile n is multiplied.
// Dynamic shared memory at hd 128: forward 64 KiB (Q, two K and two V tiles), dQ 96 KiB (Q, dO,
// two K, two V), dK/dV 97 KiB (K, V, two Q, two dO, lse, D); at hd 64: 48, 48 and 49 KiB.
// Registers (ptxas, sm_90): forward 254 / 225 (hd 128 / 64), dQ 255 / 168, dK/dV 255 (32 bytes
// spilled) / 224: 2 CTAs (8 warps) per SM.
//
// Forward (grid B*H x query tiles, the tiles with the most keys first): for key tiles up to the
// tile's last row (those above the diagonal skipped, the ones crossing it masked; a warp whose rows
// all precede a tile skips its products): S = Q K^T (f32), the running max m and sum l,
// P = exp(S - m) (f32), l = l corr + rowsum P, O = O corr + bf16(P) V (f32). out = bf16(O / l),
// lse = m + log l. exp(x) is computed as exp2(x log2 e), the scores kept unscaled and scale log2 e
// applied in one FMA.
//
// Backward (deterministic: no atomics, every output written once by one thread, its sums in a
// fixed order; P recomputed from lse):
//   delta: D = rowsum(dO * O) (f32), a warp per row.
//   dK/dV (grid B*Hkv x key tiles): a CTA owns one key tile of one kv head, loops over the group's
//     query heads in order and, for each, over the query tiles from the diagonal down:
//     S^T = K Q^T, P^T = exp(S^T - lse), dV += bf16(P^T) dO, dP^T = V dO^T,
//     dS^T = P^T (dP^T - D), dK += bf16(dS^T) Q; dK *= scale; both rounded to bf16 once.
//   dQ (grid B*H x query tiles): S, P, dP, dS again for key tiles 0..i, dQ += bf16(dS) K,
//     dQ *= scale, rounded once.
// That is 7 tile products per (query tile, key tile) against FlashAttention-2's 5: the price of
// a dQ without atomics.
//
// Bounds: tiles are loaded with zero fill past row T. Query rows >= T are never stored; in the
// backward their lse is +inf, so their P is 0. Key rows >= T occur only in key tiles that cross
// the diagonal of the query rows < T, where the causal mask removes them.
#include <cmath>
#include <cstdint>
#include <string>

#include "dtk/ops/cuda/common.cuh"
#include "dtk/ops/cuda/flash_tiles.cuh"

namespace dtk::ops::cuda {

namespace {

namespace flash {

using kern::check_cuda;
using kern::check_launch;
using kern::stream;

// ------------------------------------------------------------------------------- forward
constexpr int kBlockF = 128;  // query rows of a forward tile: 32 per warp, two m16 tiles
// Keys of a forward K/V tile: 32 at hd 128, where O (2 x 64 f32 per thread) leaves room for S of
// 32 keys only (ptxas: 254 registers, no spills); 64 at hd 64.
template <int HD>
constexpr int kBlockFN = HD == 128 ? 32 : 64;

template <int HD>
__global__ void __launch_bounds__(kThreads) forward_kernel(Params p) {
  constexpr int BN = kBlockFN<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr uint32_t kTileQ = kBlockF * HD * 2, kTile = BN * HD * 2;
  const uint32_t sQ = smem_addr(smem), sK = sQ + kTileQ, sV = sK + 2 * kTile;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t bh = blockIdx.x, b = bh / p.H;
  const int h = static_cast<int>(bh % p.H), hk = h / (p.H / p.Hkv);
  const int i = static_cast<int>(gridDim.y - 1 - blockIdx.y);  // the longest rows first
  const int q0 = i * kBlockF, row_w = q0 + warp * 32;
  const int64_t ldq = static_cast<int64_t>(p.H) * HD, ldkv = static_cast<int64_t>(p.Hkv) * HD;
  const uint16_t* Q = p.q + (b * p.T * p.H + h) * HD;
  const uint16_t* K = p.k + (b * p.T * p.Hkv + hk) * HD;
  const uint16_t* V = p.v + (b * p.T * p.Hkv + hk) * HD;
  // key tiles 0 .. last: up to the block's last row, and within T
  const int last = min((q0 + kBlockF - 1) / BN, (p.T - 1) / BN);

  load_tile<HD, kBlockF>(sQ, Q, ldq, q0, p.T);
  load_tile<HD, BN>(sK, K, ldkv, 0, p.T);
  load_tile<HD, BN>(sV, V, ldkv, 0, p.T);
  cp_async_commit();

  float o[2][HD / 8][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
  float m[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}}, l[2][2] = {{0.f, 0.f}, {0.f, 0.f}};

  for (int j = 0; j <= last; ++j) {
    const int buf = j & 1;
    if (j < last) {
      load_tile<HD, BN>(sK + (buf ^ 1) * kTile, K, ldkv, (j + 1) * BN, p.T);
      load_tile<HD, BN>(sV + (buf ^ 1) * kTile, V, ldkv, (j + 1) * BN, p.T);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int k0 = j * BN;
    if (k0 <= row_w + 31) {  // else every key of the tile is past this warp's rows: P = 0
      const uint32_t kt = sK + buf * kTile, vt = sV + buf * kTile;
      float s[2][BN / 8][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
      for (int kb = 0; kb < HD / 16; ++kb) {
        uint32_t qa[2][4];
        load_a<HD>(sQ, warp * 32, kb, lane, qa[0]);
        load_a<HD>(sQ, warp * 32 + 16, kb, lane, qa[1]);
#pragma unroll
        for (int np = 0; np < BN / 16; ++np) {
          uint32_t bf[4];
          load_b<HD>(kt, np * 16, kb, lane, bf);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma(s[mt][2 * np], qa[mt], bf[0], bf[1]);
            mma(s[mt][2 * np + 1], qa[mt], bf[2], bf[3]);
          }
        }
      }
      if (k0 + BN - 1 > row_w) {  // a key of the tile is past one of this warp's rows: mask
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = k0 + n * 8 + 2 * t + (e & 1), row = row_w + 16 * mt + g + 8 * (e >> 1);
              if (key > row) s[mt][n][e] = -INFINITY;
            }
      }
      // Online softmax. Tile 0 holds key 0 <= every row, so m is finite from the first tile on;
      // a row with every key of a later tile masked keeps m (corr = 1) and adds P = 0.
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = m[mt][r];
#pragma unroll
          for (int n = 0; n < BN / 8; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
          mx = quad_max(mx);
          const float corr = exp2f((m[mt][r] - mx) * p.scale_log2), ms = mx * p.scale_log2;
          m[mt][r] = mx;
          float sum = 0.f;
#pragma unroll
          for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
              const float pv = exp2f(fmaf(s[mt][n][e], p.scale_log2, -ms));
              s[mt][n][e] = pv;
              sum += pv;
            }
          l[mt][r] = l[mt][r] * corr + sum;
#pragma unroll
          for (int n = 0; n < HD / 8; ++n) {
            o[mt][n][2 * r] *= corr;
            o[mt][n][2 * r + 1] *= corr;
          }
        }
      // O += bf16(P) V
#pragma unroll
      for (int kb = 0; kb < BN / 16; ++kb) {
        uint32_t a[2][4];
        acc_to_a(s[0], kb, a[0]);
        acc_to_a(s[1], kb, a[1]);
#pragma unroll
        for (int np = 0; np < HD / 16; ++np) {
          uint32_t bf[4];
          load_b_trans<HD>(vt, kb * 16, np, lane, bf);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma(o[mt][2 * np], a[mt], bf[0], bf[1]);
            mma(o[mt][2 * np + 1], a[mt], bf[2], bf[3]);
          }
        }
      }
    }
    __syncthreads();  // this tile's buffers are refilled by the next iteration's prefetch
  }

  uint16_t* out = p.out + (b * p.T * p.H + h) * HD;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) l[mt][r] = quad_sum(l[mt][r]);
    store_rows<HD>(out, ldq, row_w + 16 * mt, p.T, o[mt], l[mt], true, lane);
    if (t == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row_w + 16 * mt + g + 8 * r;
        if (row < p.T) p.lse_out[bh * p.T + row] = m[mt][r] * p.scale + logf(l[mt][r]);
      }
    }
  }
}

// ------------------------------------------------------------------------------- backward
// D[b, h, t] = sum over the head dim of dO * O (f32), a warp per row (b, t, h).
template <int HD>
__global__ void __launch_bounds__(256) delta_kernel(Params p, int64_t rows) {
  const int64_t row = blockIdx.x * int64_t(8) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const uint16_t* o = p.o + row * HD;
  const uint16_t* d = p.dout + row * HD;
  float s = 0.f;
#pragma unroll
  for (int c = lane; c < HD; c += 32) s += bf16_value(o[c]) * bf16_value(d[c]);
  s = kern::warp_sum(s);
  if (lane == 0) {
    const int64_t h = row % p.H, bt = row / p.H, tt = bt % p.T, b = bt / p.T;
    p.delta[(b * p.H + h) * p.T + tt] = s;
  }
}

// dK, dV of key tile blockIdx.y of kv head (b, hk), blockIdx.x = b * Hkv + hk.
template <int HD>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(Params p) {
  constexpr int BQ = kBlock;  // query rows per step
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr uint32_t kTileK = kBlock * HD * 2, kTileQ = BQ * HD * 2;
  const uint32_t sK = smem_addr(smem), sV = sK + kTileK, sQ = sV + kTileK, sO = sQ + 2 * kTileQ;
  float* sL = reinterpret_cast<float*>(smem + 2 * kTileK + 4 * kTileQ);  // [2][BQ] lse * log2(e)
  float* sD = sL + 2 * BQ;                                              // [2][BQ] D
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t b = blockIdx.x / p.Hkv;
  const int hk = static_cast<int>(blockIdx.x % p.Hkv), G = p.H / p.Hkv;
  const int k0 = static_cast<int>(blockIdx.y) * kBlock, key_w = k0 + warp * 16;
  const int64_t ldq = static_cast<int64_t>(p.H) * HD, ldkv = static_cast<int64_t>(p.Hkv) * HD;
  const int64_t kv_off = (b * p.T * p.Hkv + hk) * HD;
  // The query tiles that see a key of this tile: from the one holding query k0 to the last.
  const int first = k0 / BQ, per_head = (p.T + BQ - 1) / BQ - first, steps = G * per_head;

  // Stage step s (head hk G + s / per_head, query tile first + s % per_head) into buffer buf.
  auto stage = [&](int s, int buf) {
    const int h = hk * G + s / per_head, q0 = (first + s % per_head) * BQ;
    const int64_t off = (b * p.T * p.H + h) * HD;
    load_tile<HD, BQ>(sQ + buf * kTileQ, p.q + off, ldq, q0, p.T);
    load_tile<HD, BQ>(sO + buf * kTileQ, p.dout + off, ldq, q0, p.T);
    if (threadIdx.x < BQ) {
      const int row = q0 + static_cast<int>(threadIdx.x);
      const int64_t at = (b * p.H + h) * p.T + row;
      sL[buf * BQ + threadIdx.x] = row < p.T ? p.lse[at] * kLog2e : INFINITY;  // P = 0 past T
      sD[buf * BQ + threadIdx.x] = row < p.T ? p.delta[at] : 0.f;
    }
  };

  load_tile<HD, kBlock>(sK, p.k + kv_off, ldkv, k0, p.T);
  load_tile<HD, kBlock>(sV, p.v + kv_off, ldkv, k0, p.T);
  stage(0, 0);
  cp_async_commit();

  float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;

  for (int s = 0; s < steps; ++s) {
    const int buf = s & 1;
    if (s + 1 < steps) stage(s + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const int q0 = (first + s % per_head) * BQ;
    const uint32_t qt = sQ + buf * kTileQ, ot = sO + buf * kTileQ;
    const float* L = sL + buf * BQ;
    const float* Dl = sD + buf * BQ;

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x BQ queries.
    float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
#pragma unroll
    for (int kb = 0; kb < HD / 16; ++kb) {
      uint32_t ka[4], va[4];
      load_a<HD>(sK, warp * 16, kb, lane, ka);
      load_a<HD>(sV, warp * 16, kb, lane, va);
#pragma unroll
      for (int np = 0; np < BQ / 16; ++np) {
        uint32_t bf[4];
        load_b<HD>(qt, np * 16, kb, lane, bf);
        mma(st[2 * np], ka, bf[0], bf[1]);
        mma(st[2 * np + 1], ka, bf[2], bf[3]);
        load_b<HD>(ot, np * 16, kb, lane, bf);
        mma(dpt[2 * np], va, bf[0], bf[1]);
        mma(dpt[2 * np + 1], va, bf[2], bf[3]);
      }
    }
    // P^T = exp(S^T - lse), masked where key > query; dS^T = P^T (dP^T - D), in place.
    const bool diagonal = q0 < k0 + kBlock;
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n * 8 + 2 * t + (e & 1), key = key_w + g + 8 * (e >> 1);
        float pv = exp2f(fmaf(st[n][e], p.scale_log2, -L[col]));
        if (diagonal && key > q0 + col) pv = 0.f;
        st[n][e] = pv;
        dpt[n][e] = pv * (dpt[n][e] - Dl[col]);
      }
    // dV += bf16(P^T) dO, dK += bf16(dS^T) Q (k runs over the tile's queries)
#pragma unroll
    for (int kb = 0; kb < BQ / 16; ++kb) {
      uint32_t pa[4], sa[4];
      acc_to_a(st, kb, pa);
      acc_to_a(dpt, kb, sa);
#pragma unroll
      for (int np = 0; np < HD / 16; ++np) {
        uint32_t bf[4];
        load_b_trans<HD>(ot, kb * 16, np, lane, bf);
        mma(dv[2 * np], pa, bf[0], bf[1]);
        mma(dv[2 * np + 1], pa, bf[2], bf[3]);
        load_b_trans<HD>(qt, kb * 16, np, lane, bf);
        mma(dk[2 * np], sa, bf[0], bf[1]);
        mma(dk[2 * np + 1], sa, bf[2], bf[3]);
      }
    }
    __syncthreads();
  }

  const float scale[2] = {p.scale, p.scale}, one[2] = {1.f, 1.f};
  store_rows<HD>(p.dk + kv_off, ldkv, key_w, p.T, dk, scale, false, lane);
  store_rows<HD>(p.dv + kv_off, ldkv, key_w, p.T, dv, one, false, lane);
}

// dQ of query tile (gridDim.y - 1 - blockIdx.y) of head (b, h), blockIdx.x = b * H + h.
template <int HD>
__global__ void __launch_bounds__(kThreads) dq_kernel(Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr uint32_t kTile = kBlock * HD * 2;
  const uint32_t sQ = smem_addr(smem), sO = sQ + kTile, sK = sO + kTile, sV = sK + 2 * kTile;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t bh = blockIdx.x, b = bh / p.H;
  const int h = static_cast<int>(bh % p.H), hk = h / (p.H / p.Hkv);
  const int i = static_cast<int>(gridDim.y - 1 - blockIdx.y);
  const int q0 = i * kBlock, row_w = q0 + warp * 16;
  const int64_t ldq = static_cast<int64_t>(p.H) * HD, ldkv = static_cast<int64_t>(p.Hkv) * HD;
  const int64_t q_off = (b * p.T * p.H + h) * HD;
  const uint16_t* K = p.k + (b * p.T * p.Hkv + hk) * HD;
  const uint16_t* V = p.v + (b * p.T * p.Hkv + hk) * HD;

  load_tile<HD, kBlock>(sQ, p.q + q_off, ldq, q0, p.T);
  load_tile<HD, kBlock>(sO, p.dout + q_off, ldq, q0, p.T);
  load_tile<HD, kBlock>(sK, K, ldkv, 0, p.T);
  load_tile<HD, kBlock>(sV, V, ldkv, 0, p.T);
  cp_async_commit();

  float lse2[2], D[2];  // this thread's rows g and g + 8: lse log2(e) (+inf past T, so P = 0) and D
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_w + g + 8 * r;
    lse2[r] = row < p.T ? p.lse[bh * p.T + row] * kLog2e : INFINITY;
    D[r] = row < p.T ? p.delta[bh * p.T + row] : 0.f;
  }
  float dq[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;

  for (int j = 0; j <= i; ++j) {
    const int buf = j & 1;
    if (j < i) {
      load_tile<HD, kBlock>(sK + (buf ^ 1) * kTile, K, ldkv, (j + 1) * kBlock, p.T);
      load_tile<HD, kBlock>(sV + (buf ^ 1) * kTile, V, ldkv, (j + 1) * kBlock, p.T);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint32_t kt = sK + buf * kTile, vt = sV + buf * kTile;

    float s[kBlock / 8][4], dp[kBlock / 8][4];
#pragma unroll
    for (int n = 0; n < kBlock / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
    for (int kb = 0; kb < HD / 16; ++kb) {
      uint32_t qa[4], da[4];
      load_a<HD>(sQ, warp * 16, kb, lane, qa);
      load_a<HD>(sO, warp * 16, kb, lane, da);
#pragma unroll
      for (int np = 0; np < kBlock / 16; ++np) {
        uint32_t bf[4];
        load_b<HD>(kt, np * 16, kb, lane, bf);
        mma(s[2 * np], qa, bf[0], bf[1]);
        mma(s[2 * np + 1], qa, bf[2], bf[3]);
        load_b<HD>(vt, np * 16, kb, lane, bf);
        mma(dp[2 * np], da, bf[0], bf[1]);
        mma(dp[2 * np + 1], da, bf[2], bf[3]);
      }
    }
    // P = exp(S - lse) (0 where key > query on the diagonal tile), dS = P (dP - D), in s.
#pragma unroll
    for (int n = 0; n < kBlock / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, key = j * kBlock + n * 8 + 2 * t + (e & 1), row = row_w + g + 8 * r;
        float pv = exp2f(fmaf(s[n][e], p.scale_log2, -lse2[r]));
        if (j == i && key > row) pv = 0.f;
        s[n][e] = pv * (dp[n][e] - D[r]);
      }
    // dQ += bf16(dS) K (k runs over the tile's keys)
#pragma unroll
    for (int kb = 0; kb < kBlock / 16; ++kb) {
      uint32_t a[4];
      acc_to_a(s, kb, a);
#pragma unroll
      for (int np = 0; np < HD / 16; ++np) {
        uint32_t bf[4];
        load_b_trans<HD>(kt, kb * 16, np, lane, bf);
        mma(dq[2 * np], a, bf[0], bf[1]);
        mma(dq[2 * np + 1], a, bf[2], bf[3]);
      }
    }
    __syncthreads();
  }
  const float scale[2] = {p.scale, p.scale};
  store_rows<HD>(p.dq + q_off, ldq, row_w, p.T, dq, scale, false, lane);
}

// ------------------------------------------------------------------------------- launches
template <int HD>
constexpr size_t kForwardSmem = (kBlockF + 4 * kBlockFN<HD>) * HD * 2;  // Q, K x2, V x2
template <int HD>
constexpr size_t kDqSmem = 6 * kBlock * HD * 2;  // Q, dO, K x2, V x2
template <int HD>
constexpr size_t kDkdvSmem = 6 * kBlock * HD * 2 + 4 * kBlock * sizeof(float);  // K, V, Q x2, dO x2, lse, D

// Dynamic shared memory above the default 48 KiB must be allowed per kernel (and per device:
// so on every launch, which costs a driver call next to a kernel of milliseconds).
template <typename K>
void allow_smem(K kernel, size_t bytes, const char* name) {
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
             name);
}

Params params_of(const Tensor& q, const Tensor& k) {
  Params p{};
  p.T = static_cast<int>(q.dim(1));
  p.H = static_cast<int>(q.dim(2));
  p.Hkv = static_cast<int>(k.dim(2));
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.dim(3)));
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  return p;
}

// The kernels need sm_80 or newer (cp.async, bf16 mma): an older GPU gets an error, not a trap.
void require_sm80(const char* op) {
  int dev = 0, major = 0;
  check_cuda(cudaGetDevice(&dev), op);
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), op);
  if (major < 8) fail(std::string(op) + ": bf16 attention needs a GPU of compute capability 8.0 or newer");
}

// Grid limits: B*H (or B*Hkv) blocks in x (up to 2^31 - 1), the tiles of T in y (up to 65535).
void check_grid(int64_t heads, int64_t T, const char* op) {
  if (heads > 0x7fffffff || (T + kBlock - 1) / kBlock > 65535 || T > 0x7fffffff)
    fail(std::string(op) + ": B*H = " + std::to_string(heads) + " and T = " + std::to_string(T) +
         " exceed the bf16 attention kernels' grid (B*H < 2^31, T <= 65535 * 64)");
}

template <int HD>
void forward_hd(const Params& p, int64_t B) {
  const dim3 grid(static_cast<unsigned>(B * p.H), static_cast<unsigned>((p.T + kBlockF - 1) / kBlockF));
  allow_smem(forward_kernel<HD>, kForwardSmem<HD>, "attention_forward(bf16): shared memory");
  forward_kernel<HD><<<grid, kThreads, kForwardSmem<HD>, stream()>>>(p);
  check_launch("attention_forward(bf16)");
}

template <int HD>
void backward_hd(const Params& p, int64_t B) {
  const int64_t rows = B * p.T * p.H;
  delta_kernel<HD><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream()>>>(p, rows);
  check_launch("attention_backward(bf16 delta)");
  const unsigned tiles = static_cast<unsigned>((p.T + kBlock - 1) / kBlock);
  allow_smem(dkdv_kernel<HD>, kDkdvSmem<HD>, "attention_backward(bf16 dk, dv): shared memory");
  dkdv_kernel<HD><<<dim3(static_cast<unsigned>(B * p.Hkv), tiles), kThreads, kDkdvSmem<HD>, stream()>>>(p);
  check_launch("attention_backward(bf16 dk, dv)");
  allow_smem(dq_kernel<HD>, kDqSmem<HD>, "attention_backward(bf16 dq): shared memory");
  dq_kernel<HD><<<dim3(static_cast<unsigned>(B * p.H), tiles), kThreads, kDqSmem<HD>, stream()>>>(p);
  check_launch("attention_backward(bf16 dq)");
}

}  // namespace flash

}  // namespace

// Called by attention.cu for bf16 q (all tensors bf16 but lse f32, hd 64 or 128, every pointer
// 16-byte aligned: attention.cu sees to it).
void flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse) {
  const int64_t B = q.dim(0), T = q.dim(1), H = q.dim(2), hd = q.dim(3);
  if (B * T * H == 0) return;
  flash::check_grid(B * H, T, "attention_forward");
  flash::require_sm80("attention_forward");
  flash::Params p = flash::params_of(q, k);
  p.q = q.ptr<uint16_t>();
  p.k = k.ptr<uint16_t>();
  p.v = v.ptr<uint16_t>();
  p.out = out.ptr<uint16_t>();
  p.lse_out = lse.ptr<float>();
  if (hd == 64)
    flash::forward_hd<64>(p, B);
  else
    flash::forward_hd<128>(p, B);
}

void flash_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  const int64_t B = q.dim(0), T = q.dim(1), H = q.dim(2), hd = q.dim(3);
  if (B * T * H == 0) return;
  flash::check_grid(B * H, T, "attention_backward");
  flash::require_sm80("attention_backward");
  Tensor delta = Tensor::empty({B * H * T}, DType::f32, q.device());
  flash::Params p = flash::params_of(q, k);
  p.q = q.ptr<uint16_t>();
  p.k = k.ptr<uint16_t>();
  p.v = v.ptr<uint16_t>();
  p.o = out.ptr<uint16_t>();
  p.dout = dout.ptr<uint16_t>();
  p.lse = lse.ptr<float>();
  p.delta = delta.ptr<float>();
  p.dq = dq.ptr<uint16_t>();
  p.dk = dk.ptr<uint16_t>();
  p.dv = dv.ptr<uint16_t>();
  if (hd == 64)
    flash::backward_hd<64>(p, B);
  else
    flash::backward_hd<128>(p, B);
}

}  // namespace dtk::ops::cuda
