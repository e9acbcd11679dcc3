#include "workspace_bindings.h"

#include <cuda_runtime.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "cuda_check.h"
#include "driver_api.h"
#include "handlers.h"
#include "kernel_bench.h"
#include "peer_registry.h"
#include "region_layout.h"
#include "watchdog.h"

namespace nb = nanobind;

namespace jax_cpgrad {
namespace {

std::atomic<int64_t> g_next_id{1};
std::atomic<int64_t> g_open_ipc_mappings{0};  // for leak tests

// Restores the calling thread's current device when setup code is done with another one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    CPG_CUDA_OR_THROW(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

std::string mib(int64_t bytes) { return std::to_string((bytes + (1 << 20) - 1) >> 20) + " MiB"; }

// A workspace as Python builds it: create (allocate locally), export handles, connect to the
// peers, activate (register for the handlers), then quiesce and release at close.
class NativeWorkspace {
 public:
  // local_members: (CUDA ordinal, CP rank) of each local device.
  NativeWorkspace(std::string name, int64_t n, int64_t nbytes, double timeout_s,
                  uint32_t initial_epoch, const std::vector<std::tuple<int, int64_t>>& local_members)
      : state_(std::make_shared<WorkspaceState>()) {
    if (n < 1 || n > kMaxRanks) throw std::invalid_argument("CP size out of range");
    if (nbytes < 1) throw std::invalid_argument("nbytes must be positive");
    state_->id = g_next_id++;
    state_->name = std::move(name);
    state_->n = n;
    state_->slot_bytes = round_up_slot_bytes(nbytes);
    state_->timeout_s = timeout_s;
    const char* unsafe = std::getenv("JAX_CPGRAD_UNSAFE_SINGLE_BUFFER");
    state_->unsafe_single_buffer = unsafe != nullptr && std::string(unsafe) == "1";
    driver_api();  // resolve the driver entry points now, not in the handler
    try {
      for (const auto& [device, rank] : local_members) allocate_member(device, rank, initial_epoch);
    } catch (...) {
      release();
      throw;
    }
  }
  ~NativeWorkspace() { release(); }

  int64_t id() const { return state_->id; }
  int64_t region_bytes_per_device() const { return region_bytes(state_->n, state_->slot_bytes); }

  std::vector<nb::bytes> ipc_handles() const {
    std::vector<nb::bytes> out;
    for (const auto& m : state_->members) {
      DeviceGuard guard(m->device);
      cudaIpcMemHandle_t handle;
      CPG_CUDA_OR_THROW(cudaIpcGetMemHandle(&handle, m->own_region));
      out.emplace_back(reinterpret_cast<const char*>(&handle), sizeof(handle));
    }
    return out;
  }

  // For each local member, for each CP rank: the index of a local member, or the IPC handle of
  // a region in another process. Returns one line per pair that could not be connected.
  std::vector<std::string> connect(
      const std::vector<std::vector<std::variant<int64_t, nb::bytes>>>& peers) {
    std::vector<std::string> problems;
    if (peers.size() != state_->members.size()) throw std::invalid_argument("one peer list per local device");
    for (size_t i = 0; i < peers.size(); ++i) {
      Member& m = *state_->members[i];
      if (static_cast<int64_t>(peers[i].size()) != state_->n) throw std::invalid_argument("one entry per CP rank");
      DeviceGuard guard(m.device);
      for (int64_t r = 0; r < state_->n; ++r) {
        const std::string pair = "CP rank " + std::to_string(m.rank) + " (GPU " +
                                 std::to_string(m.device) + ") -> CP rank " + std::to_string(r);
        if (const int64_t* local = std::get_if<int64_t>(&peers[i][r])) {
          const Member& other = *state_->members.at(*local);
          if (other.device != m.device) {
            int can = 0;
            cudaDeviceCanAccessPeer(&can, m.device, other.device);
            if (!can) {
              problems.push_back(pair + ": GPU " + std::to_string(m.device) + " cannot access GPU " +
                                 std::to_string(other.device) + " (no peer-to-peer path)");
              continue;
            }
            cudaError_t err = cudaDeviceEnablePeerAccess(other.device, 0);
            if (err == cudaErrorPeerAccessAlreadyEnabled) {
              cudaGetLastError();  // XLA or an earlier workspace enabled it: fine
            } else if (err != cudaSuccess) {
              problems.push_back(pair + ": " + cudaGetErrorString(err));
              continue;
            }
          }
          m.regions.region[r] = other.own_region;
        } else {
          const nb::bytes& blob = std::get<nb::bytes>(peers[i][r]);
          cudaIpcMemHandle_t handle;
          if (blob.size() != sizeof(handle)) throw std::invalid_argument("bad IPC handle size");
          std::memcpy(&handle, blob.c_str(), sizeof(handle));
          void* ptr = nullptr;
          cudaError_t err = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
          if (err != cudaSuccess) {
            cudaGetLastError();
            problems.push_back(pair + ": cudaIpcOpenMemHandle failed: " + cudaGetErrorString(err));
            continue;
          }
          m.ipc_mapped.push_back(ptr);
          ++g_open_ipc_mappings;
          m.regions.region[r] = static_cast<char*>(ptr);
        }
      }
    }
    return problems;
  }

