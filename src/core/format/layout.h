// A namespace's identity: its name, its model id, provenance text, and the KV layout fields of
// format.h's CXLKV_LAYOUT_FIELDS. Everything that walks the layout fields (fingerprint, mismatch
// message, listing, the Python binding) goes through layout_field_table(), built from that list.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "format.h"

namespace cxlkv {

struct Layout : format::LayoutFields {
  Layout();          // every field at its default (format.h)
  std::string name;  // namespace identity (unique in a pool)
  std::string model_id;
  // Provenance shown to operators (what model_id was derived from); not part of the identity:
  // opening an existing namespace with another source opens it and keeps the stored source.
  std::string source;
  const format::LayoutFields& fields() const { return *this; }
  format::LayoutFields& fields() { return *this; }
};

enum class FieldCodec { number, dtype, kind };

struct LayoutFieldDesc {
  const char* name;
  FieldCodec codec;
  uint64_t default_value, min, max;
  uint64_t (*get)(const format::LayoutFields&);
  void (*set)(format::LayoutFields&, uint64_t);
  // Text <-> value for the dtype and kind codecs (aliases accepted; ArgumentError otherwise).
  uint64_t parse(std::string_view text) const;
  std::string print(uint64_t v) const;  // decimal, or the canonical name ("unknown(N)")
};

std::span<const LayoutFieldDesc> layout_field_table();

// ArgumentError "<field> must be in <min>..<max>, got <got>".
[[noreturn]] void throw_out_of_range(const LayoutFieldDesc& f, const std::string& got);
// Sets field `f` from a caller's value; ArgumentError naming the field and its range.
void set_layout_field(format::LayoutFields& l, const LayoutFieldDesc& f, uint64_t v);
// The block size a layout implies: tokens_per_block x num_layers x head_size x dtype bytes, x 2 x
// heads for dense (K and V per head; heads_per_entry heads, or num_kv_heads when it is 0); mla and
// opaque: one vector per token and layer.
// ArgumentError if it overflows the block_bytes range; the dtype and kind must be known.
uint64_t natural_block_bytes(const format::LayoutFields& l);
// A caller's layout is usable: every field in range, known dtype and kind, heads_per_entry 0 or
// dividing num_kv_heads of a dense layout.
void check_layout(const format::LayoutFields& l);
// The namespace fingerprint: model_id and every layout field, by name and value. Not the
// namespace name, not the source.
uint64_t layout_fingerprint(const std::string& model_id, const format::LayoutFields& l);
// "model_id a != b, dtype bf16 != fp16, ..." for every identity field that differs; "" if none.
std::string layout_diff(const Layout& a, const Layout& b);

}  // namespace cxlkv
