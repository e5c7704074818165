// A standalone CUDA probe of the MXFP4 decode GEMV: one expert's weight rows in the MMA layout
// (moe_extension/quant/mxfp4_mma.py: e2m1 codes, E8M0 scales per 32 columns, one 32-bit word per lane and k16 step)
// times one bf16 row, per (token, slot) pair; fp32 out [P, rows]. What the direct schedule's two GEMVs
// (kernels/_gemv_dot.py) do without their epilogues, written without shared memory for the weights: each lane loads
// its fragment words straight into registers (16 B per 64-column chunk), decodes them with the layout's rotations,
// masks and one bf16 multiply by the group's factor, and feeds mma.sync m16n8k16 (the row in all 8 columns of B).
// A block is KS warps on one 16-row band, warp j taking chunks j, j + KS, ... in groups of U loaded before they are
// decoded; the row sits in shared memory in fragment order; the warps' sums meet in shared memory.
//
// Variants, each timed at gpt-oss-120b's shapes (E 128, K 2880; rows 5760 = gemm1's gate and up, 2880 = gemm2's)
// for P pairs on distinct experts:
//   decode KS/U  the GEMV (its output checked first against a host decode of the layout, fp64 sums)
//   ring KS/U/S  the same with each warp's loads as cp.async into a private ring of S stages of U chunks in shared
//                memory (S - 1 groups in flight while the warp decodes one, no registers held for them)
//   loads        the same kernel's loads and row staging, no decode or MMA
//   loads, no x  its weight and scale loads alone
//   stream       a plain streaming read of the same codes, 16 KB per block: what the bytes cost at best
//   fp8 KS/U     the same loads and GEMV through mma.sync m16n8k32 e4m3 instead of bf16: the codes in a layout of
//                its own (per lane and k32 step two words, each two e4m3 fragment registers: the bits of one are in
//                place under the mask 0x9C9C9C9C, the other's come from two shifts; a code lands as e2m1 * 2^-6),
//                the group scales applied to each k32 step's fp32 sums (one FFMA per sum), and the bf16 row split
//                exactly into two e4m3 rows, hi = e4m3(x s) and lo = e4m3(x s - hi) with s a power of two per row,
//                as columns 0 and 1 of B (exact for elements within 2^10 of the row's largest); on sm_90 ptxas
//                lowers this MMA to conversions and fp16 MMAs, so it measures that, not an fp8 tensor-core step
//   wgmma U      the fp8 form on the tensor cores: wgmma m64n8k32 e4m3 with A (the placed codes) in registers and the
//                hi / lo row as B tiles in shared memory; a block is one warpgroup on 64 rows, the chunks in groups of
//                U, each group's 2U wgmmas issued before one wait, then the group scales applied
//   wgmma U split S  the same with the reduction split S ways over blocks (a row scale per split), the partial sums
//                in a workspace and summed in split order by the block of each row tile that counts last
// Per launch: the median of 7 replays of a CUDA graph of 64 launches, each on its own set of experts (no L2 reuse
// between launches), divided by 64; GB/s counts codes and scales (17 / 32 byte per weight; stream: codes only).
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/probe_mxfp4_gemv benchmarks/probe_mxfp4_gemv.cu \
//     && /tmp/probe_mxfp4_gemv
//
// Not used by the library. benchmarks/results/probe_mxfp4_gemv_h200.txt holds a run.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CHECK_CUDA(x)                                                                           \
  do {                                                                                          \
    cudaError_t err_ = (x);                                                                     \
    if (err_ != cudaSuccess) {                                                                  \
      std::printf("%s failed at line %d: %s\n", #x, __LINE__, cudaGetErrorString(err_));        \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

constexpr int MODE_DECODE = 0, MODE_LOADS = 1, MODE_LOADS_NO_X = 2;

__device__ __forceinline__ uint32_t rotl(uint32_t x, int r) { return __funnelshift_l(x, x, r); }

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;  // a * b + (-0): the product, signs of zeros kept
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 load_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t load_stream4(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// The bf16x2 factor 2^(s - 21) of the scale byte that `sel` picks from `scales` (exponent field s + 106, both
// halves): __byte_perm puts the byte in the low byte of each half, one IMAD shifts it and adds 106 << 7.
__device__ __forceinline__ uint32_t group_factor(uint32_t scales, uint32_t sel) {
  return __byte_perm(scales, 0u, sel) * 128u + 0x35003500u;
}

// One 64-column chunk of a lane's band: its four fragment words `wv`, its lane group's scale bytes, the row's
// fragments of the chunk (x_frag: [4 t][8 words]) -> two running sums (alternate k16 steps: two MMA chains).
__device__ __forceinline__ void decode_chunk(float (&acc)[2][4], uint4 wv, uint32_t group_scales,
                                             const uint32_t* x_chunk, int t) {
  const uint32_t mask = 0x81C081C0u, mask_hi = 0x81808180u, mask_lo = 0x00400040u;
  const uint4* xv = reinterpret_cast<const uint4*>(x_chunk + t * 8);
  const uint4 xa = xv[0], xb = xv[1];
  const uint32_t xs[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
  const uint32_t ws[4] = {wv.x, wv.y, wv.z, wv.w};
  // scale bytes per lane group: (row g, columns 0-31), (row g, 32-63), (row g + 8, 0-31), (row g + 8, 32-63)
  const uint32_t f_lo[2] = {group_factor(group_scales, 0x4040), group_factor(group_scales, 0x4141)};
  const uint32_t f_hi[2] = {group_factor(group_scales, 0x4242), group_factor(group_scales, 0x4343)};
#pragma unroll
  for (int step = 0; step < 4; ++step) {
    const uint32_t w = ws[step], f0 = f_lo[step >> 1], f1 = f_hi[step >> 1];
    // rotations by 4 and 6 as shifts (no masked bit comes from the wrapped ones): IMAD on the FMA pipe
    const uint32_t a0 = bf16x2_mul(w & mask, f0);
    const uint32_t a1 = bf16x2_mul((w * 16u) & mask, f1);
    const uint32_t a2 = bf16x2_mul(rotl(w, 10) & mask, f0);
    const uint32_t a3 = bf16x2_mul((rotl(w, 14) & mask_hi) | ((w * 64u) & mask_lo), f1);
    mma_bf16(acc[step & 1], a0, a1, a2, a3, xs[2 * step], xs[2 * step + 1]);
  }
}

// The band's 16 sums from the KS warps' running sums (lanes t = 0 hold rows g and g + 8; with HI_LO the sum of
// columns 0 and 1, else column 0) -> out, times `factor` (2^MMA_EXCESS for the bf16 decode).
template <int KS, bool HI_LO = false>
__device__ __forceinline__ void store_band(const float (&acc)[2][4], float* sums, float* out_rows, int warp, int g,
                                           int t, float factor = 1048576.0f) {
  if (t == 0) {
    sums[warp * 16 + g] = acc[0][0] + acc[1][0] + (HI_LO ? acc[0][1] + acc[1][1] : 0.f);
    sums[warp * 16 + g + 8] = acc[0][2] + acc[1][2] + (HI_LO ? acc[0][3] + acc[1][3] : 0.f);
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    float v = 0.f;
#pragma unroll
    for (int j = 0; j < KS; ++j) v += sums[j * 16 + threadIdx.x];
    out_rows[threadIdx.x] = v * factor;
  }
}

// The chunks warp, warp + KS, ... of a band (codes and scales from `band_codes` / `band_scales`, a lane's own) in
// groups of U whose loads are all issued before the first is used: fn(chunk, its four words, its scale bytes).
template <int KS, int U, typename Fn>
__device__ __forceinline__ void band_chunks(const uint8_t* band_codes, const uint8_t* band_scales, int chunks, int warp,
                                            Fn fn) {
  for (int c0 = warp; c0 < chunks; c0 += KS * U) {
    uint4 words[U];
    uint32_t group_scales[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * KS;
      words[u] = c < chunks ? load_stream16(band_codes + 512 * c) : make_uint4(0, 0, 0, 0);
      group_scales[u] = c < chunks ? load_stream4(band_scales + 32 * c) : 0u;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * KS;
      if (c >= chunks) break;
      fn(c, words[u], group_scales[u]);
    }
  }
}

// out[p, band rows] = W[ids[p], band rows, :] x[p, :]: grid (rows / 16, P), KS warps per block.
template <int KS, int U, int MODE>
__global__ void __launch_bounds__(KS * 32) gemv_decode(const uint8_t* __restrict__ codes,
                                                       const uint8_t* __restrict__ scales,
                                                       const __nv_bfloat16* __restrict__ x,
                                                       const int* __restrict__ ids, float* __restrict__ out,
                                                       int rows, int K) {
  extern __shared__ uint32_t smem[];  // the row in fragment order [chunks][4 t][8 words], then [KS][16] sums
  const int band = blockIdx.x, p = blockIdx.y, e = ids[p];
  const int chunks = K / 64;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  uint32_t* x_frag = smem;
  float* sums = reinterpret_cast<float*>(smem + chunks * 32);
  if (MODE != MODE_LOADS_NO_X) {
    const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(x + (size_t)p * K);
    for (int i = threadIdx.x; i < chunks * 32; i += KS * 32) {
      const int c = i >> 5, lt = (i >> 3) & 3, step = (i >> 1) & 3, hi = i & 1;
      x_frag[i] = x_pairs[(64 * c + 16 * step + 8 * hi + 2 * lt) >> 1];
    }
  }
  __syncthreads();
  const uint8_t* band_codes = codes + ((size_t)e * rows + (size_t)band * 16) * (K / 2) + 16 * lane;
  const uint8_t* band_scales = scales + ((size_t)e * rows + (size_t)band * 16) * (K / 32) + 4 * g;
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  uint32_t folded = 0;
  band_chunks<KS, U>(band_codes, band_scales, chunks, warp, [&](int c, uint4 words, uint32_t group_scales) {
    if (MODE != MODE_DECODE)
      folded ^= words.x ^ words.y ^ words.z ^ words.w ^ group_scales;
    else
      decode_chunk(acc, words, group_scales, x_frag + c * 32, t);
  });
  if (MODE != MODE_DECODE) {  // keeps the loads; not a result
    acc[0][0] = __uint_as_float(folded & 0x007fffffu);
    acc[1][0] = 0.f;
  }
  store_band<KS>(acc, sums, out + (size_t)p * rows + band * 16, warp, g, t);
}

__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%10,%10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.f));
}

// A word of the fp8 layout -> its two e4m3 fragment registers, each code as e2m1 * 2^-6 (sign at bit 7 of its byte,
// magnitude at bits 4..2: exponent field 0..3, mantissa bit 2; code 0.5 lands on the subnormal 2^-7): the first
// register in place under FP8_MASK; the second's sign and two low magnitude bits (word bits 5, 1, 0 of each byte)
// shifted left by 2, its high magnitude bit (bit 6) right by 2.
constexpr uint32_t FP8_MASK = 0x9C9C9C9Cu;
__device__ __forceinline__ uint32_t fp8_first(uint32_t w) { return w & FP8_MASK; }
__device__ __forceinline__ uint32_t fp8_second(uint32_t w) {
  return ((w << 2) & 0x8C8C8C8Cu) | ((w >> 2) & 0x10101010u);
}

// Scale byte `k` of `scales` -> the fp32 2^(s - 127) (s >= 1).
__device__ __forceinline__ float e8m0(uint32_t scales, uint32_t k) {
  return __uint_as_float(__byte_perm(scales, 0u, 0x4440u + k) << 23);
}

// One 64-column chunk of a lane's band in the fp8 layout: words (k32 step 0: a0 a1, a2 a3; step 1: the same), its lane
// group's scale bytes (as the MMA layout's), the row's e4m3 fragments of the chunk (x_chunk: [2 steps][hi, lo][4 t]
// [b0, b1]: lanes of column g = 0 read hi, g = 1 lo, the others hold zeros) -> the running sums, one per step.
__device__ __forceinline__ void decode_chunk_fp8(float (&acc)[2][4], uint4 wv, uint32_t group_scales,
                                                 const uint32_t* x_chunk, int g, int t) {
  const uint32_t ws[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
  for (int step = 0; step < 2; ++step) {
    const uint32_t w0 = ws[2 * step], w1 = ws[2 * step + 1];
    uint2 b = make_uint2(0u, 0u);
    if (g < 2) b = *reinterpret_cast<const uint2*>(x_chunk + step * 16 + g * 8 + t * 2);
    float d[4];
    mma_e4m3(d, fp8_first(w0), fp8_second(w0), fp8_first(w1), fp8_second(w1), b.x, b.y);
    const float f_g = e8m0(group_scales, step), f_h = e8m0(group_scales, 2 + step);
    acc[step][0] = fmaf(f_g, d[0], acc[step][0]);
    acc[step][1] = fmaf(f_g, d[1], acc[step][1]);
    acc[step][2] = fmaf(f_h, d[2], acc[step][2]);
    acc[step][3] = fmaf(f_h, d[3], acc[step][3]);
  }
}

// gemv_decode on the fp8 layout: the row split into e4m3 hi and lo parts in the prologue (a power-of-two scale per
// row that takes its largest element to at most 448), fragments [chunks][2 steps][hi, lo][4 t][b0, b1] in shared
// memory; the band's sums times 2^6 / scale.
template <int KS, int U>
__global__ void __launch_bounds__(KS * 32) gemv_fp8(const uint8_t* __restrict__ codes,
                                                    const uint8_t* __restrict__ scales,
                                                    const __nv_bfloat16* __restrict__ x,
                                                    const int* __restrict__ ids, float* __restrict__ out, int rows,
                                                    int K) {
  extern __shared__ uint32_t smem[];  // row fragments [chunks * 32], [KS][16] sums, [KS] maxima
  const int band = blockIdx.x, p = blockIdx.y, e = ids[p];
  const int chunks = K / 64;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  uint32_t* x_frag = smem;
  float* sums = reinterpret_cast<float*>(smem + chunks * 32);
  float* maxima = sums + KS * 16;
  const __nv_bfloat16* xr = x + (size_t)p * K;
  float amax = 0.f;
  for (int i = threadIdx.x; i < K; i += KS * 32) amax = fmaxf(amax, fabsf(__bfloat162float(xr[i])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) maxima[warp] = amax;
  __syncthreads();
  amax = 0.f;
#pragma unroll
  for (int j = 0; j < KS; ++j) amax = fmaxf(amax, maxima[j]);
  const float row_scale = amax > 0.f ? ldexpf(1.f, ilogbf(448.f / amax)) : 1.f;
  for (int i = threadIdx.x; i < chunks * 32; i += KS * 32) {
    const int c = i >> 5, step = (i >> 4) & 1, lo = (i >> 3) & 1, lt = (i >> 1) & 3, r = i & 1;
    const int col = 64 * c + 32 * step + 16 * r + 4 * lt;
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float v = __bfloat162float(xr[col + j]) * row_scale;
      const __nv_fp8_e4m3 hi(v);
      const __nv_fp8_e4m3 part = lo ? __nv_fp8_e4m3(v - float(hi)) : hi;
      word |= (uint32_t)part.__x << (8 * j);
    }
    x_frag[i] = word;
  }
  __syncthreads();
  const uint8_t* band_codes = codes + ((size_t)e * rows + (size_t)band * 16) * (K / 2) + 16 * lane;
  const uint8_t* band_scales = scales + ((size_t)e * rows + (size_t)band * 16) * (K / 32) + 4 * g;
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  band_chunks<KS, U>(band_codes, band_scales, chunks, warp, [&](int c, uint4 words, uint32_t group_scales) {
    decode_chunk_fp8(acc, words, group_scales, x_frag + c * 32, g, t);
  });
  store_band<KS, true>(acc, sums, out + (size_t)p * rows + band * 16, warp, g, t, 64.f / row_scale);
}

// wgmma of one warpgroup: D [64 x 8] fp32 = A (e4m3 fragments in registers, the mma.m16n8k32 layout per warp) times B
// (8 columns of 32 e4m3 in shared memory, described by `desc`), D not accumulated (scale-d 0).
__device__ __forceinline__ void wgmma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(0));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_done(float (&d)[4]) {  // the registers hold the results from here on
  asm volatile("" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])::"memory");
}

