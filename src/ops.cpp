// The inplace_abn operator library: its schemas (schemas.h), declared once
// for every device (DESIGN.md section 7). Implementations: src/cpu (CPU),
// src/cuda (CUDA); fake kernels and autograd live in Python
// (inplace_abn/_backend.py, inplace_abn/functions.py).
#include <Python.h>
#include <torch/library.h>

#include "schemas.h"

// Importing inplace_abn._C from Python loads this library and so runs the
// registrations below; the module itself has no Python-level contents.
PyMODINIT_FUNC PyInit__C(void) {  // PyMODINIT_FUNC: exported despite -fvisibility=hidden
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(inplace_abn, m) { inplace_abn::define_schemas(m); }
