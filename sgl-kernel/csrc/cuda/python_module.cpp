// Python module object of sgl_kernel_fork._C_cuda: importing it runs the static
// TORCH_LIBRARY_IMPL(sgl_kernel, CUDA, ...) registrations of the files beside this one.
// Kept in its own file so each op's binding file only registers its ops.
#include <Python.h>

static struct PyModuleDef sglk_cuda_module = {PyModuleDef_HEAD_INIT, "_C_cuda",
                                              "sgl_kernel CUDA operators (torch.ops.sgl_kernel)", -1, nullptr};
PyMODINIT_FUNC PyInit__C_cuda(void) { return PyModule_Create(&sglk_cuda_module); }
