// A temporary directory that every rank of the job agrees on (rank 0 makes it, every rank gets
// its name), for tests of files written by several ranks together.
#pragma once
#include <cstdlib>
#include <filesystem>
#include <string>

#include "dtk/comm/comm.h"

namespace dtk::test {

inline std::filesystem::path shared_tmpdir() {
  std::string name;
  if (comm::Runtime::get().rank() == 0) {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/dtk-XXXXXX";
    name = mkdtemp(tmpl.data());
  }
  return comm::Runtime::get().gather_strings(name)[0];
}

}  // namespace dtk::test
