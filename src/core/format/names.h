// Text names of the core's coded values: one table per enum, used by the core's messages, the
// Python binding and (through it) the CLI. A name table is written here once; nobody else spells
// the names out.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "backend.h"

namespace cxlkv {

// One name of a coded value. A code may have several names (aliases); the first row of a code is
// its canonical name, printed back.
struct NamedCode {
  uint32_t code;
  const char* name;
};

// ASCII case-insensitive equality of a caller's text with a table's (lower-case) name.
bool name_equals(std::string_view text, const char* name);
// `text` in quotes, cut to `max` bytes, control characters replaced: safe to put in a message.
std::string quoted_input(std::string_view text, size_t max = 64);

// The code named `text` in `table`, compared case-insensitively; throws ArgumentError naming
// `what` and every canonical name when there is none.
uint32_t parse_code(std::span<const NamedCode> table, std::string_view text, const char* what);
// The canonical name of `code`, or "unknown(N)" for a code not in the table (read from a pool).
std::string code_name(std::span<const NamedCode> table, uint32_t code);
// Canonical names in table order, for messages and listings.
std::string canonical_names(std::span<const NamedCode> table);
bool code_known(std::span<const NamedCode> table, uint32_t code);

// Backend (coherence.h): how pool metadata is kept coherent.
std::span<const NamedCode> backend_names();
inline Backend parse_backend(std::string_view s) {
  return Backend(parse_code(backend_names(), s, "backend"));
}
inline std::string backend_name(Backend b) { return code_name(backend_names(), uint32_t(b)); }

// LayoutKind (format.h): how a namespace's blocks are laid out.
std::span<const NamedCode> layout_kind_names();
inline uint32_t parse_layout_kind(std::string_view s) {
  return parse_code(layout_kind_names(), s, "layout kind");
}
inline std::string layout_kind_name(uint32_t k) { return code_name(layout_kind_names(), k); }

}  // namespace cxlkv
