// The ProcessGroup transport: moves buckets with a torch c10d backend's point-to-point send/recv (gloo on
// CPU in CI; any backend that implements send/recv works).
//
// No thread of its own: gloo's send/recv are already asynchronous (its transport thread moves the bytes),
// so start() just posts them and wait() waits on the Work handles with the time left to the bucket's
// deadline. Each bucket gets its own tag, so several buckets can be in flight between the same two ranks,
// and its handshake headers another, so a header never meets a data message.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport.h"

#pragma GCC visibility push(hidden)  // see transport.h

namespace decent_comm::comm {

// The timeout `pg` was created with, as its backend for `device_type` reports it (c10d's default of 30 min
// for a backend that does not say).
std::chrono::milliseconds process_group_timeout(c10d::ProcessGroup& pg, c10::DeviceType device_type);

// A posted send or receive, and what its failure names.
struct PgPending {
  c10::intrusive_ptr<c10d::Work> work;
  PeerOp op;
};

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

  void open() override;
  std::unique_ptr<TransportSlot> make_slot() override;
  void swap_headers(const HeaderSwap& op) override;
  void start(TransportSlot& slot, const BucketOp& op) override;
  void wait(TransportSlot& slot) override;
  void synchronize() override {}  // wait() already blocked until every transfer completed
  void abort() noexcept override {}  // nothing to stop; unfinished slots keep their buffers alive
  uint64_t wait_generation() const override { return wait_generation_.load(std::memory_order_acquire); }
  std::vector<int64_t> waiting_peers() const override;
  // Aborts the operation the running wait blocks on (gloo: Work::abort() wakes a waiting send/recv, which then
  // returns false; other backends are polled and see the flag), and that wait raises `reason`.
  bool interrupt(uint64_t generation, const std::string& reason, bool timed_out) override;
  // Everything completed: drop our references to the group (it belongs to the caller). Held on, they would
  // keep the gloo backend and its worker threads alive after dist.destroy_process_group() for as long as
  // the Exchanger lives (an optimizer in a reference cycle: until the interpreter's final GC), and a gloo
  // worker still releasing a finished collective's tensors needs the GIL; once Python finalizes, that
  // thread is killed inside a noexcept destructor: std::terminate (issue #14.1).
  void shutdown() override { release(); }
  // After a failure too: the group held on kept its backend's threads alive after dist.destroy_process_group(). The
  // abandoned operations (keep_unfinished_alive) hold the backend's context, not the group.
  void release() noexcept override {
    retired_.clear();  // first: the group must outlive its Works (they hold its gloo context)
    backend_.reset();
    pg_.reset();
  }

 private:
  // Posts a receive (is_send false) or send of `tensor` on `tag`, appending it to `pending`.
  void post(std::vector<PgPending>& pending, const at::Tensor& tensor, PeerOp op, int tag);
  // Waits for every operation of `pending` until `deadline`; raises a timeout naming the unfinished ones, or
  // the error of the first that failed. `stage` prefixes the backend's text ("" for data).
  void wait_all(const std::vector<PgPending>& pending, int64_t bucket, Clock::time_point deadline,
                std::chrono::milliseconds timeout, const char* stage) const;
  // Waits for one operation until `deadline`; false or an exception when it failed or timed out.
  bool wait_one(const c10::intrusive_ptr<c10d::Work>& work, Clock::time_point deadline) const;
  // For a timeout message: did this operation finish (probed for at most ~1 ms)?
  bool finished_soon(const c10::intrusive_ptr<c10d::Work>& work) const;
  // Registers pending[index] as the operation the wait blocks on now, what interrupt() aborts (pending nullptr: the
  // wait ended, an interrupt now stops nothing).
  void set_waiting(const std::vector<PgPending>* pending, size_t index) const;

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;  // keeps the backend's owner alive (until shutdown())
  c10::intrusive_ptr<c10d::Backend> backend_;
  c10::Device device_;
  int rank_;
  int world_size_;
  int channel_ = -1;  // which exchanger on this process group (same creation order on every rank); open()
  int tag_base_ = 0;   // tag of bucket b's data is tag_base_ + b, of its handshake headers that + kHeaderTagBit
  // gloo's Work::wait(timeout) returns or throws by the timeout; other backends are polled (isCompleted)
  // so a wait never outlives the deadline whatever the backend.
  bool bounded_wait_;
  std::chrono::milliseconds default_timeout_;
  std::vector<at::Tensor> one_;  // the one-tensor list c10d's send/recv take by reference, reused
  // Each bucket's operations that completed in its last wait(), destroyed at its next start() (after the new ones are
  // posted) or by release(). Destroyed in wait() right after completion, a gloo Work's ~UnboundBuffer spun on
  // sched_yield until gloo's I/O thread dropped its reference to the buffer; on an oversubscribed machine that thread
  // was often preempted just after it woke us, and an exchange round took 2.7-6.3 ms against torch isend/irecv's
  // 0.24-1.3 ms (which drops its Works later too). A Work holds its tensor, so a bucket's last buffers stay referenced
  // (not pinned) until then. Declared after pg_ and backend_, so those outlive these Works.
  std::unordered_map<int64_t, std::vector<PgPending>> retired_;
  // What a wait blocks on right now and an interrupt()'s words for it: written by the waiting thread (under the
  // lock) and by interrupt() from another thread; `interrupted_` is also read without the lock by the polling wait.
  mutable std::mutex interrupt_mu_;
  mutable const std::vector<PgPending>* waiting_ = nullptr;
  mutable size_t waiting_index_ = 0;
  mutable std::atomic<uint64_t> wait_generation_{0};  // written under the lock
  mutable std::atomic<bool> interrupted_{false};
  mutable std::string interrupt_reason_;
  mutable bool interrupt_timed_out_ = false;
};

}  // namespace decent_comm::comm

#pragma GCC visibility pop
