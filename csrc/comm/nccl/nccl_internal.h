// The NCCL transport's class, shared by its two translation units: nccl_transport.cpp (the communicator's
// life: creation, polling, the watchdog, abort, shutdown) and nccl_exchange.cpp (what moves bytes: handshake
// headers, a bucket's group of sends and receives, waits). Included by those two files only.
//
// Ordering, per bucket:  caller stream --ready_--> comm stream: [cast to wire dtype] group(recv..., send...)
//                        --slot.done--> wait(): the caller's current stream waits (cudaStreamWaitEvent).
// The comm stream waits for an event recorded on the caller's stream, so NCCL never reads a buffer before
// the kernel that wrote it. Every tensor a transfer touches is stashed in its slot (before anything is
// enqueued) until wait() has ordered the caller's stream after the transfer, and recorded on the comm stream
// with the caching allocator, as ProcessGroupNCCL does: memory the caller frees is not handed out again
// before the comm stream is done with it.
//
// Timeouts: every exchange (and every handshake) also records a "progress" event into a ring (issue order =
// comm-stream order). Its head is the oldest unfinished one; once it is past its deadline the transport
// aborts the communicator (which makes the stuck NCCL kernels exit) and every later call raises. The head is
// checked at every call and by a watchdog thread, which also catches a caller stuck in some CUDA
// synchronization outside this transport. NCCL's asynchronous errors are polled the same way. The
// communicator is non-blocking (config.blocking = 0), so no NCCL call can hang the host: each "in progress"
// state is polled against a deadline. Once the CUDA runtime is unloading (interpreter exit) the watchdog
// stops and nothing touches NCCL again: an abort then could block the exit.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../transport.h"

#pragma GCC visibility push(hidden)  // see transport.h

namespace decent_comm::comm::nccl_detail {

// "unhandled cuda error (ncclResult_t 1): <NCCL's last error>"; comm may be null.
std::string nccl_text(ncclResult_t r, ncclComm_t comm);
// Raises ExchangeError naming `what` (and the bucket when >= 0); the message is built only on failure.
void cuda_check(cudaError_t err, const char* what, int64_t bucket = -1);
// Between two polls of a wait that began at `since`: yields for its first 200 us (NCCL's enqueue, fast
// completions), then sleeps 50 us, then 1 ms past 20 ms (long waits cost no CPU).
void backoff(Clock::time_point since);
std::string bucket_context(int64_t bucket, const std::vector<PeerOp>& peers);

// The transport's device current on the calling thread for a scope, raising nothing (noexcept paths, destructors)
// and creating no context on the device it goes back to (c10's MaybeSetDevice). A thread that has made no CUDA call
// is on device 0, where the transport's first event query created a context: ~0.5 GiB of GPU 0 from every rank of a
// node whose exchanger was checked, synchronized or closed from such a thread (a collector or user thread).
class OnDevice {
 public:
  // The runtime's own calls, which return errors (c10's SetDevice checks by throwing: a terminate in a noexcept
  // path or destructor, e.g. with the runtime unloading at exit). On any error nothing is switched or restored.
  explicit OnDevice(c10::DeviceIndex device) noexcept : device_(device) {
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess) return;
    previous_ = static_cast<c10::DeviceIndex>(current);
    if (previous_ != device_ && cudaSetDevice(device_) != cudaSuccess) previous_ = -1;
  }
  ~OnDevice() {
    if (previous_ < 0 || previous_ == device_) return;
    try {  // (MaybeSetDevice asks the driver whether the device has a context, with a check that may throw)
      (void)c10::cuda::MaybeSetDevice(previous_);
    } catch (...) {
    }
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  c10::DeviceIndex device_;
  c10::DeviceIndex previous_ = -1;
};

struct NcclSlot final : TransportSlot {
  c10::DeviceIndex device = -1;  // the transport's: current while `done` is destroyed
  cudaEvent_t done = nullptr;  // recorded on the comm stream after the bucket's transfers
  // The stash: everything the comm stream reads or writes for this bucket, alive until wait().
  at::Tensor send;  // the caller's buffer (read by the wire cast, or sent as is)
  at::Tensor wire;  // the wire-dtype copy that is sent (undefined without a wire dtype)
  std::vector<at::Tensor> recvs;
  bool stashed = false;

  ~NcclSlot() override;
  void release();
};

// One exchange or handshake in comm-stream order, for the timeout check.
struct Progress {
  cudaEvent_t event = nullptr;
  Clock::time_point deadline;
  std::chrono::milliseconds timeout{0};
  int64_t bucket = -1;
  const char* stage = "";     // "transfer" or "size/dtype handshake", for the timeout message
  std::vector<PeerOp> peers;  // capacity reused when the ring entry is reused
};

class NcclTransport final : public Transport {
 public:
  NcclTransport(const std::string& unique_id, int rank, int world_size, int cuda_device,
                std::chrono::milliseconds timeout, int max_ctas);
  ~NcclTransport() override;

  const char* name() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  c10::Device device() const override { return c10::Device(c10::DeviceType::CUDA, device_index()); }
  c10::DeviceIndex device_index() const { return static_cast<c10::DeviceIndex>(device_index_); }
  std::chrono::milliseconds default_timeout() const override { return timeout_; }
  // NCCL runs a send to and a receive from the own rank inside one group as a local copy.
  bool supports_self_exchange() const override { return true; }

