// Single-GPU measurement of the transport's kernels against a plain device copy: N writers are
// emulated by N regions on one device, so it measures HBM efficiency, not NVLink.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_cpgrad {

void bind_kernel_bench(nanobind::module_& m);

}  // namespace jax_cpgrad
