// The Python module: the layout arithmetic always; the workspace and the FFI handlers when
// built with CUDA.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <vector>

#include "cp_layout.h"
#include "region_layout.h"
#if JAX_CPGRAD_WITH_CUDA
#include "bindings/workspace_bindings.h"
#endif

namespace nb = nanobind;
using namespace jax_cpgrad;

namespace {

void check_chunk_args(int64_t n) {
  if (n < 1 || n > kMaxRanks) {
    throw std::invalid_argument("CP size must be in [1, " + std::to_string(kMaxRanks) + "], got " +
                                std::to_string(n));
  }
}

void check_chunk(int64_t chunk, int64_t n) {
  check_chunk_args(n);
  if (chunk < 0 || chunk >= 2 * n) throw std::invalid_argument("need 0 <= chunk < 2n");
}

// The global chunks in CP-layout order: rank 0's two chunks, then rank 1's, ...
std::vector<int64_t> layout_order(int64_t n) {
  check_chunk_args(n);
  std::vector<int64_t> order;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t h = 0; h < 2; ++h) order.push_back(chunk_of(r, h, n));
  }
  return order;
}

// (outer, run, chunk_len, global_len, local_len) of a shape, or ValueError naming the problem.
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> geometry(const std::vector<int64_t>& shape,
                                                                 int64_t seq_axis, int64_t n,
                                                                 bool global) {
  Geometry g;
  std::string err = compute_geometry(shape.data(), static_cast<int64_t>(shape.size()), seq_axis, n,
                                     global ? SeqExtent::kGlobal : SeqExtent::kLocal, &g);
  if (!err.empty()) throw std::invalid_argument(err);
  return {g.outer, g.run, g.chunk_len, g.global_len, g.local_len};
}

}  // namespace

NB_MODULE(_cpgrad_ext, m) {
  m.doc() = "jax_cpgrad native module: CP layout arithmetic and the CUDA peer transport";
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_TENSORS") = kMaxTensors;
  m.def(
      "chunk_of",
      [](int64_t rank, int64_t half, int64_t n) {
        check_chunk_args(n);
        if (rank < 0 || rank >= n || (half != 0 && half != 1)) {
          throw std::invalid_argument("need 0 <= rank < n and half in {0, 1}");
        }
        return chunk_of(rank, half, n);
      },
      nb::arg("rank"), nb::arg("half"), nb::arg("n"),
      "Global chunk held by `rank` at local position `half`.");
  m.def(
      "owner_of",
      [](int64_t chunk, int64_t n) {
        check_chunk(chunk, n);
        return owner_of(chunk, n);
      },
      nb::arg("chunk"), nb::arg("n"), "CP rank that holds global chunk `chunk`.");
  m.def(
      "half_of",
      [](int64_t chunk, int64_t n) {
        check_chunk(chunk, n);
        return half_of(chunk, n);
      },
      nb::arg("chunk"), nb::arg("n"),
      "Local position (0 or 1) of global chunk `chunk` on its owner.");
  m.def("layout_order", &layout_order, nb::arg("n"),
        "Global chunks in CP-layout order (rank 0's two chunks, then rank 1's, ...).");
  m.def("geometry", &geometry, nb::arg("shape"), nb::arg("seq_axis"), nb::arg("n"),
        nb::arg("global_"),
        "(outer, run, chunk_len, global_len, local_len) of a shape; ValueError when it does not "
        "fit.");
  m.def(
      "region_bytes",
      [](int64_t n, int64_t nbytes) {
        check_chunk_args(n);
        if (nbytes < 1) throw std::invalid_argument("nbytes must be positive");
        return region_bytes(n, round_up_slot_bytes(nbytes));
      },
      nb::arg("n"), nb::arg("nbytes"),
      "Device bytes a workspace of capacity nbytes holds on each GPU.");
#if JAX_CPGRAD_WITH_CUDA
  m.attr("HAS_CUDA") = true;
  bind_workspace(m);
#else
  m.attr("HAS_CUDA") = false;
#endif
}
