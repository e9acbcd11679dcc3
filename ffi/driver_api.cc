#include "driver_api.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace jax_cpgrad {
namespace {

template <typename Fn>
Fn resolve(const char* symbol, unsigned int version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err =
      cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || fn == nullptr) {
    throw std::runtime_error(
        std::string("jax_cpgrad: cannot load the CUDA driver entry point ") + symbol + " (CUDA " +
        std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10) +
        " API): " + (err != cudaSuccess ? cudaGetErrorString(err) : "symbol not found") +
        ". Is an NVIDIA driver installed?");
  }
  return reinterpret_cast<Fn>(fn);
}

DriverApi load() {
  DriverApi api{};
  // The 11.7 signature of cuStreamBatchMemOp (v2 semantics: ordered, with memory barriers).
  api.stream_batch_mem_op = resolve<decltype(api.stream_batch_mem_op)>("cuStreamBatchMemOp", 11070);
  return api;
}

}  // namespace

const DriverApi& driver_api() {
  static const DriverApi api = load();
  return api;
}

}  // namespace jax_cpgrad