  // Registers the workspace for the handlers and starts the watchdog.
  void activate() {
    for (const auto& m : state_->members) {
      for (int64_t r = 0; r < state_->n; ++r) {
        if (m->regions.region[r] == nullptr) throw std::logic_error("activate() before a complete connect()");
      }
    }
    Registry::get().add(state_);
    active_ = true;
    watchdog_start();
  }

  // Unregisters (later calls fail cleanly) and waits for this process's enqueued work.
  void quiesce() {
    if (active_) Registry::get().remove(state_->id);
    active_ = false;
    for (const auto& m : state_->members) {
      DeviceGuard guard(m->device);
      CPG_CUDA_OR_THROW(cudaDeviceSynchronize());
    }
  }

  // Frees everything (after the peers have quiesced too). Idempotent.
  void release() {
    if (active_) Registry::get().remove(state_->id);
    active_ = false;
    for (const auto& m : state_->members) {
      int previous = 0;
      cudaGetDevice(&previous);
      cudaSetDevice(m->device);
      for (void* p : m->ipc_mapped) {
        cudaIpcCloseMemHandle(p);
        --g_open_ipc_mappings;
      }
      m->ipc_mapped.clear();
      if (m->own_region) cudaFree(m->own_region);
      if (m->progress) cudaFreeHost(m->progress);
      if (m->watchdog_stream) cudaStreamDestroy(m->watchdog_stream);
      m->own_region = nullptr;
      m->progress = nullptr;
      m->watchdog_stream = nullptr;
      cudaSetDevice(previous);
    }
    state_->members.clear();
  }

  nb::dict status() const {
    nb::dict d;
    d["id"] = state_->id;
    d["name"] = state_->name;
    d["n"] = state_->n;
    d["slot_bytes"] = state_->slot_bytes;
    d["region_bytes"] = region_bytes_per_device();
    d["timeout_s"] = state_->timeout_s;
    d["failed"] = state_->failed.load();
    d["failure"] = state_->failure_text();
    nb::list epochs;
    for (const auto& m : state_->members) epochs.append(nb::make_tuple(m->device, m->rank, m->epoch.load()));
    d["epochs"] = epochs;
    return d;
  }

 private:
  void allocate_member(int device, int64_t rank, uint32_t initial_epoch) {
    auto m = std::make_unique<Member>();
    m->device = device;
    m->rank = rank;
    DeviceGuard guard(device);
    const int64_t bytes = region_bytes(state_->n, state_->slot_bytes);
    cudaError_t err = cudaMalloc(&m->own_region, bytes);
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
    // Flags start at the initial epoch (0 normally; tests start near 2^32 to cross the wrap).
    std::vector<uint32_t> page(kFlagsPageBytes / 4, 0);
    for (int64_t w = 0; w < state_->n; ++w) page[w] = initial_epoch;
    CPG_CUDA_OR_THROW(cudaMemcpy(m->own_region, page.data(), kFlagsPageBytes, cudaMemcpyHostToDevice));
    void* progress = nullptr;
    CPG_CUDA_OR_THROW(cudaHostAlloc(&progress, sizeof(ProgressWords), cudaHostAllocMapped | cudaHostAllocPortable));
    m->progress = static_cast<ProgressWords*>(progress);
    m->progress->reached = m->progress->passed = initial_epoch;
    CPG_CUDA_OR_THROW(cudaHostGetDevicePointer(&m->progress_device, progress, 0));
    CPG_CUDA_OR_THROW(cudaStreamCreateWithFlags(&m->watchdog_stream, cudaStreamNonBlocking));
    CPG_CUDA_OR_THROW(warm_kernels());
    m->epoch.store(initial_epoch);
    m->regions.region[rank] = m->own_region;
    state_->members.push_back(std::move(m));
  }

