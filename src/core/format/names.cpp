#include "names.h"

#include "errors.h"
#include "format.h"

namespace cxlkv {

bool name_equals(std::string_view a, const char* b) {
  size_t i = 0;
  for (; i < a.size() && b[i]; ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = char(x - 'A' + 'a');
    if (x != y) return false;
  }
  return i == a.size() && !b[i];
}

std::string quoted_input(std::string_view text, size_t max) {
  std::string shown(text.substr(0, max));
  for (char& c : shown)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return "'" + shown + (text.size() > max ? "...'" : "'");
}

namespace {
constexpr NamedCode kBackends[] = {
    {uint32_t(Backend::coherent), "coherent"},
    {uint32_t(Backend::flush), "flush"},
    {uint32_t(Backend::multihost), "multihost"},
};

constexpr NamedCode kLayoutKinds[] = {
    {format::kLayoutDense, "dense"},
    {format::kLayoutMla, "mla"},
    {format::kLayoutOpaque, "opaque"},
};
}  // namespace

uint32_t parse_code(std::span<const NamedCode> table, std::string_view text, const char* what) {
  for (const auto& row : table)
    if (name_equals(text, row.name)) return row.code;
  throw ArgumentError("unknown " + std::string(what) + " " + quoted_input(text) +
                      "; allowed: " + canonical_names(table));
}

std::string code_name(std::span<const NamedCode> table, uint32_t code) {
  for (const auto& row : table)
    if (row.code == code) return row.name;
  return "unknown(" + std::to_string(code) + ")";
}

bool code_known(std::span<const NamedCode> table, uint32_t code) {
  for (const auto& row : table)
    if (row.code == code) return true;
  return false;
}

std::string canonical_names(std::span<const NamedCode> table) {
  std::string out;
  for (size_t i = 0; i < table.size(); ++i) {
    bool first_of_code = true;
    for (size_t j = 0; j < i; ++j) first_of_code &= table[j].code != table[i].code;
    if (first_of_code) out += std::string(out.empty() ? "" : ", ") + table[i].name;
  }
  return out;
}

std::span<const NamedCode> backend_names() { return kBackends; }
std::span<const NamedCode> layout_kind_names() { return kLayoutKinds; }

}  // namespace cxlkv
