// CUDA kernel of moe_ext::moe_sum: output[m, :] = sum over the valid slots j of input[m, j, :].
// input [M, topk, K] and output [M, K] in fp32/fp16/bf16 (K contiguous, other strides free), fp32
// accumulation, one rounding; topk_ids [M, topk] int32/int64 and expert_map [E_global] int32 (any
// strides) select the valid slots (checks.h: slot_is_valid). Invalid slots are never read, so NaN/Inf in
// them cannot leak. Any topk; launched on the current stream, no host sync (CUDA-graph safe).
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
// NOTE: one row is covered by up to kMaxThreadsPerRow threads, each owning one 16-byte unit along K
// (8 bf16/fp16, 4 fp32). K = 2880 bf16 is 360 units -> 384 threads, one pass; K = 7168 is 896 units ->
// 448 threads, two passes. Rounding the per-row thread count to the pass count keeps idle lanes under a
// warp per row (a fixed 256 would leave 30% of the lanes idle in the second pass at K = 2880).
constexpr int kMaxThreadsPerRow = 512;
// NOTE: rows narrower than this many threads share a block (small K): enough warps per block to keep
// the SM's block slots from limiting occupancy.
constexpr int kMinThreadsPerBlock = 256;
// NOTE: the loads of up to kSlotsInFlight slots are issued before any of them is consumed: a thread has
// 4 x 16 B in flight (topk 4 in one batch, topk 8 in two). 4 rather than 8 keeps the bf16 kernel at
// 47 registers without ids / 60 with ids on sm_90 (ptxas -v; 8 slots: 64-68 and a small spill), i.e. 3
// (2) blocks of 384 threads per SM: >= 48 KB in flight per SM, above the ~25 KB HBM3 needs.
constexpr int kSlotsInFlight = 4;
static_assert(kWarp % kSlotsInFlight == 0, "a batch of slots must not straddle a 32-slot mask");

struct MoeSumParams {
  int64_t m;
  int64_t topk;
  int64_t k;
  int64_t in_row_stride;
  int64_t in_slot_stride;
  int64_t out_row_stride;
  int64_t ids_row_stride;
  int64_t ids_slot_stride;
  int64_t map_stride;
  int64_t num_global_experts;
};

// Block (threads_x, rows_per_block): threadIdx.y picks the row, threadIdx.x the unit along K. threads_x is
// a multiple of 32, so each warp works on one row and every branch on the row or the slot mask below is
// warp-uniform (the ballot runs with all 32 lanes).
// NOTE: slot validity is evaluated by the warp itself, one slot per lane, and kept in a register
// bitmask (one __ballot_sync per 32 slots): no shared memory, no __syncthreads; the ids/map reads are a
// few L1/L2-resident bytes next to the row's topk x K input.
template <typename T, int VEC, typename IdT, bool HAS_IDS>
__global__ void __launch_bounds__(kMaxThreadsPerRow)
    moe_sum_kernel(const T* __restrict__ input, T* __restrict__ output, const IdT* __restrict__ topk_ids,
                   const int32_t* __restrict__ expert_map, const MoeSumParams p) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int64_t units = (p.k + VEC - 1) / VEC;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; row < p.m;
       row += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    for (int64_t u0 = 0; u0 < units; u0 += blockDim.x) {
      const int64_t c = (u0 + threadIdx.x) * VEC;
      // full: a whole unit; otherwise the n < VEC elements of the last unit (scalar tail) or none.
      const bool full = c + VEC <= p.k;
      const int n = full ? VEC : (c < p.k ? static_cast<int>(p.k - c) : 0);
      const T* src = input + row * p.in_row_stride + c;
      float acc[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
#pragma unroll 1
      for (int64_t j0 = 0; j0 < p.topk; j0 += kWarp) {
        const int group = static_cast<int>(min(static_cast<int64_t>(kWarp), p.topk - j0));
        uint32_t valid = group == kWarp ? 0xffffffffu : (1u << group) - 1u;
        if constexpr (HAS_IDS) {
          bool ok = false;
          if (lane < group) {
            const int64_t id =
                static_cast<int64_t>(topk_ids[row * p.ids_row_stride + (j0 + lane) * p.ids_slot_stride]);
            ok = slot_is_valid(id, expert_map, p.map_stride, p.num_global_experts);
          }
          valid = __ballot_sync(0xffffffffu, ok);
        }
        if (full) {
#pragma unroll 1
          for (int s0 = 0; s0 < group; s0 += kSlotsInFlight) {
            RawUnit<T, VEC> raw[kSlotsInFlight];
#pragma unroll
            for (int s = 0; s < kSlotsInFlight; ++s) {
              if ((valid >> (s0 + s)) & 1u) raw[s] = load_unit<T, VEC>(src + (s0 + s) * p.in_slot_stride);
            }
#pragma unroll
            for (int s = 0; s < kSlotsInFlight; ++s) {
              if ((valid >> (s0 + s)) & 1u) {
                float v[VEC];
                unit_to_f32<T, VEC>(raw[s], v);
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[i] += v[i];
              }
            }
          }
        } else if (n > 0) {
#pragma unroll 1
          for (int j = 0; j < group; ++j) {
            if ((valid >> j) & 1u) {
#pragma unroll
              for (int i = 0; i < VEC; ++i) {
                if (i < n) acc[i] += static_cast<float>(src[j * p.in_slot_stride + i]);
              }
            }
          }
        }
        src += kWarp * p.in_slot_stride;
      }
      T* dst = output + row * p.out_row_stride + c;
      if (full) {
        store_unit<T, VEC>(dst, f32_to_unit<T, VEC>(acc));
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          if (i < n) dst[i] = static_cast<T>(acc[i]);
        }
      }
    }
  }
}

