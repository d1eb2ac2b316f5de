// The NCCL transport (GPU): compiled only with DECENT_COMM_WITH_NCCL. The class lives in nccl_transport.cpp;
// this header exposes what the bindings need, free of NCCL and CUDA types.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "../transport.h"

#pragma GCC visibility push(hidden)  // see transport.h

namespace decent_comm::comm {

// A fresh ncclUniqueId as NCCL_UNIQUE_ID_BYTES raw bytes. One rank creates it; every rank passes it on.
std::string nccl_unique_id();

// Collective over the `world_size` ranks sharing `unique_id`: creates a non-blocking NCCL communicator on
// CUDA device `device_index` (waiting at most timeout_ms for the other ranks), a high-priority comm stream,
// and the watchdog thread. max_ctas > 0 caps the CTAs (SMs) NCCL may use (ncclConfig_t maxCTAs).
std::shared_ptr<Transport> make_nccl_transport(const std::string& unique_id, int rank, int world_size,
                                               int device_index, int64_t timeout_ms, int max_ctas);

}  // namespace decent_comm::comm

#pragma GCC visibility pop