// Shared-memory matrix descriptor of a B tile without swizzle: start address, the byte offsets between core
// matrices (8 rows of 16 bytes) along K (`k_stride`) and along N (`n_stride`).
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t k_stride, uint32_t n_stride) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  return (uint64_t)((a >> 4) & 0x3FFF) | ((uint64_t)((k_stride >> 4) & 0x3FFF) << 16) |
         ((uint64_t)((n_stride >> 4) & 0x3FFF) << 32);
}

// The wgmma form's k loop over chunks [c_begin, c_end) of a lane's band (codes and scales from `band_codes` /
// `band_scales`), their B tiles at `smem_b` from chunk c_begin on, in groups of U: the group's loads issued together, all
// 2U k32 steps' A fragments placed, 2U wgmmas into their own sums, one wait, the group scales applied into acc. Past
// the last chunk: zero codes times the last step's B (no branch: a divergent path serializes the wgmmas).
template <int U>
__device__ __forceinline__ void wgmma_chunks(float (&acc)[4], const uint8_t* band_codes, const uint8_t* band_scales,
                                             const uint8_t* smem_b, int c_begin, int c_end, uint32_t k_stride,
                                             uint32_t n_stride) {
  const int mine = c_end - c_begin;
  for (int c0 = 0; c0 < mine; c0 += U) {
    uint4 words[U];
    uint32_t group_scales[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c_begin + c0 + u;
      words[u] = c < c_end ? load_stream16(band_codes + 512 * c) : make_uint4(0, 0, 0, 0);
      group_scales[u] = c < c_end ? load_stream4(band_scales + 32 * c) : 0u;
    }
    uint32_t a[U][2][4];
    float d[U][2][4];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t ws[4] = {words[u].x, words[u].y, words[u].z, words[u].w};
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        a[u][step][0] = fp8_first(ws[2 * step]);
        a[u][step][1] = fp8_second(ws[2 * step]);
        a[u][step][2] = fp8_first(ws[2 * step + 1]);
        a[u][step][3] = fp8_second(ws[2 * step + 1]);
        d[u][step][0] = d[u][step][1] = d[u][step][2] = d[u][step][3] = 0.f;
      }
    }
    wgmma_fence();
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int cl = min(c0 + u, mine - 1);
#pragma unroll
      for (int step = 0; step < 2; ++step)
        wgmma_e4m3(d[u][step], a[u][step][0], a[u][step][1], a[u][step][2], a[u][step][3],
                   smem_desc(smem_b + (2 * cl + step) * 256, k_stride, n_stride));
    }
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        wgmma_done(d[u][step]);
        const float f_g = e8m0(group_scales[u], step), f_h = e8m0(group_scales[u], 2 + step);
        acc[0] = fmaf(f_g, d[u][step][0], acc[0]);
        acc[1] = fmaf(f_g, d[u][step][1], acc[1]);
        acc[2] = fmaf(f_h, d[u][step][2], acc[2]);
        acc[3] = fmaf(f_h, d[u][step][3], acc[3]);
      }
    }
  }
}

