// pybind11 bindings of the exchange engine: the scheduler (_Exchanger, subclassed in Python by
// decent_comm.exchange.Exchanger), the transport factories, and the two exception types.
#include <torch/csrc/utils/pybind.h>

#include "errors.h"
#include "exchanger.h"
#include "process_group_transport.h"
#ifdef DECENT_COMM_WITH_NCCL
#include "nccl/nccl_transport.h"
#endif

namespace decent_comm::comm {

namespace {

// Created once when the module loads; the translator (a plain function pointer) reads them.
PyObject* g_exchange_error = nullptr;
PyObject* g_exchange_timeout = nullptr;

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const ExchangeTimeoutError& e) {
    PyErr_SetString(g_exchange_timeout, e.what());
  } catch (const ExchangeError& e) {
    PyErr_SetString(g_exchange_error, e.what());
  }
}

void register_exceptions(py::module& m) {
  // Named as decent_comm.exchange re-exports them. ExchangeTimeout is both an ExchangeError (so a
  // RuntimeError) and a TimeoutError, so either `except` clause catches it.
  g_exchange_error = PyErr_NewException("decent_comm.exchange.ExchangeError", PyExc_RuntimeError, nullptr);
  if (g_exchange_error == nullptr) throw py::error_already_set();
  py::tuple bases = py::make_tuple(py::handle(g_exchange_error), py::handle(PyExc_TimeoutError));
  g_exchange_timeout = PyErr_NewException("decent_comm.exchange.ExchangeTimeout", bases.ptr(), nullptr);
  if (g_exchange_timeout == nullptr) throw py::error_already_set();
  m.attr("ExchangeError") = py::handle(g_exchange_error);
  m.attr("ExchangeTimeout") = py::handle(g_exchange_timeout);
  // Module-local: consulted only for this module's functions, never for torch's own.
  py::register_local_exception_translator(&translate);
}

}  // namespace

}  // namespace decent_comm::comm

void register_comm_bindings(py::module& m) {
  using namespace decent_comm::comm;
  using Release = py::call_guard<py::gil_scoped_release>;
  register_exceptions(m);

  py::class_<Transport, std::shared_ptr<Transport>>(m, "_Transport", "A transport of the exchange engine")
      .def_property_readonly("name", [](const Transport& t) { return std::string(t.name()); })
      // For a watcher thread (transport.h): an interrupted wait raises in the Exchanger's call, which then fails
      // as on any transport error. The Exchanger's own lock is not taken: the blocked call holds it.
      .def_property_readonly("_wait_generation", &Transport::wait_generation,
                             "changes whenever a wait moves to another operation or ends")
      .def("_waiting_peers", &Transport::waiting_peers, Release(),
           "the peer of the operation the running wait blocks on ([] when none runs)")
      .def("_interrupt", &Transport::interrupt, py::arg("generation"), py::arg("reason"), py::arg("timed_out"),
           Release(), "if the operation of `generation` still blocks the wait: the wait raises `reason` (an "
           "ExchangeTimeout when timed_out); returns whether it did");

  m.def(
      "_process_group_transport",
      [](c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::Device device) -> std::shared_ptr<Transport> {
        return std::make_shared<ProcessGroupTransport>(std::move(pg), device);
      },
      py::arg("process_group"), py::arg("device"),
      "Transport over a torch ProcessGroup's send/recv (gloo on CPU)");

  m.def(
      "_process_group_timeout_ms",
      [](c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::Device device) {
        return int64_t(process_group_timeout(*pg, device.type()).count());
      },
      py::arg("process_group"), py::arg("device"), "The timeout the group was created with, in ms");

#ifdef DECENT_COMM_WITH_NCCL
  m.def(
      "_nccl_unique_id", [] { return py::bytes(nccl_unique_id()); },
      "A new ncclUniqueId as bytes (call on one rank, share it)");
  m.def("_nccl_transport", &make_nccl_transport, py::arg("unique_id"), py::arg("rank"), py::arg("world_size"),
        py::arg("device_index"), py::arg("timeout_ms"), py::arg("max_ctas"), Release(),
        "Transport over a new non-blocking NCCL communicator (collective: every rank calls it)");
#endif

  py::class_<Exchanger>(m, "_Exchanger", "The exchange scheduler; use decent_comm.exchange.Exchanger")
      .def(py::init<std::shared_ptr<Transport>, int64_t, std::optional<at::ScalarType>, bool>(), py::arg("transport"),
           py::arg("timeout_ms"), py::arg("wire_dtype"), py::arg("allow_self_exchange") = false)
      .def("exchange", &Exchanger::exchange, py::arg("bucket"), py::arg("send"), py::arg("recvs"),
           py::arg("send_to"), py::arg("recv_from"), Release(),
           "Enqueue bucket `bucket`: send `send` to every rank of send_to, receive recvs[i] from recv_from[i]. "
           "Returns at once (after a size/dtype handshake with the peers on an edge's first use); do not modify "
           "send nor read recvs before wait(bucket).")
      .def("wait", &Exchanger::wait, py::arg("bucket"), Release(),
           "CPU: block until the bucket's transfers completed. CUDA: make the current stream wait for them.")
      .def("wait_all", &Exchanger::wait_all, Release(), "wait() on every bucket in flight, in issue order")
      .def("synchronize", &Exchanger::synchronize, Release(),
           "wait_all(), then block the host until every transfer has completed")
      .def("shutdown", &Exchanger::shutdown, Release(),
           "Finish everything and release the transport (idempotent; aborts instead after an error)")
      .def_property_readonly("rank", &Exchanger::rank)
      .def_property_readonly("world_size", &Exchanger::world_size)
      .def_property_readonly("transport", &Exchanger::transport_name, "'nccl' or 'process_group'")
      .def_property_readonly("device", &Exchanger::device)
      .def_property_readonly("timeout", &Exchanger::timeout_seconds, "timeout in seconds")
      .def_property_readonly("wire_dtype", &Exchanger::wire_dtype)
      // These four read under the exchanger's lock, which a blocking call (wait, ...) holds for its whole wait with
      // the GIL released, and inside which it can take the GIL (a tensor it lets go of decrefs its Python object).
      // Read with the GIL held, the two locks were taken in opposite orders: a thread reading bytes_sent during
      // a wait deadlocked the rank (and stalled every Python thread while the wait lasted).
      .def_property_readonly("bytes_sent", py::cpp_function(&Exchanger::bytes_sent, Release()),
                             "bytes put on the wire so far (all peers)")
      .def_property_readonly("handshakes", py::cpp_function(&Exchanger::handshakes, Release()),
                             "size/dtype handshakes run so far (an exchange with a not yet agreed edge runs one)")
      .def_property_readonly("in_flight", py::cpp_function(&Exchanger::in_flight, Release()),
                             "bucket ids in flight, in issue order")
      .def_property_readonly("closed", py::cpp_function(&Exchanger::closed, Release()));
}
