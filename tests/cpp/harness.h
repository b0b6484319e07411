// A minimal unit-test harness for the torch-free core. Each TEST_CASE becomes one pytest item
// (tests/test_cpp_core.py runs the binary with --run NAME); `roundpipe_core_tests` alone runs all.
#pragma once

#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace roundpipe::testing {

struct TestCase {
  std::string name;
  std::function<void()> body;
};

std::vector<TestCase>& registry();

struct Registrar {
  Registrar(std::string name, std::function<void()> body) {
    registry().push_back({std::move(name), std::move(body)});
  }
};

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace roundpipe::testing

#define RP_CONCAT_INNER(a, b) a##b
#define RP_CONCAT(a, b) RP_CONCAT_INNER(a, b)
#define TEST_CASE(name)                                                            \
  static void RP_CONCAT(rp_test_, __LINE__)();                                     \
  static const ::roundpipe::testing::Registrar RP_CONCAT(rp_registrar_, __LINE__)( \
      name, &RP_CONCAT(rp_test_, __LINE__));                                       \
  static void RP_CONCAT(rp_test_, __LINE__)()

#define CHECK(condition)                                                             \
  do {                                                                               \
    if (!(condition)) {                                                              \
      std::ostringstream rp_message;                                                 \
      rp_message << __FILE__ << ":" << __LINE__ << ": CHECK(" #condition ") failed"; \
      throw ::roundpipe::testing::Failure(rp_message.str());                         \
    }                                                                                \
  } while (false)

#define CHECK_EQ(actual, expected)                                                      \
  do {                                                                                  \
    const auto& rp_actual = (actual);                                                   \
    const auto& rp_expected = (expected);                                               \
    if (!(rp_actual == rp_expected)) {                                                  \
      std::ostringstream rp_message;                                                    \
      rp_message << __FILE__ << ":" << __LINE__ << ": CHECK_EQ(" #actual ", " #expected \
                 << ") failed: " << rp_actual << " != " << rp_expected;                 \
      throw ::roundpipe::testing::Failure(rp_message.str());                            \
    }                                                                                   \
  } while (false)

// Checks that `statement` throws `exception_type` whose what() contains `fragment`.
#define CHECK_THROWS(statement, exception_type, fragment)                                          \
  do {                                                                                             \
    bool rp_thrown = false;                                                                        \
    try {                                                                                          \
      statement;                                                                                   \
    } catch (const exception_type& rp_error) {                                                     \
      rp_thrown = true;                                                                            \
      if (std::string(rp_error.what()).find(fragment) == std::string::npos) {                      \
        throw ::roundpipe::testing::Failure(std::string(__FILE__) + ": message '" +                \
                                            rp_error.what() + "' lacks '" + (fragment) + "'");     \
      }                                                                                            \
    }                                                                                              \
    if (!rp_thrown) {                                                                              \
      throw ::roundpipe::testing::Failure(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                                          ": expected " #exception_type " from " #statement);      \
    }                                                                                              \
  } while (false)
