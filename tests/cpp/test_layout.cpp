// The core's name tables (dtype.h, names.h) and the layout field list (format.h, layout.h).
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "dtype.h"
#include "errors.h"
#include "layout.h"
#include "names.h"

using namespace cxlkv;

TEST(DTypeTable, CodesAndNamesAreUnique) {
  std::set<uint32_t> codes;
  std::set<std::string> names;
  for (const auto& d : dtype_table()) {
    EXPECT_TRUE(codes.insert(uint32_t(d.code)).second) << d.name();
    EXPECT_GT(d.bytes, 0u) << d.name();
    for (const char* n : d.names) EXPECT_TRUE(names.insert(n).second) << "name listed twice: " << n;
  }
}

TEST(DTypeTable, EveryAliasResolvesToItsRow) {
  for (const auto& d : dtype_table())
    for (const char* n : d.names) {
      EXPECT_EQ(parse_dtype(n).code, d.code) << n;
      std::string upper(n);
      for (char& c : upper) c = char(toupper(c));
      EXPECT_EQ(parse_dtype(upper).code, d.code) << upper;
    }
  EXPECT_EQ(parse_dtype("bfloat16").code, DType::bf16);
  EXPECT_EQ(parse_dtype("torch.float8_e4m3fn").code, DType::fp8_e4m3);
  EXPECT_EQ(parse_dtype("fp8").code, DType::fp8_e4m3);
  EXPECT_EQ(parse_dtype("half").bytes, 2u);
}

TEST(DTypeTable, UnknownNameListsTheAllowedOnes) {
  try {
    parse_dtype("float128");
    FAIL() << "no error";
  } catch (const ArgumentError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("unknown dtype 'float128'"), std::string::npos) << m;
    for (const auto& d : dtype_table()) EXPECT_NE(m.find(d.name()), std::string::npos) << m;
  }
  EXPECT_THROW(parse_dtype(""), ArgumentError);
  EXPECT_THROW(parse_dtype(std::string("bf16\0x", 6)), ArgumentError);
  EXPECT_EQ(dtype_name(9999), "unknown(9999)");
}

TEST(NameTables, BackendAndKindRoundTrip) {
  for (const auto& row : backend_names()) EXPECT_EQ(uint32_t(parse_backend(row.name)), row.code);
  for (const auto& row : layout_kind_names()) EXPECT_EQ(parse_layout_kind(row.name), row.code);
  EXPECT_EQ(backend_name(Backend::flush), "flush");
  EXPECT_EQ(layout_kind_name(format::kLayoutMla), "mla");
  EXPECT_EQ(layout_kind_name(77), "unknown(77)");
  EXPECT_THROW(parse_backend("coherent\n"), ArgumentError);
}

namespace {
Layout sample(const char* dtype) {
  Layout l;
  l.model_id = "m";
  l.dtype = uint32_t(parse_dtype(dtype).code);
  l.num_layers = 4;
  l.num_kv_heads = 2;
  l.head_size = 64;
  l.block_bytes = natural_block_bytes(l);
  return l;
}
}  // namespace

TEST(LayoutFields, FingerprintFollowsTheCodeNotTheAlias) {
  EXPECT_EQ(layout_fingerprint("m", sample("bf16")), layout_fingerprint("m", sample("bfloat16")));
  EXPECT_EQ(layout_fingerprint("m", sample("bf16")), layout_fingerprint("m", sample("torch.bfloat16")));
  EXPECT_NE(layout_fingerprint("m", sample("bf16")), layout_fingerprint("m", sample("fp16")));
  EXPECT_NE(layout_fingerprint("m", sample("bf16")), layout_fingerprint("n", sample("bf16")));
}

TEST(LayoutFields, EveryFieldEntersTheFingerprintAndTheDiff) {
  Layout base = sample("bf16");
  for (const auto& f : layout_field_table()) {
    Layout other = base;
    uint64_t v = f.get(base);
    f.set(other, v == f.min ? v + 1 : v - 1);
    EXPECT_NE(layout_fingerprint("m", base), layout_fingerprint("m", other)) << f.name;
    EXPECT_NE(layout_diff(base, other).find(std::string(f.name) + " "), std::string::npos) << f.name;
  }
  EXPECT_EQ(layout_diff(base, base), "");
  Layout named = sample("fp16");
  EXPECT_NE(layout_diff(base, named).find("dtype bf16 != fp16"), std::string::npos)
      << layout_diff(base, named);
}

TEST(LayoutFields, NaturalBlockBytesAndChecks) {
  Layout l = sample("bf16");
  EXPECT_EQ(l.block_bytes, 16u * 4 * 64 * 2 * 2 * 2);
  l.heads_per_entry = 1;  // one KV head of the block per entry: half of it
  EXPECT_EQ(natural_block_bytes(l), 16u * 4 * 64 * 2 * 2);
  EXPECT_NO_THROW(check_layout(l));
  l.heads_per_entry = 0;
  l.kind = format::kLayoutMla;
  EXPECT_EQ(natural_block_bytes(l), 16u * 4 * 64 * 2);
  l.num_layers = 0xFFFFFFFFu;
  l.head_size = 0xFFFFFFFFu;
  EXPECT_THROW(natural_block_bytes(l), ArgumentError);
  Layout bad = sample("bf16");
  bad.heads_per_entry = 3;  // does not divide 2 heads
  EXPECT_THROW(check_layout(bad), ArgumentError);
  bad = sample("bf16");
  bad.kind = format::kLayoutMla;
  bad.heads_per_entry = 1;  // an MLA latent is not split by head
  EXPECT_THROW(check_layout(bad), ArgumentError);
  bad = sample("bf16");
  bad.dtype = 4242;
  EXPECT_THROW(check_layout(bad), ArgumentError);
  bad = sample("bf16");
  bad.block_bytes = 0;
  EXPECT_THROW(check_layout(bad), ArgumentError);
}
