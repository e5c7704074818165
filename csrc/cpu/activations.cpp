// CPU kernels of the gated activations: out [..., d] from input [..., 2d] (fp32/fp16/bf16, same dtype,
// last dim contiguous, any leading strides). silu/gelu/gelu_tanh/swiglustep read gate = input[..., :d],
// up = input[..., d:]; swigluoai reads interleaved gate = input[..., 0::2], up = input[..., 1::2].
// Math in fp32, one rounding to the output dtype. Formulas: ops.h.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "checks.h"
#include "ops.h"

namespace moe_ext::cpu {
namespace {

// NOTE: at::parallel_for grain in elements touched per task (ATen's GRAIN_SIZE is 32768); the math is
// a few libm calls per element, so a smaller grain already pays for a thread.
constexpr int64_t kGrainElements = 16384;

enum class Act { kSilu, kGelu, kGeluTanh, kSwigluoai, kSwiglustep };

struct ActParams {
  float alpha = 0.0f;
  float limit = 0.0f;
};

// min(x, limit) and clamp(x, -limit, limit) that keep NaN, like torch.clamp.
inline float clamp_max(float x, float limit) { return x > limit ? limit : x; }
inline float clamp_abs(float x, float limit) { return x > limit ? limit : (x < -limit ? -limit : x); }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// NOTE: scalar fp32 libm math per element. GCC does not vectorize exp/erf/tanh calls without
// -ffast-math, and at::vec::Vectorized is its generic (scalar) fallback in this TU; the CPU path is the
// reference-speed path, parallel over rows.
template <Act A>
inline float gated(float gate, float up, const ActParams& p) {
  if constexpr (A == Act::kSilu) {
    return silu(gate) * up;
  } else if constexpr (A == Act::kGelu) {
    // NOTE: 0.5 x (1 + erf(x / sqrt 2)) == 0.5 x erfc(-x / sqrt 2); erfc has no cancellation for x << 0,
    // where 1 + erf loses most of its digits in fp32 (same kernel math as the CUDA backend).
    return 0.5f * gate * std::erfc(-gate * static_cast<float>(M_SQRT1_2)) * up;
  } else if constexpr (A == Act::kGeluTanh) {
    // NOTE: 0.5 x (1 + tanh(z)) == x * sigmoid(2z), free of the cancellation in 1 + tanh(z) for x << 0.
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    const float z = kSqrt2OverPi * (gate + 0.044715f * gate * gate * gate);
    return gate / (1.0f + std::exp(-2.0f * z)) * up;
  } else if constexpr (A == Act::kSwigluoai) {
    const float g = clamp_max(gate, p.limit);
    const float u = clamp_abs(up, p.limit);
    return g / (1.0f + std::exp(-p.alpha * g)) * (u + 1.0f);
  } else {
    return clamp_max(silu(gate), p.limit) * clamp_abs(up, p.limit);
  }
}

template <typename T, Act A>
void gated_rows(const ActivationOperands& ops, const ActParams& p) {
  const T* in = ops.input.const_data_ptr<T>();
  T* out = ops.out.mutable_data_ptr<T>();
  const int64_t d = ops.width;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / (3 * d));
  at::parallel_for(0, ops.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* x = in + ops.in_rows.offset(row);
      T* y = out + ops.out_rows.offset(row);
      if constexpr (A == Act::kSwigluoai) {
        for (int64_t i = 0; i < d; ++i) {
          y[i] = static_cast<T>(gated<A>(static_cast<float>(x[2 * i]), static_cast<float>(x[2 * i + 1]), p));
        }
      } else {
        for (int64_t i = 0; i < d; ++i) {
          y[i] = static_cast<T>(gated<A>(static_cast<float>(x[i]), static_cast<float>(x[d + i]), p));
        }
      }
    }
  });
}

template <Act A>
void run(const char* op, at::Tensor& out, const at::Tensor& input, ActParams p) {
  checks::activation_args(op, out, input);
  if (out.numel() == 0) return;
  const ActivationOperands ops = activation_operands(out, input);
  MOE_EXT_DISPATCH_FLOAT(input.scalar_type(), "gated_activation", [&] { gated_rows<scalar_t, A>(ops, p); });
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

}  // namespace moe_ext::cpu

TORCH_LIBRARY_IMPL(moe_ext, CPU, m) {
  m.impl("swigluoai_and_mul", &moe_ext::cpu::swigluoai_and_mul);
  m.impl("silu_and_mul", &moe_ext::cpu::silu_and_mul);
  m.impl("gelu_and_mul", &moe_ext::cpu::gelu_and_mul);
  m.impl("gelu_tanh_and_mul", &moe_ext::cpu::gelu_tanh_and_mul);
  m.impl("swiglustep_and_mul", &moe_ext::cpu::swiglustep_and_mul);
}
