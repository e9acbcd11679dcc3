// The stream an overlapped workspace's calls run on (Workspace(overlap=True)): one per GPU, owned
// by the workspace, so that a call can run beside the work XLA does on its own stream.
//
// A call is split in two custom calls. Its start makes this stream wait for XLA's stream (the
// inputs are ready), enqueues the whole protocol here, writing the call's results, and records an
// event; its done, placed by XLA later in the program, makes XLA's stream wait for that event.
// The results reach the rest of the program only through a barrier with the done's token (see
// peer_transport.py), so nothing reads them before the done.
//
// Every call of the workspace runs on this one stream, in program order, so a workspace's calls
// never run two at a time, whatever XLA schedules between a start and its done. A done waits for
// the newest start enqueued so far: its own, or (if XLA began another pair first) a later one,
// which is later work on the same stream, so never too little.
#pragma once

#include <cuda_runtime.h>

#include <mutex>

namespace jax_cpgrad {

class CallStream {
 public:
  // Creates the stream and its events on `device`; throws std::runtime_error.
  explicit CallStream(int device);
  ~CallStream();
  CallStream(const CallStream&) = delete;
  CallStream& operator=(const CallStream&) = delete;

  cudaStream_t stream() const { return stream_; }
  // Start: this stream waits for everything enqueued so far on `xla_stream`.
  cudaError_t follow(cudaStream_t xla_stream);
  // Start, after the protocol is enqueued here: the point dones wait for.
  cudaError_t mark_started();
  // Done: `xla_stream` waits for every start enqueued so far.
  cudaError_t join(cudaStream_t xla_stream);

 private:
  void release();  // waits for the stream, then destroys it and the events (never throws)
  int device_;
  cudaStream_t stream_ = nullptr;
  // A wait takes an event's state when it is enqueued, so one event of each kind serves every
  // call; the mutex orders record and wait (XLA may enqueue from several threads on one GPU).
  cudaEvent_t inputs_ready_ = nullptr;
  cudaEvent_t started_ = nullptr;
  std::mutex mu_;
};

}  // namespace jax_cpgrad
