// Python bindings of the CUDA side: the native workspace (allocation, IPC export/import, peer
// access, registration, close), reachability checks, the handler capsules, the kernel benchmark.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_cpgrad {

void bind_workspace(nanobind::module_& m);

}  // namespace jax_cpgrad
