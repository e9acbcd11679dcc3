// Error text for CUDA runtime failures, the check used by setup code (which may throw; handlers
// turn the same text into an ffi::Error instead), and the current-device guard of setup code.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace jax_cpgrad {

inline std::string cuda_error_text(cudaError_t err, const char* expr, const char* file, int line) {
  return std::string(expr) + " failed at " + file + ":" + std::to_string(line) + ": " +
         cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

// Restores the calling thread's current device when setup code is done with another one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess)
      throw std::runtime_error(cuda_error_text(err, "cudaSetDevice", __FILE__, __LINE__));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace jax_cpgrad

#define CPG_CUDA_OR_THROW(expr)                                                \
  do {                                                                         \
    cudaError_t cpg_err_ = (expr);                                             \
    if (cpg_err_ != cudaSuccess) {                                             \
      throw std::runtime_error(                                                \
          ::jax_cpgrad::cuda_error_text(cpg_err_, #expr, __FILE__, __LINE__)); \
    }                                                                          \
  } while (0)

// Release paths never throw: a failing call is recorded in `problems` (reported by the caller)
// and the release goes on.
#define CPG_CUDA_OR_NOTE(expr, problems)                                                        \
  do {                                                                                          \
    cudaError_t cpg_err_ = (expr);                                                              \
    if (cpg_err_ != cudaSuccess) {                                                              \
      (problems).push_back(::jax_cpgrad::cuda_error_text(cpg_err_, #expr, __FILE__, __LINE__)); \
      cudaGetLastError();                                                                       \
    }                                                                                           \
  } while (0)
