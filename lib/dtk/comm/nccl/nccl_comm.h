// The NCCL backend (internal to comm; built with the CUDA backend when NCCL is found).
#pragma once
#include <mpi.h>

#include <memory>

#include "dtk/comm/comm.h"

namespace dtk::comm {
// Over the ranks of `comm` (the unique id travels by MPI_Bcast); mpi_initialized false gives a
// world of one without MPI. The calling rank's GPU must be set already. The set-up's steps are
// recorded as operations of runtime_flight (the runtime's own calls, flight.h; -1: none).
std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, bool mpi_initialized, int runtime_flight);
// Fails (dtk::Error, after aborting every communicator) when a live NCCL communicator reports
// an asynchronous error; `what` is the wait in progress. Polled by comm::wait_for_device.
void nccl_check_async_errors(const char* what);
}
