// The NCCL transport's data path: handshake headers, a bucket's group of receives and sends, and the waits
// (the class and its ordering/lifetime rules: nccl_internal.h; the communicator's life: nccl_transport.cpp).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include "nccl_internal.h"

namespace decent_comm::comm::nccl_detail {

namespace {

// The caching allocator keeps `t`'s memory from being handed out again, once the caller frees it, until the
// comm stream's work queued so far has finished (a no-op for memory it does not own).
void record_on(const at::Tensor& t, const c10::cuda::CUDAStream& stream) {
  if (t.defined() && t.has_storage()) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
}

std::vector<PeerOp> peer_ops(const BucketOp& op) {
  std::vector<PeerOp> ops;
  for (const int64_t r : op.recv_from) ops.push_back({int(r), false});
  for (const int64_t r : op.send_to) ops.push_back({int(r), true});
  return ops;
}

std::string call_text(const PeerOp& op) {
  return (op.is_send ? "ncclSend to rank " : "ncclRecv from rank ") + std::to_string(op.peer);
}

}  // namespace

NcclSlot::~NcclSlot() {
  if (stashed) {  // never waited for (failure, or no shutdown()): the GPU may still touch these
    struct Kept {
      at::Tensor send, wire;
      std::vector<at::Tensor> recvs;
    };
    keep_alive_forever(std::make_shared<Kept>(Kept{std::move(send), std::move(wire), std::move(recvs)}));
  }
  // Safe even if the event is pending (its resources are released once it completes); errors at
  // interpreter exit (CUDA already unloading) are deliberately ignored.
  if (done != nullptr) {
    const OnDevice on(device);
    (void)cudaEventDestroy(done);
  }
}

void NcclSlot::release() {
  send = at::Tensor();
  wire = at::Tensor();
  recvs.clear();  // keeps the capacity
  stashed = false;
}

std::unique_ptr<TransportSlot> NcclTransport::make_slot() {
  const c10::cuda::CUDAGuard guard{device_index()};
  auto slot = std::make_unique<NcclSlot>();
  slot->device = device_index();
  cuda_check(cudaEventCreateWithFlags(&slot->done, cudaEventDisableTiming), "cudaEventCreate (bucket event)");
  return slot;
}

void NcclTransport::swap_headers(const HeaderSwap& op) {
  const OnDevice on(device_index());  // (before poll_locked's event queries)
  std::unique_lock<std::mutex> lock(mu_);
  poll_locked();
  ensure_live_locked();
  const c10::cuda::CUDAGuard guard{device_index()};
  const c10::cuda::CUDAStream comm = comm_stream();
  const int64_t n = int64_t(op.peers.size());
  const size_t header_bytes = size_t(kHeaderWords) * sizeof(int64_t);
  // [mine | theirs] in pinned host memory and on the device, so that both copies are asynchronous on the comm
  // stream and the wait below honours the deadline. The device buffer is allocated with the comm stream
  // current: the caching allocator then reuses it only for work ordered after what the comm stream did with it.
  at::Tensor host = at::empty({2, n, kHeaderWords}, at::TensorOptions(at::kLong).pinned_memory(true));
  at::Tensor dev;
  try {
    host[0].copy_(op.mine);
    {
      const c10::cuda::CUDAStreamGuard on_comm(comm);
      dev = at::empty({2, n, kHeaderWords}, at::TensorOptions(at::kLong).device(device()));
      dev[0].copy_(host[0], /*non_blocking=*/true);
    }
    const auto what = [&] { return "size/dtype handshake of " + bucket_context(op.bucket, op.edges); };
    const ncclResult_t started = ncclGroupStart();
    if (started != ncclSuccess) {
      throw ExchangeError("decent_comm NCCL transport: " + what() + ": ncclGroupStart failed: " +
                          nccl_text(started, comm_));
    }
    int64_t* mine = dev.data_ptr<int64_t>();
    int64_t* theirs = mine + n * kHeaderWords;
    ncclResult_t failed = ncclSuccess;
    PeerOp failed_op{-1, false};
    for (int64_t i = 0; i < n && (failed == ncclSuccess || failed == ncclInProgress); ++i) {
      const int peer = int(op.peers[size_t(i)]);
      failed_op = {peer, false};
      failed = ncclRecv(theirs + i * kHeaderWords, header_bytes, ncclUint8, peer, comm_, stream_);
      if (failed != ncclSuccess && failed != ncclInProgress) break;
      failed_op = {peer, true};
      failed = ncclSend(mine + i * kHeaderWords, header_bytes, ncclUint8, peer, comm_, stream_);
    }
    end_group_locked(failed, [&] { return call_text(failed_op); }, op.deadline, op.timeout, what);
    {
      const c10::cuda::CUDAStreamGuard on_comm(comm);
      host[1].copy_(dev[1], /*non_blocking=*/true);
    }
    cuda_check(cudaEventRecord(headers_, stream_), "cudaEventRecord (headers) on the comm stream", op.bucket);
    Progress& p = push_progress_locked(op.bucket, op.deadline, op.timeout, "size/dtype handshake");
    p.peers = op.edges;
    const Clock::time_point since = Clock::now();
    for (;;) {
      poll_locked();  // past the deadline: aborts, and the next line raises the timeout
      ensure_live_locked();
      const cudaError_t q = cudaEventQuery(headers_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) cuda_check(q, "cudaEventQuery (headers)", op.bucket);
      lock.unlock();  // lets the watchdog in
      backoff(since);
      lock.lock();
    }
  } catch (...) {
    // The GPU may still copy into these (an aborted kernel exits, the copies queued behind it still run).
    keep_alive_forever(std::make_shared<std::pair<at::Tensor, at::Tensor>>(host, dev));
    throw;
  }
  op.theirs.copy_(host[1]);
}

void NcclTransport::start(TransportSlot& base, const BucketOp& op) {
  auto& slot = static_cast<NcclSlot&>(base);
  std::lock_guard<std::mutex> lock(mu_);
  ensure_live_locked();
  const c10::cuda::CUDAGuard guard{device_index()};
  const c10::cuda::CUDAStream comm = comm_stream();

  // Stashed before anything is enqueued: whatever throws from here on may leave work on the comm stream, and
  // the slot (kept alive forever if never waited for) must own every buffer that work reads or writes,
  // `send` included when a wire cast reads it.
  slot.send = op.send;
  slot.wire = op.wire;
  slot.recvs.assign(op.recvs.begin(), op.recvs.end());
  slot.stashed = true;
  record_on(op.send, comm);
  record_on(op.wire, comm);
  for (const at::Tensor& r : op.recvs) record_on(r, comm);

  // The comm stream waits for everything enqueued so far on the caller's stream (the kernel writing `send`,
  // the previous readers of `recvs`).
  const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_index()).stream();
  cuda_check(cudaEventRecord(ready_, caller), "cudaEventRecord on the current stream", op.bucket);
  cuda_check(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent of the comm stream", op.bucket);
  if (op.wire.defined()) {
    // On the comm stream, after the wait above; the previous send from this buffer is earlier on the same
    // stream, so overwriting it is ordered after that send.
    const c10::cuda::CUDAStreamGuard on_comm(comm);
    op.wire.copy_(op.send);
  }
  const at::Tensor& payload = op.wire.defined() ? op.wire : op.send;

  // One group per bucket: NCCL schedules its receives and sends together, so a pair of ranks sending to
  // each other cannot deadlock and the transfers share channels. Messages are put into words only on failure.
  const auto what = [&] { return "enqueueing " + bucket_context(op.bucket, peer_ops(op)); };
  const ncclResult_t started = ncclGroupStart();
  if (started != ncclSuccess) {
    throw ExchangeError("decent_comm NCCL transport: " + what() + ": ncclGroupStart failed: " +
                        nccl_text(started, comm_));
  }
  ncclResult_t failed = ncclSuccess;
  PeerOp failed_op{-1, false};
  const auto ok = [&] { return failed == ncclSuccess || failed == ncclInProgress; };
  for (size_t i = 0; i < op.recv_from.size() && ok(); ++i) {
    failed_op = {int(op.recv_from[i]), false};
    failed = ncclRecv(op.recvs[i].data_ptr(), size_t(op.recvs[i].nbytes()), ncclUint8, failed_op.peer, comm_, stream_);
  }
  for (size_t i = 0; i < op.send_to.size() && ok(); ++i) {
    failed_op = {int(op.send_to[i]), true};
    failed = ncclSend(payload.data_ptr(), size_t(payload.nbytes()), ncclUint8, failed_op.peer, comm_, stream_);
  }
  end_group_locked(failed, [&] { return call_text(failed_op); }, op.deadline, op.timeout, what);
  cuda_check(cudaEventRecord(slot.done, stream_), "cudaEventRecord on the comm stream", op.bucket);
  Progress& p = push_progress_locked(op.bucket, op.deadline, op.timeout, "transfer");
  for (const int64_t r : op.recv_from) p.peers.push_back({int(r), false});
  for (const int64_t r : op.send_to) p.peers.push_back({int(r), true});
}

void NcclTransport::order_current_stream_after_locked(const NcclSlot& slot) {
  poll_locked();
  ensure_live_locked();
  const c10::cuda::CUDAGuard guard{device_index()};
  const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(device_index()).stream();
  cuda_check(cudaStreamWaitEvent(caller, slot.done, 0), "cudaStreamWaitEvent of the current stream on a bucket");
}

void NcclTransport::wait(TransportSlot& base) {
  auto& slot = static_cast<NcclSlot&>(base);
  const OnDevice on(device_index());  // (before poll_locked's event queries)
  std::lock_guard<std::mutex> lock(mu_);
  order_current_stream_after_locked(slot);
  // The caller's stream is now ordered after the transfer: memory freed from here on is only reused by
  // work that runs after it.
  slot.release();
}

void NcclTransport::wait_again(TransportSlot& base) {
  const OnDevice on(device_index());
  std::lock_guard<std::mutex> lock(mu_);
  order_current_stream_after_locked(static_cast<NcclSlot&>(base));
}

void NcclTransport::synchronize() {
  const OnDevice on(device_index());
  const Clock::time_point since = Clock::now();
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      poll_locked();
      ensure_live_locked();
      if (count_ == 0) return;
    }
    backoff(since);  // outside the lock, so the watchdog is never held up
  }
}

}  // namespace decent_comm::comm::nccl_detail
