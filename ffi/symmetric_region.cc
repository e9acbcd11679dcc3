#include "symmetric_region.h"

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "cuda_check.h"
#include "memop_kernels.h"

namespace jax_cpgrad {
namespace {

std::atomic<int64_t> g_open_ipc_mappings{0};

std::string mib(int64_t bytes) { return std::to_string((bytes + (1 << 20) - 1) >> 20) + " MiB"; }

char* allocate(int device, int64_t bytes) {
  void* ptr = nullptr;
  cudaError_t err = cudaMalloc(&ptr, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    throw std::runtime_error(
        "jax_cpgrad: out of GPU memory allocating the workspace's " + mib(bytes) + " on GPU " +
        std::to_string(device) + " (" + mib(free_b) + " free of " + mib(total_b) +
        "). XLA preallocates most of the GPU by default: create the workspace before the first "
        "JAX computation, or lower XLA_PYTHON_CLIENT_MEM_FRACTION (or set "
        "XLA_PYTHON_CLIENT_PREALLOCATE=false), or ask for a smaller nbytes.");
  }
  CPG_CUDA_OR_THROW(err);
  return static_cast<char*>(ptr);
}

}  // namespace

SymmetricRegion::SymmetricRegion(int device, int64_t rank, int64_t n, int64_t slot_bytes,
                                 uint32_t initial_epoch)
    : device_(device), rank_(rank), n_(n) {
  DeviceGuard guard(device);
  try {
    header_ = allocate(device, header_bytes(n, slot_bytes));
    slots_ = allocate(device, slots_bytes(n, slot_bytes));
    CPG_CUDA_OR_THROW(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
    // Control: epoch and flags at the initial epoch, state ok; the LL words filled uniformly (with
    // the same value), which no call can take for an arrived word.
    std::vector<uint32_t> header(header_bytes(n, slot_bytes) / 4, initial_epoch);
    Control control{};
    control.epoch = initial_epoch;
    std::memcpy(header.data(), &control, sizeof(control));
    std::memset(reinterpret_cast<char*>(header.data()) + sizeof(control), 0,
                kControlBytes - sizeof(control));
    write_header(0, header.data(), header_bytes(n, slot_bytes));
    void* report = nullptr;
    CPG_CUDA_OR_THROW(
        cudaHostAlloc(&report, sizeof(HostReport), cudaHostAllocMapped | cudaHostAllocPortable));
    report_ = static_cast<HostReport*>(report);
    *report_ = HostReport{initial_epoch, initial_epoch, 0};
    void* report_dev = nullptr;
    CPG_CUDA_OR_THROW(cudaHostGetDevicePointer(&report_dev, report, 0));
    report_dev_ = static_cast<HostReport*>(report_dev);
    // Load every kernel now: CUDA's lazy loading would otherwise do it inside a handler.
    CPG_CUDA_OR_THROW(warm_memop_kernels());
    CPG_CUDA_OR_THROW(warm_fused_kernels());
  } catch (...) {
    std::vector<std::string> ignored;  // the allocation error is what the caller needs to see
    release_all_but_header(ignored);
    if (header_) cudaFree(header_);
    header_ = nullptr;
    throw;
  }
  peers_.header[rank] = header_;
  peers_.slots[rank] = slots_;
}

SymmetricRegion::~SymmetricRegion() {
  std::vector<std::string> problems;
  int previous = 0;
  cudaGetDevice(&previous);
  if (cudaSetDevice(device_) == cudaSuccess) {
    release_all_but_header(problems);
    if (header_) CPG_CUDA_OR_NOTE(cudaFree(header_), problems);
    header_ = nullptr;
    cudaSetDevice(previous);
  }
  // A destructor may run at interpreter exit, after the CUDA driver shut down: say what failed,
  // never throw.
  for (const auto& p : problems)
    std::fprintf(stderr, "jax_cpgrad: releasing a workspace: %s\n", p.c_str());
}

RegionHandles SymmetricRegion::export_handles() const {
  DeviceGuard guard(device_);
  RegionHandles h;
  CPG_CUDA_OR_THROW(cudaIpcGetMemHandle(&h.header, header_));
  CPG_CUDA_OR_THROW(cudaIpcGetMemHandle(&h.slots, slots_));
  return h;
}

std::string SymmetricRegion::map_same_process(int64_t peer_rank, const SymmetricRegion& peer) {
  if (peer.device_ != device_) {
    DeviceGuard guard(device_);
    int can = 0;
    cudaDeviceCanAccessPeer(&can, device_, peer.device_);
    if (!can)
      return "GPU " + std::to_string(device_) + " cannot access GPU " +
             std::to_string(peer.device_) + " (no peer-to-peer path)";
    cudaError_t err = cudaDeviceEnablePeerAccess(peer.device_, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // XLA or an earlier workspace enabled it: fine
    } else if (err != cudaSuccess) {
      cudaGetLastError();
      return cudaGetErrorString(err);
    }
  }
  peers_.header[peer_rank] = peer.header_;
  peers_.slots[peer_rank] = peer.slots_;
  return "";
}

std::string SymmetricRegion::map_other_process(int64_t peer_rank, const RegionHandles& handles) {
  DeviceGuard guard(device_);
  void* mapped[2] = {nullptr, nullptr};
  const cudaIpcMemHandle_t* both[2] = {&handles.header, &handles.slots};
  for (int i = 0; i < 2; ++i) {
    cudaError_t err = cudaIpcOpenMemHandle(&mapped[i], *both[i], cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();
      if (i == 1) {
        cudaIpcCloseMemHandle(mapped[0]);
        --g_open_ipc_mappings;
      }
      return std::string("cudaIpcOpenMemHandle failed: ") + cudaGetErrorString(err);
    }
    ipc_mapped_.push_back(mapped[i]);
    ++g_open_ipc_mappings;
  }
  peers_.header[peer_rank] = static_cast<char*>(mapped[0]);
  peers_.slots[peer_rank] = static_cast<char*>(mapped[1]);
  return "";
}

bool SymmetricRegion::connected() const {
  for (int64_t r = 0; r < n_; ++r) {
    if (peers_.header[r] == nullptr || peers_.slots[r] == nullptr) return false;
  }
  return true;
}

void SymmetricRegion::write_header(int64_t offset, const void* values, int64_t bytes) const {
  DeviceGuard guard(device_);
  CPG_CUDA_OR_THROW(
      cudaMemcpyAsync(header_ + offset, values, bytes, cudaMemcpyHostToDevice, side_stream_));
  CPG_CUDA_OR_THROW(cudaStreamSynchronize(side_stream_));
}

void SymmetricRegion::read_header(int64_t offset, void* values, int64_t bytes) const {
  DeviceGuard guard(device_);
  CPG_CUDA_OR_THROW(
      cudaMemcpyAsync(values, header_ + offset, bytes, cudaMemcpyDeviceToHost, side_stream_));
  CPG_CUDA_OR_THROW(cudaStreamSynchronize(side_stream_));
}

std::vector<std::string> SymmetricRegion::drain() const {
  std::vector<std::string> problems;
  int previous = 0;
  cudaGetDevice(&previous);
  CPG_CUDA_OR_NOTE(cudaSetDevice(device_), problems);
  CPG_CUDA_OR_NOTE(cudaDeviceSynchronize(), problems);
  cudaSetDevice(previous);
  return problems;
}

std::vector<std::string> SymmetricRegion::close() {
  std::vector<std::string> problems;
  int previous = 0;
  cudaGetDevice(&previous);
  CPG_CUDA_OR_NOTE(cudaSetDevice(device_), problems);
  // Work queued before close() finishes first; any kernel that starts afterwards (a CUDA graph
  // replayed later) finds the header closed.
  CPG_CUDA_OR_NOTE(cudaDeviceSynchronize(), problems);
  if (header_ != nullptr && side_stream_ != nullptr) {
    const uint32_t closed = kStateClosed;
    CPG_CUDA_OR_NOTE(cudaMemcpyAsync(header_ + offsetof(Control, state), &closed, sizeof(closed),
                                     cudaMemcpyHostToDevice, side_stream_),
                     problems);
    CPG_CUDA_OR_NOTE(cudaStreamSynchronize(side_stream_), problems);
  }
  release_all_but_header(problems);
  cudaSetDevice(previous);
  return problems;
}

void SymmetricRegion::release_all_but_header(std::vector<std::string>& problems) {
  for (void* p : ipc_mapped_) {
    CPG_CUDA_OR_NOTE(cudaIpcCloseMemHandle(p), problems);
    --g_open_ipc_mappings;
  }
  ipc_mapped_.clear();
  if (slots_) CPG_CUDA_OR_NOTE(cudaFree(slots_), problems);
  if (report_) CPG_CUDA_OR_NOTE(cudaFreeHost(report_), problems);
  if (side_stream_) CPG_CUDA_OR_NOTE(cudaStreamDestroy(side_stream_), problems);
  slots_ = nullptr;
  report_ = report_dev_ = nullptr;
  side_stream_ = nullptr;
  for (int64_t r = 0; r < n_; ++r) {
    if (r != rank_) peers_.header[r] = peers_.slots[r] = nullptr;
  }
  peers_.slots[rank_] = nullptr;
}

int64_t open_ipc_mappings() { return g_open_ipc_mappings.load(); }

}  // namespace jax_cpgrad
