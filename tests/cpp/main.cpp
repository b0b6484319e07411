// Runs the registered C++ unit tests: all of them, one (--run NAME), or lists them (--list).
#include <cstring>
#include <exception>
#include <iostream>

#include "harness.h"

namespace roundpipe::testing {
std::vector<TestCase>& registry() {
  static std::vector<TestCase> tests;
  return tests;
}
}  // namespace roundpipe::testing

int main(int argc, char** argv) {
  using roundpipe::testing::registry;
  if (argc == 2 && std::strcmp(argv[1], "--list") == 0) {
    for (const auto& test : registry()) std::cout << test.name << "\n";
    return 0;
  }
  const char* only = (argc == 3 && std::strcmp(argv[1], "--run") == 0) ? argv[2] : nullptr;
  int failed = 0;
  int passed = 0;
  for (const auto& test : registry()) {
    if (only != nullptr && test.name != only) continue;
    try {
      test.body();
      ++passed;
    } catch (const std::exception& error) {
      ++failed;
      std::cerr << "FAILED " << test.name << ": " << error.what() << "\n";
    }
  }
  if (only != nullptr && passed + failed == 0) {
    std::cerr << "no test named '" << only << "'\n";
    return 2;
  }
  std::cout << passed << " passed, " << failed << " failed\n";
  return failed == 0 ? 0 : 1;
}
