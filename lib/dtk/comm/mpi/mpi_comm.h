// The MPI backend (internal to comm).
#pragma once
#include <mpi.h>

#include <memory>
#include <string>

#include "dtk/comm/comm.h"

namespace dtk::comm {

// Before MPI_Init: the all-reduce algorithm for large messages (see mpi_comm.cpp), unless
// DTK_ALLREDUCE_ALGO=mpi or the user chose one.
void mpi_select_algorithms();
void mpi_types_init();  // after MPI_Init: the bf16 / f16 datatypes and reduction ops
// label: its name in the flight recorder (flight.h), "world" for the world's duplicate.
std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, bool owned, const std::string& label);

}  // namespace dtk::comm
