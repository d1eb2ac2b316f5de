// The interface between the exchange scheduler (exchanger.h: validation, bucket table, wire casts, error
// state) and a transport that moves bytes (ProcessGroup/gloo on CPU, NCCL on GPU). A transport never
// validates arguments and never decides policy; it enqueues, waits, and reports failures as
// ExchangeError / ExchangeTimeoutError naming the bucket and the peers.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "errors.h"

// Hidden like pybind11's own types: this module exports none of them, and class_<T> of a more visible T
// than pybind11 draws -Wattributes warnings.
#pragma GCC visibility push(hidden)

namespace decent_comm::comm {

// Bucket ids are 0 <= id <= kMaxBucketId: the ProcessGroup transport derives a message tag from the id
// (tags are 31-bit and also carry an exchanger channel and a data/handshake bit), and every transport shares
// the same bound. 16 bits: the optimizers number their buckets 0, 1, ... (a few per model), and the bits above go
// to the channels, which must not repeat while an exchanger is alive (process_group_transport.cpp).
constexpr int64_t kMaxBucketId = (int64_t(1) << 16) - 1;

// int64 words of the header two ranks swap before a bucket's bytes first move between them (handshake.h).
constexpr int64_t kHeaderWords = 6;

// A transport's per-bucket state (Work handles, CUDA events, the tensors kept alive while in flight).
// Created once per bucket id and reused every step, so the steady state allocates nothing here.
// A slot destroyed while its transfer may still touch memory keeps that memory alive forever
// (see keep_alive_forever) rather than free it under the transport. The scheduler holds the caller's buffers'
// storages too, non-resizable, from before start() until wait() (in_flight_buffers.h): a Tensor kept alive does
// not keep its memory if the caller resizes or re-points it, so a slot's tensors alone are not enough.
struct TransportSlot {
  virtual ~TransportSlot() = default;
};

// One bucket's exchange, already validated by the scheduler.
struct BucketOp {
  int64_t bucket;
  const at::Tensor& send;  // the caller's buffer (contiguous)
  // When defined: the persistent wire-dtype buffer `send` is cast into and which goes on the wire instead.
  // The transport does the cast, so it is ordered after whatever wrote `send` (the CUDA comm stream casts
  // after waiting for the compute stream).
  const at::Tensor& wire;
  const std::vector<at::Tensor>& recvs;  // contiguous, wire dtype, send.numel() elements each
  const std::vector<int64_t>& send_to;
  const std::vector<int64_t>& recv_from;
  Clock::time_point deadline;          // past it, an unfinished transfer is a timeout
  std::chrono::milliseconds timeout;   // for messages
};

// One bucket's handshake (handshake.h): mine[i] goes to peers[i] and theirs[i] comes from peers[i], one
// header each way per peer, host-blocking until all arrived or the deadline passed.
struct HeaderSwap {
  int64_t bucket;
  const std::vector<int64_t>& peers;
  const std::vector<PeerOp>& edges;  // the exchange's transfers with those peers, to name them in a timeout
  const at::Tensor& mine;            // int64 CPU, [peers.size(), kHeaderWords], contiguous
  const at::Tensor& theirs;          // same; written
  Clock::time_point deadline;
  std::chrono::milliseconds timeout;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual const char* name() const = 0;  // "process_group" or "nccl"
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual c10::Device device() const = 0;
  // Used when the caller gives no timeout (the process group's own timeout where there is one).
  virtual std::chrono::milliseconds default_timeout() const = 0;

  // Whether a rank may list itself as a peer (a loopback transfer). Only NCCL can: gloo has no pair to self.
  virtual bool supports_self_exchange() const { return false; }
  // Called once by the Exchanger that owns this transport, after it validated its own arguments: where a
  // transport claims what must be claimed in the same order on every rank (the ProcessGroup transport's tag
  // channel), so that a construction refused on one rank claims nothing there.
  virtual void open() {}

  virtual std::unique_ptr<TransportSlot> make_slot() = 0;
  // Host-blocking: swaps handshake headers with peers (see HeaderSwap). Raises ExchangeTimeoutError /
  // ExchangeError like a transfer.
  virtual void swap_headers(const HeaderSwap& op) = 0;
  // Enqueues the bucket's receives and sends and returns without waiting for the peers.
  virtual void start(TransportSlot& slot, const BucketOp& op) = 0;
  // Makes the bucket's data usable by the caller: CPU transports block until its transfers completed;
  // the NCCL transport makes the current CUDA stream wait for it. Releases the slot's stash.
  virtual void wait(TransportSlot& slot) = 0;
  // wait() once more on a slot whose transfer was already waited for: the NCCL transport orders the current
  // stream after it again (cheap, the event is complete or nearly); host-blocking transports do nothing.
  virtual void wait_again(TransportSlot& /*slot*/) {}
  // Host-blocking: returns once every transfer ever started has completed (wait() was called on all).
  virtual void synchronize() = 0;
  // Raises a failure detected asynchronously (a watchdog's timeout, a communicator's async error).
  virtual void check() {}
  // For a watcher on another thread (decent_comm.exchange.peer_watch), which can learn another way that a peer
  // stopped for good (it reported its own failure through the store) where the transport itself would only tell at
  // the deadline. A host-blocking wait (wait(), swap_headers()) blocks on one operation at a time: waiting_peers() is
  // that operation's peer (empty: no wait runs); wait_generation() changes whenever the wait moves to another
  // operation or ends, so the same value at two looks means the same operation blocked all along; interrupt(
  // generation, ...): if that operation still blocks the wait, makes the wait stop and raise ExchangeError
  // (ExchangeTimeoutError when `timed_out`) with `reason`, and returns true. Only the blocking operation counts: one
  // with a peer that stopped right after that operation went through completes (check_finite's ranks stop so).
  // Transports whose waits do not block the host keep these defaults.
  virtual uint64_t wait_generation() const { return 0; }
  virtual std::vector<int64_t> waiting_peers() const { return {}; }
  virtual bool interrupt(uint64_t /*generation*/, const std::string& /*reason*/, bool /*timed_out*/) { return false; }
  // After a failure: stop everything without waiting for peers. Memory a transfer may still touch is kept.
  virtual void abort() noexcept = 0;
  // Orderly teardown once everything completed (after synchronize()).
  virtual void shutdown() = 0;
  // The exchanger's shutdown() after a failure, where the orderly teardown cannot run (abort() came first): drop the
  // references to what the caller owns (a process group), as shutdown() does. What abort() kept stays kept.
  virtual void release() noexcept {}
};

// Keeps `what` alive until the process exits. Used for buffers an aborted or abandoned transfer may still
// write into: leaking them is bounded (one step's buffers) and cannot corrupt memory.
void keep_alive_forever(std::shared_ptr<void> what);

}  // namespace decent_comm::comm

#pragma GCC visibility pop
