// Shared by the fuzz targets of tests/fuzz (scripts/fuzz runs them under libFuzzer; the normal
// build links them to replay_main.cpp and ctest replays the seed corpus and the regressions).
//
// A target hands its input to one of dtk's file readers as a file and checks the readers'
// contract (docs/DESIGN.md, "Checkpoints": anything wrong with a file being read is a
// UsageError naming it, exit 2): a UsageError is the expected answer to a hostile file; any other
// exception (dtk::Error, std::bad_alloc, a JSON or CLI11 exception escaping) is a finding, and
// so, under the sanitizers, is any memory error or undefined behaviour.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <typeinfo>

#include "dtk/core/error.h"

namespace dtk::fuzz {

// A directory of this process's own, removed at exit: $TMPDIR/dtk-fuzz-XXXXXX.
inline const std::filesystem::path& scratch() {
  static const std::filesystem::path dir = [] {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/dtk-fuzz-XXXXXX";
    if (!mkdtemp(tmpl.data())) {
      std::perror("fuzz: mkdtemp");
      std::abort();
    }
    static const std::string keep = tmpl;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(keep, ec);
    });
    return std::filesystem::path(tmpl);
  }();
  return dir;
}

// Writes the input to `path` (replacing it).
inline void write_file(const std::filesystem::path& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out.flush()) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
}

// Runs f, the reading of a hostile file: returns normally on success or a UsageError (printed
// when DTK_FUZZ_VERBOSE is set); aborts, naming the exception, on anything else (the finding
// libFuzzer then keeps as a crash file).
template <class F>
void expect_usage_errors(F&& f) {
  try {
    f();
  } catch (const UsageError& e) {
    if (std::getenv("DTK_FUZZ_VERBOSE")) std::fprintf(stderr, "fuzz: UsageError: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: a %s escaped the reader (not a UsageError): %s\n", typeid(e).name(), e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "fuzz: a non-std exception escaped the reader\n");
    std::abort();
  }
}

// Tensors larger than this are not read: a file may declare any shape (an unwritten chunked
// dataset costs nothing on disk), and every dtk reader first checks a stored shape against the
// model or the user's request before it allocates for it. The readers' own checks run anyway.
inline constexpr size_t kMaxReadBytes = size_t{16} << 20;

}  // namespace dtk::fuzz
