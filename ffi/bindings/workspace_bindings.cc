// Thin nanobind face of the CUDA side: a NativeWorkspace holds one shared WorkspaceState and
// forwards to it; the handler capsules and their state type; small device queries (peer paths,
// what the driver offers for peer memory); test hooks (test builds only).
#include "workspace_bindings.h"

#include <cuda_runtime.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "cuda_check.h"
#include "driver_api.h"
#include "handlers.h"
#include "vmm_memory.h"
#include "watchdog.h"
#include "workspace_state.h"
#include "xla/ffi/api/c_api.h"

#ifndef JAX_CPGRAD_TEST_HOOKS
#define JAX_CPGRAD_TEST_HOOKS 0
#endif

namespace nb = nanobind;

namespace jax_cpgrad {
namespace {

std::atomic<int64_t> g_next_id{1};

// A region's memory as Python passes it between processes: (header fd, header bytes, slots fd,
// slots bytes).
using ExportTuple = std::tuple<int, int64_t, int, int64_t>;

Protocol parse_protocol(const std::string& name) {
  if (name == "device") return Protocol::kDevice;
  if (name == "memop") return Protocol::kStreamMemops;
  throw std::invalid_argument("protocol must be 'device' or 'memop', got '" + name + "'");
}

// The Python handle of a workspace. Python builds it in steps (allocate here, export memory,
// connect to the peers, activate), and closes it in two (begin_close, a barrier of every process,
// finish_close) before dropping it, so that a closed workspace holds no native object.
class NativeWorkspace {
 public:
  // local_members: (CUDA ordinal, CP rank) of each local device.
  NativeWorkspace(const std::string& name, int64_t n, int64_t nbytes, double timeout_s,
                  const std::string& protocol, int32_t block_budget, int32_t push_blocks,
                  bool abort_on_timeout, bool overlap,
                  const std::vector<std::tuple<int, int64_t>>& local_members) {
    if (n < 1 || n > kMaxRanks) throw std::invalid_argument("CP size out of range");
    if (nbytes < 1) throw std::invalid_argument("nbytes must be positive");
    WorkspaceConfig cfg;
    cfg.name = name;
    cfg.n = n;
    cfg.slot_bytes = round_up_slot_bytes(nbytes);
    cfg.timeout_s = timeout_s;
    cfg.protocol = parse_protocol(protocol);
    cfg.block_budget = block_budget;
    cfg.push_blocks = push_blocks;
    cfg.abort_on_timeout = abort_on_timeout;
    cfg.overlap = overlap;
    driver_api();  // resolve the driver entry points now, not in the handler
    state_ = std::make_shared<WorkspaceState>(g_next_id++, std::move(cfg));
    for (const auto& [device, rank] : local_members) {
      state_->members.push_back(std::make_unique<Member>(device, rank, state_->config, 0));
    }
  }
  ~NativeWorkspace() {
    // Normally closed already; otherwise (an error during set-up) release now, without a barrier.
    Registry::get().remove(state_->id);
    for (const auto& p : state_->begin_close()) std::fprintf(stderr, "jax_cpgrad: %s\n", p.c_str());
    for (const auto& p : state_->finish_close())
      std::fprintf(stderr, "jax_cpgrad: %s\n", p.c_str());
  }

  int64_t id() const { return state_->id; }
  int64_t bytes_per_device() const {
    return region_bytes(state_->config.n, state_->config.slot_bytes);
  }
  int64_t slot_bytes() const { return state_->config.slot_bytes; }

  // Per local GPU: (header fd, header bytes, slots fd, slots bytes), new descriptors of its memory
  // for the job's other processes on this host; the caller closes them.
  std::vector<ExportTuple> export_memory() const {
    std::vector<ExportTuple> out;
    try {
      for (const auto& m : state_->members) {
        const RegionExport e = m->region.export_memory();
        out.emplace_back(e.header_fd, e.header_bytes, e.slots_fd, e.slots_bytes);
      }
    } catch (...) {  // a later GPU failed: the descriptors already made go nowhere
      for (const auto& [header_fd, h, slots_fd, s] : out) {
        ::close(header_fd);
        ::close(slots_fd);
      }
      throw;
    }
    return out;
  }