// The fp8 form on wgmma: a block (one warpgroup) takes 64 rows, warp w the band 4 * block + w (fp8 layout), the
// chunks in groups of U: their loads issued together, all 2U k32 steps' A fragments placed, then 2U wgmmas into their
// own sums, one wait, the group scales applied. The row split into e4m3 hi and lo as in gemv_fp8, staged as B tiles of
// 8 columns (hi, lo, zeros) per k32 step. `k_stride` / `n_stride`: the descriptor's two core-matrix offsets.
template <int U>
__global__ void __launch_bounds__(128) gemv_wgmma(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                                  const __nv_bfloat16* __restrict__ x, const int* __restrict__ ids,
                                                  float* __restrict__ out, int rows, int K, uint32_t k_stride,
                                                  uint32_t n_stride) {
  extern __shared__ __align__(128) uint8_t smem_b[];  // B tiles [K / 32][256 B], [64] sums, [4] maxima
  const int blk = blockIdx.x, p = blockIdx.y, e = ids[p];
  const int chunks = K / 64, steps = K / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  float* sums = reinterpret_cast<float*>(smem_b + steps * 256);
  float* maxima = sums + 64;
  const __nv_bfloat16* xr = x + (size_t)p * K;
  float amax = 0.f;
  for (int i = threadIdx.x; i < K; i += 128) amax = fmaxf(amax, fabsf(__bfloat162float(xr[i])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) maxima[warp] = amax;
  uint32_t* b_words = reinterpret_cast<uint32_t*>(smem_b);
  for (int i = threadIdx.x; i < steps * 64; i += 128) b_words[i] = 0u;
  __syncthreads();
  amax = fmaxf(fmaxf(maxima[0], maxima[1]), fmaxf(maxima[2], maxima[3]));
  const float row_scale = amax > 0.f ? ldexpf(1.f, ilogbf(448.f / amax)) : 1.f;
  // B tile of step s: core matrix j (k 16j .. 16j + 15) at 128 j, its row n (column n of B) at 16 n; n 0: hi, 1: lo
  for (int k = threadIdx.x; k < K; k += 128) {
    const float v = __bfloat162float(xr[k]) * row_scale;
    const __nv_fp8_e4m3 hi(v), lo(v - float(__nv_fp8_e4m3(v)));
    uint8_t* tile = smem_b + (k >> 5) * 256 + ((k >> 4) & 1) * 128 + (k & 15);
    tile[0] = hi.__x;
    tile[16] = lo.__x;
  }
  __syncthreads();
  const int band = 4 * blk + warp;
  const uint8_t* band_codes = codes + ((size_t)e * rows + (size_t)band * 16) * (K / 2) + 16 * lane;
  const uint8_t* band_scales = scales + ((size_t)e * rows + (size_t)band * 16) * (K / 32) + 4 * g;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  wgmma_chunks<U>(acc, band_codes, band_scales, smem_b, 0, chunks, k_stride, n_stride);
  if (t == 0) {
    sums[16 * warp + g] = acc[0] + acc[1];
    sums[16 * warp + g + 8] = acc[2] + acc[3];
  }
  __syncthreads();
  if (threadIdx.x < 64) out[(size_t)p * rows + 64 * blk + threadIdx.x] = sums[threadIdx.x] * (64.f / row_scale);
}

// gemv_wgmma with the reduction split S ways: block (blk, p, s) takes chunks [s cps, min(chunks, (s + 1) cps)) (cps =
// ceil(chunks / S)) with a row scale of its own columns, stores its 64 partial sums in `part` [S][P][rows], and the
// block that counts last for (p, blk) in `cnt` (which it resets to 0 for the next launch) sums the S partials in
// split order into out: a fixed order whichever block arrives last.
template <int U, int S>
__global__ void __launch_bounds__(128) gemv_wgmma_split(const uint8_t* __restrict__ codes,
                                                        const uint8_t* __restrict__ scales,
                                                        const __nv_bfloat16* __restrict__ x, const int* __restrict__ ids,
                                                        float* __restrict__ out, float* __restrict__ part,
                                                        int* __restrict__ cnt, int rows, int K, uint32_t k_stride,
                                                        uint32_t n_stride) {
  extern __shared__ __align__(128) uint8_t smem_b[];  // B tiles [2 cps][256 B], [64] sums, [4] maxima, [1] flag
  const int blk = blockIdx.x, p = blockIdx.y, s = blockIdx.z, e = ids[p], P = gridDim.y;
  const int chunks = K / 64, cps = (chunks + S - 1) / S;
  const int c_begin = min(chunks, s * cps), c_end = min(chunks, c_begin + cps), mine = c_end - c_begin;
  const int k_begin = 64 * c_begin, k_end = 64 * c_end;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  float* sums = reinterpret_cast<float*>(smem_b + cps * 512);
  float* maxima = sums + 64;
  int* last = reinterpret_cast<int*>(maxima + 4);
  const __nv_bfloat16* xr = x + (size_t)p * K;
  float amax = 0.f;
  for (int i = k_begin + threadIdx.x; i < k_end; i += 128) amax = fmaxf(amax, fabsf(__bfloat162float(xr[i])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) maxima[warp] = amax;
  uint32_t* b_words = reinterpret_cast<uint32_t*>(smem_b);
  for (int i = threadIdx.x; i < cps * 128; i += 128) b_words[i] = 0u;
  __syncthreads();
  amax = fmaxf(fmaxf(maxima[0], maxima[1]), fmaxf(maxima[2], maxima[3]));
  const float row_scale = amax > 0.f ? ldexpf(1.f, ilogbf(448.f / amax)) : 1.f;
  for (int k = k_begin + threadIdx.x; k < k_end; k += 128) {
    const float v = __bfloat162float(xr[k]) * row_scale;
    const __nv_fp8_e4m3 hi(v), lo(v - float(__nv_fp8_e4m3(v)));
    const int kl = k - k_begin;
    uint8_t* tile = smem_b + (kl >> 5) * 256 + ((kl >> 4) & 1) * 128 + (kl & 15);
    tile[0] = hi.__x;
    tile[16] = lo.__x;
  }
  __syncthreads();
  const int band = 4 * blk + warp;
  const uint8_t* band_codes = codes + ((size_t)e * rows + (size_t)band * 16) * (K / 2) + 16 * lane;
  const uint8_t* band_scales = scales + ((size_t)e * rows + (size_t)band * 16) * (K / 32) + 4 * g;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  wgmma_chunks<U>(acc, band_codes, band_scales, smem_b, c_begin, c_end, k_stride, n_stride);
  if (t == 0) {
    sums[16 * warp + g] = acc[0] + acc[1];
    sums[16 * warp + g + 8] = acc[2] + acc[3];
  }
  __syncthreads();
  const size_t row = (size_t)64 * blk + threadIdx.x;
  if (threadIdx.x < 64) part[((size_t)s * P + p) * rows + row] = sums[threadIdx.x] * (64.f / row_scale);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int arrived = atomicAdd(cnt + p * gridDim.x + blk, 1);
    *last = arrived == S - 1;
    if (arrived == S - 1) cnt[p * gridDim.x + blk] = 0;
  }
  __syncthreads();
  if (*last && threadIdx.x < 64) {
    __threadfence();
    float v = 0.f;
#pragma unroll
    for (int ss = 0; ss < S; ++ss) v += __ldcg(part + ((size_t)ss * P + p) * rows + row);
    out[(size_t)p * rows + row] = v;
  }
}

__device__ __forceinline__ void copy_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void copy_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void copy_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// gemv_decode with each warp's loads as cp.async into a private ring of S stages of U chunks in shared memory:
// the loads of the next S - 1 groups fly while the warp decodes one, without holding registers. Each lane copies
// and reads back only its own 16 B of codes and its lane group's 4 B of scales: no barrier between the warp's lanes.
template <int KS, int U, int S>
__global__ void __launch_bounds__(KS * 32) gemv_decode_ring(const uint8_t* __restrict__ codes,
                                                            const uint8_t* __restrict__ scales,
                                                            const __nv_bfloat16* __restrict__ x,
                                                            const int* __restrict__ ids, float* __restrict__ out,
                                                            int rows, int K) {
  extern __shared__ __align__(16) uint32_t smem[];  // x fragments, sums, then per warp [S][U][32] codes and scales
  const int band = blockIdx.x, p = blockIdx.y, e = ids[p];
  const int chunks = K / 64;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  uint32_t* x_frag = smem;
  float* sums = reinterpret_cast<float*>(smem + chunks * 32);
  uint4* ring_codes = reinterpret_cast<uint4*>(smem + chunks * 32 + KS * 16) + (size_t)warp * S * U * 32;
  uint32_t* ring_scales = smem + chunks * 32 + KS * 16 + KS * S * U * 32 * 4 + (size_t)warp * S * U * 32;
  const uint8_t* band_codes = codes + ((size_t)e * rows + (size_t)band * 16) * (K / 2) + 16 * lane;
  const uint8_t* band_scales = scales + ((size_t)e * rows + (size_t)band * 16) * (K / 32) + 4 * g;
  const int mine = chunks > warp ? (chunks - warp + KS - 1) / KS : 0;  // chunks warp, warp + KS, ...
  const int groups = (mine + U - 1) / U;
  auto issue = [&](int j) {
    if (j < groups) {
      const int slot = j % S;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int k = j * U + u;
        if (k < mine) {
          const int c = warp + k * KS;
          copy_async16(ring_codes + (slot * U + u) * 32 + lane, band_codes + 512 * c);
          copy_async4(ring_scales + (slot * U + u) * 32 + lane, band_scales + 32 * c);
        }
      }
    }
    copy_async_commit();
  };
#pragma unroll
  for (int j = 0; j < S - 1; ++j) issue(j);
  const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(x + (size_t)p * K);
  for (int i = threadIdx.x; i < chunks * 32; i += KS * 32) {
    const int c = i >> 5, lt = (i >> 3) & 3, step = (i >> 1) & 3, hi = i & 1;
    x_frag[i] = x_pairs[(64 * c + 16 * step + 8 * hi + 2 * lt) >> 1];
  }
  __syncthreads();
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  for (int j = 0; j < groups; ++j) {
    issue(j + S - 1);
    copy_async_wait<S - 1>();
    const int slot = j % S;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = j * U + u;
      if (k >= mine) break;
      const int c = warp + k * KS;
      decode_chunk(acc, ring_codes[(slot * U + u) * 32 + lane], ring_scales[(slot * U + u) * 32 + lane],
                   x_frag + c * 32, t);
    }
  }
  copy_async_wait<0>();
  store_band<KS>(acc, sums, out + (size_t)p * rows + band * 16, warp, g, t);
}

