#include "symmetric_region.h"

#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "cuda_check.h"
#include "memop_kernels.h"

namespace jax_cpgrad {
namespace {

std::atomic<int64_t> g_open_peer_mappings{0};

void problems_from(std::vector<std::string> more, std::vector<std::string>& problems) {
  for (auto& p : more) problems.push_back(std::move(p));
}

std::string mib(int64_t bytes) { return std::to_string((bytes + (1 << 20) - 1) >> 20) + " MiB"; }

std::unique_ptr<VmmMapping> allocate(int device, int64_t bytes, bool exportable) {
  try {
    return VmmMapping::allocate(device, bytes, exportable);
  } catch (const OutOfDeviceMemory&) {
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    throw std::runtime_error(
        "jax_cpgrad: out of GPU memory allocating the workspace's " + mib(bytes) + " on GPU " +
        std::to_string(device) + " (" + mib(free_b) + " free of " + mib(total_b) +
        "). XLA preallocates most of the GPU by default: create the workspace before the first "
        "JAX computation, or lower XLA_PYTHON_CLIENT_MEM_FRACTION (or set "
        "XLA_PYTHON_CLIENT_PREALLOCATE=false), or ask for a smaller nbytes.");
  }
}

// The driver must offer virtual memory management; exporting as file descriptors is checked
// when another process asks for it (one process driving several GPUs does without).
bool check_support(int device) {
  const VmmSupport support = vmm_support(device);
  if (!support.vmm)
    throw std::runtime_error(
        "jax_cpgrad: GPU " + std::to_string(device) +
        " does not offer CUDA virtual memory management (cuMemCreate/cuMemMap), which the "
        "workspace's memory needs; calls without a workspace (the XLA transport) still run");
  return support.posix_fd;
}

}  // namespace

SymmetricRegion::SymmetricRegion(int device, int64_t rank, int64_t n, int64_t slot_bytes,
                                 uint32_t initial_epoch)
    : device_(device), rank_(rank), n_(n), slot_bytes_(slot_bytes) {
  DeviceGuard guard(device);
  try {
    exportable_ = check_support(device);
    header_mem_ = allocate(device, header_bytes(n, slot_bytes), exportable_);
    header_ = header_mem_->ptr();
    slots_mem_ = allocate(device, slots_bytes(n, slot_bytes), exportable_);
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
    if (header_mem_) header_mem_->release();
    header_mem_.reset();
    header_ = nullptr;
    throw;
  }
  peers_.header[rank] = header_;
  peers_.slots[rank] = slots_mem_->ptr();
}

SymmetricRegion::~SymmetricRegion() {
  std::vector<std::string> problems;
  int previous = 0;
  cudaGetDevice(&previous);
  if (cudaSetDevice(device_) == cudaSuccess) {
    release_all_but_header(problems);
    if (header_mem_) problems_from(header_mem_->release(), problems);
    header_mem_.reset();
    header_ = nullptr;
    cudaSetDevice(previous);
  }
  // A destructor may run at interpreter exit, after the CUDA driver shut down: say what failed,
  // never throw.
  for (const auto& p : problems)
    std::fprintf(stderr, "jax_cpgrad: releasing a workspace: %s\n", p.c_str());
}

RegionExport SymmetricRegion::export_memory() const {
  if (!exportable_)
    throw std::runtime_error("jax_cpgrad: GPU " + std::to_string(device_) +
                             " cannot export memory as a file descriptor "
                             "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is "
                             "0), which ranks in several processes need");
  if (!slots_mem_) throw std::logic_error("export_memory() after close()");
  DeviceGuard guard(device_);
  RegionExport out;
  out.header_bytes = header_mem_->bytes();
  out.slots_bytes = slots_mem_->bytes();
  out.header_fd = header_mem_->export_fd();
  try {
    out.slots_fd = slots_mem_->export_fd();
  } catch (...) {
    ::close(out.header_fd);
    throw;
  }
  return out;
}

std::string SymmetricRegion::map_same_process(int64_t peer_rank, const SymmetricRegion& peer) {
  if (peer.device_ != device_) {
    int can = 0;
    cudaDeviceCanAccessPeer(&can, device_, peer.device_);
    if (!can)
      return "GPU " + std::to_string(device_) + " cannot access GPU " +
             std::to_string(peer.device_) + " (no peer-to-peer path)";
    try {  // one physical allocation, readable and writable by both GPUs
      peer.header_mem_->grant_access(device_);
      peer.slots_mem_->grant_access(device_);
    } catch (const std::exception& e) {
      return e.what();
    }
  }
  peers_.header[peer_rank] = peer.header_;
  peers_.slots[peer_rank] = peer.slots_mem_->ptr();
  return "";
}

std::string SymmetricRegion::map_other_process(int64_t peer_rank, const RegionExport& peer) {
  // The sizes came with the descriptors; a smaller region would let calls write past its end.
  const int64_t need_header = header_bytes(n_, slot_bytes_),
                need_slots = slots_bytes(n_, slot_bytes_);
  if (peer.header_bytes < need_header || peer.slots_bytes < need_slots)
    return "its memory (" + std::to_string(peer.header_bytes) + " + " +
           std::to_string(peer.slots_bytes) + " bytes) is smaller than this workspace needs (" +
           std::to_string(need_header) + " + " + std::to_string(need_slots) + ")";
  try {
    auto header = VmmMapping::import_fd(device_, peer.header_fd, peer.header_bytes);
    auto slots = VmmMapping::import_fd(device_, peer.slots_fd, peer.slots_bytes);
    peers_.header[peer_rank] = header->ptr();
    peers_.slots[peer_rank] = slots->ptr();
    peer_mem_.push_back(std::move(header));
    peer_mem_.push_back(std::move(slots));
    g_open_peer_mappings += 2;
  } catch (const std::exception& e) {
    return std::string("mapping its memory failed: ") + e.what();
  }
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
  for (auto& m : peer_mem_) {
    problems_from(m->release(), problems);
    --g_open_peer_mappings;
  }
  peer_mem_.clear();
  if (slots_mem_) problems_from(slots_mem_->release(), problems);
  slots_mem_.reset();
  if (report_) CPG_CUDA_OR_NOTE(cudaFreeHost(report_), problems);
  if (side_stream_) CPG_CUDA_OR_NOTE(cudaStreamDestroy(side_stream_), problems);
  report_ = report_dev_ = nullptr;
  side_stream_ = nullptr;
  for (int64_t r = 0; r < n_; ++r) {
    if (r != rank_) peers_.header[r] = peers_.slots[r] = nullptr;
  }
  peers_.slots[rank_] = nullptr;
}

int64_t open_peer_mappings() { return g_open_peer_mappings.load(); }

}  // namespace jax_cpgrad
