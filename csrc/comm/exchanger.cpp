// The exchange scheduler (see exchanger.h).
#include "exchanger.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <ostream>
#include <utility>

namespace decent_comm::comm {

namespace {

// Prefix of every argument error: the call and the bucket, so a message alone says where it came from.
// Streamed into the message only when a check fails, so a passing check formats nothing.
struct Where {
  const char* call;
  int64_t bucket;
};

std::ostream& operator<<(std::ostream& os, const Where& w) {
  return os << "decent_comm Exchanger." << w.call << "(bucket=" << w.bucket << "): ";
}

Where where(const char* call, int64_t bucket) { return Where{call, bucket}; }

// "send" or "recvs[i] (from rank r)", formatted only into a failing check's message.
struct Buffer {
  int64_t index;  // -1: send
  int64_t peer;
};

std::ostream& operator<<(std::ostream& os, const Buffer& b) {
  if (b.index < 0) return os << "send";
  return os << "recvs[" << b.index << "] (from rank " << b.peer << ")";
}

// Every transport moves a buffer's raw memory, so it must hold exactly the values the tensor reads as. A tensor
// with the conjugate or negative bit set reads its memory conjugated or negated (z.conj(), z.conj().imag,
// torch._neg_view): sent as is, the peer got z instead of conj(z) and [1, 2] instead of [-1, -2]; received into,
// the values read back conjugated. A sparse or other non-strided tensor has no such flat memory at all.
void check_plain(const Where& at, const at::Tensor& t, const Buffer& name) {
  TORCH_CHECK_VALUE(t.layout() == c10::kStrided, at, name, " has layout ", t.layout(), ", not torch.strided: the "
                    "exchanger moves dense tensors only", name.index < 0 ? " (pass send.to_dense())" : "");
  TORCH_CHECK_VALUE(t.has_storage(), at, name, " has no storage (a wrapper tensor subclass?): the exchanger "
                    "moves a tensor's own memory");
  TORCH_CHECK_VALUE(!t.is_conj(), at, name, " has its conjugate bit set (a lazy .conj() view): its memory holds "
                    "the unconjugated values, which is what the transport would move; ",
                    name.index < 0 ? "send .resolve_conj() (or .clone()) instead"
                                   : "receive into a tensor without the bit (.resolve_conj() or .clone() of it)");
  TORCH_CHECK_VALUE(!t.is_neg(), at, name, " has its negative bit set (a lazy negated view, e.g. z.conj().imag): "
                    "its memory holds the values without their sign, which is what the transport would move; ",
                    name.index < 0 ? "send .resolve_neg() (or .clone()) instead"
                                   : "receive into a tensor without the bit (.resolve_neg() or .clone() of it)");
}

}  // namespace

Exchanger::Exchanger(std::shared_ptr<Transport> transport, int64_t timeout_ms,
                     std::optional<at::ScalarType> wire_dtype, bool allow_self_exchange)
    : transport_(std::move(transport)), wire_dtype_(wire_dtype), allow_self_exchange_(allow_self_exchange) {
  TORCH_CHECK_VALUE(transport_ != nullptr, "decent_comm Exchanger: transport is None");
  timeout_ = timeout_ms > 0 ? std::chrono::milliseconds(timeout_ms) : transport_->default_timeout();
  if (wire_dtype_.has_value()) {
    TORCH_CHECK_VALUE(at::isFloatingType(*wire_dtype_), "decent_comm Exchanger: wire_dtype must be a floating "
                      "point dtype (e.g. torch.bfloat16), got ", *wire_dtype_);
  }
  TORCH_CHECK_VALUE(!allow_self_exchange_ || transport_->supports_self_exchange(), "decent_comm Exchanger: the ",
                    transport_->name(), " transport cannot exchange with its own rank (self-exchange needs NCCL)");
  transport_->open();  // last: a construction refused above claims nothing on this rank
}

Exchanger::~Exchanger() {
  // Never wait or tear down a communicator here (a destructor may run at interpreter exit, with peers gone):
  // in-flight slots keep their buffers alive forever (TransportSlot), the transport leaks what it must.
  if (state_ == State::Open) {
    for (const auto& [id, b] : buckets_) {
      if (b.in_flight && b.has_transfer) {
        TORCH_WARN("decent_comm Exchanger destroyed with bucket ", id, " still in flight and without shutdown(); "
                   "its buffers are kept alive until the process exits");
        break;
      }
    }
  }
}

template <class F>
void Exchanger::guarded(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    if (state_ == State::Open) {
      state_ = State::Failed;
      error_ = e.what();
      transport_->abort();
    }
    throw;
  }
}

