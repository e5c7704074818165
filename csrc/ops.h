// Declarations of the native moe_ext ops, with their shape and dtype contracts.
// Schemas live in torch_bindings.cpp; CPU kernels in cpu/ (namespace moe_ext::cpu), CUDA kernels in cuda/
// (namespace moe_ext::cuda); each file registers its kernels with TORCH_LIBRARY_IMPL. The argument
// checks shared by both backends are in checks.h.
//
// moe_sum: input [M, topk, K] (K contiguous, other strides free), output [M, K] (K contiguous), same
// dtype (fp32/fp16/bf16). output[m] = sum_j input[m, j] in fp32, rounded once. With topk_ids [M, topk]
// (int32/int64) a slot with id < 0 contributes exactly 0; with expert_map [E_global] (int32) too, a slot
// with id >= E_global or expert_map[id] < 0 contributes exactly 0 (NaN/Inf in such slots never leak).
// Any topk >= 0 (topk 0 gives zeros).
//
// Gated activations: input [..., 2d], out [..., d]; same dtype (fp32/fp16/bf16), same leading shape,
// last dim contiguous, rows may be strided (any leading strides). Math in fp32, one rounding at the end.
// swigluoai: gate = input[..., 0::2], up = input[..., 1::2] (interleaved);
//   gate = min(gate, limit), up = clamp(up, -limit, limit), out = gate * sigmoid(alpha * gate) * (up + 1).
// The rest split halves: gate = input[..., :d], up = input[..., d:]:
//   silu: silu(gate) * up; gelu: erf-GELU(gate) * up; gelu_tanh: tanh-GELU(gate) * up;
//   swiglustep: min(silu(gate), limit) * clamp(up, -limit, limit).
// NaN inputs propagate (the clamps keep NaN, like torch.clamp).
#pragma once

#include <ATen/core/Tensor.h>
#include <optional>

namespace moe_ext {

namespace cpu {
void moe_sum(const at::Tensor& input, at::Tensor& output, const std::optional<at::Tensor>& topk_ids,
             const std::optional<at::Tensor>& expert_map);
void swigluoai_and_mul(at::Tensor& out, const at::Tensor& input, double alpha, double limit);
void silu_and_mul(at::Tensor& out, const at::Tensor& input);
void gelu_and_mul(at::Tensor& out, const at::Tensor& input);
void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input);
void swiglustep_and_mul(at::Tensor& out, const at::Tensor& input, double limit);
}  // namespace cpu

namespace cuda {
void moe_sum(const at::Tensor& input, at::Tensor& output, const std::optional<at::Tensor>& topk_ids,
             const std::optional<at::Tensor>& expert_map);
void swigluoai_and_mul(at::Tensor& out, const at::Tensor& input, double alpha, double limit);
void silu_and_mul(at::Tensor& out, const at::Tensor& input);
void gelu_and_mul(at::Tensor& out, const at::Tensor& input);
void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input);
void swiglustep_and_mul(at::Tensor& out, const at::Tensor& input, double limit);
}  // namespace cuda

}  // namespace moe_ext
