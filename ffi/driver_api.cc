#include "driver_api.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace jax_cpgrad {
namespace {

template <typename Fn>
void resolve(Fn& out, const char* symbol, unsigned int version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err =
      cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || fn == nullptr) {
    throw std::runtime_error(
        std::string("jax_cpgrad: cannot load the CUDA driver entry point ") + symbol + " (CUDA " +
        std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10) +
        " API): " + (err != cudaSuccess ? cudaGetErrorString(err) : "symbol not found") +
        ". Is an NVIDIA driver installed, and does it offer that API? (The XLA transport, calls "
        "without a workspace, does not need it.)");
  }
  out = reinterpret_cast<Fn>(fn);
}

DriverApi load() {
  DriverApi api{};
  // The 11.7 signature of cuStreamBatchMemOp (v2 semantics: ordered, with memory barriers).
  resolve(api.stream_batch_mem_op, "cuStreamBatchMemOp", 11070);
  resolve(api.device_get, "cuDeviceGet", 2000);
  resolve(api.device_get_attribute, "cuDeviceGetAttribute", 2000);
  resolve(api.get_error_name, "cuGetErrorName", 6000);
  resolve(api.mem_get_allocation_granularity, "cuMemGetAllocationGranularity", 10020);
  resolve(api.mem_create, "cuMemCreate", 10020);
  resolve(api.mem_release, "cuMemRelease", 10020);
  resolve(api.mem_address_reserve, "cuMemAddressReserve", 10020);
  resolve(api.mem_address_free, "cuMemAddressFree", 10020);
  resolve(api.mem_map, "cuMemMap", 10020);
  resolve(api.mem_unmap, "cuMemUnmap", 10020);
  resolve(api.mem_set_access, "cuMemSetAccess", 10020);
  resolve(api.mem_export_to_shareable_handle, "cuMemExportToShareableHandle", 10020);
  resolve(api.mem_import_from_shareable_handle, "cuMemImportFromShareableHandle", 10020);
  return api;
}

}  // namespace

const DriverApi& driver_api() {
  static const DriverApi api = load();
  return api;
}

std::string cu_error_text(CUresult res, const char* expr, const char* file, int line) {
  const char* name = nullptr;
  if (driver_api().get_error_name(res, &name) != CUDA_SUCCESS || name == nullptr)
    name = "unknown CUDA driver error";
  return std::string(expr) + " failed at " + file + ":" + std::to_string(line) + ": " + name +
         " (" + std::to_string(static_cast<int>(res)) + ")";
}

}  // namespace jax_cpgrad
