"""Optional accelerator backends: thin glue from the moe_ext op contracts to third-party kernels.

Each backend is one small module with ``is_available()`` (its package imports and can run here) and entry
points that take the arguments of the ``moe_ext`` op they serve and return the same result, e.g.
``moe_extension.backends.triton_kernels`` (OpenAI's ``triton_kernels.matmul_ogs``, the engine behind vLLM's
gpt-oss path) behind ``fused_experts(..., backend="triton_kernels")``.

Importing a backend module never imports its third-party package: that happens on the first
``is_available()`` or call, and a missing or incompatible package is reported with the reason, never
required.
"""
