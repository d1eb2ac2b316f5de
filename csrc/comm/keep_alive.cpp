// keep_alive_forever (transport.h): the process-lifetime home of buffers an aborted transfer may still touch.
#include <mutex>

#include "transport.h"

namespace decent_comm::comm {

void keep_alive_forever(std::shared_ptr<void> what) {
  // Deliberately leaked (never destroyed, not even at exit): destroying these at interpreter teardown could
  // run after the transport's threads or the CUDA context are gone.
  static auto* mu = new std::mutex;
  static auto* kept = new std::vector<std::shared_ptr<void>>;
  std::lock_guard<std::mutex> lock(*mu);
  kept->push_back(std::move(what));
}

}  // namespace decent_comm::comm
