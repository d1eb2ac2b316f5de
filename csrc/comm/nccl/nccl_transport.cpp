// The NCCL transport: buckets move on a dedicated high-priority CUDA stream over the exchanger's own
// non-blocking NCCL communicator; nothing here blocks the host except synchronize() and shutdown().
//
// Ordering, per bucket:  caller stream --ready_--> comm stream: [cast to wire dtype] group(recv..., send...)
//                        --slot.done--> wait(): the caller's current stream waits (cudaStreamWaitEvent).
// The comm stream waits for an event recorded on the caller's stream, so NCCL never reads a buffer before
// the kernel that wrote it. Tensors stay stashed in the slot until wait() has ordered the caller's stream
// after the transfer; memory freed after that is only reused by work ordered after it.
//
// Timeouts: every exchange also records a "progress" event into a ring (issue order = comm-stream order).
// Its head is the oldest unfinished exchange; once it is past its deadline the transport aborts the
// communicator (which makes the stuck NCCL kernels exit) and every later call raises. The head is checked
// at every exchange/wait/synchronize call and by a watchdog thread, which also catches a caller stuck in
// some CUDA synchronization outside this transport. NCCL's asynchronous errors are polled the same way.
// The communicator is non-blocking (config.blocking = 0), so no NCCL call can hang the host either: each
// "in progress" state is polled against a deadline.
#include "nccl_transport.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

namespace decent_comm::comm {

namespace {

std::string nccl_text(ncclResult_t r, ncclComm_t comm) {
  std::string text = std::string(ncclGetErrorString(r)) + " (ncclResult_t " + std::to_string(int(r)) + ")";
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') text += ": " + std::string(last);
  return text;
}

// The message is built only on failure: these checks sit on the per-exchange path.
void cuda_check(cudaError_t err, const char* what, int64_t bucket = -1) {
  if (err != cudaSuccess) {
    throw ExchangeError(std::string("decent_comm NCCL transport: ") +
                        (bucket >= 0 ? "bucket " + std::to_string(bucket) + ": " : std::string()) + what +
                        " failed: " + cudaGetErrorString(err));
  }
}

std::string bucket_prefix(int64_t bucket) {
  return "decent_comm NCCL transport: bucket " + std::to_string(bucket) + ": ";
}

std::string bucket_context(int64_t bucket, const std::vector<PeerOp>& peers) {
  return "bucket " + std::to_string(bucket) + " (" + describe(peers) + ")";
}

// Sleeps a little longer each time: the first polls catch fast completions, later ones cost no CPU.
void backoff(int polls) {
  if (polls < 32) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(polls < 512 ? 50 : 1000));
  }
}

struct NcclSlot final : TransportSlot {
  cudaEvent_t done = nullptr;  // recorded on the comm stream after the bucket's transfers
  at::Tensor send;             // the stash: alive until wait()
  std::vector<at::Tensor> recvs;
  bool stashed = false;

  ~NcclSlot() override {
    if (stashed) {  // never waited for (failure, or no shutdown()): the GPU may still touch these
      struct Kept {
        at::Tensor send;
        std::vector<at::Tensor> recvs;
      };
      keep_alive_forever(std::make_shared<Kept>(Kept{std::move(send), std::move(recvs)}));
    }
    // Safe even if the event is pending (its resources are released once it completes); errors at
    // interpreter exit (CUDA already unloading) are deliberately ignored.
    if (done != nullptr) (void)cudaEventDestroy(done);
  }
};

// One exchange in comm-stream order, for the timeout check.
struct Progress {
  cudaEvent_t event = nullptr;
  Clock::time_point deadline;
  std::chrono::milliseconds timeout{0};
  int64_t bucket = -1;
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

  std::unique_ptr<TransportSlot> make_slot() override;
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
  void wait_comm_ready_locked(Clock::time_point deadline, std::chrono::milliseconds timeout,
                              const std::string& what);
  void fail_locked(const std::string& message, bool is_timeout);
  void raise_if_failed_locked() const;
  void poll_locked();
  void push_progress_locked(const BucketOp& op);
  // Raises a pending failure, else makes the caller's current stream wait for the slot's transfer.
  void order_current_stream_after_locked(const NcclSlot& slot);
  void abort_comm_locked() noexcept;
  void watchdog_loop();
  void stop_watchdog() noexcept;
  void destroy_cuda_objects() noexcept;

