#include "dtype.h"

#include "errors.h"
#include "names.h"

namespace cxlkv {

namespace {
#define CXLKV_DTYPE_NAMES(name, code, bytes, ...) \
  constexpr const char* k_names_##name[] = {#name, __VA_ARGS__};
CXLKV_DTYPES(CXLKV_DTYPE_NAMES)
#undef CXLKV_DTYPE_NAMES

const DTypeInfo kTable[] = {
#define CXLKV_DTYPE_ROW(name, code, bytes, ...) {DType::name, bytes, k_names_##name},
    CXLKV_DTYPES(CXLKV_DTYPE_ROW)
#undef CXLKV_DTYPE_ROW
};

std::string allowed_names() {
  std::string out;
  for (const auto& d : kTable) {
    out += std::string(out.empty() ? "" : ", ") + d.name();
    if (d.names.size() > 1) {
      out += " (";
      for (size_t i = 1; i < d.names.size(); ++i) out += std::string(i > 1 ? ", " : "") + d.names[i];
      out += ")";
    }
  }
  return out;
}
}  // namespace

std::span<const DTypeInfo> dtype_table() { return kTable; }

const DTypeInfo& parse_dtype(std::string_view text) {
  for (const auto& d : kTable)
    for (const char* n : d.names)
      if (name_equals(text, n)) return d;
  throw ArgumentError("unknown dtype " + quoted_input(text) + "; allowed: " + allowed_names());
}

const DTypeInfo* find_dtype(uint32_t code) {
  for (const auto& d : kTable)
    if (uint32_t(d.code) == code) return &d;
  return nullptr;
}

std::string dtype_name(uint32_t code) {
  const DTypeInfo* d = find_dtype(code);
  return d ? d->name() : "unknown(" + std::to_string(code) + ")";
}

}  // namespace cxlkv
