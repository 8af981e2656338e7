#include "layout.h"

#include "checksum.h"
#include "dtype.h"
#include "errors.h"
#include "names.h"

namespace cxlkv {

using format::LayoutFields;

namespace {
constexpr LayoutFieldDesc kFields[] = {
#define CXLKV_LAYOUT_DESC(type, fname, codec, dflt, lo, hi) \
  {#fname,                                                  \
   FieldCodec::codec,                                       \
   uint64_t(dflt),                                          \
   uint64_t(lo),                                            \
   uint64_t(hi),                                            \
   [](const LayoutFields& l) { return uint64_t(l.fname); }, \
   [](LayoutFields& l, uint64_t v) { l.fname = type(v); }},
    CXLKV_LAYOUT_FIELDS(CXLKV_LAYOUT_DESC)
#undef CXLKV_LAYOUT_DESC
};
}  // namespace

Layout::Layout() : format::LayoutFields{} {
  for (const auto& f : kFields) f.set(*this, f.default_value);
}

std::span<const LayoutFieldDesc> layout_field_table() { return kFields; }

uint64_t LayoutFieldDesc::parse(std::string_view text) const {
  switch (codec) {
    case FieldCodec::dtype: return uint32_t(parse_dtype(text).code);
    case FieldCodec::kind: return parse_layout_kind(text);
    case FieldCodec::number: break;
  }
  throw ArgumentError(std::string(name) + " must be an integer, not text");
}

std::string LayoutFieldDesc::print(uint64_t v) const {
  switch (codec) {
    case FieldCodec::dtype: return dtype_name(uint32_t(v));
    case FieldCodec::kind: return layout_kind_name(uint32_t(v));
    case FieldCodec::number: break;
  }
  return std::to_string(v);
}

void throw_out_of_range(const LayoutFieldDesc& f, const std::string& got) {
  throw ArgumentError(std::string(f.name) + " must be in " + std::to_string(f.min) + ".." +
                      std::to_string(f.max) + ", got " + got);
}

void set_layout_field(LayoutFields& l, const LayoutFieldDesc& f, uint64_t v) {
  if (v < f.min || v > f.max) throw_out_of_range(f, std::to_string(v));
  f.set(l, v);
}

uint64_t natural_block_bytes(const LayoutFields& l) {
  const DTypeInfo* d = find_dtype(l.dtype);
  if (!d) throw ArgumentError("unknown dtype code " + std::to_string(l.dtype));
  uint64_t factors[] = {l.tokens_per_block,
                        l.num_layers,
                        l.head_size,
                        d->bytes,
                        l.kind == format::kLayoutDense ? 2u : 1u,
                        l.kind != format::kLayoutDense ? 1u
                        : l.heads_per_entry            ? l.heads_per_entry
                                                       : l.num_kv_heads};
  uint64_t bytes = 1;
  for (uint64_t f : factors)
    if (__builtin_mul_overflow(bytes, f, &bytes)) bytes = ~0ull;
  const LayoutFieldDesc& bb = kFields[0];
  static_assert(std::string_view(kFields[0].name) == "block_bytes");
  if (bytes > bb.max)
    throw ArgumentError("the layout's blocks would hold more than " + std::to_string(bb.max) +
                        " bytes; lower tokens_per_block, or split the layout");
  return bytes;
}

void check_layout(const LayoutFields& l) {
  for (const auto& f : kFields) {
    uint64_t v = f.get(l);
    if (v < f.min || v > f.max) throw_out_of_range(f, std::to_string(v));
  }
  if (!find_dtype(l.dtype)) throw ArgumentError("unknown dtype code " + std::to_string(l.dtype));
  if (!code_known(layout_kind_names(), l.kind))
    throw ArgumentError("unknown layout kind code " + std::to_string(l.kind));
  if (l.heads_per_entry != 0 && l.kind != format::kLayoutDense)
    throw ArgumentError(
        "heads_per_entry applies to dense layouts only (mla and opaque blocks are not "
        "split by KV head), got " +
        std::to_string(l.heads_per_entry));
  if (l.heads_per_entry != 0 && l.num_kv_heads % l.heads_per_entry != 0)
    throw ArgumentError("heads_per_entry must divide num_kv_heads: heads_per_entry " +
                        std::to_string(l.heads_per_entry) + ", num_kv_heads " +
                        std::to_string(l.num_kv_heads));
}

uint64_t layout_fingerprint(const std::string& model_id, const LayoutFields& l) {
  std::string s = "cxlkv-namespace-v3";  // v3: heads_per_entry for tp_rank/tp_size (format 2.5)
  s += '\0';
  s += model_id;
  s += '\0';
  for (const auto& f : kFields) {
    uint64_t v = f.get(l);
    s += f.name;
    s += '=';
    for (int i = 0; i < 8; ++i) s += char(uint8_t(v >> (8 * i)));  // little-endian on any host
  }
  return xxh3(s.data(), s.size(), 7);
}

std::string layout_diff(const Layout& a, const Layout& b) {
  std::string d;
  auto add = [&](const char* f, const std::string& x, const std::string& y) {
    if (x != y) d += std::string(d.empty() ? "" : ", ") + f + " " + x + " != " + y;
  };
  add("model_id", quoted_input(a.model_id, a.model_id.size()), quoted_input(b.model_id, b.model_id.size()));
  for (const auto& f : kFields) add(f.name, f.print(f.get(a)), f.print(f.get(b)));
  return d;
}

}  // namespace cxlkv