template <typename T, int VEC, typename IdT, bool HAS_IDS>
void launch(const at::Tensor& input, const at::Tensor& output, const IdT* ids, const int32_t* map,
            const MoeSumParams& p) {
  const int64_t units = (p.k + VEC - 1) / VEC;
  const int64_t passes = (units + kMaxThreadsPerRow - 1) / kMaxThreadsPerRow;
  const int64_t per_pass = (units + passes - 1) / passes;
  const int threads_x = static_cast<int>((per_pass + kWarp - 1) / kWarp * kWarp);
  const int rows_per_block = std::max(1, kMinThreadsPerBlock / threads_x);
  const int64_t blocks = std::min<int64_t>((p.m + rows_per_block - 1) / rows_per_block, INT_MAX);
  moe_sum_kernel<T, VEC, IdT, HAS_IDS>
      <<<static_cast<unsigned>(blocks), dim3(threads_x, rows_per_block), 0, c10::cuda::getCurrentCUDAStream()>>>(
          input.const_data_ptr<T>(), output.mutable_data_ptr<T>(), ids, map, p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, typename IdT, bool HAS_IDS>
void launch_vec(const at::Tensor& input, const at::Tensor& output, const IdT* ids, const int32_t* map,
                const MoeSumParams& p) {
  // NOTE: 16-byte loads/stores when both base pointers and every row/slot stride keep 16-byte alignment
  // (checked at run time: slices and offsets are common); a K that is not a multiple of the vector
  // width then ends in a scalar tail unit. Otherwise every access is scalar (correct, slower).
  constexpr int kVec = kVec16<T>;
  const bool vectorizable = aligned16(input.const_data_ptr()) && aligned16(output.const_data_ptr()) &&
                            effective_stride(input, 0) % kVec == 0 && effective_stride(input, 1) % kVec == 0 &&
                            effective_stride(output, 0) % kVec == 0;
  if (vectorizable) {
    launch<T, kVec, IdT, HAS_IDS>(input, output, ids, map, p);
  } else {
    launch<T, 1, IdT, HAS_IDS>(input, output, ids, map, p);
  }
}

}  // namespace

void moe_sum(const at::Tensor& input, at::Tensor& output, const std::optional<at::Tensor>& topk_ids,
             const std::optional<at::Tensor>& expert_map) {
  checks::moe_sum_args(input, output, topk_ids, expert_map);
  if (output.numel() == 0) return;
  const c10::cuda::OptionalCUDAGuard device_guard(input.device());
  MoeSumParams p{};
  p.m = input.size(0);
  p.topk = input.size(1);
  p.k = input.size(2);
  p.in_row_stride = input.stride(0);
  p.in_slot_stride = input.stride(1);
  p.out_row_stride = output.stride(0);
  const int32_t* map = nullptr;
  if (expert_map.has_value()) {
    map = expert_map->const_data_ptr<int32_t>();
    p.map_stride = expert_map->stride(0);
    p.num_global_experts = expert_map->size(0);
  }
  MOE_EXT_DISPATCH_FLOAT(input.scalar_type(), "moe_sum", [&] {
    if (!topk_ids.has_value()) {
      launch_vec<scalar_t, int32_t, false>(input, output, nullptr, nullptr, p);
      return;
    }
    p.ids_row_stride = topk_ids->stride(0);
    p.ids_slot_stride = topk_ids->stride(1);
    if (topk_ids->scalar_type() == at::kLong) {
      launch_vec<scalar_t, int64_t, true>(input, output, topk_ids->const_data_ptr<int64_t>(), map, p);
    } else {
      launch_vec<scalar_t, int32_t, true>(input, output, topk_ids->const_data_ptr<int32_t>(), map, p);
    }
  });
}

}  // namespace moe_ext::cuda

TORCH_LIBRARY_IMPL(moe_ext, CUDA, m) {
  m.impl("moe_sum", &moe_ext::cuda::moe_sum);
}