// Reads each pair's expert's codes, 16 KB per block (4 loads of 16 B per thread).
__global__ void __launch_bounds__(256) stream_codes(const uint8_t* __restrict__ codes, const int* __restrict__ ids,
                                                    float* __restrict__ out, size_t per_expert) {
  const uint8_t* base = codes + (size_t)ids[blockIdx.y] * per_expert;
  uint32_t folded = 0;
  uint4 v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const size_t off = (size_t)blockIdx.x * 16384 + (size_t)(i * 256 + threadIdx.x) * 16;
    v[i] = off < per_expert ? load_stream16(base + off) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) folded ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
  if (folded == 0x9e3779b9u) out[0] = 1.f;
}

namespace {

float bf16_to_float(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// The bit of a word that holds code bit `bit` (3 sign, 2..0 magnitude) of fragment register (a, h), bf16 lane i:
// moe_extension/quant/mxfp4_mma.py's _source_bit.
int source_bit(int a, int h, int i, int bit) {
  static const int target_bits[4] = {6, 7, 8, 15};
  const int target = target_bits[bit] + 16 * i;
  int rot;
  if (a == 0 && h == 0) rot = 0;
  else if (a == 0 && h == 1) rot = 4;
  else if (a == 1 && h == 0) rot = 10;
  else rot = bit == 0 ? 6 : 14;
  return ((target - rot) % 32 + 32) % 32;
}

// The bit of a word of the fp8 layout that holds code bit `bit` (3 sign, 2..0 magnitude) of byte i of its first
// (second = false) or second register (gemv_fp8's fp8_first / fp8_second).
int fp8_source_bit(bool second, int i, int bit) {
  static const int first_bits[4] = {2, 3, 4, 7}, second_bits[4] = {0, 1, 6, 5};
  return 8 * i + (second ? second_bits[bit] : first_bits[bit]);
}

const double kE2m1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};

struct Problem {
  int E, K, max_rows, max_pairs, sets;
  uint8_t *codes, *scales;
  __nv_bfloat16* x;
  int* ids;
  float* out;
  float* part;  // split partial sums [8][max_pairs][max_rows]
  int* cnt;     // split counters [max_pairs][max_rows / 64], zero between launches
  std::vector<uint8_t> h_codes, h_scales;
  std::vector<uint16_t> h_x;
  std::vector<int> h_ids;
};

template <int KS, int U, int MODE>
void launch(const Problem& pr, int rows, int P, const int* ids, cudaStream_t stream) {
  const size_t smem = (size_t)(pr.K / 64) * 32 * 4 + KS * 16 * 4;
  gemv_decode<KS, U, MODE><<<dim3(rows / 16, P), KS * 32, smem, stream>>>(pr.codes, pr.scales, pr.x, ids, pr.out,
                                                                         rows, pr.K);
}

template <int KS, int U>
void launch_fp8(const Problem& pr, int rows, int P, const int* ids, cudaStream_t stream) {
  const size_t smem = (size_t)(pr.K / 64) * 32 * 4 + KS * 17 * 4;
  gemv_fp8<KS, U><<<dim3(rows / 16, P), KS * 32, smem, stream>>>(pr.codes, pr.scales, pr.x, ids, pr.out, rows,
                                                                pr.K);
}

template <int U>
void launch_wgmma(const Problem& pr, int rows, int P, const int* ids, cudaStream_t stream, uint32_t k_stride,
                  uint32_t n_stride) {
  const size_t smem = (size_t)(pr.K / 32) * 256 + 68 * 4;
  gemv_wgmma<U><<<dim3(rows / 64, P), 128, smem, stream>>>(pr.codes, pr.scales, pr.x, ids, pr.out, rows, pr.K,
                                                           k_stride, n_stride);
}

template <int U, int S>
void launch_wgmma_split(const Problem& pr, int rows, int P, const int* ids, cudaStream_t stream, uint32_t k_stride,
                        uint32_t n_stride) {
  const int cps = (pr.K / 64 + S - 1) / S;
  const size_t smem = (size_t)cps * 512 + 69 * 4;
  gemv_wgmma_split<U, S><<<dim3(rows / 64, P, S), 128, smem, stream>>>(pr.codes, pr.scales, pr.x, ids, pr.out, pr.part,
                                                                      pr.cnt, rows, pr.K, k_stride, n_stride);
}

template <int KS, int U, int S>
void launch_ring(const Problem& pr, int rows, int P, const int* ids, cudaStream_t stream) {
  const size_t smem = (size_t)(pr.K / 64) * 32 * 4 + KS * 16 * 4 + (size_t)KS * S * U * 32 * 20;
  static bool configured = false;
  if (!configured) {
    CHECK_CUDA(cudaFuncSetAttribute(gemv_decode_ring<KS, U, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)smem));
    configured = true;
  }
  gemv_decode_ring<KS, U, S><<<dim3(rows / 16, P), KS * 32, smem, stream>>>(pr.codes, pr.scales, pr.x, ids, pr.out,
                                                                           rows, pr.K);
}

