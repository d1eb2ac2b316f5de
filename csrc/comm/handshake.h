// The size/dtype handshake of the exchange scheduler.
//
// Before a bucket's bytes first move between two ranks, and again whenever the bucket's element count or
// wire dtype changes or it meets a new peer or direction, the two ranks swap a small fixed-size header and
// each compares the other's with its own. A mismatch (another bucket layout, another comm dtype, another
// schedule) then raises ExchangeError on both ranks, naming the bucket, the peer and both sides, before any
// of the bucket's bytes are posted. Without it, unequal gloo message sizes abort the receiving process,
// unequal NCCL sizes hang or corrupt the stream of messages, and equal sizes of different dtypes (fp16 vs
// bf16) mix garbage silently.
//
// Agreed edges cost nothing afterwards: the steady state only looks its peers up in two short vectors, so
// even time-varying topologies stop swapping headers once each (bucket, peer, direction) has been agreed.
// A new size or dtype forgets every edge of the bucket, so ranks must change a bucket together. Two ranks
// decide alike whether to swap as long as they exchanged the bucket alike before; data is only ever posted on
// an edge whose last handshake both ranks made at the size and dtype they hold now. A rank that changes a
// bucket on its own swaps headers while its peer posts data; the two never match (other gloo tags; on NCCL
// the data is recognized as not a header), so both raise or time out and no process dies.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "transport.h"

#pragma GCC visibility push(hidden)  // see transport.h

namespace decent_comm::comm {

// What one bucket has agreed with its peers.
class BucketAgreement {
 public:
  // True when every edge of this exchange was agreed at this element count and wire dtype. Allocates nothing.
  bool covers(int64_t numel, at::ScalarType dtype, const std::vector<int64_t>& send_to,
              const std::vector<int64_t>& recv_from) const;
  // The peers with an edge in this exchange that was not agreed at this element count and wire dtype. Two
  // ranks that exchanged the bucket alike so far get each other here, or neither does.
  std::vector<int64_t> unagreed_peers(int64_t numel, at::ScalarType dtype, const std::vector<int64_t>& send_to,
                                      const std::vector<int64_t>& recv_from) const;
  // Records the edges with `peers` after their handshake succeeded; a new count or dtype forgets the rest.
  void record(int64_t numel, at::ScalarType dtype, const std::vector<int64_t>& peers,
              const std::vector<int64_t>& send_to, const std::vector<int64_t>& recv_from);

 private:
  bool agreed(const std::vector<int64_t>& edges, int64_t peer, bool needed) const;

  int64_t numel_ = -1;
  at::ScalarType dtype_ = at::ScalarType::Undefined;
  std::vector<int64_t> sends_;  // peers agreed as receivers of this rank's sends
  std::vector<int64_t> recvs_;  // peers agreed as senders of this rank's receives
};

// Swaps headers with each of `peers` through `transport` (host-blocking, until `deadline`) and raises
// ExchangeError naming the bucket, the peer and both sides when a peer's header differs: element count,
// wire dtype, or direction (this rank sends to a peer that does not receive from it, or the reverse).
void handshake(Transport& transport, int64_t bucket, int64_t numel, at::ScalarType dtype,
               const std::vector<int64_t>& peers, const std::vector<int64_t>& send_to,
               const std::vector<int64_t>& recv_from, Clock::time_point deadline, std::chrono::milliseconds timeout);

}  // namespace decent_comm::comm

#pragma GCC visibility pop