  std::unique_ptr<TransportSlot> make_slot() override;
  void swap_headers(const HeaderSwap& op) override;
  void start(TransportSlot& slot, const BucketOp& op) override;
  void wait(TransportSlot& slot) override;
  void wait_again(TransportSlot& slot) override;
  void synchronize() override;
  void check() override;
  void abort() noexcept override;
  void shutdown() override;

 private:
  enum class CommState { Live, Aborted, Destroyed };

  // All *_locked members run with mu_ held.
  void create_communicator_locked(const std::string& unique_id, int max_ctas);
  // Polls the communicator until its pending operation (init, an enqueue, finalize) completed; `what()` names
  // it in an error and is only called on failure.
  template <class What>
  void wait_comm_ready_locked(Clock::time_point deadline, std::chrono::milliseconds timeout, const What& what);
  // Raises the first failure, or an ExchangeError once the communicator was aborted or destroyed.
  void ensure_live_locked() const;
  void fail_locked(const std::string& message, bool is_timeout);
  void raise_if_failed_locked() const;
  void poll_locked();
  // Records a progress event on the comm stream after the work enqueued so far; the caller fills in its peers.
  Progress& push_progress_locked(int64_t bucket, Clock::time_point deadline, std::chrono::milliseconds timeout,
                                 const char* stage);
  // Closes an NCCL group opened by the caller and waits for the non-blocking enqueue; `failed` is the first
  // error of the calls inside it (ncclSuccess if none), `failed_call()` names it.
  template <class Failed, class What>
  void end_group_locked(ncclResult_t failed, const Failed& failed_call, Clock::time_point deadline,
                        std::chrono::milliseconds timeout, const What& what);
  // Raises a pending failure, else makes the caller's current stream wait for the slot's transfer.
  void order_current_stream_after_locked(const NcclSlot& slot);
  c10::cuda::CUDAStream comm_stream() const;
  void abort_comm_locked() noexcept;
  void watchdog_loop();
  void stop_watchdog() noexcept;
  void destroy_cuda_objects() noexcept;

  const int rank_;
  const int world_size_;
  const int device_index_;
  const std::chrono::milliseconds timeout_;

  std::mutex mu_;  // the caller's calls and the watchdog: NCCL calls, the ring, the error
  ncclComm_t comm_ = nullptr;  // null once aborted or destroyed: never used again
  CommState state_ = CommState::Live;
  cudaStream_t stream_ = nullptr;  // the comm stream
  cudaEvent_t ready_ = nullptr;    // recorded on the caller's stream, waited for by the comm stream
  cudaEvent_t headers_ = nullptr;  // recorded on the comm stream after a handshake's headers reached the host
  std::vector<Progress> ring_;
  size_t head_ = 0;
  size_t count_ = 0;
  std::string error_;  // the first failure; every later call raises it
  bool error_is_timeout_ = false;
  bool runtime_unloading_ = false;  // the CUDA runtime is going away (exit): touch neither CUDA nor NCCL

  std::condition_variable wake_;
  bool stop_ = false;
  std::thread watchdog_;
};

template <class What>
void NcclTransport::wait_comm_ready_locked(Clock::time_point deadline, std::chrono::milliseconds timeout,
                                           const What& what) {
  const Clock::time_point since = Clock::now();
  for (;;) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      const std::string message = "decent_comm NCCL transport: " + what() + " failed: " + nccl_text(state, comm_);
      fail_locked(message, false);
      throw ExchangeError(message);
    }
    if (Clock::now() >= deadline) {
      const std::string message = "decent_comm NCCL transport: " + what() + " timed out after " +
                                  std::to_string(timeout.count()) + " ms (a peer died, is stuck, or did not "
                                  "post the matching operation)";
      fail_locked(message, true);
      throw ExchangeTimeoutError(message);
    }
    backoff(since);
  }
}

template <class Failed, class What>
void NcclTransport::end_group_locked(ncclResult_t failed, const Failed& failed_call, Clock::time_point deadline,
                                     std::chrono::milliseconds timeout, const What& what) {
  // Always closed, even after a failed call: the group depth is per-thread NCCL state that other NCCL users
  // of this thread (torch's ProcessGroupNCCL) would otherwise inherit.
  const ncclResult_t ended = ncclGroupEnd();
  if (failed != ncclSuccess && failed != ncclInProgress) {
    const std::string message = "decent_comm NCCL transport: " + what() + ": " + failed_call() + " failed: " +
                                nccl_text(failed, comm_);
    fail_locked(message, false);
    throw ExchangeError(message);
  }
  if (ended == ncclInProgress) {
    // A non-blocking communicator enqueues in the background (the first exchange with a peer also connects
    // to it); the kernels are on the stream, and events may be recorded after them, only once it is ready.
    wait_comm_ready_locked(deadline, timeout, what);
  } else if (ended != ncclSuccess) {
    const std::string message = "decent_comm NCCL transport: " + what() + ": ncclGroupEnd failed: " +
                                nccl_text(ended, comm_);
    fail_locked(message, false);
    throw ExchangeError(message);
  }
}

}  // namespace decent_comm::comm::nccl_detail

#pragma GCC visibility pop
