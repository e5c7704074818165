// Device helpers shared by the CUDA kernels: a "unit" of VEC elements of T (fp32/fp16/bf16) held in
// registers in its raw form (16 bytes as a uint4 when VEC == 16 / sizeof(T), one T when VEC == 1) and
// converted to / from fp32.
// NOTE: raw 16-byte units are kept as uint4 and unpacked with bit operations (bf16: a shift or a mask
// per value; fp16: one cvt per pair), so a 16-byte unit costs 4 registers while its load is in flight.
// An array of eight c10::BFloat16 was kept as eight 32-bit registers: the bf16 moe_sum kernel needed 128
// registers instead of 64 (8 slots in flight, sm_90, ptxas -v), which costs occupancy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace moe_ext::cuda {

template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

template <typename T, int VEC>
using RawUnit = std::conditional_t<VEC == 1, T, uint4>;

template <typename T, int VEC>
__device__ __forceinline__ RawUnit<T, VEC> load_unit(const T* src) {
  return *reinterpret_cast<const RawUnit<T, VEC>*>(src);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_unit(T* dst, const RawUnit<T, VEC>& raw) {
  *reinterpret_cast<RawUnit<T, VEC>*>(dst) = raw;
}

// Two fp32 values from one 32-bit word holding two T (T = fp16 or bf16), low half first.
template <typename T>
__device__ __forceinline__ float2 word_to_f32x2(uint32_t w) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    __half2 h;
    static_assert(sizeof(h) == sizeof(w));
    memcpy(&h, &w, sizeof(w));
    return __half22float2(h);
  }
}

// One 32-bit word holding two T (T = fp16 or bf16) rounded to nearest even from fp32, low half first.
template <typename T>
__device__ __forceinline__ uint32_t f32x2_to_word(float lo, float hi) {
  uint32_t w;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&w, &h, sizeof(w));
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&w, &h, sizeof(w));
  }
  return w;
}

template <typename T, int VEC>
__device__ __forceinline__ void unit_to_f32(const RawUnit<T, VEC>& raw, float (&v)[VEC]) {
  if constexpr (VEC == 1) {
    v[0] = static_cast<float>(raw);
  } else if constexpr (std::is_same_v<T, float>) {
    v[0] = __uint_as_float(raw.x);
    v[1] = __uint_as_float(raw.y);
    v[2] = __uint_as_float(raw.z);
    v[3] = __uint_as_float(raw.w);
  } else {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = word_to_f32x2<T>(words[i]);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
}

template <typename T, int VEC>
__device__ __forceinline__ RawUnit<T, VEC> f32_to_unit(const float (&v)[VEC]) {
  if constexpr (VEC == 1) {
    return static_cast<T>(v[0]);
  } else if constexpr (std::is_same_v<T, float>) {
    return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                      __float_as_uint(v[3]));
  } else {
    return make_uint4(f32x2_to_word<T>(v[0], v[1]), f32x2_to_word<T>(v[2], v[3]),
                      f32x2_to_word<T>(v[4], v[5]), f32x2_to_word<T>(v[6], v[7]));
  }
}

// Whether ptr is 16-byte aligned (the vector paths also need every row stride to keep that alignment).
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace moe_ext::cuda
