// The MPI backend (internal to comm).
#pragma once
#include <mpi.h>

#include <memory>

#include "dtk/comm/comm.h"

namespace dtk::comm {

void mpi_types_init();  // after MPI_Init: the bf16 / f16 datatypes and reduction ops
std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, bool owned);

}  // namespace dtk::comm
