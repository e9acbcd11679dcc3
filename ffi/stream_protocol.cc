#include "stream_protocol.h"

#include <algorithm>

#include "driver_api.h"

namespace jax_cpgrad {

CUresult enqueue_publish_and_wait(const ProtocolSite& site, uint32_t epoch, cudaStream_t stream) {
  constexpr unsigned kMaxOpsPerBatch = 255;  // the driver's limit per cuStreamBatchMemOp
  CUstreamBatchMemOpParams ops[2 * kMaxRanks + 2] = {};
  unsigned count = 0;
  auto write = [&](const void* addr) {
    CUstreamBatchMemOpParams& op = ops[count++];
    op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
    op.writeValue.address = reinterpret_cast<CUdeviceptr>(addr);
    op.writeValue.value = epoch;
    op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;  // fenced after the scatter's stores
  };
  for (int64_t o = 0; o < site.n; ++o) {
    if (o != site.self) write(flags_of(site.peers->header[o]) + site.self);
  }
  write(site.reached);
  for (int64_t w = 0; w < site.n; ++w) {
    if (w == site.self) continue;
    CUstreamBatchMemOpParams& op = ops[count++];
    op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
    op.waitValue.address =
        reinterpret_cast<CUdeviceptr>(flags_of(site.peers->header[site.self]) + w);
    op.waitValue.value = epoch;
    op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;  // (int32)(flag - e) >= 0: wraps correctly
  }
  write(site.passed);
  const DriverApi& api = driver_api();
  for (unsigned begin = 0; begin < count; begin += kMaxOpsPerBatch) {
    const unsigned batch = std::min(kMaxOpsPerBatch, count - begin);
    CUresult res =
        api.stream_batch_mem_op(reinterpret_cast<CUstream>(stream), batch, ops + begin, 0);
    if (res != CUDA_SUCCESS) return res;
  }
  return CUDA_SUCCESS;
}

}  // namespace jax_cpgrad
