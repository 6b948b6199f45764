// Error messages built without iostreams.
//
// Some toolchains link a static copy of libstdc++ into the extension whose locale is never set up (seen with
// GCC 13.3 and torch 2.11 on the GPU machines: the extension's NEEDED list has no libstdc++, and its own copy
// of the locale code is inside). There the first std::ostringstream, which c10::str and TORCH_CHECK's message
// use, dereferences a null facet and the process dies. These helpers only append to a std::string.
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <type_traits>

namespace fp8p {

inline void append_part(std::string& s, const char* v) { s += v; }
inline void append_part(std::string& s, const std::string& v) { s += v; }
inline void append_part(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename I, std::enable_if_t<std::is_integral_v<I> && !std::is_same_v<I, bool>, int> = 0>
inline void append_part(std::string& s, I v) {
  s += std::to_string(v);
}
// as c10 prints sizes and strides: [8, 16]
inline void append_part(std::string& s, at::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
inline void append_part(std::string& s, at::ScalarType t) { s += c10::toString(t); }
inline void append_part(std::string& s, const at::Device& d) { s += d.str(); }

// the parts one after the other, as c10::str would print them
template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string s;
  (append_part(s, parts), ...);
  return s;
}

}  // namespace fp8p
