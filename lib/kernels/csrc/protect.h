// Error handling shared by the shim's translation units: every C entry point runs its body
// through `mrs_detail::protect`, so no C++ exception unwinds into Rust.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace mrs_detail {

// A malloc'd copy of `s`, which the Rust side frees with mrs_free_string.
inline char* malloc_string(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

// Runs `body`; returns NULL on success or the exception's message.
template <typename F>
char* protect(F&& body) {
  try {
    body();
    return nullptr;
  } catch (const c10::Error& e) {
    return malloc_string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return malloc_string(e.what());
  } catch (...) {
    return malloc_string("unknown C++ exception");
  }
}

}  // namespace mrs_detail
