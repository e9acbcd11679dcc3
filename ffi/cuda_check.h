// Error text for CUDA runtime failures, and the check used by setup code (which may throw;
// handlers turn the same text into an ffi::Error instead).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace jax_cpgrad {

inline std::string cuda_error_text(cudaError_t err, const char* expr, const char* file, int line) {
  return std::string(expr) + " failed at " + file + ":" + std::to_string(line) + ": " +
         cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

}  // namespace jax_cpgrad

#define CPG_CUDA_OR_THROW(expr)                                                              \
  do {                                                                                       \
    cudaError_t cpg_err_ = (expr);                                                           \
    if (cpg_err_ != cudaSuccess) {                                                           \
      throw std::runtime_error(::jax_cpgrad::cuda_error_text(cpg_err_, #expr, __FILE__, __LINE__)); \
    }                                                                                        \
  } while (0)
