// The native moe_ext operator schemas (one line each) and the Python module moe_extension._C that
// loads them. Kernels register per backend: cpu/*.cpp (CPU), cuda/*.cu (CUDA). Meta/fake kernels are
// registered in Python (moe_extension/ops/*.py) next to each op's wrapper and reference.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(moe_ext, m) {
  // Sum input [M, topk, K] over topk into output [M, K]; slots with invalid / non-local ids add exactly 0.
  m.def("moe_sum(Tensor input, Tensor(a!) output, Tensor? topk_ids=None, Tensor? expert_map=None) -> ()");
  // gpt-oss gated activation on interleaved gate/up: out [..., d] from input [..., 2d].
  m.def("swigluoai_and_mul(Tensor(a!) out, Tensor input, float alpha=1.702, float limit=7.0) -> ()");
  // silu(gate) * up, halves.
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  // erf-GELU(gate) * up, halves.
  m.def("gelu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  // tanh-GELU(gate) * up, halves.
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor input) -> ()");
  // min(silu(gate), limit) * clamp(up, -limit, limit), halves.
  m.def("swiglustep_and_mul(Tensor(a!) out, Tensor input, float limit=7.0) -> ()");
}

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "moe_extension native ops", -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
#ifdef MOE_EXT_WITH_CUDA
  const bool with_cuda = true;
#else
  const bool with_cuda = false;
#endif
  if (PyModule_AddObject(module, "WITH_CUDA", PyBool_FromLong(with_cuda)) < 0 ||
      PyModule_AddStringConstant(module, "CUDA_ARCHS", MOE_EXT_CUDA_ARCHS) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