void Exchanger::ensure_usable(const char* call) const {
  if (state_ == State::Failed) {
    throw ExchangeError(std::string("decent_comm Exchanger.") + call + ": the exchanger is unusable after an "
                        "earlier error (shut it down and create a new one); the error was: " + error_);
  }
  TORCH_CHECK(state_ != State::Closed, "decent_comm Exchanger.", call, ": the exchanger has been shut down");
}

void Exchanger::check_peer_list(int64_t bucket, const char* what, const std::vector<int64_t>& ranks) const {
  const int64_t world = transport_->world_size(), self = transport_->rank();
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int64_t r = ranks[i];
    TORCH_CHECK_VALUE(r >= 0 && r < world, where("exchange", bucket), what, "[", i, "] = ", r,
                      " is not a rank of the process group (world size ", world, ")");
    TORCH_CHECK_VALUE(r != self || allow_self_exchange_, where("exchange", bucket), what, "[", i, "] = ", r,
                      " is this rank itself; a rank does not exchange with itself");
    // Peer lists are short (a topology's degree), so the quadratic scan is cheaper than a set.
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK_VALUE(ranks[j] != r, where("exchange", bucket), what, " lists rank ", r, " twice (at ", j,
                        " and ", i, ")");
    }
  }
}

at::ScalarType Exchanger::check_exchange_args(int64_t bucket, const at::Tensor& send,
                                              const std::vector<at::Tensor>& recvs,
                                              const std::vector<int64_t>& send_to,
                                              const std::vector<int64_t>& recv_from) const {
  const Where at = where("exchange", bucket);
  TORCH_CHECK_VALUE(bucket >= 0 && bucket <= kMaxBucketId, at, "bucket ids must be in [0, ", kMaxBucketId, "]");
  TORCH_CHECK_VALUE(recvs.size() == recv_from.size(), at, "got ", recvs.size(), " recv buffers for ",
                    recv_from.size(), " ranks in recv_from (one buffer per rank)");
  check_peer_list(bucket, "send_to", send_to);
  check_peer_list(bucket, "recv_from", recv_from);

  const c10::Device device = transport_->device();
  TORCH_CHECK_VALUE(send.defined(), at, "send is undefined");
  TORCH_CHECK_VALUE(send.device() == device, at, "send is on ", send.device(), " but this exchanger moves ",
                    device, " buffers");
  check_plain(at, send, Buffer{-1, -1});
  TORCH_CHECK_VALUE(send.is_contiguous(), at, "send must be contiguous");
  at::ScalarType wire = send.scalar_type();
  if (wire_dtype_.has_value() && *wire_dtype_ != wire) {
    TORCH_CHECK_VALUE(at::isFloatingType(wire), at, "send has dtype ", wire, "; wire_dtype=", *wire_dtype_,
                      " casts floating point buffers only");
    wire = *wire_dtype_;
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    const at::Tensor& r = recvs[i];
    TORCH_CHECK_VALUE(r.defined(), at, "recvs[", i, "] (from rank ", recv_from[i], ") is undefined");
    TORCH_CHECK_VALUE(r.device() == device, at, "recvs[", i, "] (from rank ", recv_from[i], ") is on ", r.device(),
                      " but this exchanger moves ", device, " buffers");
    check_plain(at, r, Buffer{int64_t(i), recv_from[i]});
    TORCH_CHECK_VALUE(r.is_contiguous(), at, "recvs[", i, "] (from rank ", recv_from[i], ") must be contiguous");
    TORCH_CHECK_VALUE(r.scalar_type() == wire, at, "recvs[", i, "] (from rank ", recv_from[i], ") has dtype ",
                      r.scalar_type(), " but the wire dtype is ", wire,
                      wire_dtype_.has_value() ? " (the exchanger's wire_dtype)" : " (send's dtype)");
    TORCH_CHECK_VALUE(r.numel() == send.numel(), at, "recvs[", i, "] (from rank ", recv_from[i], ") has ",
                      r.numel(), " elements but send has ", send.numel());
    // Two transfers writing the same memory (or one overwriting what is being sent) race silently.
    TORCH_CHECK_VALUE(r.numel() == 0 || at::get_overlap_status(r, send) == at::MemOverlapStatus::No, at, "recvs[",
                      i, "] (from rank ", recv_from[i], ") overlaps send in memory");
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK_VALUE(r.numel() == 0 || at::get_overlap_status(r, recvs[j]) == at::MemOverlapStatus::No, at,
                        "recvs[", i, "] and recvs[", j, "] overlap in memory (one buffer per peer)");
    }
  }
  return wire;
}