  // For each local member, for each CP rank: the index of a local member, or the memory of a
  // region in another process as export_memory() gave it there (descriptors received by this
  // process, left open: the caller closes them). Returns one line per pair that could not be
  // connected.
  std::vector<std::string> connect(
      const std::vector<std::vector<std::variant<int64_t, ExportTuple>>>& peers) {
    if (peers.size() != state_->members.size())
      throw std::invalid_argument("one peer list per local device");
    std::vector<std::string> problems;
    for (size_t i = 0; i < peers.size(); ++i) {
      SymmetricRegion& region = state_->members[i]->region;
      if (static_cast<int64_t>(peers[i].size()) != state_->config.n)
        throw std::invalid_argument("one entry per CP rank");
      for (int64_t r = 0; r < state_->config.n; ++r) {
        std::string problem;
        if (const int64_t* local = std::get_if<int64_t>(&peers[i][r])) {
          problem = region.map_same_process(r, state_->members.at(*local)->region);
        } else {
          RegionExport e;
          std::tie(e.header_fd, e.header_bytes, e.slots_fd, e.slots_bytes) =
              std::get<ExportTuple>(peers[i][r]);
          problem = region.map_other_process(r, e);
        }
        if (!problem.empty()) {
          problems.push_back("CP rank " + std::to_string(region.rank()) + " (GPU " +
                             std::to_string(region.device()) + ") -> CP rank " + std::to_string(r) +
                             ": " + problem);
        }
      }
    }
    return problems;
  }

  // Registers the workspace for the handlers and the watchdog.
  void activate() {
    for (const auto& m : state_->members) {
      if (!m->region.connected()) throw std::logic_error("activate() before a complete connect()");
    }
    Registry::get().add(state_);
    watchdog_start();
  }

  std::vector<std::string> begin_close() { return state_->begin_close(); }
  std::vector<std::string> finish_close() {
    Registry::get().remove(state_->id);
    return state_->finish_close();
  }

  // (CUDA ordinal, rank, [(pointer, owner rank)]) per local GPU: where this rank may write up to
  // slot_bytes into each peer's memory, peers in rotated order. For the benchmarks' ceiling.
  std::vector<std::tuple<int, int64_t, std::vector<std::tuple<uintptr_t, int64_t>>>> push_targets()
      const {
    std::vector<std::tuple<int, int64_t, std::vector<std::tuple<uintptr_t, int64_t>>>> out;
    const WorkspaceConfig& cfg = state_->config;
    for (const auto& m : state_->members) {
      std::vector<std::tuple<uintptr_t, int64_t>> targets;
      for (int64_t p = 0; p + 1 < cfg.n; ++p) {
        const int64_t owner = rotated_owner(m->region.rank(), cfg.n, p);
        const char* dst = m->region.peers().slots[owner] +
                          slot_offset(cfg.n, cfg.slot_bytes, 0, m->region.rank());
        targets.emplace_back(reinterpret_cast<uintptr_t>(dst), owner);
      }
      out.emplace_back(m->region.device(), m->region.rank(), std::move(targets));
    }
    return out;
  }