// max |out - ref| / sum |terms| over P pairs of `rows` rows against the host decode of the MMA layout (fp8: of the
// fp8 layout); on a mismatch exits, or with `fatal` false says so and returns false.
template <typename Launch>
bool check(const char* name, const Problem& pr, int rows, int P, bool fp8, Launch launch_one, bool fatal = true) {
  CHECK_CUDA(cudaMemset(pr.out, 0xff, (size_t)P * rows * 4));
  launch_one(pr.ids, (cudaStream_t)0);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> got((size_t)P * rows);
  CHECK_CUDA(cudaMemcpy(got.data(), pr.out, got.size() * 4, cudaMemcpyDeviceToHost));
  const int K = pr.K;
  double worst = 0;
  for (int p = 0; p < P; ++p) {
    const uint8_t* qe = pr.h_codes.data() + (size_t)pr.h_ids[p] * rows * (K / 2);
    const uint8_t* se = pr.h_scales.data() + (size_t)pr.h_ids[p] * rows * (K / 32);
    std::vector<double> ref(rows, 0.0), mag(rows, 0.0);
    // code of word bits `bits` -> its term; row, col in the band's chunk; scale byte of lane group g
    auto add = [&](int band, int c, int g, uint32_t w, const int* bits, int row, int col, int scale_byte) {
      int code = 0;
      for (int bit = 0; bit < 4; ++bit) code |= ((w >> bits[bit]) & 1) << bit;
      const int s = se[(size_t)band * 16 * (K / 32) + 32 * c + 4 * g + scale_byte];
      const double term = kE2m1[code & 7] * (code & 8 ? -1 : 1) * std::ldexp(1.0, s - 127) *
                          bf16_to_float(pr.h_x[(size_t)p * K + 64 * c + col]);
      ref[16 * band + row] += term;
      mag[16 * band + row] += std::fabs(term);
    };
    for (int band = 0; band < rows / 16; ++band)
      for (int c = 0; c < K / 64; ++c)
        for (int lane = 0; lane < 32; ++lane)
          for (int wi = 0; wi < 4; ++wi) {
            const int g = lane / 4, t = lane % 4;
            uint32_t w;
            std::memcpy(&w, qe + (size_t)band * 16 * (K / 2) + 512 * c + 16 * lane + 4 * wi, 4);
            int bits[4];
            if (fp8) {  // word wi = (k32 step wi / 2, half wi % 2); register h: row g + 8 h; byte i: column
              for (int h = 0; h < 2; ++h)
                for (int i = 0; i < 4; ++i) {
                  for (int bit = 0; bit < 4; ++bit) bits[bit] = fp8_source_bit(h == 1, i, bit);
                  add(band, c, g, w, bits, 8 * h + g, 32 * (wi / 2) + 16 * (wi % 2) + 4 * t + i, 2 * h + wi / 2);
                }
            } else {  // word wi = k16 step; register (a, h); lane i
              for (int a = 0; a < 2; ++a)
                for (int h = 0; h < 2; ++h)
                  for (int i = 0; i < 2; ++i) {
                    for (int bit = 0; bit < 4; ++bit) bits[bit] = source_bit(a, h, i, bit);
                    add(band, c, g, w, bits, 8 * h + g, 16 * wi + 8 * a + 2 * t + i, 2 * h + wi / 2);
                  }
            }
          }
    for (int r = 0; r < rows; ++r) {
      const double err = std::fabs(got[(size_t)p * rows + r] - ref[r]) / (mag[r] + 1e-30);
      if (!(err < 1e-2)) {
        std::printf("%s: pair %d row %d: %g, expected %g\n", name, p, r, got[(size_t)p * rows + r], ref[r]);
        if (fatal) std::exit(1);
        return false;
      }
      worst = std::max(worst, err);
    }
  }
  std::printf("%s rows %d, %d pairs: max |out - ref| / sum |terms| = %.2e\n", name, rows, P, worst);
  return true;
}

