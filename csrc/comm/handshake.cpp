// The size/dtype handshake (see handshake.h).
#include "handshake.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <string>

namespace decent_comm::comm {

namespace {

// "dcomm" and a layout version, so that bytes which are no header at all (an NCCL data message matched
// against a header receive) are told apart from a real disagreement.
constexpr int64_t kMagic = 0x64636f6d6d0001;
enum Word : int64_t { kMagicWord, kBucketWord, kNumelWord, kDtypeWord, kFlagsWord, kRankWord };
static_assert(kRankWord + 1 == kHeaderWords, "the header layout and its size disagree");
// Flags of a header, from its sender's point of view towards the rank it is sent to.
constexpr int64_t kSendsToYou = 1;
constexpr int64_t kReceivesFromYou = 2;

bool contains(const std::vector<int64_t>& ranks, int64_t rank) {
  return std::find(ranks.begin(), ranks.end(), rank) != ranks.end();
}

int64_t flags_towards(int64_t peer, const std::vector<int64_t>& send_to, const std::vector<int64_t>& recv_from) {
  return (contains(send_to, peer) ? kSendsToYou : 0) | (contains(recv_from, peer) ? kReceivesFromYou : 0);
}

std::string dtype_name(int64_t code) {
  if (code >= 0 && code < int64_t(at::ScalarType::NumOptions)) {
    return c10::toString(static_cast<at::ScalarType>(code));
  }
  return "dtype code " + std::to_string(code);
}

// "sends to and receives from rank 1", from the flags of a header.
std::string directions(int64_t flags, const std::string& other) {
  switch (flags & (kSendsToYou | kReceivesFromYou)) {
    case kSendsToYou | kReceivesFromYou:
      return "sends to and receives from " + other;
    case kSendsToYou:
      return "sends to " + other + " without receiving from it";
    case kReceivesFromYou:
      return "receives from " + other + " without sending to it";
    default:
      return "neither sends to nor receives from " + other;
  }
}

// Raises when `theirs` (what `peer` sent) disagrees with `mine` (what this rank sent it). Both ranks of a pair
// compare the same two headers, so both raise, each naming the other.
void check_header(int64_t bucket, int64_t self, int64_t peer, const int64_t* mine, const int64_t* theirs) {
  const std::string where = "decent_comm exchange: bucket " + std::to_string(bucket) + ": ";
  const std::string us = "this rank (rank " + std::to_string(self) + ")";
  const std::string them = "rank " + std::to_string(peer);
  if (theirs[kMagicWord] != kMagic || theirs[kRankWord] != peer) {
    throw ExchangeError(where + them + " answered the size/dtype handshake of " + us + " with bytes that are no "
                        "handshake header: it exchanged this bucket without renegotiating (it kept the size and "
                        "dtype it had agreed before while this rank changed them), or the ranks issue their "
                        "buckets in different orders");
  }
  if (theirs[kBucketWord] != bucket) {
    throw ExchangeError(where + them + " sent its size/dtype handshake for bucket " +
                        std::to_string(theirs[kBucketWord]) + " at the same time: the ranks issue their buckets "
                        "in different orders");
  }
  if (theirs[kNumelWord] != mine[kNumelWord] || theirs[kDtypeWord] != mine[kDtypeWord]) {
    throw ExchangeError(where + us + " has " + std::to_string(mine[kNumelWord]) + " elements of " +
                        dtype_name(mine[kDtypeWord]) + " on the wire for it but " + them + " has " +
                        std::to_string(theirs[kNumelWord]) + " elements of " + dtype_name(theirs[kDtypeWord]) +
                        " (every rank must give a bucket id the same number of elements and the same wire dtype: "
                        "the same bucket layout and the same comm_dtype / wire_dtype); nothing was sent");
  }
  // Mirrored: what the peer sends to us, we must receive from it, and the reverse.
  const int64_t expected = ((mine[kFlagsWord] & kSendsToYou) ? kReceivesFromYou : 0) |
                           ((mine[kFlagsWord] & kReceivesFromYou) ? kSendsToYou : 0);
  if ((theirs[kFlagsWord] & (kSendsToYou | kReceivesFromYou)) != expected) {
    throw ExchangeError(where + us + " " + directions(mine[kFlagsWord], them) + " but " + them + " " +
                        directions(theirs[kFlagsWord], "this rank") + " (the ranks run different schedules: "
                        "send_to and recv_from must mirror each other); nothing was sent");
  }
}

}  // namespace

bool BucketAgreement::covers(int64_t numel, at::ScalarType dtype, const std::vector<int64_t>& send_to,
                             const std::vector<int64_t>& recv_from) const {
  if (numel != numel_ || dtype != dtype_) return false;
  for (const int64_t peer : send_to) {
    if (!contains(sends_, peer)) return false;
  }
  for (const int64_t peer : recv_from) {
    if (!contains(recvs_, peer)) return false;
  }
  return true;
}

std::vector<int64_t> BucketAgreement::unagreed_peers(int64_t numel, at::ScalarType dtype,
                                                     const std::vector<int64_t>& send_to,
                                                     const std::vector<int64_t>& recv_from) const {
  const bool same = numel == numel_ && dtype == dtype_;
  std::vector<int64_t> peers;
  for (const int64_t peer : send_to) {
    if (!same || !contains(sends_, peer)) peers.push_back(peer);
  }
  for (const int64_t peer : recv_from) {
    if ((!same || !contains(recvs_, peer)) && !contains(peers, peer)) peers.push_back(peer);
  }
  return peers;
}

void BucketAgreement::record(int64_t numel, at::ScalarType dtype, const std::vector<int64_t>& peers,
                             const std::vector<int64_t>& send_to, const std::vector<int64_t>& recv_from) {
  if (numel != numel_ || dtype != dtype_) {
    numel_ = numel;
    dtype_ = dtype;
    sends_.clear();
    recvs_.clear();
  }
  for (const int64_t peer : peers) {
    if (contains(send_to, peer) && !contains(sends_, peer)) sends_.push_back(peer);
    if (contains(recv_from, peer) && !contains(recvs_, peer)) recvs_.push_back(peer);
  }
}

void handshake(Transport& transport, int64_t bucket, int64_t numel, at::ScalarType dtype,
               const std::vector<int64_t>& peers, const std::vector<int64_t>& send_to,
               const std::vector<int64_t>& recv_from, Clock::time_point deadline, std::chrono::milliseconds timeout) {
  const int64_t n = int64_t(peers.size());
  const int64_t self = transport.rank();
  at::Tensor mine = at::empty({n, kHeaderWords}, at::kLong);
  at::Tensor theirs = at::zeros({n, kHeaderWords}, at::kLong);  // zeros: a header never written fails the magic
  std::vector<PeerOp> edges;
  int64_t* m = mine.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t peer = peers[size_t(i)];
    int64_t* h = m + i * kHeaderWords;
    h[kMagicWord] = kMagic;
    h[kBucketWord] = bucket;
    h[kNumelWord] = numel;
    h[kDtypeWord] = int64_t(dtype);
    h[kFlagsWord] = flags_towards(peer, send_to, recv_from);
    h[kRankWord] = self;
    if (h[kFlagsWord] & kSendsToYou) edges.push_back({int(peer), true});
    if (h[kFlagsWord] & kReceivesFromYou) edges.push_back({int(peer), false});
  }
  transport.swap_headers(HeaderSwap{bucket, peers, edges, mine, theirs, deadline, timeout});
  const int64_t* t = theirs.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    check_header(bucket, self, peers[size_t(i)], m + i * kHeaderWords, t + i * kHeaderWords);
  }
}

}  // namespace decent_comm::comm
