// The ProcessGroup transport: moves buckets with a torch c10d backend's point-to-point send/recv (gloo on
// CPU in CI; any backend that implements send/recv works).
//
// No thread of its own: gloo's send/recv are already asynchronous (its transport thread moves the bytes),
// so start() just posts them and wait() waits on the Work handles with the time left to the bucket's
// deadline. Each bucket gets its own tag, so several buckets can be in flight between the same two ranks.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "transport.h"

#pragma GCC visibility push(hidden)  // see transport.h

namespace decent_comm::comm {

// The timeout `pg` was created with, as its backend for `device_type` reports it (c10d's default of 30 min
// for a backend that does not say).
std::chrono::milliseconds process_group_timeout(c10d::ProcessGroup& pg, c10::DeviceType device_type);

class ProcessGroupTransport final : public Transport {
 public:
  // device: where the buffers live (the process group needs a backend for its type).
  ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::Device device);

  const char* name() const override { return "process_group"; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  c10::Device device() const override { return device_; }
  std::chrono::milliseconds default_timeout() const override { return default_timeout_; }
  int channel() const { return channel_; }

  std::unique_ptr<TransportSlot> make_slot() override;
  void start(TransportSlot& slot, const BucketOp& op) override;
  void wait(TransportSlot& slot) override;
  void synchronize() override {}  // wait() already blocked until every transfer completed
  void abort() noexcept override {}  // nothing to stop; unfinished slots keep their buffers alive
  void shutdown() override {}     // the process group belongs to the caller

 private:
  // Waits for one operation until `deadline`; false or an exception when it failed or timed out.
  bool wait_one(const c10::intrusive_ptr<c10d::Work>& work, Clock::time_point deadline) const;
  // For a timeout message: did this operation finish (probed for at most ~1 ms)?
  bool finished_soon(const c10::intrusive_ptr<c10d::Work>& work) const;

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;  // keeps the backend's owner alive
  c10::intrusive_ptr<c10d::Backend> backend_;
  c10::Device device_;
  int rank_;
  int world_size_;
  int channel_;   // which exchanger on this process group (same creation order on every rank)
  int tag_base_;  // tag of bucket b is tag_base_ + b
  // gloo's Work::wait(timeout) returns or throws by the timeout; other backends are polled (isCompleted)
  // so a wait never outlives the deadline whatever the backend.
  bool bounded_wait_;
  std::chrono::milliseconds default_timeout_;
  std::vector<at::Tensor> one_;  // the one-tensor list c10d's send/recv take by reference, reused
};

}  // namespace decent_comm::comm

#pragma GCC visibility pop