  const int rank_;
  const int world_size_;
  const int device_index_;
  const std::chrono::milliseconds timeout_;

  std::mutex mu_;  // the caller's calls and the watchdog: NCCL calls, the ring, the error
  ncclComm_t comm_ = nullptr;
  CommState state_ = CommState::Live;
  cudaStream_t stream_ = nullptr;  // the comm stream
  cudaEvent_t ready_ = nullptr;    // recorded on the caller's stream, waited for by the comm stream
  std::vector<Progress> ring_;
  size_t head_ = 0;
  size_t count_ = 0;
  std::string error_;  // the first failure; every later call raises it
  bool error_is_timeout_ = false;

  std::condition_variable wake_;
  bool stop_ = false;
  std::thread watchdog_;
};

NcclTransport::NcclTransport(const std::string& unique_id, int rank, int world_size, int cuda_device,
                             std::chrono::milliseconds timeout, int max_ctas)
    : rank_(rank), world_size_(world_size), device_index_(cuda_device), timeout_(timeout) {
  TORCH_CHECK_VALUE(unique_id.size() == NCCL_UNIQUE_ID_BYTES, "decent_comm NCCL transport: unique_id must be ",
                    NCCL_UNIQUE_ID_BYTES, " bytes, got ", unique_id.size());
  TORCH_CHECK_VALUE(world_size >= 1 && rank >= 0 && rank < world_size, "decent_comm NCCL transport: rank ", rank,
                    " is not in [0, world_size=", world_size, ")");
  TORCH_CHECK_VALUE(max_ctas >= 0, "decent_comm NCCL transport: nccl_max_ctas must be >= 1 (0: NCCL's default), got ",
                    max_ctas);
  const c10::cuda::CUDAGuard guard{device_index()};
  std::lock_guard<std::mutex> lock(mu_);
  try {
    // A dedicated stream (not one of torch's pool streams, which other code may share) at the highest
    // priority, so transfers are scheduled ahead of the compute kernels they overlap with.
    int least = 0, greatest = 0;
    cuda_check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    cuda_check(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest),
               "cudaStreamCreateWithPriority (comm stream)");
    cuda_check(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate (ready event)");
    create_communicator_locked(unique_id, max_ctas);
  } catch (...) {
    abort_comm_locked();
    destroy_cuda_objects();  // nothing was enqueued yet
    throw;
  }
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

void NcclTransport::create_communicator_locked(const std::string& unique_id, int max_ctas) {
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; "in progress" states are polled with a deadline
  config.commName = "decent_comm";
  if (max_ctas > 0) {
    // Leaves the other SMs to the compute kernels the exchange overlaps with.
    config.minCTAs = 1;
    config.maxCTAs = max_ctas;
  }
  const ncclResult_t r = ncclCommInitRankConfig(&comm_, world_size_, id, rank_, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    throw ExchangeError("decent_comm NCCL transport: ncclCommInitRankConfig (rank " + std::to_string(rank_) +
                        " of " + std::to_string(world_size_) + ", device " + std::to_string(device_index_) +
                        ") failed: " + nccl_text(r, comm_));
  }
  wait_comm_ready_locked(Clock::now() + timeout_, timeout_,
                         "creating the NCCL communicator (every one of the " + std::to_string(world_size_) +
                             " ranks must create its Exchanger)");
}

NcclTransport::~NcclTransport() {
  stop_watchdog();
  if (state_ == CommState::Live) {
    // Destroying a communicator can block on peers, and a destructor may run at interpreter exit: leak it.
    TORCH_WARN("decent_comm NCCL transport destroyed without shutdown(); its NCCL communicator is leaked "
               "(call Exchanger.shutdown())");
  }
  // Live or aborted: GPU work may still reference the stream and events, so they are leaked too.
}

void NcclTransport::wait_comm_ready_locked(Clock::time_point deadline, std::chrono::milliseconds timeout,
                                           const std::string& what) {
  for (int polls = 0;; ++polls) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      const std::string message = "decent_comm NCCL transport: " + what + " failed: " + nccl_text(state, comm_);
      abort_comm_locked();
      throw ExchangeError(message);
    }
    if (Clock::now() >= deadline) {
      const std::string message = "decent_comm NCCL transport: " + what + " timed out after " +
                                  std::to_string(timeout.count()) + " ms (a peer died, is stuck, or did not "
                                  "post the matching operation)";
      abort_comm_locked();
      throw ExchangeTimeoutError(message);
    }
    backoff(polls);
  }
}

