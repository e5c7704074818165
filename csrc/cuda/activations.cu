// CUDA kernels of the gated activations: out [..., d] from input [..., 2d] (fp32/fp16/bf16, same dtype,
// last dim contiguous, any leading strides). silu/gelu/gelu_tanh/swiglustep read gate = input[..., :d],
// up = input[..., d:]; swigluoai reads interleaved gate = input[..., 0::2], up = input[..., 1::2].
// Math in fp32, one rounding to the output dtype (formulas: ops.h). Launched on the current stream, no
// host sync (CUDA-graph safe).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "checks.h"
#include "cuda/pack.cuh"
#include "ops.h"

namespace moe_ext::cuda {
namespace {

constexpr int kWarp = 32;
// NOTE: grid = row blocks x column chunks; a chunk is up to kMaxThreadsPerChunk threads, each owning one
// 16-byte unit of the output row (8 bf16/fp16, 4 fp32) and the matching gate and up units. The chunk
// width is the unit count divided evenly over the chunks, rounded to a warp: N = 2880 bf16 is 360 units
// -> one chunk of 384 threads; N = 14336 is 1792 units -> 4 chunks of 448 threads (no idle lanes).
constexpr int kMaxThreadsPerChunk = 512;
// NOTE: rows narrower than this many threads share a block (small N), so blocks stay >= 8 warps.
constexpr int kMinThreadsPerBlock = 256;
constexpr int kMaxGridY = 65535;

enum class Act { kSilu, kGelu, kGeluTanh, kSwigluoai, kSwiglustep };

struct ActParams {
  float alpha = 0.0f;
  float limit = 0.0f;
};

// min(x, limit) and clamp(x, -limit, limit) that keep NaN, like torch.clamp.
__device__ __forceinline__ float clamp_max(float x, float limit) { return x > limit ? limit : x; }
__device__ __forceinline__ float clamp_abs(float x, float limit) {
  return x > limit ? limit : (x < -limit ? -limit : x);
}
// NOTE: x * sigmoid(x) through __expf (ex2.approx: a few ulp, far below bf16/fp16 rounding and within
// 1e-6 relative for fp32). For x < -88, __expf(-x) = inf and x / inf = -0, the correct limit.
__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

template <Act A>
__device__ __forceinline__ float gated(float gate, float up, const ActParams& p) {
  if constexpr (A == Act::kSilu) {
    return silu(gate) * up;
  } else if constexpr (A == Act::kGelu) {
    // NOTE: 0.5 x (1 + erf(x / sqrt 2)) == 0.5 x erfc(-x / sqrt 2); erfc has no cancellation for x << 0,
    // where 1 + erf loses most of its digits in fp32.
    return 0.5f * gate * erfcf(-gate * 0.7071067811865476f) * up;
  } else if constexpr (A == Act::kGeluTanh) {
    // NOTE: 0.5 x (1 + tanh(z)) == x * sigmoid(2z): one __expf instead of tanhf (which --use_fast_math
    // may turn into tanh.approx, ~5e-4 relative error), and no cancellation in 1 + tanh(z) for x << 0.
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    const float z = kSqrt2OverPi * (gate + 0.044715f * gate * gate * gate);
    return gate / (1.0f + __expf(-2.0f * z)) * up;
  } else if constexpr (A == Act::kSwigluoai) {
    const float g = clamp_max(gate, p.limit);
    const float u = clamp_abs(up, p.limit);
    return g / (1.0f + __expf(-p.alpha * g)) * (u + 1.0f);
  } else {
    return clamp_max(silu(gate), p.limit) * clamp_abs(up, p.limit);
  }
}

struct ActLaunch {
  RowLayout in_rows;
  RowLayout out_rows;
  int64_t rows;
  int64_t width;  // d
  ActParams act;
  // The rows [row_begin, row_end) and output units [unit_begin, unit_end) of one launch.
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int64_t unit_begin = 0;
  int64_t unit_end = 0;
};

// Element offset of logical row `row`: one multiply when the leading dims merged into one (FLAT), the
// general walk over up to kMaxRowDims dims otherwise.
template <bool FLAT>
__device__ __forceinline__ int64_t row_offset(const RowLayout& rows, int64_t row) {
  if constexpr (FLAT) {
    return row * rows.strides[0];
  } else {
    return rows.offset(row);
  }
}

// Thread (x, y) of block (bx, by) owns output unit unit_begin + by * blockDim.x + x of the R rows
// row_begin + (bx * blockDim.y * R + y) + k * blockDim.y, k < R; the host launches again with new
// row_begin / unit_begin when a size exceeds the grid limits. A unit is VEC outputs: the gate and up units
// (halves) or the two adjacent units of interleaved pairs (swigluoai). A partial last unit (in practice
// interleaved only: halves take the vector path only when d is a multiple of VEC) is read and written
// per element.
// NOTE: no grid-stride loops and the R rows' loads issued before any math (R = 2 on the vector path).
// In a standalone H100 test of this structure swiglustep_and_mul ran at 100% of copy bandwidth (79% with
// the former grid-stride loops, which also took 64-76 registers at R = 2 instead of 38-40) and
// gelu_and_mul (erfc) at 92-95% with R = 2 against 87-90% with R = 1; R = 4 was slower (61 registers).
template <typename T, int VEC, int R, bool FLAT, Act A>
__global__ void __launch_bounds__(kMaxThreadsPerChunk)
    gated_kernel(T* __restrict__ out, const T* __restrict__ input, const ActLaunch p) {
  const int64_t u = p.unit_begin + static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (u >= p.unit_end) return;
  const int64_t row0 = p.row_begin + static_cast<int64_t>(blockIdx.x) * blockDim.y * R + threadIdx.y;
  const int64_t c = u * VEC;
  if (c + VEC <= p.width) {
    RawUnit<T, VEC> lo[R];  // gate unit (halves) or elements 2c .. 2c + VEC (interleaved)
    RawUnit<T, VEC> hi[R];  // up unit (halves) or elements 2c + VEC .. 2c + 2 VEC (interleaved)
#pragma unroll
    for (int k = 0; k < R; ++k) {
      const int64_t row = row0 + k * blockDim.y;
      if (row < p.row_end) {
        const T* x = input + row_offset<FLAT>(p.in_rows, row);
        lo[k] = load_unit<T, VEC>(A == Act::kSwigluoai ? x + 2 * c : x + c);
        hi[k] = load_unit<T, VEC>(A == Act::kSwigluoai ? x + 2 * c + VEC : x + p.width + c);
      }
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
      const int64_t row = row0 + k * blockDim.y;
      if (row < p.row_end) {
        float a[VEC];
        float b[VEC];
        float gate[VEC];
        float up[VEC];
        float r[VEC];
        unit_to_f32<T, VEC>(lo[k], a);
        unit_to_f32<T, VEC>(hi[k], b);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          if constexpr (A == Act::kSwigluoai) {
            // Pair i is (element 2i, element 2i + 1) of the 2 VEC elements a then b.
            gate[i] = 2 * i < VEC ? a[2 * i] : b[2 * i - VEC];
            up[i] = 2 * i + 1 < VEC ? a[2 * i + 1] : b[2 * i + 1 - VEC];
          } else {
            gate[i] = a[i];
            up[i] = b[i];
          }
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) r[i] = gated<A>(gate[i], up[i], p.act);
        store_unit<T, VEC>(out + row_offset<FLAT>(p.out_rows, row) + c, f32_to_unit<T, VEC>(r));
      }
    }
  } else {
    const int n = static_cast<int>(p.width - c);
    for (int k = 0; k < R; ++k) {
      const int64_t row = row0 + k * blockDim.y;
      if (row >= p.row_end) break;
      const T* x = input + row_offset<FLAT>(p.in_rows, row);
      T* y = out + row_offset<FLAT>(p.out_rows, row);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        if (i < n) {
          const int64_t e = c + i;
          const float g = static_cast<float>(A == Act::kSwigluoai ? x[2 * e] : x[e]);
          const float v = static_cast<float>(A == Act::kSwigluoai ? x[2 * e + 1] : x[p.width + e]);
          y[e] = static_cast<T>(gated<A>(g, v, p.act));
        }
      }
    }
  }
}