template <typename Launch>
void time_graph(const char* name, const Problem& pr, int rows, int P, double bytes, Launch launch_one) {
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int r = 0; r < pr.sets; ++r) launch_one(pr.ids + r * P, stream);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphLaunch(exec, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> per_launch;
  for (int it = 0; it < 7; ++it) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    per_launch.push_back(ms * 1000.f / pr.sets);
  }
  std::sort(per_launch.begin(), per_launch.end());
  const float us = per_launch[3];
  std::printf("  rows %4d  P %d  %-14s %7.2f us  %5.0f GB/s\n", rows, P, name, us, bytes / us / 1e3);
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamDestroy(stream));
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
}

double copy_gbps() {
  const size_t n = (size_t)256 << 20;
  void *a, *b;
  CHECK_CUDA(cudaMalloc(&a, n));
  CHECK_CUDA(cudaMalloc(&b, n));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) CHECK_CUDA(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
  CHECK_CUDA(cudaEventRecord(start));
  for (int i = 0; i < 10; ++i) CHECK_CUDA(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
  CHECK_CUDA(cudaEventRecord(stop));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  return 2.0 * n * 10 / (ms * 1e-3) / 1e9;
}

}  // namespace

int main() {
  Problem pr;
  pr.E = 128;
  pr.K = 2880;
  pr.max_rows = 5760;
  pr.max_pairs = 8;
  pr.sets = 64;
  std::mt19937 rng(20261129);
  pr.h_codes.resize((size_t)pr.E * pr.max_rows * pr.K / 2);
  pr.h_scales.resize((size_t)pr.E * pr.max_rows * pr.K / 32);
  for (auto& v : pr.h_codes) v = rng() & 0xff;      // any byte is two valid codes
  for (auto& v : pr.h_scales) v = 118 + rng() % 16;  // 2^-9 .. 2^6
  pr.h_x.resize((size_t)pr.max_pairs * pr.K);
  std::normal_distribution<float> normal;
  for (auto& v : pr.h_x) v = float_to_bf16(normal(rng));
  pr.h_ids.resize((size_t)pr.sets * pr.max_pairs);
  for (size_t i = 0; i < pr.h_ids.size(); ++i) pr.h_ids[i] = (int)((i * 37 + 11) % pr.E);
  CHECK_CUDA(cudaMalloc(&pr.codes, pr.h_codes.size()));
  CHECK_CUDA(cudaMalloc(&pr.scales, pr.h_scales.size()));
  CHECK_CUDA(cudaMalloc(&pr.x, pr.h_x.size() * 2));
  CHECK_CUDA(cudaMalloc(&pr.ids, pr.h_ids.size() * 4));
  CHECK_CUDA(cudaMalloc(&pr.out, (size_t)pr.max_pairs * pr.max_rows * 4));
  CHECK_CUDA(cudaMalloc(&pr.part, (size_t)8 * pr.max_pairs * pr.max_rows * 4));
  CHECK_CUDA(cudaMalloc(&pr.cnt, (size_t)pr.max_pairs * (pr.max_rows / 64) * 4));
  CHECK_CUDA(cudaMemset(pr.cnt, 0, (size_t)pr.max_pairs * (pr.max_rows / 64) * 4));
  CHECK_CUDA(cudaMemcpy(pr.codes, pr.h_codes.data(), pr.h_codes.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(pr.scales, pr.h_scales.data(), pr.h_scales.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(pr.x, pr.h_x.data(), pr.h_x.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(pr.ids, pr.h_ids.data(), pr.h_ids.size() * 4, cudaMemcpyHostToDevice));

  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; device copy %.0f GB/s (read + write)\n", prop.name, prop.multiProcessorCount, copy_gbps());
  check("decode 4/4", pr, 5760, 3, false,
        [&](const int* ids, cudaStream_t st) { launch<4, 4, MODE_DECODE>(pr, 5760, 3, ids, st); });
  check("decode 8/2", pr, 2880, 3, false,
        [&](const int* ids, cudaStream_t st) { launch<8, 2, MODE_DECODE>(pr, 2880, 3, ids, st); });
  check("ring 4/2/4", pr, 5760, 3, false,
        [&](const int* ids, cudaStream_t st) { launch_ring<4, 2, 4>(pr, 5760, 3, ids, st); });
  check("ring 4/1/6", pr, 2880, 3, false,
        [&](const int* ids, cudaStream_t st) { launch_ring<4, 1, 6>(pr, 2880, 3, ids, st); });
  check("fp8 4/4", pr, 5760, 3, true,
        [&](const int* ids, cudaStream_t st) { launch_fp8<4, 4>(pr, 5760, 3, ids, st); });
  check("fp8 8/2", pr, 2880, 3, true,
        [&](const int* ids, cudaStream_t st) { launch_fp8<8, 2>(pr, 2880, 3, ids, st); });
  // The descriptor's core-matrix offsets: 128 bytes along K, 256 along N, else the other way round.
  uint32_t k_stride = 128, n_stride = 256;
  bool wgmma_ok = check("wgmma 4", pr, 5760, 3, true, [&](const int* ids, cudaStream_t st) {
    launch_wgmma<4>(pr, 5760, 3, ids, st, k_stride, n_stride);
  }, false);
  if (!wgmma_ok) {
    std::swap(k_stride, n_stride);
    wgmma_ok = check("wgmma 4, offsets swapped", pr, 5760, 3, true, [&](const int* ids, cudaStream_t st) {
      launch_wgmma<4>(pr, 5760, 3, ids, st, k_stride, n_stride);
    }, false);
  }
  if (wgmma_ok)
    check("wgmma 8", pr, 2880, 3, true,
          [&](const int* ids, cudaStream_t st) { launch_wgmma<8>(pr, 2880, 3, ids, st, k_stride, n_stride); });
  if (wgmma_ok) {
    check("wgmma 4 split 4", pr, 5760, 3, true, [&](const int* ids, cudaStream_t st) {
      launch_wgmma_split<4, 4>(pr, 5760, 3, ids, st, k_stride, n_stride);
    });
    check("wgmma 3 split 8", pr, 2880, 3, true, [&](const int* ids, cudaStream_t st) {
      launch_wgmma_split<3, 8>(pr, 2880, 3, ids, st, k_stride, n_stride);
    });
  }
  for (int rows : {5760, 2880}) {
    for (int P : {1, 4, 8}) {
      const double bytes = (double)P * rows * pr.K * 17 / 32;
      const size_t per_expert = (size_t)rows * pr.K / 2;
      time_graph("decode 4/4", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch<4, 4, MODE_DECODE>(pr, rows, P, ids, s); });
      time_graph("decode 8/2", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch<8, 2, MODE_DECODE>(pr, rows, P, ids, s); });
      time_graph("fp8 4/4", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch_fp8<4, 4>(pr, rows, P, ids, s); });
      time_graph("fp8 8/2", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch_fp8<8, 2>(pr, rows, P, ids, s); });
      time_graph("fp8 4/2", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch_fp8<4, 2>(pr, rows, P, ids, s); });
      time_graph("fp8 8/4", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch_fp8<8, 4>(pr, rows, P, ids, s); });
      if (wgmma_ok) {
        time_graph("wgmma 2", pr, rows, P, bytes, [&](const int* ids, cudaStream_t s) {
          launch_wgmma<2>(pr, rows, P, ids, s, k_stride, n_stride);
        });
        time_graph("wgmma 4", pr, rows, P, bytes, [&](const int* ids, cudaStream_t s) {
          launch_wgmma<4>(pr, rows, P, ids, s, k_stride, n_stride);
        });
        time_graph("wgmma 8", pr, rows, P, bytes, [&](const int* ids, cudaStream_t s) {
          launch_wgmma<8>(pr, rows, P, ids, s, k_stride, n_stride);
        });
        time_graph("wgmma 4 split 2", pr, rows, P, bytes, [&](const int* ids, cudaStream_t s) {
          launch_wgmma_split<4, 2>(pr, rows, P, ids, s, k_stride, n_stride);
        });
        time_graph("wgmma 8 split 2", pr, rows, P, bytes, [&](const int* ids, cudaStream_t s) {
          launch_wgmma_split<8, 2>(pr, rows, P, ids, s, k_stride, n_stride);
        });
        time_graph("wgmma 4 split 4", pr, rows, P, bytes, [&](const int* ids, cudaStream_t s) {
          launch_wgmma_split<4, 4>(pr, rows, P, ids, s, k_stride, n_stride);
        });
        time_graph("wgmma 6 split 4", pr, rows, P, bytes, [&](const int* ids, cudaStream_t s) {
          launch_wgmma_split<6, 4>(pr, rows, P, ids, s, k_stride, n_stride);
        });
        time_graph("wgmma 3 split 8", pr, rows, P, bytes, [&](const int* ids, cudaStream_t s) {
          launch_wgmma_split<3, 8>(pr, rows, P, ids, s, k_stride, n_stride);
        });
        time_graph("wgmma 6 split 8", pr, rows, P, bytes, [&](const int* ids, cudaStream_t s) {
          launch_wgmma_split<6, 8>(pr, rows, P, ids, s, k_stride, n_stride);
        });
      }
      time_graph("ring 4/2/4", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch_ring<4, 2, 4>(pr, rows, P, ids, s); });
      time_graph("ring 4/1/6", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch_ring<4, 1, 6>(pr, rows, P, ids, s); });
      time_graph("ring 2/2/6", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch_ring<2, 2, 6>(pr, rows, P, ids, s); });
      time_graph("ring 1/2/6", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch_ring<1, 2, 6>(pr, rows, P, ids, s); });
      time_graph("ring 1/4/4", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch_ring<1, 4, 4>(pr, rows, P, ids, s); });
      time_graph("ring 2/4/4", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch_ring<2, 4, 4>(pr, rows, P, ids, s); });
      time_graph("ring 8/1/4", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch_ring<8, 1, 4>(pr, rows, P, ids, s); });
      time_graph("loads 4/4", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch<4, 4, MODE_LOADS>(pr, rows, P, ids, s); });
      time_graph("loads, no x", pr, rows, P, bytes,
                 [&](const int* ids, cudaStream_t s) { launch<4, 4, MODE_LOADS_NO_X>(pr, rows, P, ids, s); });
      time_graph("stream", pr, rows, P, (double)P * per_expert, [&](const int* ids, cudaStream_t s) {
        stream_codes<<<dim3((unsigned)((per_expert + 16383) / 16384), P), 256, 0, s>>>(pr.codes, ids, pr.out,
                                                                                      per_expert);
      });
    }
  }
  return 0;
}
