// What a bucket in flight holds of the caller's buffers, for every transport alike (exchanger.h).
//
// A transport is handed raw memory: gloo posts the data pointers, NCCL enqueues kernels on them. Keeping the
// Tensor objects alive is not enough to keep that memory: `t.resize_(bigger)` gives the same storage a new
// allocation and frees the old one, `t.set_(u)` / `t.data = u` give the tensor another storage, and the last
// reference to the old one frees it, while the backend still reads or writes there (seen: a peer received
// garbage; received data vanished and a rank died with SIGSEGV). So, from exchange() to wait():
//   - each buffer's storage is held (a re-pointed tensor's former memory stays allocated), and
//   - each storage is made non-resizable, so a resize_ that would reallocate raises torch's "Trying to resize
//     storage that is not resizable" at the call instead of freeing memory under the transfer; the flag is
//     restored at wait() (reference-counted per storage: buffers of several buckets may share one flat storage);
//   - wait() checks that every buffer still has the memory and size it had at exchange(), so a tensor resized in
//     place or re-pointed raises RuntimeError naming the bucket there rather than reading back data that went
//     elsewhere. torch's resize_ sets the new shape before it resizes the storage, so a refused resize_ leaves the
//     tensor claiming more elements than its memory holds (reads past the allocation); wait() gives such a tensor
//     its shape at exchange() back, and raises all the same.
// Held buffers never waited for (a failure, an exchanger dropped in flight) are kept pinned until the process
// exits (keep_alive_forever): the transfer may still touch them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/DimVector.h>

#include <cstdint>
#include <string>
#include <vector>

#pragma GCC visibility push(hidden)  // see transport.h

namespace decent_comm::comm {

class InFlightBuffers {
 public:
  InFlightBuffers() = default;
  InFlightBuffers(const InFlightBuffers&) = delete;
  InFlightBuffers& operator=(const InFlightBuffers&) = delete;
  InFlightBuffers(InFlightBuffers&&) = default;  // std::unordered_map<id, Bucket> moves buckets while rehashing
  InFlightBuffers& operator=(InFlightBuffers&&) = delete;
  ~InFlightBuffers();  // entries still held: kept alive and pinned forever

  // Holds and pins `send` and `recvs` (validated: dense tensors with storage; recvs[i] from rank recv_from[i]).
  void hold(const at::Tensor& send, const std::vector<at::Tensor>& recvs, const std::vector<int64_t>& recv_from);
  // After the transfer completed: "" when every buffer still has its memory and size, else what changed (the
  // first such buffer), naming the call, the bucket, the buffer and where its data went. Sets back the shape of a
  // buffer that a refused resize_ left past its memory.
  std::string changed(const char* call, int64_t bucket);
  // After the transfer completed: unpins (restores each storage's resizable flag) and lets go.
  void release();
  bool empty() const { return entries_.empty(); }

 private:
  struct Entry {
    at::Tensor tensor;    // the caller's tensor, to see whether it still refers to `storage`'s memory
    c10::Storage storage;  // the memory the transfer uses, allocated until release()
    const void* data;     // tensor.data_ptr() at exchange()
    int64_t numel;
    c10::DimVector sizes, strides;  // at exchange(), to undo a refused resize_ (inline: no allocation per step)
    int64_t offset;
    int64_t peer;  // -1: send; else the rank recvs[index] comes from
    size_t index;
  };
  std::vector<Entry> entries_;  // send first, then recvs in order; capacity reused every step
};

}  // namespace decent_comm::comm

#pragma GCC visibility pop