  nb::dict status() const {
    const WorkspaceConfig& cfg = state_->config;
    {
      std::shared_lock lock(state_->mu);
      if (!state_->released && cfg.protocol == Protocol::kDevice) sync_device_failure(*state_);
    }
    nb::dict d;
    d["id"] = state_->id;
    d["name"] = cfg.name;
    d["n"] = cfg.n;
    d["protocol"] = protocol_name(cfg.protocol);
    d["slot_bytes"] = cfg.slot_bytes;
    d["bytes_per_device"] = bytes_per_device();
    d["timeout_s"] = cfg.timeout_s;
    d["failed"] = state_->failed.load();
    d["failure"] = state_->failure_text();
    nb::list epochs;  // the last epoch each local GPU finished (device) or issued (memop)
    for (const auto& m : state_->members) {
      uint32_t epoch = m->epoch.load();
      if (cfg.protocol == Protocol::kDevice && !state_->released) {
        m->region.read_header(offsetof(Control, epoch), &epoch, sizeof(epoch));
      }
      epochs.append(nb::make_tuple(m->region.device(), m->region.rank(), epoch));
    }
    d["epochs"] = epochs;
    return d;
  }

#if JAX_CPGRAD_TEST_HOOKS
  // Every local GPU's epoch (host, device, flags, progress words) set to `epoch` before any call
  // (the wrap test starts just below 2^32). Collective: every process must call it.
  void test_set_epoch(uint32_t epoch) {
    const int64_t n = state_->config.n;
    // LL words refilled uniformly: words of earlier calls must not meet their epochs again.
    const std::vector<char> ll_fill(ll_area_bytes(n, state_->config.slot_bytes), 0);
    for (const auto& m : state_->members) {
      std::vector<uint32_t> flags(kMaxTiles * n, epoch);
      m->region.write_header(kControlBytes, flags.data(), 4 * flags.size());
      m->region.write_header(ll_area_offset(n), ll_fill.data(), ll_fill.size());
      m->region.write_header(offsetof(Control, epoch), &epoch, sizeof(epoch));
      m->region.report()->reached = m->region.report()->passed = epoch;
      m->epoch.store(epoch);
    }
  }
  void test_set_single_buffer(bool on) { state_->single_buffer.store(on); }
  void test_set_skip_join(bool on) { state_->test_skip_join.store(on); }
  // The local GPU of CP rank `rank` (if any) waits `ns` before it reads each tile or call.
  void test_set_finish_delay(int64_t rank, uint32_t ns) {
    for (const auto& m : state_->members) {
      if (m->region.rank() == rank) m->test_finish_delay_ns.store(ns);
    }
  }
#endif

