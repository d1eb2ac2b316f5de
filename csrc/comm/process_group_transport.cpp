// The ProcessGroup transport (see process_group_transport.h).
#include "process_group_transport.h"

#include <c10/util/Exception.h>

#include <map>
#include <mutex>
#include <thread>

namespace decent_comm::comm {

namespace {

// Tags: bit 30 set keeps them clear of the small tags user code passes to dist.send/recv on the same
// group; bits 24..29 are the exchanger's channel, so two exchangers on one group (or a new one after a
// failed one left unmatched operations behind) never match each other's messages; bits 0..23 the bucket.
constexpr int kTagBit = 1 << 30;
constexpr int kChannels = 64;

// The n-th exchanger created on a process group gets channel n % 64. Keyed by the group's name, which
// torch assigns in the same order on every rank, so ranks that create exchangers in the same order (as
// they must create groups) agree on channels without communicating.
int next_channel(const c10d::ProcessGroup& pg) {
  static std::mutex mu;
  static std::map<std::string, int> created;
  std::lock_guard<std::mutex> lock(mu);
  return created[pg.getGroupName()]++ % kChannels;
}

// What a slot keeps alive: the Work handles and the tensors the transfer reads or writes.
struct Pending {
  c10::intrusive_ptr<c10d::Work> work;
  PeerOp op;
};

struct PgSlot final : TransportSlot {
  int64_t bucket = -1;
  Clock::time_point deadline;
  std::chrono::milliseconds timeout{0};
  std::vector<Pending> pending;  // receives first, then sends
  at::Tensor send;
  std::vector<at::Tensor> recvs;

  ~PgSlot() override {
    // Destroyed with transfers not waited for (a failure, or no shutdown()): the backend may still write
    // into the recv buffers, so they outlive us.
    if (pending.empty()) return;
    struct Kept {
      std::vector<Pending> pending;
      at::Tensor send;
      std::vector<at::Tensor> recvs;
    };
    keep_alive_forever(std::make_shared<Kept>(Kept{std::move(pending), std::move(send), std::move(recvs)}));
  }

  void release() {
    pending.clear();  // clear() keeps the capacity: the next step allocates nothing here
    send = at::Tensor();
    recvs.clear();
  }
};

std::chrono::milliseconds remaining(Clock::time_point deadline) {
  // c10d reads a 0 ms timeout as "no timeout", so never pass less than 1 ms.
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

}  // namespace

std::chrono::milliseconds process_group_timeout(c10d::ProcessGroup& pg, c10::DeviceType device_type) {
  if (!pg.hasBackendForDeviceType(device_type)) return kBackendDefaultTimeout;
  try {
    return pg.getBackend(device_type)->getBackendOptions()->timeout;
  } catch (const std::exception&) {  // a backend that does not implement getBackendOptions()
    return kBackendDefaultTimeout;
  }
}

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::Device device)
    : pg_(std::move(pg)), device_(device), one_(1) {
  TORCH_CHECK_VALUE(pg_, "decent_comm ProcessGroupTransport: process_group is None");
  TORCH_CHECK_VALUE(pg_->hasBackendForDeviceType(device_.type()), "decent_comm ProcessGroupTransport: process "
                    "group '", pg_->getGroupName(), "' (backend ", pg_->getBackendName(), ") has no backend for ",
                    device_.type(), " tensors");
  backend_ = pg_->getBackend(device_.type());
  rank_ = pg_->getRank();
  world_size_ = pg_->getSize();
  channel_ = next_channel(*pg_);
  tag_base_ = kTagBit + (channel_ << 24);
  static_assert(kMaxBucketId < (1 << 24), "bucket ids must fit the tag's low 24 bits");
  bounded_wait_ = backend_->getBackendName() == "gloo";
  default_timeout_ = process_group_timeout(*pg_, device_.type());
}

std::unique_ptr<TransportSlot> ProcessGroupTransport::make_slot() { return std::make_unique<PgSlot>(); }

void ProcessGroupTransport::start(TransportSlot& base, const BucketOp& op) {
  auto& slot = static_cast<PgSlot&>(base);
  slot.bucket = op.bucket;
  slot.deadline = op.deadline;
  slot.timeout = op.timeout;
  // The cast runs on the caller's thread; this bucket's previous send from the same buffer completed in
  // wait(), which the scheduler requires before the bucket is exchanged again.
  if (op.wire.defined()) op.wire.copy_(op.send);
  const at::Tensor& payload = op.wire.defined() ? op.wire : op.send;
  slot.send = payload;
  slot.recvs.assign(op.recvs.begin(), op.recvs.end());
  const int tag = tag_base_ + int(op.bucket);

  PeerOp current{-1, false};
  try {
    // Receives are posted first so the peers' sends find them ready.
    for (size_t i = 0; i < op.recv_from.size(); ++i) {
      current = {int(op.recv_from[i]), false};
      one_[0] = op.recvs[i];
      slot.pending.push_back({backend_->recv(one_, current.peer, tag), current});
    }
    for (const int64_t peer : op.send_to) {
      current = {int(peer), true};
      one_[0] = payload;
      slot.pending.push_back({backend_->send(one_, current.peer, tag), current});
    }
  } catch (const std::exception& e) {
    one_[0] = at::Tensor();
    throw transfer_error(op.bucket, "posting the " + describe(current), e.what());
  }
  one_[0] = at::Tensor();
}

bool ProcessGroupTransport::wait_one(const c10::intrusive_ptr<c10d::Work>& work,
                                     Clock::time_point deadline) const {
  if (bounded_wait_) return work->wait(remaining(deadline));
  // Backends whose Work::wait ignores a timeout: poll, spinning briefly (transfers of small buckets finish
  // in microseconds) and then sleeping, until completion or the deadline.
  for (int polls = 0; !work->isCompleted(); ++polls) {
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

void ProcessGroupTransport::wait(TransportSlot& base) {
  auto& slot = static_cast<PgSlot&>(base);
  for (size_t i = 0; i < slot.pending.size(); ++i) {
    const Pending& p = slot.pending[i];
    std::string detail;
    try {
      if (wait_one(p.work, slot.deadline)) continue;
      detail = "the operation was aborted";
    } catch (const std::exception& e) {
      detail = e.what();
    }
    // Failed. At (or past) the deadline it is a timeout: name every peer still unfinished, probing the
    // later ones for 1 ms each. Before it, the backend reported an error (typically: the peer exited).
    if (Clock::now() + std::chrono::milliseconds(10) >= slot.deadline) {
      std::vector<PeerOp> stuck{p.op};
      for (size_t j = i + 1; j < slot.pending.size(); ++j) {
        if (!finished_soon(slot.pending[j].work)) stuck.push_back(slot.pending[j].op);
      }
      throw timeout_error(slot.bucket, slot.timeout, stuck, detail);
    }
    throw transfer_error(slot.bucket, describe(p.op) + " (rank " + std::to_string(p.op.peer) +
                                          " may have exited or failed)", detail);
  }
  slot.release();
}

}  // namespace decent_comm::comm