const at::Tensor& Exchanger::wire_buffer(Bucket& b, const at::Tensor& send, bool receive_only) {
  static const at::Tensor none;
  if (receive_only || !wire_dtype_.has_value() || send.scalar_type() == *wire_dtype_) return none;
  // Reallocated only when the bucket's size changes: steady-state steps reuse it.
  if (!b.wire.defined() || b.wire.numel() != send.numel() || b.wire.device() != send.device()) {
    b.wire = at::empty({send.numel()}, send.options().dtype(*wire_dtype_));
  }
  return b.wire;
}

void Exchanger::exchange(int64_t bucket, const at::Tensor& send, const std::vector<at::Tensor>& recvs,
                         const std::vector<int64_t>& send_to, const std::vector<int64_t>& recv_from) {
  std::lock_guard<std::mutex> lock(mu_);
  ensure_usable("exchange");
  guarded([&] { transport_->check(); });
  const at::ScalarType wire_dtype = check_exchange_args(bucket, send, recvs, send_to, recv_from);
  Bucket& b = buckets_[bucket];
  TORCH_CHECK(!b.in_flight, where("exchange", bucket), "bucket ", bucket,
              " is still in flight; call wait(", bucket, ") before exchanging it again");

  // Agreed edges (the steady state) skip this; an empty bucket is agreed too, so that 0 elements on one rank
  // against 1000 on its peer is a mismatch rather than a receive that never completes. An exchange without
  // peers neither agrees nor changes anything.
  const bool has_peers = !send_to.empty() || !recv_from.empty();
  if (has_peers && !b.agreement.covers(send.numel(), wire_dtype, send_to, recv_from)) {
    const std::vector<int64_t> peers = b.agreement.unagreed_peers(send.numel(), wire_dtype, send_to, recv_from);
    guarded([&] { handshake(*transport_, bucket, send.numel(), wire_dtype, peers, send_to, recv_from,
                            Clock::now() + timeout_, timeout_); });
    b.agreement.record(send.numel(), wire_dtype, peers, send_to, recv_from);
    ++handshakes_;
  }

  // Nothing to move (world size 1, a step without peers, an empty bucket): the bucket is still tracked so
  // wait() pairs with every exchange() whatever the schedule.
  b.has_transfer = has_peers && send.numel() > 0;
  if (b.has_transfer) {
    if (!b.slot) b.slot = transport_->make_slot();
    const at::Tensor& wire = wire_buffer(b, send, send_to.empty());
    const BucketOp op{bucket, send, wire, recvs, send_to, recv_from, Clock::now() + timeout_, timeout_};
    // Before anything is posted: from here the backend may touch this memory (a failed start keeps it held).
    b.held.hold(send, recvs, recv_from);
    guarded([&] { transport_->start(*b.slot, op); });
    const int64_t wire_bytes = wire.defined() ? wire.nbytes() : send.nbytes();
    bytes_sent_ += wire_bytes * int64_t(send_to.size());
  }
  b.in_flight = true;
  b.seq = next_seq_++;
}

