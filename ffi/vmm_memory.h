// Device memory through the CUDA virtual memory management API: one physical allocation mapped at
// an address range of its own, with each GPU's access granted explicitly (peer access enabled by
// cudaDeviceEnablePeerAccess does not reach such memory). A workspace uses it for its own memory,
// exportable as a POSIX file descriptor (a capability passed only to the job's own processes),
// and for its views of other processes' memory, imported from such descriptors.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace jax_cpgrad {

// What a GPU's driver offers (CU_DEVICE_ATTRIBUTE_*_SUPPORTED).
struct VmmSupport {
  bool vmm = false;       // cuMemCreate / cuMemMap at all
  bool posix_fd = false;  // export as a file descriptor (processes of one host)
  bool fabric = false;    // export as a fabric handle (hosts of one NVLink domain)
};
VmmSupport vmm_support(int device);

// cuMemCreate found the GPU full: the caller adds advice.
struct OutOfDeviceMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class VmmMapping {
 public:
  // At least `bytes` on `device` (rounded up to the allocation granularity), read/write there;
  // `exportable` requests a POSIX file descriptor handle. Throws std::runtime_error naming the
  // failing call (OutOfDeviceMemory when the GPU is full).
  static std::unique_ptr<VmmMapping> allocate(int device, int64_t bytes, bool exportable);
  // Maps `bytes` of another process's allocation, received as descriptor `fd` (left open: the
  // caller closes it), read/write for `device`. Throws std::runtime_error naming the failing call.
  static std::unique_ptr<VmmMapping> import_fd(int device, int fd, int64_t bytes);
  ~VmmMapping();
  VmmMapping(const VmmMapping&) = delete;
  VmmMapping& operator=(const VmmMapping&) = delete;

  char* ptr() const { return reinterpret_cast<char*>(static_cast<uintptr_t>(ptr_)); }
  int64_t bytes() const { return bytes_; }
  // Another GPU of this process may read and write this memory (one process, several GPUs).
  void grant_access(int device) const;
  // A new file descriptor for the allocation; the caller owns it. Only for exportable memory.
  int export_fd() const;
  // Unmaps, releases the allocation handle, frees the address range (in that order); idempotent,
  // never throws: returns what failed.
  std::vector<std::string> release();

 private:
  VmmMapping() = default;
  void reserve_and_map(int device, int64_t bytes);

  CUmemGenericAllocationHandle handle_ = 0;
  CUdeviceptr ptr_ = 0;  // the reserved range
  int64_t bytes_ = 0;
  bool has_handle_ = false, reserved_ = false, mapped_ = false;
};

}  // namespace jax_cpgrad
