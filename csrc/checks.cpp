// Out-of-line definitions of the argument checks declared in checks.h (one copy, compiled by g++, shared
// by the CPU and CUDA kernels).
#include "checks.h"

#include <string>

namespace moe_ext {
namespace checks {

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kDouble: return "torch.float64";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(t);
  }
}

void float_dtype(const char* op, const char* name, const at::Tensor& t) {
  const at::ScalarType s = t.scalar_type();
  TORCH_CHECK_TYPE(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, op, ": ", name,
                   " must be float32, float16 or bfloat16, got ", dtype_name(s));
}

void same_dtype(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have the dtype of ",
                   ref_name, " (", dtype_name(ref.scalar_type()), "), got ", dtype_name(t.scalar_type()));
}

void same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                        const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on the device of ", ref_name, " (",
              ref.device(), "), got ", t.device());
}

void last_dim_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, op, ": ", name,
              " must be contiguous in its last dim (stride 1), got stride ", t.stride(-1));
}

void moe_sum_args(const at::Tensor& input, const at::Tensor& output,
                         const std::optional<at::Tensor>& topk_ids,
                         const std::optional<at::Tensor>& expert_map) {
  constexpr const char* op = "moe_sum";
  TORCH_CHECK(input.dim() == 3, op, ": input must have 3 dims [M, topk, K], got ", input.dim(), " dims");
  float_dtype(op, "input", input);
  same_dtype(op, "output", output, "input", input);
  same_device(op, "output", output, "input", input);
  const int64_t m = input.size(0);
  const int64_t topk = input.size(1);
  const int64_t k = input.size(2);
  TORCH_CHECK(output.dim() == 2 && output.size(0) == m && output.size(1) == k, op,
              ": output must have shape [M, K] = [", m, ", ", k, "], got ", output.sizes());
  last_dim_contiguous(op, "input", input);
  last_dim_contiguous(op, "output", output);
  if (topk_ids.has_value()) {
    const at::Tensor& ids = *topk_ids;
    same_device(op, "topk_ids", ids, "input", input);
    TORCH_CHECK_TYPE(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong, op,
                     ": topk_ids must be int32 or int64, got ", dtype_name(ids.scalar_type()));
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == m && ids.size(1) == topk, op,
                ": topk_ids must have shape [M, topk] = [", m, ", ", topk, "], got ", ids.sizes());
  }
  if (expert_map.has_value()) {
    const at::Tensor& map = *expert_map;
    TORCH_CHECK(topk_ids.has_value(), op, ": expert_map needs topk_ids");
    same_device(op, "expert_map", map, "input", input);
    TORCH_CHECK_TYPE(map.scalar_type() == at::kInt, op, ": expert_map must be int32, got ",
                     dtype_name(map.scalar_type()));
    TORCH_CHECK(map.dim() == 1, op, ": expert_map must have 1 dim [E_global], got ", map.dim(), " dims");
  }
}

void activation_args(const char* op, const at::Tensor& out, const at::Tensor& input) {
  TORCH_CHECK(input.dim() >= 1, op, ": input must have at least 1 dim [..., 2d], got 0 dims");
  float_dtype(op, "input", input);
  same_dtype(op, "out", out, "input", input);
  same_device(op, "out", out, "input", input);
  const int64_t width = input.size(-1);
  TORCH_CHECK(width % 2 == 0, op, ": input width (last dim) must be even, got ", width);
  const at::IntArrayRef lead = input.sizes().slice(0, input.dim() - 1);
  TORCH_CHECK(out.dim() == input.dim() && out.sizes().slice(0, out.dim() - 1) == lead, op,
              ": out must have the leading shape of input ", lead, ", got ", out.sizes());
  TORCH_CHECK(out.size(-1) == width / 2, op, ": out width (last dim) must be half the input width = ",
              width / 2, ", got ", out.size(-1));
  last_dim_contiguous(op, "input", input);
  last_dim_contiguous(op, "out", out);
}

}  // namespace checks
}  // namespace moe_ext
