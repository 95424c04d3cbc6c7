// The local backend (internal to comm): a world of one that needs no MPI.
#pragma once
#include <memory>

#include "dtk/comm/comm.h"

namespace dtk::comm {
std::shared_ptr<Communicator> make_local_communicator();
}
