// The KV cache dtypes: one table, the only place a dtype name, alias or size is written. The
// Python package (cxlkv.dtypes(), KVLayout) and the vLLM connector resolve names through it.
//
// A namespace entry stores the code, and the fingerprint hashes the code: every alias of a dtype
// opens the same namespace. Codes are part of the pool format: never renumber or reuse one.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace cxlkv {

// X(canonical name, code, bytes per element, aliases...). Names are matched case-insensitively.
// Two names belong to one row only if they mean the same bytes: the fnuz fp8 variants (ROCm)
// encode other values than the OCP ones, so they are rows of their own.
#define CXLKV_DTYPES(X)                                                                  \
  X(bf16, 1, 2, "bfloat16", "torch.bfloat16")                                            \
  X(fp16, 2, 2, "float16", "half", "torch.float16", "torch.half")                        \
  X(fp32, 3, 4, "float32", "float", "torch.float32", "torch.float")                      \
  /* vLLM's "fp8" and "fp8_inc" cache dtypes are OCP e4m3 (float8_e4m3fn) */             \
  X(fp8_e4m3, 4, 1, "fp8", "fp8_inc", "float8_e4m3fn", "torch.float8_e4m3fn")            \
  X(fp8_e5m2, 5, 1, "float8_e5m2", "torch.float8_e5m2")                                  \
  X(fp8_e4m3fnuz, 6, 1, "float8_e4m3fnuz", "torch.float8_e4m3fnuz")                      \
  X(fp8_e5m2fnuz, 7, 1, "float8_e5m2fnuz", "torch.float8_e5m2fnuz")                      \
  /* vLLM's DeepSeek sparse-MLA cache: fp8 latent + fp32 scales + bf16 rope per token */ \
  X(fp8_ds_mla, 8, 1)                                                                    \
  X(int8, 9, 1, "torch.int8")                                                            \
  X(uint8, 10, 1, "torch.uint8")                                                         \
  /* opaque bytes: the caller vouches for the layout */                                  \
  X(bytes, 11, 1)

enum class DType : uint32_t {
#define CXLKV_DTYPE_ENUM(name, code, bytes, ...) name = code,
  CXLKV_DTYPES(CXLKV_DTYPE_ENUM)
#undef CXLKV_DTYPE_ENUM
};

struct DTypeInfo {
  DType code;
  uint32_t bytes;                      // bytes per element
  std::span<const char* const> names;  // names[0] is the canonical name, then the aliases
  const char* name() const { return names[0]; }
};

std::span<const DTypeInfo> dtype_table();
// The dtype named `text` (any alias); ArgumentError listing every allowed name otherwise.
const DTypeInfo& parse_dtype(std::string_view text);
// The row of `code`, or nullptr for a code this build does not know (e.g. read from a pool).
const DTypeInfo* find_dtype(uint32_t code);
// The canonical name of `code`, or "unknown(N)".
std::string dtype_name(uint32_t code);

}  // namespace cxlkv
