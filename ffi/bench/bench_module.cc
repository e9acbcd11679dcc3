#include <nanobind/nanobind.h>

#include "bench/bench_bindings.h"

NB_MODULE(_cpgrad_bench, m) {
  m.doc() =
      "jax_cpgrad benchmark helpers: kernel efficiency, per-call cost, the cross-GPU push ceiling";
  jax_cpgrad::bind_kernel_bench(m);
  jax_cpgrad::bind_push_bench(m);
  jax_cpgrad::bind_chain_bench(m);
}
