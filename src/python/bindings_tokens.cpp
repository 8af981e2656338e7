// Python binding of the token store's core (src/core/transfer/token_rows.h): sealing blocks, resolving a
// sequence's pinned blocks and verified row gathers. The policy (keys, lengths, pins, dtypes and
// shapes as the user sees them) is python/cxlkv/token_store.py; this layer re-checks every size
// it is given, since a wrong one here would be a wild write.
#include "bindings_tokens.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "errors.h"
#include "token_rows.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace cxlkv;

namespace {

NsAccessFn g_access = nullptr;

using Bytes = nb::ndarray<nb::device::cpu, nb::c_contig>;
using Offsets = nb::ndarray<const uint64_t, nb::ndim<1>, nb::device::cpu, nb::c_contig>;
using Indices = nb::ndarray<const int64_t, nb::device::cpu, nb::c_contig>;

Key key_of(nb::handle obj) {
  nb::bytes b = nb::cast<nb::bytes>(obj);
  if (b.size() != 32) throw ArgumentError("token block keys are 32 bytes");
  Key k;
  std::memcpy(k.data(), b.c_str(), 32);
  return k;
}

}  // namespace

void bind_tokens(nb::module_& m, NsAccessFn access) {
  g_access = access;

  m.def(
      "token_block_layout",
      [](uint64_t layers, uint64_t tokens_per_block, uint64_t row_bytes) {
        auto g = tokens::TokenGeometry::make(layers, tokens_per_block, row_bytes);
        nb::dict d;
        d["payload_bytes"] = g.payload_bytes(), d["row_stride"] = g.row_stride();
        d["header_off"] = g.header_off(), d["block_bytes"] = g.block_bytes();
        d["version"] = tokens::kTokenBlockVersion;
        d["row_check_kernel"] = tokens::row_check_kernel_name();  // the gather's copy+check on this CPU
        return d;
      },
      "layers"_a, "tokens_per_block"_a, "row_bytes"_a,
      "Byte layout of a token block (token_rows.h): payload (row slots: row, pad, check), slot stride, "
      "header, total.");

  m.def(
      "token_seal",
      [](Bytes block, uint64_t layers, uint64_t tokens_per_block, uint64_t row_bytes, uint64_t seq_hash,
         uint32_t stream, uint64_t chunk, uint32_t valid_tokens) {
        auto g = tokens::TokenGeometry::make(layers, tokens_per_block, row_bytes);
        if (block.nbytes() != g.block_bytes())
          throw ArgumentError("token block buffer has " + std::to_string(block.nbytes()) + " bytes, not " +
                              std::to_string(g.block_bytes()));
        nb::gil_scoped_release nogil;
        tokens::seal_block(static_cast<char*>(block.data()), g, seq_hash, stream, chunk, valid_tokens);
      },
      "block"_a, "layers"_a, "tokens_per_block"_a, "row_bytes"_a, "seq_hash"_a, "stream"_a, "chunk"_a,
      "valid_tokens"_a,
      "Row checks, pads and header of a block whose rows the caller wrote in their slots (token_rows.h).");

  m.def(
      "token_resolve",
      [](nb::handle ns, nb::handle keys, uint64_t layers, uint64_t tokens_per_block, uint64_t row_bytes,
         uint64_t seq_hash, uint32_t stream, uint64_t first_chunk) {
        auto g = tokens::TokenGeometry::make(layers, tokens_per_block, row_bytes);
        std::vector<Key> ks;
        for (nb::handle h : keys) ks.push_back(key_of(h));
        NsAccess a = g_access(ns);
        std::vector<tokens::ResolvedBlock> r;
        {
          nb::gil_scoped_release nogil;
          Pool& pool = *a.pool;
          const NsHandle& h = a.ns;
          r = tokens::resolve_blocks(
              pool.arena_view(),
              [&](const Key& k, uint64_t* off, uint64_t* len) { return pool.locate(h, k, off, len); }, h, g,
              ks.data(), ks.size(), seq_hash, stream, first_chunk);
        }
        std::vector<std::pair<uint64_t, uint32_t>> out;
        for (auto& b : r) out.emplace_back(b.offset, b.valid_tokens);
        return out;
      },
      "ns"_a, "keys"_a, "layers"_a, "tokens_per_block"_a, "row_bytes"_a, "seq_hash"_a, "stream"_a,
      "first_chunk"_a,
      "[(offset, valid_tokens)] of the leading present, well-formed blocks keys[i] = chunk first_chunk + i.");

  m.def(
      "rows_gather_private",
      [](Bytes rows, uint64_t row_bytes, Indices indices, Bytes out) {
        if (row_bytes == 0 || rows.nbytes() % row_bytes) throw ArgumentError("rows must be whole rows");
        const uint64_t n_rows = rows.nbytes() / row_bytes;
        if (out.nbytes() != indices.size() * row_bytes)
          throw ArgumentError("out must hold len(indices) rows of row_bytes");
        const int64_t* idx = indices.data();
        for (size_t i = 0; i < indices.size(); ++i)
          if (idx[i] < 0 || uint64_t(idx[i]) >= n_rows)
            throw nb::index_error(("row index " + std::to_string(idx[i]) + " out of range").c_str());
        const char* src = static_cast<const char*>(rows.data());
        char* dst = static_cast<char*>(out.data());
        nb::gil_scoped_release nogil;
        for (size_t i = 0; i < indices.size(); ++i)
          std::memcpy(dst + i * row_bytes, src + uint64_t(idx[i]) * row_bytes, row_bytes);
      },
      "rows"_a, "row_bytes"_a, "indices"_a, "out"_a,
      "Reference for `cxlkv bench sparse`: rows[indices] -> out by a plain C loop of row copies from "
      "private memory (no pool, no verification): what a gather costs without the pool.");

  m.def(
      "token_gather",
      [](nb::handle ns, uint64_t layers, uint64_t tokens_per_block, uint64_t row_bytes, uint64_t seq_hash,
         uint32_t stream, uint64_t n_tokens, Offsets offsets, uint32_t first_layer, uint32_t n_layers,
         Indices indices, bool per_layer, Bytes out) -> nb::object {
        auto g = tokens::TokenGeometry::make(layers, tokens_per_block, row_bytes);
        if (n_layers == 0 || first_layer >= g.layers || n_layers > g.layers - first_layer)
          throw nb::index_error(("layers [" + std::to_string(first_layer) + ", +" + std::to_string(n_layers) +
                                 ") out of range 0.." + std::to_string(g.layers - 1))
                                    .c_str());
        const size_t n_idx = indices.size();
        if (per_layer && n_idx % n_layers) throw ArgumentError("per-layer indices must be n_layers x k");
        const size_t k = per_layer ? n_idx / n_layers : n_idx;
        if (out.nbytes() != uint64_t(n_layers) * k * g.row_bytes)
          throw ArgumentError("out has " + std::to_string(out.nbytes()) + " bytes; " +
                              std::to_string(n_layers) + " layers x " + std::to_string(k) + " rows x " +
                              std::to_string(g.row_bytes) + " B expected");
        if (offsets.shape(0) * uint64_t(g.tokens_per_block) < n_tokens)
          throw ArgumentError("fewer blocks than the sequence length needs");
        tokens::SeqRows s{&g, seq_hash, stream, n_tokens, offsets.data(), offsets.shape(0)};
        NsAccess a = g_access(ns);
        tokens::GatherResult r;
        {
          nb::gil_scoped_release nogil;
          r = tokens::gather_rows(a.pool->arena_view(), s, first_layer, n_layers, indices.data(), k,
                                  per_layer, static_cast<char*>(out.data()));
        }
        if (r.status == tokens::GatherResult::kIndexOutOfRange)
          throw nb::index_error(("token index " + std::to_string(r.bad_index) + " (position " +
                                 std::to_string(r.bad_pos) + ") out of range: the sequence has " +
                                 std::to_string(n_tokens) + " tokens")
                                    .c_str());
        if (r.status == tokens::GatherResult::kMiss) return nb::make_tuple(r.bad_layer, r.bad_index);
        return nb::none();
      },
      "ns"_a, "layers"_a, "tokens_per_block"_a, "row_bytes"_a, "seq_hash"_a, "stream"_a, "n_tokens"_a,
      "offsets"_a, "first_layer"_a, "n_layers"_a, "indices"_a, "per_layer"_a, "out"_a,
      "Verified row gather (token_rows.h). None, or (layer, index) of the first row that failed "
      "verification (absent, reused or corrupt: a miss). IndexError for an index out of range.");
}
