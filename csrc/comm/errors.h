// The two failure kinds of the exchange engine, as C++ exceptions the bindings translate into
// decent_comm.exchange.ExchangeError (a RuntimeError) and ExchangeTimeout (an ExchangeError and a
// TimeoutError). Bad arguments are not among them: those are c10::ValueError / c10::Error, raised before
// anything is enqueued, and leave the exchanger usable.
#pragma once

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#pragma GCC visibility push(hidden)  // see transport.h

namespace decent_comm::comm {

using Clock = std::chrono::steady_clock;

// A transfer failed (peer died, transport error, communicator aborted). The exchanger is unusable after it.
class ExchangeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A transfer did not complete within the timeout. Also makes the exchanger unusable.
class ExchangeTimeoutError : public ExchangeError {
 public:
  using ExchangeError::ExchangeError;
};

// One direction of one peer of a bucket, for error messages: "receive from rank 3", "send to rank 1".
struct PeerOp {
  int peer;
  bool is_send;
};

inline std::string describe(const PeerOp& op) {
  return std::string(op.is_send ? "send to rank " : "receive from rank ") + std::to_string(op.peer);
}

inline std::string describe(const std::vector<PeerOp>& ops) {
  std::string out;
  for (const auto& op : ops) out += (out.empty() ? "" : ", ") + describe(op);
  return out.empty() ? "(no peer)" : out;
}

// "exchange of bucket 3 timed out after 5000 ms waiting for receive from rank 1, send to rank 2 ..."
inline ExchangeTimeoutError timeout_error(int64_t bucket, std::chrono::milliseconds timeout,
                                          const std::vector<PeerOp>& stuck, const std::string& detail) {
  return ExchangeTimeoutError(
      "decent_comm exchange: bucket " + std::to_string(bucket) + " timed out after " +
      std::to_string(timeout.count()) + " ms waiting for " + describe(stuck) +
      " (that peer died, is stuck, or did not post the matching exchange of this bucket)" +
      (detail.empty() ? "" : "; transport: " + detail));
}

// "exchange of bucket 3: receive from rank 1 failed: Connection closed by peer"
inline ExchangeError transfer_error(int64_t bucket, const std::string& what_failed, const std::string& detail) {
  return ExchangeError("decent_comm exchange: bucket " + std::to_string(bucket) + ": " + what_failed +
                       " failed: " + detail);
}

}  // namespace decent_comm::comm

#pragma GCC visibility pop
