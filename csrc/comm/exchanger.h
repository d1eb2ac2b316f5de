// The exchange scheduler: the transport-agnostic half of decent_comm.exchange.Exchanger.
//
// It owns the bucket table (which bucket ids are in flight, in which order they were issued), validates
// every argument before anything is enqueued, agrees each bucket's size and wire dtype with its peers before
// its bytes first move (handshake.h), casts to the wire dtype through persistent per-bucket buffers, counts
// bytes, and holds the error state: after a transport failure (timeout, dead peer, mismatch) it aborts the
// transport and every later call raises, naming the original error. The Transport (transport.h) only moves
// bytes.
//
// Calls are serialized by a mutex and meant to come from one thread; the bindings release the GIL around
// them so a blocking wait does not stall other Python threads.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "handshake.h"
#include "in_flight_buffers.h"
#include "transport.h"

#pragma GCC visibility push(hidden)  // see transport.h

namespace decent_comm::comm {

class Exchanger {
 public:
  // timeout_ms <= 0: the transport's default (the process group's timeout). wire_dtype: when set, floating
  // buffers go on the wire in that dtype and recv buffers must have it. allow_self_exchange (tests only: one
  // GPU driving the whole NCCL transport): a rank may list itself in send_to / recv_from.
  Exchanger(std::shared_ptr<Transport> transport, int64_t timeout_ms, std::optional<at::ScalarType> wire_dtype,
            bool allow_self_exchange = false);
  ~Exchanger();
  Exchanger(const Exchanger&) = delete;
  Exchanger& operator=(const Exchanger&) = delete;

  // Enqueues bucket `bucket`: `send` to every rank of send_to, recvs[i] from recv_from[i]. Returns at once,
  // except when an edge of this exchange has not agreed this size and wire dtype yet (a bucket's first
  // exchanges, a new peer, a new size): then it first blocks until those peers reached the same exchange.
  // `send` must not be modified and `recvs` not read until wait(bucket); neither may be resized or re-pointed
  // (in_flight_buffers.h: a resize_ that would reallocate raises, wait() raises RuntimeError for one that did not).
  void exchange(int64_t bucket, const at::Tensor& send, const std::vector<at::Tensor>& recvs,
                const std::vector<int64_t>& send_to, const std::vector<int64_t>& recv_from);
  // See Transport::wait: CPU blocks, CUDA makes the current stream wait. Waiting again for a bucket that
  // completed (waited, wait_all, synchronize) is allowed; for a bucket id never exchanged it is an error.
  void wait(int64_t bucket);
  void wait_all();            // wait() on every bucket in flight, in issue order
  void synchronize();         // wait_all(), then block the host until every transfer completed
  // synchronize() and release the transport; idempotent. After a failure a call has raised, it only closes; a
  // failure no call has raised yet (one the watchdog found) is raised here once, as any call would raise it.
  void shutdown();

  int rank() const { return transport_->rank(); }
  int world_size() const { return transport_->world_size(); }
  std::string transport_name() const { return transport_->name(); }
  c10::Device device() const { return transport_->device(); }
  double timeout_seconds() const { return timeout_.count() / 1e3; }
  std::optional<at::ScalarType> wire_dtype() const { return wire_dtype_; }
  int64_t bytes_sent() const;
  int64_t handshakes() const;              // size/dtype handshakes run so far (one per exchange that needed one)
  std::vector<int64_t> in_flight() const;  // bucket ids, in issue order
  bool closed() const;

 private:
  struct Bucket {
    std::unique_ptr<TransportSlot> slot;  // created on the bucket's first transfer, reused every step
    at::Tensor wire;                      // persistent wire-dtype send buffer (wire_dtype only)
    bool in_flight = false;
    bool has_transfer = false;  // false for an exchange with no peer or no bytes: wait() has nothing to do
    uint64_t seq = 0;           // issue order, for wait_all()
    BucketAgreement agreement;  // the (peer, direction) edges that agreed its size and wire dtype
    InFlightBuffers held;       // the caller's buffers of the transfer in flight (has_transfer), until waited
  };
  enum class State { Open, Failed, Closed };

  void ensure_usable(const char* call) const;
  // Returns the wire dtype (wire_dtype_ for floating buffers when set, else send's dtype).
  at::ScalarType check_exchange_args(int64_t bucket, const at::Tensor& send, const std::vector<at::Tensor>& recvs,
                                     const std::vector<int64_t>& send_to, const std::vector<int64_t>& recv_from) const;
  void check_peer_list(int64_t bucket, const char* what, const std::vector<int64_t>& ranks) const;
  // The bucket's persistent wire-dtype send buffer, or an undefined tensor when `send` goes as is.
  const at::Tensor& wire_buffer(Bucket& b, const at::Tensor& send, bool receive_only);
  // Completes the bucket's transfer; returns what wait() must raise because the caller resized or re-pointed one of
  // its buffers while in flight ("" if nothing). The bucket is waited for either way (its transfer completed).
  std::string wait_locked(int64_t bucket, Bucket& b, const char* call);
  // wait_locked() on every bucket in flight, in issue order; returns the first such problem.
  std::string wait_all_locked(const char* call);
  // Runs a transport call; on any exception records it as the fatal error, aborts the transport, rethrows.
  template <class F>
  void guarded(F&& f);

  std::shared_ptr<Transport> transport_;
  std::chrono::milliseconds timeout_;
  std::optional<at::ScalarType> wire_dtype_;
  bool allow_self_exchange_;
  mutable std::mutex mu_;
  std::unordered_map<int64_t, Bucket> buckets_;
  uint64_t next_seq_ = 0;
  int64_t bytes_sent_ = 0;
  int64_t handshakes_ = 0;
  State state_ = State::Open;
  std::string error_;  // the failure that made the exchanger unusable
};

}  // namespace decent_comm::comm

#pragma GCC visibility pop
