// The CUDA side's Python bindings: NativeWorkspace, the handler capsules and their FFI state
// type, device queries, and the test hooks of test builds.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_cpgrad {

void bind_workspace(nanobind::module_& m);

}  // namespace jax_cpgrad