std::unique_ptr<TransportSlot> NcclTransport::make_slot() {
  const c10::cuda::CUDAGuard guard{device_index()};
  auto slot = std::make_unique<NcclSlot>();
  cuda_check(cudaEventCreateWithFlags(&slot->done, cudaEventDisableTiming), "cudaEventCreate (bucket event)");
  return slot;
}

void NcclTransport::start(TransportSlot& base, const BucketOp& op) {
  auto& slot = static_cast<NcclSlot&>(base);
  std::lock_guard<std::mutex> lock(mu_);
  raise_if_failed_locked();
  const c10::cuda::CUDAGuard guard{device_index()};

  // The comm stream waits for everything enqueued so far on the caller's stream (the kernel writing `send`,
  // the previous readers of `recvs`).
  const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_index()).stream();
  cuda_check(cudaEventRecord(ready_, caller), "cudaEventRecord on the current stream", op.bucket);
  cuda_check(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent of the comm stream", op.bucket);
  if (op.wire.defined()) {
    // On the comm stream, after the wait above; the previous send from this buffer is earlier on the same
    // stream, so overwriting it is ordered after that send.
    const c10::cuda::CUDAStreamGuard on_comm(
        c10::cuda::getStreamFromExternal(stream_, device_index()));
    op.wire.copy_(op.send);
  }
  const at::Tensor& payload = op.wire.defined() ? op.wire : op.send;

  // One group per bucket: NCCL schedules its receives and sends together, so a pair of ranks sending to
  // each other cannot deadlock and the transfers share channels.
  const ncclResult_t started = ncclGroupStart();
  if (started != ncclSuccess) {
    throw ExchangeError(bucket_prefix(op.bucket) + "ncclGroupStart failed: " + nccl_text(started, comm_));
  }
  std::string failed;
  for (size_t i = 0; i < op.recv_from.size() && failed.empty(); ++i) {
    const ncclResult_t r = ncclRecv(op.recvs[i].data_ptr(), size_t(op.recvs[i].nbytes()), ncclUint8,
                                    int(op.recv_from[i]), comm_, stream_);
    if (r != ncclSuccess && r != ncclInProgress) {
      failed = "ncclRecv from rank " + std::to_string(op.recv_from[i]) + ": " + nccl_text(r, comm_);
    }
  }
  for (size_t i = 0; i < op.send_to.size() && failed.empty(); ++i) {
    const ncclResult_t r = ncclSend(payload.data_ptr(), size_t(payload.nbytes()), ncclUint8, int(op.send_to[i]),
                                    comm_, stream_);
    if (r != ncclSuccess && r != ncclInProgress) {
      failed = "ncclSend to rank " + std::to_string(op.send_to[i]) + ": " + nccl_text(r, comm_);
    }
  }
  // Always closed, even after a failed call: the group depth is per-thread NCCL state that other NCCL users
  // of this thread (torch's ProcessGroupNCCL) would otherwise inherit.
  const ncclResult_t ended = ncclGroupEnd();
  if (!failed.empty()) throw ExchangeError(bucket_prefix(op.bucket) + failed);
  if (ended != ncclSuccess && ended != ncclInProgress) {
    throw ExchangeError(bucket_prefix(op.bucket) + "ncclGroupEnd failed: " + nccl_text(ended, comm_));
  }
  std::vector<PeerOp> peers;
  if (ended == ncclInProgress) {
    // A non-blocking communicator enqueues in the background (the first exchange with a peer also connects
    // to it); the kernels are on the stream, and events may be recorded after them, only once it is ready.
    for (const int64_t r : op.recv_from) peers.push_back({int(r), false});
    for (const int64_t r : op.send_to) peers.push_back({int(r), true});
    wait_comm_ready_locked(op.deadline, op.timeout, "enqueueing " + bucket_context(op.bucket, peers));
  }
  cuda_check(cudaEventRecord(slot.done, stream_), "cudaEventRecord on the comm stream", op.bucket);
  push_progress_locked(op);
  slot.send = payload;
  slot.recvs.assign(op.recvs.begin(), op.recvs.end());
  slot.stashed = true;
}