std::string Exchanger::wait_locked(int64_t bucket, Bucket& b, const char* call) {
  std::string changed;
  if (b.has_transfer) {
    guarded([&] { transport_->wait(*b.slot); });  // on failure `held` stays: the transfer may still touch it
    // A local misuse, not a transfer failure: the peers completed, so the exchanger stays usable.
    changed = b.held.changed(call, bucket);
    b.held.release();
  }
  b.in_flight = false;
  return changed;
}

void Exchanger::wait(int64_t bucket) {
  std::lock_guard<std::mutex> lock(mu_);
  ensure_usable("wait");
  guarded([&] { transport_->check(); });
  auto it = buckets_.find(bucket);
  TORCH_CHECK(it != buckets_.end(), "decent_comm Exchanger.wait(bucket=", bucket, "): unknown bucket ", bucket,
              " (it was never exchanged)");
  Bucket& b = it->second;
  if (b.in_flight) {
    const std::string changed = wait_locked(bucket, b, "wait");
    TORCH_CHECK(changed.empty(), changed);
  } else if (b.has_transfer) {
    // Already completed (an earlier wait, wait_all or synchronize): waiting again is harmless and orders
    // the caller's current stream after the transfer once more (it may be another stream than last time).
    guarded([&] { transport_->wait_again(*b.slot); });
  }
}

std::string Exchanger::wait_all_locked(const char* call) {
  std::vector<std::pair<uint64_t, int64_t>> order;
  for (const auto& [id, b] : buckets_) {
    if (b.in_flight) order.emplace_back(b.seq, id);
  }
  std::sort(order.begin(), order.end());
  // Every bucket is waited for even after one reports a changed buffer, so none is left in flight.
  std::string first;
  for (const auto& [seq, id] : order) {
    std::string changed = wait_locked(id, buckets_.at(id), call);
    if (first.empty()) first = std::move(changed);
  }
  return first;
}

void Exchanger::wait_all() {
  std::lock_guard<std::mutex> lock(mu_);
  ensure_usable("wait_all");
  guarded([&] { transport_->check(); });
  const std::string changed = wait_all_locked("wait_all");
  TORCH_CHECK(changed.empty(), changed);
}

void Exchanger::synchronize() {
  std::lock_guard<std::mutex> lock(mu_);
  ensure_usable("synchronize");
  guarded([&] { transport_->check(); });
  const std::string changed = wait_all_locked("synchronize");
  guarded([&] { transport_->synchronize(); });
  TORCH_CHECK(changed.empty(), changed);
}

void Exchanger::shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ == State::Closed) return;
  if (state_ == State::Failed) {  // already aborted when it failed; nothing is waited for
    transport_->release();
    state_ = State::Closed;
    return;
  }
  std::string changed;
  try {
    guarded([&] {
      transport_->check();
      changed = wait_all_locked("shutdown");
      transport_->synchronize();
      transport_->shutdown();
    });
  } catch (...) {
    transport_->release();  // as after any failure; the state stays Failed, so later calls quote the error
    throw;
  }
  state_ = State::Closed;
  // Closed all the same (every transfer completed); the misuse is raised rather than dropped.
  TORCH_CHECK(changed.empty(), changed);
}

int64_t Exchanger::bytes_sent() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_sent_;
}

int64_t Exchanger::handshakes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return handshakes_;
}

std::vector<int64_t> Exchanger::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<uint64_t, int64_t>> order;
  for (const auto& [id, b] : buckets_) {
    if (b.in_flight) order.emplace_back(b.seq, id);
  }
  std::sort(order.begin(), order.end());
  std::vector<int64_t> ids;
  for (const auto& [seq, id] : order) ids.push_back(id);
  return ids;
}

bool Exchanger::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_ == State::Closed;
}

}  // namespace decent_comm::comm
