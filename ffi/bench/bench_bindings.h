// The benchmark module (jax_cpgrad._cpgrad_bench, an optional target): measurements behind
// benchmarks/, never used by the transport itself.
#pragma once

#include <nanobind/nanobind.h>

namespace jax_cpgrad {

// kernel_bench.cu: kernels vs device copies on one GPU, per-call cost, GPU-to-GPU copies.
void bind_kernel_bench(nanobind::module_& m);
// push_bench.cu: the push ceiling, every local GPU pushing to every peer at once.
void bind_push_bench(nanobind::module_& m);
// chain_bench.cu: device-protocol calls chained on real GPUs without XLA (per-call latency).
void bind_chain_bench(nanobind::module_& m);

}  // namespace jax_cpgrad
