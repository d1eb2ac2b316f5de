// The ProcessGroup transport (see process_group_transport.h).
#include "process_group_transport.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <thread>

namespace decent_comm::comm {

namespace {

// Tags: bit 30 set keeps them clear of the small tags user code passes to dist.send/recv on the same
// group; bit 29 tells a bucket's handshake headers from its data; bits 16..28 are the exchanger's channel, so
// two exchangers on one group (or a new one after a failed one left unmatched operations behind) never
// match each other's messages; bits 0..15 the bucket. With 32 channels (5 bits, an earlier layout) the 33rd
// optimizer alive on a group shared the 1st one's tags, and two ranks that stepped them in different orders
// silently averaged each other's parameters; 8192 channels put that 8192 optimizers (or rebuilds after a
// failure) away.
constexpr int kTagBit = 1 << 30;
constexpr int kHeaderTagBit = 1 << 29;
constexpr int kChannelShift = 16;
constexpr int kChannels = 1 << 13;
static_assert(kMaxBucketId < (1 << kChannelShift), "bucket ids must fit the tag's low 16 bits");
static_assert((kChannels - 1) << kChannelShift < kHeaderTagBit, "channels must stay clear of the header bit");

// The n-th exchanger opened on a process group gets channel n % kChannels. Keyed by the group's name, which
// torch assigns in the same order on every rank, so ranks that create exchangers in the same order (as
// they must create groups) agree on channels without communicating. Claimed in open(), once the exchanger's
// construction can no longer fail (decent_comm.exchange.Exchanger also agrees across ranks that every
// rank's arguments were valid before it creates the transport).
int next_channel(const c10d::ProcessGroup& pg) {
  static std::mutex mu;
  static std::map<std::string, int> created;
  std::lock_guard<std::mutex> lock(mu);
  return created[pg.getGroupName()]++ % kChannels;
}

// What operations abandoned unfinished (a failure, or no shutdown()) keep alive: the backend may still write
// into their tensors.
struct Abandoned {
  std::vector<PgPending> pending;
  std::vector<at::Tensor> tensors;
};

void keep_unfinished_alive(std::vector<PgPending>&& pending, std::vector<at::Tensor>&& tensors) {
  if (pending.empty()) return;
  keep_alive_forever(std::make_shared<Abandoned>(Abandoned{std::move(pending), std::move(tensors)}));
}

struct PgSlot final : TransportSlot {
  int64_t bucket = -1;
  Clock::time_point deadline;
  std::chrono::milliseconds timeout{0};
  std::vector<PgPending> pending;  // receives first, then sends
  std::vector<at::Tensor> tensors;  // what the transfers read or write: the payload, then the recvs

  ~PgSlot() override { keep_unfinished_alive(std::move(pending), std::move(tensors)); }

