// CPU kernel of moe_ext::moe_sum: output[m, :] = sum over the valid slots j of input[m, j, :].
// input [M, topk, K] and output [M, K] in fp32/fp16/bf16 (K contiguous, other strides free), fp32
// accumulation, one rounding; topk_ids [M, topk] int32/int64 and expert_map [E_global] int32 (any
// strides) select the valid slots (checks.h: slot_is_valid). Invalid slots are never read.
#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "checks.h"
#include "ops.h"

namespace moe_ext::cpu {
namespace {

// NOTE: the hidden dim is processed in chunks of kChunk fp32 accumulators on the stack (1 KiB, stays in
// L1) so that the inner loops are plain convert-and-add loops over contiguous elements, which GCC
// auto-vectorizes at -O3. at::vec::Vectorized would compile to its generic fallback here (this TU is not
// built with ATen's per-CPU-capability flags), so it would add nothing.
constexpr int64_t kChunk = 256;
// NOTE: at::parallel_for grain in elements touched per task, as ATen's own GRAIN_SIZE (32768): small
// inputs stay on one thread.
constexpr int64_t kGrainElements = 32768;

struct SlotSelector {
  const void* ids = nullptr;  // nullptr: every slot is valid
  bool ids_are_int64 = false;
  int64_t ids_row_stride = 0;
  int64_t ids_slot_stride = 0;
  const int32_t* expert_map = nullptr;
  int64_t map_stride = 0;
  int64_t num_global_experts = 0;

  bool valid(int64_t row, int64_t slot) const {
    if (ids == nullptr) return true;
    const int64_t at = row * ids_row_stride + slot * ids_slot_stride;
    const int64_t id = ids_are_int64 ? static_cast<const int64_t*>(ids)[at]
                                     : static_cast<const int32_t*>(ids)[at];
    return slot_is_valid(id, expert_map, map_stride, num_global_experts);
  }
};

template <typename T>
void moe_sum_rows(const at::Tensor& input, const at::Tensor& output, const SlotSelector& slots) {
  const int64_t m = input.size(0);
  const int64_t topk = input.size(1);
  const int64_t k = input.size(2);
  const T* in = input.const_data_ptr<T>();
  T* out = output.mutable_data_ptr<T>();
  const int64_t in_row_stride = input.stride(0);
  const int64_t in_slot_stride = input.stride(1);
  const int64_t out_row_stride = output.stride(0);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, (topk + 1) * k));
  at::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
    c10::SmallVector<const T*, 16> sources;
    float acc[kChunk];
    for (int64_t row = begin; row < end; ++row) {
      sources.clear();
      for (int64_t j = 0; j < topk; ++j) {
        if (slots.valid(row, j)) sources.push_back(in + row * in_row_stride + j * in_slot_stride);
      }
      T* dst = out + row * out_row_stride;
      for (int64_t c0 = 0; c0 < k; c0 += kChunk) {
        const int64_t n = std::min(kChunk, k - c0);
        std::fill(acc, acc + n, 0.0f);
        for (const T* src : sources) {
          const T* s = src + c0;
          for (int64_t i = 0; i < n; ++i) acc[i] += static_cast<float>(s[i]);
        }
        for (int64_t i = 0; i < n; ++i) dst[c0 + i] = static_cast<T>(acc[i]);
      }
    }
  });
}

}  // namespace

void moe_sum(const at::Tensor& input, at::Tensor& output, const std::optional<at::Tensor>& topk_ids,
             const std::optional<at::Tensor>& expert_map) {
  checks::moe_sum_args(input, output, topk_ids, expert_map);
  if (output.numel() == 0) return;
  SlotSelector slots;
  if (topk_ids.has_value()) {
    slots.ids = topk_ids->const_data_ptr();
    slots.ids_are_int64 = topk_ids->scalar_type() == at::kLong;
    slots.ids_row_stride = topk_ids->stride(0);
    slots.ids_slot_stride = topk_ids->stride(1);
  }
  if (expert_map.has_value()) {
    slots.expert_map = expert_map->const_data_ptr<int32_t>();
    slots.map_stride = expert_map->stride(0);
    slots.num_global_experts = expert_map->size(0);
  }
  MOE_EXT_DISPATCH_FLOAT(input.scalar_type(), "moe_sum", [&] { moe_sum_rows<scalar_t>(input, output, slots); });
}

}  // namespace moe_ext::cpu

TORCH_LIBRARY_IMPL(moe_ext, CPU, m) {
  m.impl("moe_sum", &moe_ext::cpu::moe_sum);
}