void NcclTransport::push_progress_locked(const BucketOp& op) {
  if (count_ == ring_.size()) {  // grow, keeping issue order; steady state reuses the entries
    std::vector<Progress> grown(std::max<size_t>(8, 2 * ring_.size()));
    for (size_t i = 0; i < count_; ++i) grown[i] = std::move(ring_[(head_ + i) % ring_.size()]);
    for (size_t i = count_; i < grown.size(); ++i) {
      cuda_check(cudaEventCreateWithFlags(&grown[i].event, cudaEventDisableTiming), "cudaEventCreate (progress)");
    }
    ring_ = std::move(grown);
    head_ = 0;
  }
  Progress& p = ring_[(head_ + count_) % ring_.size()];
  p.deadline = op.deadline;
  p.timeout = op.timeout;
  p.bucket = op.bucket;
  p.peers.clear();
  for (const int64_t r : op.recv_from) p.peers.push_back({int(r), false});
  for (const int64_t r : op.send_to) p.peers.push_back({int(r), true});
  cuda_check(cudaEventRecord(p.event, stream_), "cudaEventRecord (progress) on the comm stream", op.bucket);
  ++count_;
}

void NcclTransport::poll_locked() {
  if (state_ != CommState::Live) return;
  while (count_ > 0) {
    Progress& p = ring_[head_];
    const cudaError_t q = cudaEventQuery(p.event);
    if (q == cudaSuccess) {
      head_ = (head_ + 1) % ring_.size();
      --count_;
      continue;
    }
    if (q != cudaErrorNotReady) {
      fail_locked("decent_comm NCCL transport: " + bucket_context(p.bucket, p.peers) + ": CUDA error on the comm "
                  "stream: " + cudaGetErrorString(q), false);
      return;
    }
    if (Clock::now() >= p.deadline) {
      fail_locked(timeout_error(p.bucket, p.timeout, p.peers, "NCCL transfer not complete; communicator aborted")
                      .what(),
                  true);
      return;
    }
    break;  // the head is in progress and in time; later exchanges are behind it on the same stream
  }
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
  if (r != ncclSuccess) state = r;
  if (state != ncclSuccess && state != ncclInProgress) {
    const std::string which = count_ > 0 ? bucket_context(ring_[head_].bucket, ring_[head_].peers) : "no bucket";
    fail_locked("decent_comm NCCL transport: asynchronous NCCL error (oldest exchange in flight: " + which +
                    "): " + nccl_text(state, comm_), false);
  }
}

void NcclTransport::fail_locked(const std::string& message, bool is_timeout) {
  if (!error_.empty()) return;
  error_ = message;
  error_is_timeout_ = is_timeout;
  abort_comm_locked();  // the stuck kernels exit, so the caller's stream (waiting on them) moves on
}

void NcclTransport::raise_if_failed_locked() const {
  if (error_.empty()) return;
  if (error_is_timeout_) throw ExchangeTimeoutError(error_);
  throw ExchangeError(error_);
}

void NcclTransport::order_current_stream_after_locked(const NcclSlot& slot) {
  poll_locked();
  raise_if_failed_locked();
  const c10::cuda::CUDAGuard guard{device_index()};
  const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_index()).stream();
  cuda_check(cudaStreamWaitEvent(caller, slot.done, 0), "cudaStreamWaitEvent of the current stream on a bucket");
}