 private:
  std::shared_ptr<WorkspaceState> state_;
};

// Why GPU `device` cannot reach the GPU with PCI bus id `pci_bus_id` ("" when it can).
std::string peer_unreachable_reason(int device, const std::string& pci_bus_id) {
  int peer = -1;
  if (cudaDeviceGetByPCIBusId(&peer, pci_bus_id.c_str()) != cudaSuccess) {
    cudaGetLastError();
    return "GPU " + pci_bus_id +
           " is not visible from this process (another host, or hidden by CUDA_VISIBLE_DEVICES)";
  }
  if (peer == device) return "";
  int can = 0;
  cudaDeviceCanAccessPeer(&can, device, peer);
  return can ? ""
             : "GPU " + std::to_string(device) + " has no peer-to-peer path to GPU " + pci_bus_id;
}

std::string pci_bus_id(int device) {
  char id[64] = {};
  CPG_CUDA_OR_THROW(cudaDeviceGetPCIBusId(id, sizeof(id), device));
  return id;
}

int multiprocessor_count(int device) {
  int count = 0;
  CPG_CUDA_OR_THROW(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// (free, total) bytes of GPU `device`, for memory-leak checks.
std::tuple<int64_t, int64_t> device_memory(int device) {
  DeviceGuard guard(device);
  size_t free_b = 0, total_b = 0;
  CPG_CUDA_OR_THROW(cudaMemGetInfo(&free_b, &total_b));
  return {static_cast<int64_t>(free_b), static_cast<int64_t>(total_b)};
}

// The traits a handler declares, asked the way XLA asks: a call frame carrying the metadata
// extension. For the tests: the device protocol must be command-buffer compatible.
uint32_t handler_traits(XLA_FFI_Handler* handler) {
  XLA_FFI_Metadata metadata{};
  metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension extension{};
  extension.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
  extension.extension_base.type = XLA_FFI_Extension_Metadata;
  extension.metadata = &metadata;
  XLA_FFI_CallFrame frame{};
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.extension_start = &extension.extension_base;
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  if (handler(&frame) != nullptr)
    throw std::runtime_error("the handler did not answer the metadata query");
  return metadata.traits;
}

struct Target {
  const char* name;
  XLA_FFI_Handler* execute;
};
constexpr Target kTargets[] = {{"grad_return", JaxCpgradGradReturn},
                               {"all_gather", JaxCpgradAllGather},
                               {"grad_return_device", JaxCpgradGradReturnDevice},
                               {"all_gather_device", JaxCpgradAllGatherDevice},
                               {"grad_return_start", JaxCpgradGradReturnStart},
                               {"all_gather_start", JaxCpgradAllGatherStart},
                               {"grad_return_device_start", JaxCpgradGradReturnDeviceStart},
                               {"all_gather_device_start", JaxCpgradAllGatherDeviceStart},
                               {"done", JaxCpgradDone}};

nb::capsule capsule(const void* p) { return nb::capsule(const_cast<void*>(p)); }

}  // namespace

void bind_workspace(nb::module_& m) {
  nb::class_<NativeWorkspace>(m, "NativeWorkspace")
      .def(nb::init<const std::string&, int64_t, int64_t, double, const std::string&, int32_t,
                    int32_t, bool, bool, const std::vector<std::tuple<int, int64_t>>&>(),
           nb::arg("name"), nb::arg("n"), nb::arg("nbytes"), nb::arg("timeout_s"),
           nb::arg("protocol"), nb::arg("block_budget"), nb::arg("push_blocks"),
           nb::arg("abort_on_timeout"), nb::arg("overlap"), nb::arg("local_members"))
      .def_prop_ro("id", &NativeWorkspace::id)
      .def_prop_ro("bytes_per_device", &NativeWorkspace::bytes_per_device)
      .def_prop_ro("slot_bytes", &NativeWorkspace::slot_bytes)
      .def("export_memory", &NativeWorkspace::export_memory)
      .def("connect", &NativeWorkspace::connect)
      .def("activate", &NativeWorkspace::activate)
      .def("begin_close", &NativeWorkspace::begin_close, nb::call_guard<nb::gil_scoped_release>())
      .def("finish_close", &NativeWorkspace::finish_close, nb::call_guard<nb::gil_scoped_release>())
      .def("push_targets", &NativeWorkspace::push_targets)
#if JAX_CPGRAD_TEST_HOOKS
      .def("test_set_epoch", &NativeWorkspace::test_set_epoch)
      .def("test_set_single_buffer", &NativeWorkspace::test_set_single_buffer)
      .def("test_set_skip_join", &NativeWorkspace::test_set_skip_join)
      .def("test_set_finish_delay", &NativeWorkspace::test_set_finish_delay)
#endif
      .def("status", &NativeWorkspace::status);
  m.attr("HAS_TEST_HOOKS") = bool(JAX_CPGRAD_TEST_HOOKS);
  m.def("peer_unreachable_reason", &peer_unreachable_reason, nb::arg("device"),
        nb::arg("pci_bus_id"));
  m.def("pci_bus_id", &pci_bus_id, nb::arg("device"));
  m.def("multiprocessor_count", &multiprocessor_count, nb::arg("device"));
  m.def("device_memory", &device_memory, nb::arg("device"));
  m.def("open_peer_mappings", &open_peer_mappings);
  m.def(
      "memory_support",
      [](int device) {
        const VmmSupport s = vmm_support(device);
        nb::dict d;
        d["vmm"] = s.vmm;
        d["posix_fd"] = s.posix_fd;
        d["fabric"] = s.fabric;
        return d;
      },
      nb::arg("device"));
  m.def("watchdog_stop", &watchdog_stop, nb::call_guard<nb::gil_scoped_release>());
  m.def("handlers", [] {
    nb::dict d;
    for (const Target& t : kTargets) {
      nb::dict stages;
      stages["instantiate"] = capsule(reinterpret_cast<const void*>(&JaxCpgradInstantiate));
      stages["execute"] = capsule(reinterpret_cast<const void*>(t.execute));
      d[t.name] = stages;
    }
    return d;
  });
  m.def("state_type", [] {
    nb::dict d;
    d["type_id"] = capsule(call_state_type_id());
    d["type_info"] = capsule(call_state_type_info());
    return d;
  });
  m.def("handler_traits", [](const std::string& name) {
    for (const Target& t : kTargets) {
      if (name == t.name) return handler_traits(t.execute);
    }
    throw std::invalid_argument("no handler named " + name);
  });
  m.attr("COMMAND_BUFFER_COMPATIBLE") =
      static_cast<uint32_t>(XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
}

}  // namespace jax_cpgrad
