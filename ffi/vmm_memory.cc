#include "vmm_memory.h"

#include <cstdio>

#include "cuda_check.h"
#include "driver_api.h"

namespace jax_cpgrad {
namespace {

CUdevice cu_device(int device) {
  CUdevice dev = 0;
  CPG_CU_OR_THROW(driver_api().device_get(&dev, device));
  return dev;
}

bool attribute(CUdevice dev, CUdevice_attribute attr) {
  int value = 0;
  CPG_CU_OR_THROW(driver_api().device_get_attribute(&value, attr, dev));
  return value != 0;
}

CUmemAllocationProp device_prop(int device, CUmemAllocationHandleType handle_type) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = cu_device(device);
  prop.requestedHandleTypes = handle_type;
  return prop;
}

// The recommended granularity (2 MiB on Hopper): large pages, as cudaMalloc gives large buffers.
size_t granularity(const CUmemAllocationProp& prop) {
  size_t g = 0;
  CPG_CU_OR_THROW(
      driver_api().mem_get_allocation_granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  return g;
}

void set_read_write(CUdeviceptr ptr, int64_t bytes, int device) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = cu_device(device);
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CPG_CU_OR_THROW(driver_api().mem_set_access(ptr, bytes, &access, 1));
}

}  // namespace

VmmSupport vmm_support(int device) {
  const CUdevice dev = cu_device(device);
  VmmSupport s;
  s.vmm = attribute(dev, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
  s.posix_fd =
      s.vmm && attribute(dev, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);
  s.fabric = s.vmm && attribute(dev, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED);
  return s;
}

std::unique_ptr<VmmMapping> VmmMapping::allocate(int device, int64_t bytes, bool exportable) {
  DeviceGuard guard(device);
  const CUmemAllocationProp prop = device_prop(
      device, exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE);
  const int64_t g = static_cast<int64_t>(granularity(prop));
  const int64_t rounded = (bytes + g - 1) / g * g;
  std::unique_ptr<VmmMapping> m(new VmmMapping());
  const CUresult res = driver_api().mem_create(&m->handle_, rounded, &prop, 0);
  if (res == CUDA_ERROR_OUT_OF_MEMORY)
    throw OutOfDeviceMemory(cu_error_text(res, "cuMemCreate", __FILE__, __LINE__));
  CPG_CU_OR_THROW(res);
  m->has_handle_ = true;
  m->reserve_and_map(device, rounded);
  return m;
}

std::unique_ptr<VmmMapping> VmmMapping::import_fd(int device, int fd, int64_t bytes) {
  DeviceGuard guard(device);
  const int64_t g = static_cast<int64_t>(
      granularity(device_prop(device, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)));
  if (bytes <= 0 || bytes % g != 0)
    throw std::runtime_error("a peer's allocation of " + std::to_string(bytes) +
                             " bytes is not a positive multiple of the granularity (" +
                             std::to_string(g) + " bytes)");
  std::unique_ptr<VmmMapping> m(new VmmMapping());
  CPG_CU_OR_THROW(driver_api().mem_import_from_shareable_handle(
      &m->handle_, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  m->has_handle_ = true;
  m->reserve_and_map(device, bytes);  // fails if the allocation is smaller than `bytes`
  return m;
}

void VmmMapping::reserve_and_map(int device, int64_t bytes) {
  const DriverApi& api = driver_api();
  CPG_CU_OR_THROW(api.mem_address_reserve(&ptr_, bytes, 0, 0, 0));
  reserved_ = true;
  bytes_ = bytes;
  CPG_CU_OR_THROW(api.mem_map(ptr_, bytes, 0, handle_, 0));
  mapped_ = true;
  set_read_write(ptr_, bytes, device);
}

VmmMapping::~VmmMapping() {
  // A destructor may run at interpreter exit, after the driver shut down: report, never throw.
  for (const auto& p : release())
    std::fprintf(stderr, "jax_cpgrad: releasing GPU memory: %s\n", p.c_str());
}

void VmmMapping::grant_access(int device) const { set_read_write(ptr_, bytes_, device); }

int VmmMapping::export_fd() const {
  int fd = -1;
  CPG_CU_OR_THROW(driver_api().mem_export_to_shareable_handle(
      &fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  return fd;
}

std::vector<std::string> VmmMapping::release() {
  std::vector<std::string> problems;
  const DriverApi& api = driver_api();
  if (mapped_) CPG_CU_OR_NOTE(api.mem_unmap(ptr_, bytes_), problems);
  if (has_handle_) CPG_CU_OR_NOTE(api.mem_release(handle_), problems);
  if (reserved_) CPG_CU_OR_NOTE(api.mem_address_free(ptr_, bytes_), problems);
  mapped_ = has_handle_ = reserved_ = false;
  return problems;
}

}  // namespace jax_cpgrad