void NcclTransport::wait(TransportSlot& base) {
  auto& slot = static_cast<NcclSlot&>(base);
  std::lock_guard<std::mutex> lock(mu_);
  order_current_stream_after_locked(slot);
  // The caller's stream is now ordered after the transfer: memory freed from here on is only reused by
  // work that runs after it.
  slot.send = at::Tensor();
  slot.recvs.clear();
  slot.stashed = false;
}

void NcclTransport::wait_again(TransportSlot& base) {
  std::lock_guard<std::mutex> lock(mu_);
  order_current_stream_after_locked(static_cast<NcclSlot&>(base));
}

void NcclTransport::synchronize() {
  for (int polls = 0;; ++polls) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      poll_locked();
      raise_if_failed_locked();
      if (count_ == 0) return;
    }
    backoff(polls);  // outside the lock, so the watchdog is never held up
  }
}

void NcclTransport::check() {
  std::lock_guard<std::mutex> lock(mu_);
  poll_locked();
  raise_if_failed_locked();
}

void NcclTransport::watchdog_loop() {
  // Event queries need this thread on the transport's device.
  if (cudaSetDevice(device_index_) != cudaSuccess) return;  // the caller-side checks still run
  const auto period = std::clamp(timeout_ / 10, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    wake_.wait_for(lock, period);
    if (!stop_) poll_locked();
  }
}

void NcclTransport::stop_watchdog() noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

void NcclTransport::abort_comm_locked() noexcept {
  if (state_ != CommState::Live) return;
  state_ = CommState::Aborted;
  if (comm_ != nullptr) (void)ncclCommAbort(comm_);  // nothing more to do if even the abort fails
}

void NcclTransport::abort() noexcept {
  stop_watchdog();
  std::lock_guard<std::mutex> lock(mu_);
  abort_comm_locked();
}

void NcclTransport::destroy_cuda_objects() noexcept {
  for (auto& p : ring_) {
    if (p.event != nullptr) (void)cudaEventDestroy(p.event);
    p.event = nullptr;
  }
  if (ready_ != nullptr) (void)cudaEventDestroy(ready_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  ready_ = nullptr;
  stream_ = nullptr;
}

void NcclTransport::shutdown() {
  stop_watchdog();
  std::lock_guard<std::mutex> lock(mu_);
  raise_if_failed_locked();
  if (state_ != CommState::Live) return;
  const c10::cuda::CUDAGuard guard{device_index()};
  // The scheduler synchronized first, so finalize only flushes NCCL's internal work; it is non-blocking
  // like every call here and polled with the timeout.
  const ncclResult_t r = ncclCommFinalize(comm_);
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string message = "decent_comm NCCL transport: ncclCommFinalize failed: " + nccl_text(r, comm_);
    abort_comm_locked();
    throw ExchangeError(message);
  }
  wait_comm_ready_locked(Clock::now() + timeout_, timeout_, "finalizing the NCCL communicator");
  const ncclResult_t d = ncclCommDestroy(comm_);
  if (d != ncclSuccess && d != ncclInProgress) {
    const std::string message = "decent_comm NCCL transport: ncclCommDestroy failed: " + nccl_text(d, comm_);
    abort_comm_locked();
    throw ExchangeError(message);
  }
  state_ = CommState::Destroyed;
  comm_ = nullptr;
  cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize of the comm stream at shutdown");
  destroy_cuda_objects();
}

}  // namespace

std::string nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    throw ExchangeError(std::string("decent_comm NCCL transport: ncclGetUniqueId failed: ") + ncclGetErrorString(r));
  }
  return std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
}

std::shared_ptr<Transport> make_nccl_transport(const std::string& unique_id, int rank, int world_size,
                                               int device_index, int64_t timeout_ms, int max_ctas) {
  TORCH_CHECK_VALUE(timeout_ms > 0, "decent_comm NCCL transport: timeout must be positive, got ", timeout_ms, " ms");
  return std::make_shared<NcclTransport>(unique_id, rank, world_size, device_index,
                                         std::chrono::milliseconds(timeout_ms), max_ctas);
}

}  // namespace decent_comm::comm