  std::shared_ptr<WorkspaceState> state_;
  bool active_ = false;
};

// Why GPU `device` cannot reach the GPU with PCI bus id `pci_bus_id` ("" when it can).
std::string peer_unreachable_reason(int device, const std::string& pci_bus_id) {
  int peer = -1;
  if (cudaDeviceGetByPCIBusId(&peer, pci_bus_id.c_str()) != cudaSuccess) {
    cudaGetLastError();
    return "GPU " + pci_bus_id + " is not visible from this process (another host, or hidden by CUDA_VISIBLE_DEVICES)";
  }
  if (peer == device) return "";
  int can = 0;
  cudaDeviceCanAccessPeer(&can, device, peer);
  return can ? "" : "GPU " + std::to_string(device) + " has no peer-to-peer path to GPU " + pci_bus_id;
}

std::string pci_bus_id(int device) {
  char id[64] = {};
  CPG_CUDA_OR_THROW(cudaDeviceGetPCIBusId(id, sizeof(id), device));
  return id;
}

nb::capsule handler_capsule(void* fn) { return nb::capsule(fn); }

// (free, total) bytes of GPU `device`, for memory-leak checks.
std::tuple<int64_t, int64_t> device_memory(int device) {
  DeviceGuard guard(device);
  size_t free_b = 0, total_b = 0;
  CPG_CUDA_OR_THROW(cudaMemGetInfo(&free_b, &total_b));
  return {static_cast<int64_t>(free_b), static_cast<int64_t>(total_b)};
}

}  // namespace

void bind_workspace(nb::module_& m) {
  nb::class_<NativeWorkspace>(m, "NativeWorkspace")
      .def(nb::init<std::string, int64_t, int64_t, double, uint32_t, const std::vector<std::tuple<int, int64_t>>&>(),
           nb::arg("name"), nb::arg("n"), nb::arg("nbytes"), nb::arg("timeout_s"),
           nb::arg("initial_epoch"), nb::arg("local_members"))
      .def_prop_ro("id", &NativeWorkspace::id)
      .def_prop_ro("region_bytes_per_device", &NativeWorkspace::region_bytes_per_device)
      .def("ipc_handles", &NativeWorkspace::ipc_handles)
      .def("connect", &NativeWorkspace::connect)
      .def("activate", &NativeWorkspace::activate)
      .def("quiesce", &NativeWorkspace::quiesce, nb::call_guard<nb::gil_scoped_release>())
      .def("release", &NativeWorkspace::release)
      .def("status", &NativeWorkspace::status);
  m.def("peer_unreachable_reason", &peer_unreachable_reason, nb::arg("device"), nb::arg("pci_bus_id"));
  m.def("pci_bus_id", &pci_bus_id, nb::arg("device"));
  m.def("device_memory", &device_memory, nb::arg("device"));
  m.def("open_ipc_mappings", [] { return g_open_ipc_mappings.load(); });
  m.def("watchdog_stop", &watchdog_stop, nb::call_guard<nb::gil_scoped_release>());
  m.def("handlers", [] {
    nb::dict d;
    d["grad_return"] = handler_capsule(reinterpret_cast<void*>(&JaxCpgradGradReturn));
    d["all_gather"] = handler_capsule(reinterpret_cast<void*>(&JaxCpgradAllGather));
    return d;
  });
  bind_kernel_bench(m);
}

}  // namespace jax_cpgrad