template <typename T, int VEC, int R, bool FLAT, Act A>
void launch(const ActivationOperands& ops, ActLaunch p) {
  const int64_t units = (p.width + VEC - 1) / VEC;
  const int64_t chunks = (units + kMaxThreadsPerChunk - 1) / kMaxThreadsPerChunk;
  const int64_t per_chunk = (units + chunks - 1) / chunks;
  const int threads_x = static_cast<int>((per_chunk + kWarp - 1) / kWarp * kWarp);
  const int rows_per_block = std::max(1, kMinThreadsPerBlock / threads_x);
  const int64_t rows_per_launch = int64_t{INT_MAX} * rows_per_block * R;
  const int64_t chunks_per_launch = std::min<int64_t>(chunks, kMaxGridY);
  const int64_t units_per_launch = chunks_per_launch * threads_x;
  for (int64_t row_begin = 0; row_begin < p.rows; row_begin += rows_per_launch) {
    p.row_begin = row_begin;
    p.row_end = std::min(p.rows, row_begin + rows_per_launch);
    const int64_t rows_per_x_block = int64_t{rows_per_block} * R;
    const int64_t row_blocks = (p.row_end - row_begin + rows_per_x_block - 1) / rows_per_x_block;
    for (int64_t unit_begin = 0; unit_begin < units; unit_begin += units_per_launch) {
      p.unit_begin = unit_begin;
      p.unit_end = std::min(units, unit_begin + units_per_launch);
      const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(chunks_per_launch));
      gated_kernel<T, VEC, R, FLAT, A><<<grid, dim3(threads_x, rows_per_block), 0,
                                         c10::cuda::getCurrentCUDAStream()>>>(
          ops.out.mutable_data_ptr<T>(), ops.input.const_data_ptr<T>(), p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
}

template <typename T, int VEC, Act A>
void launch_rows(const ActivationOperands& ops, const ActLaunch& p) {
  if (p.in_rows.ndim == 1 && p.out_rows.ndim == 1) {
    launch<T, VEC, VEC == 1 ? 1 : 2, true, A>(ops, p);
  } else {
    launch<T, VEC, 1, false, A>(ops, p);
  }
}

template <typename T, Act A>
void launch_vec(const ActivationOperands& ops, const ActLaunch& p) {
  // NOTE: 16-byte accesses when both base pointers and all row strides keep 16-byte alignment (checked
  // at run time); halves also need d to be a multiple of the vector width (the up half starts at d).
  // Interleaved rows keep their alignment for any d and end in a scalar tail unit.
  constexpr int kVec = kVec16<T>;
  const bool vectorizable = aligned16(ops.input.const_data_ptr()) && aligned16(ops.out.const_data_ptr()) &&
                            p.in_rows.strides_multiple_of(kVec) && p.out_rows.strides_multiple_of(kVec) &&
                            (A == Act::kSwigluoai || p.width % kVec == 0);
  if (vectorizable) {
    launch_rows<T, kVec, A>(ops, p);
  } else {
    launch_rows<T, 1, A>(ops, p);
  }
}

template <Act A>
void run(const char* op, at::Tensor& out, const at::Tensor& input, ActParams act) {
  checks::activation_args(op, out, input);
  if (out.numel() == 0) return;
  const c10::cuda::OptionalCUDAGuard device_guard(input.device());
  const ActivationOperands ops = activation_operands(out, input);
  const ActLaunch p{ops.in_rows, ops.out_rows, ops.rows, ops.width, act};
  MOE_EXT_DISPATCH_FLOAT(input.scalar_type(), "gated_activation", [&] { launch_vec<scalar_t, A>(ops, p); });
  ops.finish();
}

}  // namespace

void swigluoai_and_mul(at::Tensor& out, const at::Tensor& input, double alpha, double limit) {
  run<Act::kSwigluoai>("swigluoai_and_mul", out, input,
                       ActParams{static_cast<float>(alpha), static_cast<float>(limit)});
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  run<Act::kSilu>("silu_and_mul", out, input, ActParams{});
}

void gelu_and_mul(at::Tensor& out, const at::Tensor& input) {
  run<Act::kGelu>("gelu_and_mul", out, input, ActParams{});
}

void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input) {
  run<Act::kGeluTanh>("gelu_tanh_and_mul", out, input, ActParams{});
}

void swiglustep_and_mul(at::Tensor& out, const at::Tensor& input, double limit) {
  run<Act::kSwiglustep>("swiglustep_and_mul", out, input, ActParams{0.0f, static_cast<float>(limit)});
}

}  // namespace moe_ext::cuda

TORCH_LIBRARY_IMPL(moe_ext, CUDA, m) {
  m.impl("swigluoai_and_mul", &moe_ext::cuda::swigluoai_and_mul);
  m.impl("silu_and_mul", &moe_ext::cuda::silu_and_mul);
  m.impl("gelu_and_mul", &moe_ext::cuda::gelu_and_mul);
  m.impl("gelu_tanh_and_mul", &moe_ext::cuda::gelu_tanh_and_mul);
  m.impl("swiglustep_and_mul", &moe_ext::cuda::swiglustep_and_mul);
}
