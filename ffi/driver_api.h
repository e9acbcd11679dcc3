// CUDA driver entry points, resolved at run time through the runtime: the module never links
// libcuda.so, so a CPU-only machine can import it and the driver XLA already loaded is used.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <stdexcept>
#include <string>

namespace jax_cpgrad {

struct DriverApi {
  PFN_cuStreamBatchMemOp_v11070 stream_batch_mem_op;
  // Device queries and error names.
  PFN_cuDeviceGet_v2000 device_get;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute;
  PFN_cuGetErrorName_v6000 get_error_name;
  // Virtual memory management: the workspace's memory and its peers' views of it.
  PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity;
  PFN_cuMemCreate_v10020 mem_create;
  PFN_cuMemRelease_v10020 mem_release;
  PFN_cuMemAddressReserve_v10020 mem_address_reserve;
  PFN_cuMemAddressFree_v10020 mem_address_free;
  PFN_cuMemMap_v10020 mem_map;
  PFN_cuMemUnmap_v10020 mem_unmap;
  PFN_cuMemSetAccess_v10020 mem_set_access;
  PFN_cuMemExportToShareableHandle_v10020 mem_export_to_shareable_handle;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import_from_shareable_handle;
};

// Resolves the entry points once (thread-safe). Throws std::runtime_error naming what is
// missing; call it during setup so the handler never pays for it.
const DriverApi& driver_api();

// "expr failed at file:line: CUDA_ERROR_NAME", for driver calls (cuda_check.h does the runtime's).
std::string cu_error_text(CUresult res, const char* expr, const char* file, int line);

}  // namespace jax_cpgrad

#define CPG_CU_OR_THROW(expr)                                                                     \
  do {                                                                                            \
    CUresult cpg_res_ = (expr);                                                                   \
    if (cpg_res_ != CUDA_SUCCESS) {                                                               \
      throw std::runtime_error(::jax_cpgrad::cu_error_text(cpg_res_, #expr, __FILE__, __LINE__)); \
    }                                                                                             \
  } while (0)

// Release paths never throw: a failing call is recorded in `problems` and the release goes on.
#define CPG_CU_OR_NOTE(expr, problems)                                                        \
  do {                                                                                        \
    CUresult cpg_res_ = (expr);                                                               \
    if (cpg_res_ != CUDA_SUCCESS)                                                             \
      (problems).push_back(::jax_cpgrad::cu_error_text(cpg_res_, #expr, __FILE__, __LINE__)); \
  } while (0)
