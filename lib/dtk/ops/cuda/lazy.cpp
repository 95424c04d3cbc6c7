#include "dtk/ops/cuda/lazy.h"

#include <dlfcn.h>

#include <map>
#include <mutex>
#include <string>

#include "dtk/core/error.h"

namespace dtk::ops::cuda::lazy {

void* symbol(const char* library, const char* name) {
  static std::mutex mu;
  static std::map<std::string, void*> handles;
  std::lock_guard lock(mu);
  void*& h = handles[library];
  if (!h) {
    h = dlopen(library, RTLD_NOW | RTLD_LOCAL);
    if (!h) fail(std::string("cannot load ") + library + " (CUDA Toolkit library, needed for CUDA tensors): " + dlerror());
  }
  dlerror();
  void* f = dlsym(h, name);
  if (!f) fail(std::string("no ") + name + " in " + library + ": " + dlerror());
  return f;
}

}  // namespace dtk::ops::cuda::lazy
