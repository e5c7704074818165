// Argument checks shared by the CPU and CUDA kernels of the native ops, and the two small pieces of
// layout logic those checks validate (shared so that both backends read the arguments the same way):
//   - RowLayout: the leading dims of an activation tensor, merged where the strides allow, mapping a
//     logical row index to an element offset (any strides, no copy);
//   - slot_is_valid: the moe_sum rule for which top-k slots contribute.
// Every failed check names the op, the argument and what was expected. Dtype errors raise TypeError
// (TORCH_CHECK_TYPE), everything else RuntimeError; the Python fakes (moe_extension/ops/*.py) raise the
// same types with the same messages, in the same order. The checks are defined out of line in
// checks.cpp, compiled by g++ for both backends.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <optional>
#include <string>

#if defined(__CUDACC__)
#define MOE_EXT_HOST_DEVICE __host__ __device__
#else
#define MOE_EXT_HOST_DEVICE
#endif

namespace moe_ext {

// ---------------------------------------------------------------------------------------------------
// Shared layout logic
// ---------------------------------------------------------------------------------------------------

// moe_sum: whether slot j of a token contributes, given its global expert id. Without an expert map
// only negative ids are invalid; with one (expert_map [E_global], stride map_stride), ids >= E_global and
// ids mapped to a negative local id are invalid too. Never reads out of bounds.
MOE_EXT_HOST_DEVICE inline bool slot_is_valid(int64_t id, const int32_t* expert_map, int64_t map_stride,
                                              int64_t num_global_experts) {
  if (id < 0) return false;
  if (expert_map == nullptr) return true;
  return id < num_global_experts && expert_map[id * map_stride] >= 0;
}

// Leading dims of a tensor after dropping size-1 dims and merging neighbours whose strides chain, so a
// contiguous or row-sliced tensor has ndim == 1 and offset(row) == row * strides[0].
constexpr int kMaxRowDims = 6;

struct RowLayout {
  int ndim;                      // >= 1
  int64_t sizes[kMaxRowDims];    // outermost first
  int64_t strides[kMaxRowDims];  // in elements

  // Element offset of logical row `row` (row-major over the leading dims). The loop is unrolled over the
  // fixed capacity so that CUDA keeps the arrays in registers/parameter space (no local memory).
  MOE_EXT_HOST_DEVICE int64_t offset(int64_t row) const {
    int64_t off = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int d = kMaxRowDims - 1; d > 0; --d) {
      if (d < ndim) {
        off += (row % sizes[d]) * strides[d];
        row /= sizes[d];
      }
    }
    return off + row * strides[0];
  }

  // Whether every row starts at a multiple of `elems` elements from the base pointer.
  bool strides_multiple_of(int64_t elems) const {
    for (int d = 0; d < ndim; ++d) {
      if (strides[d] % elems != 0) return false;
    }
    return true;
  }
};

// The row layout of t's leading dims (all but the last), or nullopt when more than kMaxRowDims dims
// remain after merging (the callers then run on a contiguous copy).
inline std::optional<RowLayout> row_layout(const at::Tensor& t) {
  c10::SmallVector<int64_t, kMaxRowDims> sizes;
  c10::SmallVector<int64_t, kMaxRowDims> strides;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    const int64_t size = t.size(d);
    const int64_t stride = t.stride(d);
    if (size == 1) continue;
    if (!sizes.empty() && strides.back() == size * stride) {
      sizes.back() *= size;
      strides.back() = stride;
    } else {
      sizes.push_back(size);
      strides.push_back(stride);
    }
  }
  if (sizes.empty()) {
    sizes.push_back(1);
    strides.push_back(0);
  }
  if (sizes.size() > static_cast<size_t>(kMaxRowDims)) return std::nullopt;
  RowLayout layout{};
  layout.ndim = static_cast<int>(sizes.size());
  for (int d = 0; d < layout.ndim; ++d) {
    layout.sizes[d] = sizes[d];
    layout.strides[d] = strides[d];
  }
  return layout;
}

// An activation's operands as a kernel sees them. When a tensor's leading dims do not fit a RowLayout
// (more than kMaxRowDims unmergeable dims: rare) the kernel reads a contiguous copy of input and/or
// writes a contiguous scratch output that finish() copies into the caller's out.
struct ActivationOperands {
  at::Tensor out;    // written by the kernel: the caller's out, or scratch
  at::Tensor input;  // read by the kernel: the caller's input, or a contiguous copy
  RowLayout out_rows;
  RowLayout in_rows;
  int64_t rows;   // product of the leading dims
  int64_t width;  // output width d (the input width is 2 * d)
  at::Tensor caller_out;

  void finish() const {
    if (!out.is_same(caller_out)) caller_out.copy_(out);
  }
};

inline ActivationOperands activation_operands(const at::Tensor& out, const at::Tensor& input) {
  ActivationOperands ops{out, input, {}, {}, 1, out.size(-1), out};
  std::optional<RowLayout> in_rows = row_layout(input);
  if (!in_rows) {
    ops.input = input.contiguous();
    in_rows = row_layout(ops.input);
  }
  std::optional<RowLayout> out_rows = row_layout(out);
  if (!out_rows) {
    ops.out = out.new_empty(out.sizes());
    out_rows = row_layout(ops.out);
  }
  ops.in_rows = *in_rows;
  ops.out_rows = *out_rows;
  for (int64_t d = 0; d + 1 < out.dim(); ++d) ops.rows *= out.size(d);
  return ops;
}

// Stride of dim d, or 0 when the dim has size 1 (its stride is then meaningless and must not block the
// vector path).
inline int64_t effective_stride(const at::Tensor& t, int64_t d) {
  return t.size(d) == 1 ? 0 : t.stride(d);
}

// ---------------------------------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------------------------------
namespace checks {

// Python-style dtype names, so that the messages match those of the fakes ("torch.bfloat16").
std::string dtype_name(at::ScalarType t);

// Dispatch over exactly the dtypes float_dtype admits (scalar_t inside the lambda).
#define MOE_EXT_DISPATCH_FLOAT(TYPE, NAME, ...)                  \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                 \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)   \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

void float_dtype(const char* op, const char* name, const at::Tensor& t);

void same_dtype(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                const at::Tensor& ref);

void same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                 const at::Tensor& ref);

// The last dim has stride 1 (a last dim of size <= 1 has no meaningful stride).
void last_dim_contiguous(const char* op, const char* name, const at::Tensor& t);

// moe_sum(input [M, topk, K], output [M, K], topk_ids [M, topk]?, expert_map [E_global]?).
void moe_sum_args(const at::Tensor& input, const at::Tensor& output,
                  const std::optional<at::Tensor>& topk_ids,
                  const std::optional<at::Tensor>& expert_map);

// <op>(out [..., d], input [..., 2d]).
void activation_args(const char* op, const at::Tensor& out, const at::Tensor& input);

}  // namespace checks
}  // namespace moe_ext
