// Namespaces: one per model/KV layout (and TP rank). Keys of different namespaces never alias:
// the namespace id seeds the index hash and is compared on every lookup, and each chunk belongs to
// exactly one namespace, so block geometry is fixed per chunk.
#include <unistd.h>

#include <cstring>
#include <thread>

#include "pool.h"

namespace cxlkv {

using namespace format;

namespace {
uint64_t fingerprint(const Layout& l) {
  std::string s = l.model_id + '\0' + l.dtype + '\0';
  uint32_t f[9] = {l.dtype_bytes, l.kind, l.num_layers, l.num_kv_heads, l.head_size,
                   l.tokens_per_block, l.tp_rank, l.tp_size, 0};
  s.append(reinterpret_cast<const char*>(f), sizeof f);
  s.append(reinterpret_cast<const char*>(&l.block_bytes), sizeof l.block_bytes);
  return xxh3(s.data(), s.size(), 7);
}

std::string fixed_str(const char* p, size_t n) { return std::string(p, strnlen(p, n)); }

// F12: a NUL would be cut by fixed_str (the stored name differs from the one compared, so each
// open creates another entry) and control characters reach operators' terminals.
void check_text(const std::string& s, const char* what) {
  for (unsigned char c : s)
    if (c < 0x20 || c == 0x7f)
      throw ArgumentError(std::string(what) + " must not contain NUL or control characters (found 0x" +
                          "0123456789abcdef"[c >> 4] + "0123456789abcdef"[c & 15] + ")");
}

Layout layout_of(const NamespaceEntry& e) {
  Layout l;
  l.name = fixed_str(e.name, kNameBytes);
  l.model_id = fixed_str(e.model_id, kModelIdBytes);
  l.dtype = fixed_str(e.dtype, sizeof e.dtype);
  l.dtype_bytes = e.dtype_bytes;
  l.kind = e.kind;
  l.num_layers = e.num_layers;
  l.num_kv_heads = e.num_kv_heads;
  l.head_size = e.head_size;
  l.tokens_per_block = e.tokens_per_block;
  l.tp_rank = e.tp_rank;
  l.tp_size = e.tp_size;
  l.block_bytes = e.block_bytes;
  return l;
}

std::string describe_diff(const Layout& a, const Layout& b) {
  std::string d;
  auto add = [&](const char* f, const std::string& x, const std::string& y) {
    if (x != y) d += std::string(d.empty() ? "" : ", ") + f + " " + x + " != " + y;
  };
  add("model_id", a.model_id, b.model_id);
  add("dtype", a.dtype, b.dtype);
  add("kind", std::to_string(a.kind), std::to_string(b.kind));
  add("num_layers", std::to_string(a.num_layers), std::to_string(b.num_layers));
  add("num_kv_heads", std::to_string(a.num_kv_heads), std::to_string(b.num_kv_heads));
  add("head_size", std::to_string(a.head_size), std::to_string(b.head_size));
  add("tokens_per_block", std::to_string(a.tokens_per_block), std::to_string(b.tokens_per_block));
  add("tp_rank", std::to_string(a.tp_rank), std::to_string(b.tp_rank));
  add("tp_size", std::to_string(a.tp_size), std::to_string(b.tp_size));
  add("block_bytes", std::to_string(a.block_bytes), std::to_string(b.block_bytes));
  return d;
}
}  // namespace

std::vector<std::pair<NsHandle, Layout>> Pool::list_namespaces() {
  std::vector<std::pair<NsHandle, Layout>> out;
  for (uint32_t id = 1; id <= hdr_->max_namespaces; ++id) {
    NamespaceEntry* e = ns_entry(id);
    if (ns_state(coh_.read(&e->state)) != kNsReady) continue;
    coh_.invalidate(e, sizeof *e);
    Layout l = layout_of(*e);
    // F5: a READY entry is immutable by contract, but the bytes are untrusted: read once, and skip
    // an entry whose block size no writer could have stored (`pool check` reports it).
    if (l.block_bytes == 0 || l.block_bytes > kMaxBlockBytes) continue;
    NsHandle h;
    h.id = id;
    h.block_bytes = l.block_bytes;
    h.geo = chunk_geometry(hdr_->chunk_bytes, l.block_bytes);
    h.name = l.name;
    out.emplace_back(h, l);
  }
  return out;
}

uint64_t Pool::break_stale_ns_lock() {
  uint64_t* lock = &shared()->ns_lock.word;
  uint64_t holder = coh_.read(lock);
  if (holder == 0) return 0;
  bool stale = holder > hdr_->max_nodes;
  if (!stale) stale = node_state(coh_.read(&node_slot(uint32_t(holder - 1))->state)) == kNodeFree;
  if (!stale) return 0;
  uint64_t expected = holder;
  return coh_.claim(lock, expected, 0) ? holder : 0;
}

NsHandle Pool::open_namespace(const Layout& want) {
  if (read_only_) throw Error("pool " + path_ + " was opened read-only; namespaces cannot be opened");
  check_text(want.name, "namespace name");
  check_text(want.model_id, "model_id");
  if (want.name.empty() || want.name.size() >= kNameBytes)
    throw ArgumentError("namespace name must have 1.." + std::to_string(kNameBytes - 1) + " bytes");
  if (want.model_id.size() >= kModelIdBytes)
    throw ArgumentError("model_id must be shorter than " + std::to_string(kModelIdBytes) + " bytes");
  if (want.dtype.size() >= 8) throw ArgumentError("dtype name too long");
  if (want.block_bytes == 0 || want.block_bytes > kMaxBlockBytes)
    throw ArgumentError("block_bytes must be in 1.." + std::to_string(kMaxBlockBytes));
  auto geo = chunk_geometry(hdr_->chunk_bytes, want.block_bytes);
  if (geo.blocks == 0)
    throw ArgumentError("a block of " + std::to_string(want.block_bytes) + " bytes does not fit in this pool's chunks of " +
                        std::to_string(hdr_->chunk_bytes) + " bytes; create the pool with a larger chunk size");
  uint64_t fp = fingerprint(want);

  auto lookup = [&](NsHandle* h) -> bool {
    for (auto& [handle, layout] : list_namespaces()) {
      if (layout.name != want.name) continue;
      NamespaceEntry* e = ns_entry(handle.id);
      if (e->fingerprint != fp || layout.block_bytes != want.block_bytes)
        throw LayoutMismatchError("namespace '" + want.name + "' exists in pool " + path_ +
                                  " with another KV layout: " + describe_diff(want, layout));
      *h = handle;
      return true;
    }
    return false;
  };
  NsHandle h;
  if (lookup(&h)) return h;

  // Create under the namespace-table lock (rare; a lock held by a dead node is broken by reap).
  uint64_t* lock = &shared()->ns_lock.word;
  for (int spins = 0;; ++spins) {
    uint64_t expected = 0;
    if (coh_.claim(lock, expected, node_id_)) break;
    if (spins % 100 == 0) break_stale_ns_lock();  // F13: a holder that can never release it
    if (spins % 100 == 99) reap_dead_nodes();
    if (spins > 100000) throw Error("pool " + path_ + ": namespace table lock held too long by node " + std::to_string(expected));
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  struct Unlock {
    Pool* p;
    uint64_t* w;
    ~Unlock() { p->coh_.publish(w, 0); }
  } unlock{this, lock};
  if (lookup(&h)) return h;
  for (uint32_t id = 1; id <= hdr_->max_namespaces; ++id) {
    NamespaceEntry* e = ns_entry(id);
    uint64_t w = coh_.read(&e->state);
    if (ns_state(w) != kNsFree) continue;
    if (!coh_.claim(&e->state, w, make_ns_word(kNsCreating, uint8_t(node_id_)))) continue;
    std::memset(reinterpret_cast<char*>(e) + 8, 0, sizeof *e - 8);
    e->fingerprint = fp;
    e->block_bytes = want.block_bytes;
    e->dtype_bytes = want.dtype_bytes;
    e->kind = want.kind;
    e->num_layers = want.num_layers;
    e->num_kv_heads = want.num_kv_heads;
    e->head_size = want.head_size;
    e->tokens_per_block = want.tokens_per_block;
    e->tp_rank = want.tp_rank;
    e->tp_size = want.tp_size;
    std::memcpy(e->dtype, want.dtype.data(), want.dtype.size());
    std::memcpy(e->model_id, want.model_id.data(), want.model_id.size());
    std::memcpy(e->name, want.name.data(), want.name.size());
    coh_.flush(e, sizeof *e);
    coh_.publish(&e->state, make_ns_word(kNsReady, 0));
    h.id = id;
    h.block_bytes = want.block_bytes;
    h.geo = geo;
    h.name = want.name;
    return h;
  }
  throw NamespaceTableFullError("pool " + path_ + ": all " + std::to_string(hdr_->max_namespaces) + " namespace slots are in use");
}

}  // namespace cxlkv
