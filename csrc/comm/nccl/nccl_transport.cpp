// The NCCL transport's communicator life: creation, polling for timeouts and asynchronous errors, the
// watchdog, abort and shutdown (the class and its design: nccl_internal.h; moving bytes: nccl_exchange.cpp).
#include "nccl_transport.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "nccl_internal.h"

namespace decent_comm::comm {

namespace nccl_detail {

std::string nccl_text(ncclResult_t r, ncclComm_t comm) {
  std::string text = std::string(ncclGetErrorString(r)) + " (ncclResult_t " + std::to_string(int(r)) + ")";
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') text += ": " + std::string(last);
  return text;
}

void cuda_check(cudaError_t err, const char* what, int64_t bucket) {
  if (err != cudaSuccess) {
    throw ExchangeError(std::string("decent_comm NCCL transport: ") +
                        (bucket >= 0 ? "bucket " + std::to_string(bucket) + ": " : std::string()) + what +
                        " failed: " + cudaGetErrorString(err));
  }
}

void backoff(Clock::time_point since) {
  // A non-blocking communicator hands every group to a thread of its own (NCCL's ncclGroupEndInternal; 2.28 and
  // 2.30), ready some 25-60 us later: yielding through that costs little CPU, and the caller gets on at once. 32
  // yields (18 us) before 50 us sleeps, which Linux's default timer slack stretches to ~130 us, put one sleep into
  // nearly every exchange (a fixed ~130 us per exchange on the H200, docs/gpu_results.md). torch's
  // ProcessGroupNCCL yields without sleeping at the same point.
  const auto waited = Clock::now() - since;
  if (waited < std::chrono::microseconds(200)) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(waited < std::chrono::milliseconds(20) ? std::chrono::microseconds(50)
                                                                       : std::chrono::milliseconds(1));
  }
}

// Comm streams are never destroyed: the caching allocator keeps every stream a block was recorded on
// (recordStream, done for each buffer a transfer uses) and records an event on it when that block is freed,
// which can come long after shutdown(): the parameters freed at exit, an optimizer rebuilt in the process. A
// destroyed stream there is an invalid handle inside a destructor (a terminate). So a transport that shut
// down gives its (synchronized) stream back here and the next transport on that device takes it: a device holds
// at most as many comm streams as transports were ever alive on it at once.
namespace {
std::mutex& stream_pool_mutex() {
  static auto* mu = new std::mutex();  // leaked: transports may shut down during static destruction
  return *mu;
}
std::unordered_map<int, std::vector<cudaStream_t>>& stream_pool() {
  static auto* pool = new std::unordered_map<int, std::vector<cudaStream_t>>();
  return *pool;
}

cudaStream_t take_comm_stream(int device) {
  {
    std::lock_guard<std::mutex> lock(stream_pool_mutex());
    auto& idle = stream_pool()[device];
    if (!idle.empty()) {
      const cudaStream_t stream = idle.back();
      idle.pop_back();
      return stream;
    }
  }
  // At the highest priority, so transfers are scheduled ahead of the compute kernels they overlap with; not
  // one of torch's pool streams, which other code may share.
  int least = 0, greatest = 0;
  cuda_check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest),
             "cudaStreamCreateWithPriority (comm stream)");
  return stream;
}

void give_back_comm_stream(int device, cudaStream_t stream) noexcept {
  try {
    std::lock_guard<std::mutex> lock(stream_pool_mutex());
    stream_pool()[device].push_back(stream);
  } catch (...) {  // out of memory: the stream stays leaked, which is safe
  }
}
}  // namespace

std::string bucket_context(int64_t bucket, const std::vector<PeerOp>& peers) {
  return "bucket " + std::to_string(bucket) + " (" + describe(peers) + ")";
}

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
    stream_ = take_comm_stream(device_index_);
    cuda_check(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate (ready event)");
    cuda_check(cudaEventCreateWithFlags(&headers_, cudaEventDisableTiming), "cudaEventCreate (headers event)");
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
  wait_comm_ready_locked(Clock::now() + timeout_, timeout_, [&] {
    return "creating the NCCL communicator (every one of the " + std::to_string(world_size_) +
           " ranks must create its Exchanger)";
  });
}

NcclTransport::~NcclTransport() {
  stop_watchdog();
  if (state_ == CommState::Live && !runtime_unloading_) {
    // Destroying a communicator can block on peers, and a destructor may run at interpreter exit: leak it.
    TORCH_WARN("decent_comm NCCL transport destroyed without shutdown(); its NCCL communicator is leaked "
               "(call Exchanger.shutdown())");
  }
  // Live or aborted: GPU work may still reference the stream and events, so they are leaked too.
}

c10::cuda::CUDAStream NcclTransport::comm_stream() const {
  return c10::cuda::getStreamFromExternal(stream_, device_index());
}

void NcclTransport::ensure_live_locked() const {
  raise_if_failed_locked();
  if (state_ == CommState::Aborted) {
    throw ExchangeError("decent_comm NCCL transport: the communicator was aborted after an earlier error; "
                        "create a new Exchanger");
  }
  if (state_ == CommState::Destroyed) throw ExchangeError("decent_comm NCCL transport: it has been shut down");
}