  void release() {
    pending.clear();  // clear() keeps the capacity: the next step allocates nothing here
    tensors.clear();
  }
};

// ProcessGroup::hasBackendForDeviceType is newer than torch 2.11 (the GPU machine's); getDeviceTypes() lists
// the same set (setBackend fills both) in every torch this builds against.
bool has_backend_for(const c10d::ProcessGroup& pg, c10::DeviceType device_type) {
  const auto devices = pg.getDeviceTypes();
  return std::any_of(devices.begin(), devices.end(), [&](const c10::Device& d) { return d.type() == device_type; });
}

std::chrono::milliseconds remaining(Clock::time_point deadline) {
  // c10d reads a 0 ms timeout as "no timeout", so never pass less than 1 ms.
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

}  // namespace

std::chrono::milliseconds process_group_timeout(c10d::ProcessGroup& pg, c10::DeviceType device_type) {
  if (!has_backend_for(pg, device_type)) return kBackendDefaultTimeout;
  try {
    return pg.getBackend(device_type)->getBackendOptions()->timeout;
  } catch (const std::exception&) {  // a backend that does not implement getBackendOptions()
    return kBackendDefaultTimeout;
  }
}

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::Device device)
    : pg_(std::move(pg)), device_(device), one_(1) {
  TORCH_CHECK_VALUE(pg_, "decent_comm ProcessGroupTransport: process_group is None");
  TORCH_CHECK_VALUE(has_backend_for(*pg_, device_.type()), "decent_comm ProcessGroupTransport: process "
                    "group '", pg_->getGroupName(), "' (backend ", pg_->getBackendName(), ") has no backend for ",
                    device_.type(), " tensors");
  backend_ = pg_->getBackend(device_.type());
  rank_ = pg_->getRank();
  world_size_ = pg_->getSize();
  bounded_wait_ = backend_->getBackendName() == "gloo";
  default_timeout_ = process_group_timeout(*pg_, device_.type());
}

void ProcessGroupTransport::open() {
  TORCH_CHECK(channel_ < 0, "decent_comm ProcessGroupTransport: opened twice");
  channel_ = next_channel(*pg_);
  tag_base_ = kTagBit + (channel_ << kChannelShift);
}

std::unique_ptr<TransportSlot> ProcessGroupTransport::make_slot() { return std::make_unique<PgSlot>(); }

void ProcessGroupTransport::post(std::vector<PgPending>& pending, const at::Tensor& tensor, PeerOp op, int tag) {
  one_[0] = tensor;
  // No profiler range on the backend's work: c10d attaches an async RecordFunction ("gloo:send") to every
  // Work created while a profiler runs, and ends it on the backend's thread when the transfer completes. An
  // exchange is in flight across step() boundaries, so a profiler stopped between steps leaves those ranges
  // open; ending them afterwards writes into the stopped profiler's event storage, and the process dies with
  // SIGSEGV at exit (seen with torch 2.14 + gloo). Our own ranges (decent_comm::exchange_launch/_wait) mark
  // where the host issues and waits for the exchange.
  at::DisableRecordFunctionGuard no_async_profiler_range;
  try {
    pending.push_back({op.is_send ? backend_->send(one_, op.peer, tag) : backend_->recv(one_, op.peer, tag), op});
  } catch (...) {
    one_[0] = at::Tensor();
    throw;
  }
  one_[0] = at::Tensor();
}

void ProcessGroupTransport::swap_headers(const HeaderSwap& op) {
  TORCH_CHECK(channel_ >= 0, "decent_comm ProcessGroupTransport: used before open()");
  const int tag = tag_base_ + kHeaderTagBit + int(op.bucket);
  // The backend moves tensors of its own device type only.
  const bool on_cpu = device_.is_cpu();
  at::Tensor mine = on_cpu ? op.mine : op.mine.to(device_);
  at::Tensor theirs = on_cpu ? op.theirs : at::zeros_like(op.theirs, op.theirs.options().device(device_));
  std::vector<PgPending> pending;
  PeerOp current{-1, false};
  try {
    for (size_t i = 0; i < op.peers.size(); ++i) {
      // A timeout names the exchange's own transfers with that peer, which is what the caller asked for.
      const int peer = int(op.peers[i]);
      const auto edge = std::find_if(op.edges.begin(), op.edges.end(), [&](const PeerOp& e) { return e.peer == peer; });
      current = edge != op.edges.end() ? *edge : PeerOp{peer, false};
      post(pending, theirs[int64_t(i)], PeerOp{peer, false}, tag);
      pending.back().op = current;
      post(pending, mine[int64_t(i)], PeerOp{peer, true}, tag);
      pending.back().op = current;
    }
  } catch (const std::exception& e) {
    keep_unfinished_alive(std::move(pending), {mine, theirs});
    throw transfer_error(op.bucket, "posting the size/dtype handshake for " + describe(current), e.what());
  }
  try {
    wait_all(pending, op.bucket, op.deadline, op.timeout, "size/dtype handshake: ");
  } catch (...) {
    keep_unfinished_alive(std::move(pending), {mine, theirs});
    throw;
  }
  if (!on_cpu) op.theirs.copy_(theirs);
}

void ProcessGroupTransport::start(TransportSlot& base, const BucketOp& op) {
  TORCH_CHECK(channel_ >= 0, "decent_comm ProcessGroupTransport: used before open()");
  auto& slot = static_cast<PgSlot&>(base);
  slot.bucket = op.bucket;
  slot.deadline = op.deadline;
  slot.timeout = op.timeout;
  // The cast runs on the caller's thread; this bucket's previous send from the same buffer completed in
  // wait(), which the scheduler requires before the bucket is exchanged again.
  if (op.wire.defined()) op.wire.copy_(op.send);
  const at::Tensor& payload = op.wire.defined() ? op.wire : op.send;
  slot.tensors.push_back(payload);
  slot.tensors.insert(slot.tensors.end(), op.recvs.begin(), op.recvs.end());
  const int tag = tag_base_ + int(op.bucket);
  std::vector<PgPending>& retired = retired_[op.bucket];  // created once per bucket

  PeerOp current{-1, false};
  try {
    // Receives are posted first so the peers' sends find them ready.
    for (size_t i = 0; i < op.recv_from.size(); ++i) {
      current = {int(op.recv_from[i]), false};
      post(slot.pending, op.recvs[i], current, tag);
    }
    for (const int64_t peer : op.send_to) {
      current = {int(peer), true};
      post(slot.pending, payload, current, tag);
    }
  } catch (const std::exception& e) {
    throw transfer_error(op.bucket, "posting the " + describe(current), e.what());
  }
  // The previous round's Works, a full step after they completed: gloo's I/O thread let go of their buffers long
  // ago, so this frees without spinning (see retired_). After posting, so the new transfers are not delayed.
  retired.clear();
}

bool ProcessGroupTransport::wait_one(const c10::intrusive_ptr<c10d::Work>& work,
                                     Clock::time_point deadline) const {
  if (bounded_wait_) return work->wait(remaining(deadline));
  // Backends whose Work::wait ignores a timeout: poll, spinning briefly (transfers of small buckets finish
  // in microseconds) and then sleeping, until completion or the deadline.
  for (int polls = 0; !work->isCompleted(); ++polls) {
    if (interrupted_.load(std::memory_order_relaxed)) return false;
    if (Clock::now() >= deadline) {
      throw std::runtime_error(backend_->getBackendName() + " operation not completed by the deadline");
    }
    if (polls < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(polls < 1024 ? 50 : 1000));
    }
  }
  return work->wait();  // completed: returns at once, or rethrows the operation's exception
}

