// What a bucket in flight holds of the caller's buffers (see in_flight_buffers.h).
#include "in_flight_buffers.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "transport.h"

namespace decent_comm::comm {

namespace {

// One storage's pins: how many held buffers of buckets in flight (any exchanger) use it, and its resizable flag
// before the first of them. A count, not a flag per exchange: a flat storage sliced into several buckets' buffers
// must stay pinned until the last of those buckets was waited for, and then get back its own flag, not the
// "false" an earlier pin left.
struct Pin {
  int64_t count;
  bool was_resizable;
};

// Leaked, like keep_alive_forever's list: pins of buffers abandoned in flight last until the process exits.
std::mutex& pin_mutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

std::unordered_map<const c10::StorageImpl*, Pin>& pins() {
  static auto* table = new std::unordered_map<const c10::StorageImpl*, Pin>;
  return *table;
}

void pin(c10::StorageImpl* s) {
  std::lock_guard<std::mutex> lock(pin_mutex());
  auto it = pins().try_emplace(s, Pin{0, s->resizable()}).first;
  if (it->second.count++ == 0) s->set_resizable(false);
}

void unpin(c10::StorageImpl* s) {
  std::lock_guard<std::mutex> lock(pin_mutex());
  const auto it = pins().find(s);
  if (it == pins().end()) return;  // not pinned by us (cannot happen: every release pairs with a hold)
  if (--it->second.count > 0) return;
  // Only a storage that was resizable before is made resizable again (it has an allocator: set_resizable's
  // requirement); one that never was (from_blob, numpy) stays as it was.
  if (it->second.was_resizable) s->set_resizable(true);
  pins().erase(it);
}

}  // namespace

InFlightBuffers::~InFlightBuffers() {
  // Never waited for (a failure aborted the transport, or the exchanger went away in flight): the backend may
  // still read or write this memory, so it stays allocated, and its storages non-resizable, for good.
  if (!entries_.empty()) keep_alive_forever(std::make_shared<std::vector<Entry>>(std::move(entries_)));
}

void InFlightBuffers::hold(const at::Tensor& send, const std::vector<at::Tensor>& recvs,
                           const std::vector<int64_t>& recv_from) {
  TORCH_INTERNAL_ASSERT(entries_.empty(), "decent_comm InFlightBuffers: held twice");
  entries_.reserve(recvs.size() + 1);  // push_back below cannot throw between a pin and its record
  const auto add = [&](const at::Tensor& t, int64_t peer, size_t index) {
    // data_ptr() (not const_data_ptr()): a copy-on-write storage is materialized here, as the transport's own
    // data_ptr() call would do after this record, which would then look like a re-pointed buffer at wait().
    void* data = t.data_ptr();
    entries_.push_back(Entry{t, t.storage(), data, t.numel(), c10::DimVector(t.sizes()), c10::DimVector(t.strides()),
                             t.storage_offset(), peer, index});
    pin(entries_.back().storage.unsafeGetStorageImpl());
  };
  try {
    add(send, -1, 0);
    for (size_t i = 0; i < recvs.size(); ++i) add(recvs[i], recv_from[i], i);
  } catch (...) {  // nothing was posted yet: undo, so the bucket can be exchanged again
    release();
    throw;
  }
}

namespace {

// "send" or "recvs[i] (from rank r)".
std::ostream& name(std::ostream& os, int64_t peer, size_t index) {
  if (peer < 0) return os << "send";
  return os << "recvs[" << index << "] (from rank " << peer << ")";
}

// Whether `t`'s shape reaches past the end of its storage: what a refused resize_ leaves (torch sets the shape first).
bool past_its_memory(const at::Tensor& t) {
  return at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.itemsize(), size_t(t.storage_offset())) >
         t.storage().nbytes();
}

}  // namespace

std::string InFlightBuffers::changed(const char* call, int64_t bucket) {
  std::string first;  // the message names the first changed buffer; every buffer past its memory is set back
  for (const Entry& e : entries_) {
    const at::Tensor& t = e.tensor;
    const bool same_memory = t.has_storage() && t.storage().unsafeGetStorageImpl() == e.storage.unsafeGetStorageImpl();
    if (same_memory && t.const_data_ptr() == e.data && t.numel() == e.numel) continue;
    std::ostringstream os;
    os << "decent_comm Exchanger." << call << "(bucket=" << bucket << "): ";
    name(os, e.peer, e.index);
    if (same_memory && past_its_memory(t)) {
      os << " was resized while bucket " << bucket << " was in flight: torch refused the resize_ (a buffer's "
         << "storage is not resizable until wait(), so that the transfer's memory stays allocated) but had already "
         << "given the tensor " << t.numel() << " elements, more than its memory holds. ";
      try {
        t.unsafeGetTensorImpl()->set_sizes_and_strides(e.sizes, e.strides, e.offset);
        os << "Its shape is set back to " << c10::IntArrayRef(e.sizes) << "; it holds "
           << (e.peer < 0 ? "what its peers received." : "the data received.");
      } catch (const std::exception&) {  // a tensor whose metadata cannot change: leave it, say so
        os << "Its shape could not be set back (it should be " << c10::IntArrayRef(e.sizes) << "); do not read it.";
      }
    } else {
      os << " was resized or re-pointed to other memory (resize_, set_, .data =) while bucket " << bucket
         << " was in flight: it had " << e.numel << " elements at " << e.data << ", now " << t.numel()
         << " elements at " << (t.has_storage() ? t.const_data_ptr() : nullptr) << ". ";
      if (e.peer < 0) {
        os << "Its peers received what its former memory held.";
      } else {
        os << "The data received from rank " << e.peer << " went into the memory it had at exchange(), which the "
           << "tensor as it is now does not (wholly) cover: do not use its values.";
      }
    }
    os << " A buffer must keep its memory and size from exchange() until wait().";
    if (first.empty()) first = os.str();
  }
  return first;
}

void InFlightBuffers::release() {
  for (const Entry& e : entries_) unpin(e.storage.unsafeGetStorageImpl());
  entries_.clear();  // keeps the capacity: the steady state allocates nothing here
}

}  // namespace decent_comm::comm
