// Fuzz target: a checkpoint directory (ckpt::Directory, as --resume DIR and --auto-resume find
// its latest entry). The input is text: its first line is the `latest` file's content, each
// further line the name of an entry made in the directory (a file, or a directory when the name
// ends in '/'); names with a '/' inside, ".", "..", empty ones and repeats are skipped. Then the
// directory's latest entry is looked up and opened by ckpt::Reader.
#include <filesystem>
#include <sstream>
#include <string>

#include "dtk/ckpt/checkpoint.h"
#include "fuzz.h"

namespace fs = std::filesystem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path dir = dtk::fuzz::scratch() / "ckpt";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string text(reinterpret_cast<const char*>(data), size);
  const size_t eol = text.find('\n');
  const std::string latest = text.substr(0, eol);
  dtk::fuzz::write_file(dir / "latest", reinterpret_cast<const uint8_t*>(latest.data()), latest.size());
  std::istringstream rest(eol == std::string::npos ? std::string() : text.substr(eol + 1));
  for (std::string name; std::getline(rest, name);) {
    const bool is_dir = name.ends_with('/');
    if (is_dir) name.pop_back();
    if (name.empty() || name == "." || name == ".." || name == "latest" || name.size() > 200 ||
        name.find('/') != std::string::npos || name.find('\0') != std::string::npos)
      continue;
    std::error_code ec;
    if (fs::exists(dir / name, ec)) continue;  // named twice
    if (is_dir)
      fs::create_directory(dir / name, ec);
    else
      dtk::fuzz::write_file(dir / name, nullptr, 0);
  }
  dtk::fuzz::expect_usage_errors([&] {
    (void)dtk::ckpt::Directory(dir, 1).latest();
    dtk::ckpt::Reader r(dir);
  });
  return 0;
}