bool ProcessGroupTransport::finished_soon(const c10::intrusive_ptr<c10d::Work>& work) const {
  try {
    // gloo marks a send/recv completed only inside wait(), hence the 1 ms wait rather than isCompleted().
    return bounded_wait_ ? work->wait(std::chrono::milliseconds(1)) : work->isCompleted();
  } catch (const std::exception&) {
    return false;
  }
}

void ProcessGroupTransport::set_waiting(const std::vector<PgPending>* pending, size_t index) const {
  std::lock_guard<std::mutex> lock(interrupt_mu_);
  waiting_ = pending;
  waiting_index_ = index;
  interrupted_.store(false, std::memory_order_relaxed);
  wait_generation_.fetch_add(1, std::memory_order_release);
}

std::vector<int64_t> ProcessGroupTransport::waiting_peers() const {
  std::lock_guard<std::mutex> lock(interrupt_mu_);
  if (waiting_ == nullptr) return {};
  return {int64_t((*waiting_)[waiting_index_].op.peer)};
}

bool ProcessGroupTransport::interrupt(uint64_t generation, const std::string& reason, bool timed_out) {
  std::lock_guard<std::mutex> lock(interrupt_mu_);
  // Under the lock that moves the wait from one operation to the next: an interrupt meant for an operation that
  // completed meanwhile stops nothing (its peer may have stopped only after that operation went through).
  if (waiting_ == nullptr || wait_generation_.load(std::memory_order_relaxed) != generation) return false;
  interrupt_reason_ = reason;
  interrupt_timed_out_ = timed_out;
  interrupted_.store(true, std::memory_order_relaxed);
  if (bounded_wait_) {
    // gloo: the aborted send/recv's wait returns false at once (its UnboundBuffer's abortWait flag); the transfer
    // itself stays posted, and the failed exchange keeps its buffers alive (PgSlot). A timed-out gloo wait would
    // instead fail every pair of the process group.
    try {
      (*waiting_)[waiting_index_].work->abort();
    } catch (const std::exception&) {  // a Work that cannot abort: its wait runs on to its deadline
    }
  }
  return true;
}

void ProcessGroupTransport::wait_all(const std::vector<PgPending>& pending, int64_t bucket,
                                     Clock::time_point deadline, std::chrono::milliseconds timeout,
                                     const char* stage) const {
  struct Done {
    const ProcessGroupTransport& t;
    ~Done() { t.set_waiting(nullptr, 0); }
  } done{*this};
  for (size_t i = 0; i < pending.size(); ++i) {
    set_waiting(&pending, i);
    const PgPending& p = pending[i];
    std::string detail;
    try {
      if (wait_one(p.work, deadline)) continue;
      detail = "the operation was aborted";
    } catch (const std::exception& e) {
      detail = e.what();
    }
    if (interrupted_.load(std::memory_order_relaxed)) {  // by interrupt(): its reason, not the abort, is the error
      std::lock_guard<std::mutex> lock(interrupt_mu_);
      const std::string what = "decent_comm exchange: bucket " + std::to_string(bucket) + ": " + stage +
                               "stopped waiting for " + describe(p.op) + ": " + interrupt_reason_;
      if (interrupt_timed_out_) throw ExchangeTimeoutError(what);
      throw ExchangeError(what);
    }
    detail = stage + detail;
    // Failed. At (or past) the deadline it is a timeout: name every peer still unfinished, probing the
    // later ones for 1 ms each. Before it, the backend reported an error (typically: the peer exited).
    if (Clock::now() + std::chrono::milliseconds(10) >= deadline) {
      std::vector<PeerOp> stuck{p.op};
      for (size_t j = i + 1; j < pending.size(); ++j) {
        const PeerOp& op = pending[j].op;
        const bool named = std::any_of(stuck.begin(), stuck.end(),
                                       [&](const PeerOp& s) { return s.peer == op.peer && s.is_send == op.is_send; });
        if (!named && !finished_soon(pending[j].work)) stuck.push_back(op);
      }
      throw timeout_error(bucket, timeout, stuck, detail);
    }
    throw transfer_error(bucket, describe(p.op) + " (rank " + std::to_string(p.op.peer) +
                                     " may have exited or failed)", detail);
  }
}

void ProcessGroupTransport::wait(TransportSlot& base) {
  auto& slot = static_cast<PgSlot&>(base);
  wait_all(slot.pending, slot.bucket, slot.deadline, slot.timeout, "");
  // Completed: kept until the bucket's next start() rather than destroyed now (see retired_). Swapped, so the two
  // vectors trade capacities and the steady state allocates nothing. A failed wait threw above: its operations stay in
  // the slot, which keeps them alive forever (~PgSlot), as before.
  std::vector<PgPending>& retired = retired_[slot.bucket];
  retired.clear();  // empty already: start() cleared it
  retired.swap(slot.pending);
  slot.release();
}

}  // namespace decent_comm::comm