Progress& NcclTransport::push_progress_locked(int64_t bucket, Clock::time_point deadline,
                                              std::chrono::milliseconds timeout, const char* stage) {
  if (count_ == ring_.size()) {  // grow, keeping issue order; steady state reuses the entries
    std::vector<Progress> grown(std::max<size_t>(8, 2 * ring_.size()));
    for (size_t i = count_; i < grown.size(); ++i) {
      const cudaError_t err = cudaEventCreateWithFlags(&grown[i].event, cudaEventDisableTiming);
      if (err != cudaSuccess) {
        for (size_t j = count_; j < i; ++j) (void)cudaEventDestroy(grown[j].event);  // never recorded
        cuda_check(err, "cudaEventCreate (progress)", bucket);
      }
    }
    for (size_t i = 0; i < count_; ++i) grown[i] = std::move(ring_[(head_ + i) % ring_.size()]);
    ring_ = std::move(grown);
    head_ = 0;
  }
  Progress& p = ring_[(head_ + count_) % ring_.size()];
  p.deadline = deadline;
  p.timeout = timeout;
  p.bucket = bucket;
  p.stage = stage;
  p.peers.clear();  // keeps the capacity
  cuda_check(cudaEventRecord(p.event, stream_), "cudaEventRecord (progress) on the comm stream", bucket);
  ++count_;
  return p;
}

void NcclTransport::poll_locked() {
  if (state_ != CommState::Live || runtime_unloading_) return;
  while (count_ > 0) {
    Progress& p = ring_[head_];
    const cudaError_t q = cudaEventQuery(p.event);
    if (q == cudaSuccess) {
      head_ = (head_ + 1) % ring_.size();
      --count_;
      continue;
    }
    if (q == cudaErrorStreamCaptureUnsupported || q == cudaErrorStreamCaptureImplicit) {
      // Asked from a thread that is capturing a CUDA graph (a caller's check()): no answer; the watchdog asks later.
      (void)cudaGetLastError();
      break;
    }
    if (q == cudaErrorCudartUnloading) {
      // Interpreter exit with this transport still alive: whatever was in flight no longer matters, and an
      // abort now could block the exit. Stop here for good.
      runtime_unloading_ = true;
      return;
    }
    if (q != cudaErrorNotReady) {
      fail_locked("decent_comm NCCL transport: " + bucket_context(p.bucket, p.peers) + ": CUDA error on the comm "
                  "stream: " + cudaGetErrorString(q), false);
      return;
    }
    if (Clock::now() >= p.deadline) {
      fail_locked(timeout_error(p.bucket, p.timeout, p.peers,
                                std::string(p.stage) + " not complete on the GPU; communicator aborted").what(),
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

void NcclTransport::check() {
  const OnDevice on(device_index());
  std::lock_guard<std::mutex> lock(mu_);
  poll_locked();
  ensure_live_locked();
}

void NcclTransport::watchdog_loop() {
  // Event queries need this thread on the transport's device. Without it only the caller-side checks run, and a
  // caller blocked in its own CUDA synchronization behind a stuck transfer is never aborted: said, not silent.
  if (cudaSetDevice(device_index_) != cudaSuccess) {
    TORCH_WARN("decent_comm NCCL transport: its watchdog could not set device ", device_index_,
               "; timeouts are enforced only inside exchange(), wait() and synchronize()");
    return;
  }
  // torch.cuda.graph captures in the global mode by default, in which an event query from any other thread is a
  // prohibited call that invalidates the capture (and fails here): a user capturing forward and backward while an
  // exchange is in flight. This thread's queries touch no captured stream, so it runs in the relaxed mode, as
  // torch's own NCCL watchdog does.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess) {
    TORCH_WARN("decent_comm NCCL transport: its watchdog could not enter the relaxed capture mode; timeouts are "
               "enforced only inside exchange(), wait() and synchronize()");
    return;
  }
  const auto period = std::clamp(timeout_ / 10, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_ && !runtime_unloading_) {
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
  ncclComm_t comm = comm_;
  comm_ = nullptr;  // an aborted communicator is freed by NCCL: never passed to NCCL again
  // At exit (the failure may be one the runtime's teardown caused, seen through NCCL) the communicator is
  // leaked rather than aborted: the abort waits for the device and could block the exit.
  if (stream_ != nullptr && cudaStreamQuery(stream_) == cudaErrorCudartUnloading) runtime_unloading_ = true;
  if (comm == nullptr || runtime_unloading_) return;
  // Blocking even for a non-blocking communicator: it waits for the kernels, which see the abort flag and exit.
  const ncclResult_t r = ncclCommAbort(comm);
  if (r != ncclSuccess) {
    TORCH_WARN("decent_comm NCCL transport: ncclCommAbort failed: ", nccl_text(r, nullptr));
  }
}

void NcclTransport::abort() noexcept {
  const OnDevice on(device_index());
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
  if (headers_ != nullptr) (void)cudaEventDestroy(headers_);
  if (stream_ != nullptr) give_back_comm_stream(device_index_, stream_);  // idle: nothing is queued on it
  ready_ = nullptr;
  headers_ = nullptr;
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
    fail_locked(message, false);
    throw ExchangeError(message);
  }
  wait_comm_ready_locked(Clock::now() + timeout_, timeout_, [] { return std::string("finalizing the NCCL communicator"); });
  const ncclResult_t d = ncclCommDestroy(comm_);
  if (d != ncclSuccess && d != ncclInProgress) {
    const std::string message = "decent_comm NCCL transport: ncclCommDestroy failed: " + nccl_text(d, comm_);
    fail_locked(message, false);
    throw ExchangeError(message);
  }
  state_ = CommState::Destroyed;
  comm_ = nullptr;
  cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize of the comm stream at shutdown");
  destroy_cuda_objects();
}

}  // namespace nccl_detail

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
  return std::make_shared<nccl_detail::NcclTransport>(unique_id, rank, world_size, device_index,
                                                      std::chrono::milliseconds(timeout_ms), max_ctas);
}

}  // namespace decent_comm::comm
