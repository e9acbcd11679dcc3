// The stream an overlapped workspace's calls run on (Workspace(overlap=True)): one per GPU, owned
// by the workspace, so that a call can run beside the work XLA does on its own stream.
//
// A call is split in two custom calls. Its start makes this stream wait for XLA's stream (the
// inputs are ready), enqueues the whole protocol here, writing the call's results, and records an
// event with the call's buffers; its done, placed by XLA later in the program, checks that it was
// handed the buffers of one of the last starts (so XLA did not copy the results, nor the inputs
// it keeps alive; a copy that landed on another recent start's identical buffers would pass) and
// makes XLA's stream wait for the event. The results reach the rest of the program only
// through a barrier with the done's token (see peer_transport.py).
//
// Every call of the workspace runs on this one stream, in program order, so a workspace's calls
// never run two at a time, whatever XLA schedules between a start and its done. A done waits for
// the newest start enqueued so far: its own, or (if XLA began another pair first) a later one,
// which is later work on the same stream, so never too little.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "cp_layout.h"

namespace jax_cpgrad {

// The buffers of one call, as its start saw them and its done must see them again.
struct CallBuffers {
  int64_t count = 0;
  std::array<const void*, kMaxTensors> results{};
  std::array<const void*, kMaxTensors> inputs{};
  bool operator==(const CallBuffers& o) const {
    return count == o.count && results == o.results && inputs == o.inputs;
  }
};

class CallStream {
 public:
  // Creates the stream and its events on `device`; throws std::runtime_error.
  explicit CallStream(int device);
  ~CallStream();
  CallStream(const CallStream&) = delete;
  CallStream& operator=(const CallStream&) = delete;

  // One start (follow, enqueue, mark) or one done at a time; the lock is every call's proof.
  using Lock = std::unique_lock<std::mutex>;
  Lock hold() { return Lock(mu_); }

  cudaStream_t stream() const { return stream_; }
  // Start: this stream waits for everything enqueued so far on `xla_stream`.
  cudaError_t follow(const Lock&, cudaStream_t xla_stream);
  // Start, after the protocol is enqueued here (or failed to be): the point dones wait for.
  cudaError_t mark_started(const Lock&, const CallBuffers& buffers);
  // Done: "" and `xla_stream` waits for every start so far, or why the buffers are not a start's.
  std::string join(const Lock&, const CallBuffers& buffers, cudaStream_t xla_stream);
  // A start that failed: `xla_stream` waits for whatever it enqueued here, before XLA moves on.
  cudaError_t join_unchecked(const Lock&, cudaStream_t xla_stream);

 private:
  // Waits for the stream, then destroys it and the events (never throws). Only at construction
  // failure and destruction, when the last executable holding the workspace is gone: never in a
  // handler, which must not block.
  void release();
  int device_;
  cudaStream_t stream_ = nullptr;
  // A wait takes an event's state when it is enqueued, so one event of each kind serves every call.
  cudaEvent_t inputs_ready_ = nullptr;
  cudaEvent_t started_ = nullptr;
  std::mutex mu_;
  // The newest starts' buffers (oldest first), for the dones' check.
  static constexpr size_t kRemembered = 64;
  std::vector<CallBuffers> started_calls_;
};

}  // namespace jax_cpgrad
