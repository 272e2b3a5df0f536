#include "core/status.h"

#include <gtest/gtest.h>

#include <new>
#include <stdexcept>
#include <string>

namespace weightfs {
namespace {

Status Caught(void (*thrower)()) {
  try {
    thrower();
  } catch (...) {
    return StatusOfCurrentException("reading x");
  }
  return Status::Ok();
}

TEST(StatusOfCurrentExceptionTest, AllocationFailureIsResourceExhausted) {
  const Status s = Caught([] { throw std::bad_alloc(); });
  EXPECT_EQ(s.kind(), ErrorKind::kResourceExhausted);
  EXPECT_EQ(s.message(), "reading x: out of memory");
}

TEST(StatusOfCurrentExceptionTest, OtherExceptionsAreIOErrorsWithTheirWhat) {
  Status s = Caught([] { throw std::runtime_error("disk on fire"); });
  EXPECT_EQ(s.kind(), ErrorKind::kIOError);
  EXPECT_EQ(s.message(), "reading x: disk on fire");
  s = Caught([] { throw 42; });
  EXPECT_EQ(s.kind(), ErrorKind::kIOError);
  EXPECT_EQ(s.message(), "reading x: unknown exception");
}

}  // namespace
}  // namespace weightfs
