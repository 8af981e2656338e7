// Shared-memory RPC channel: see rpc.h for the protocol and its invariants.
#include "rpc.h"

#include <sched.h>

#include <atomic>
#include <cstring>

#include "errors.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace cxlkv::rpc {

Channel Channel::format(void* region, size_t bytes, uint32_t slots, Backend b) {
  if (slots == 0 || slots > kMaxSlots)
    throw ArgumentError("rpc channel slots must be in 1.." + std::to_string(kMaxSlots));
  if (reinterpret_cast<uintptr_t>(region) % format::kCacheLine)
    throw ArgumentError("rpc channel region must be 64-byte aligned");
  if (bytes < sizeof(ChannelHeader) + body_bytes(slots))
    throw ArgumentError("rpc channel region of " + std::to_string(bytes) + " bytes is too small for " +
                        std::to_string(slots) + " slots");
  Coherence coh(b);
  auto* h = static_cast<ChannelHeader*>(region);
  char* body = static_cast<char*>(region) + sizeof(ChannelHeader);
  std::memset(body, 0, body_bytes(slots));
  coh.flush(body, body_bytes(slots));
  std::memset(h, 0, sizeof *h);
  h->version = kChannelVersion;
  h->slots = slots;
  h->backend = uint32_t(b);
  coh.flush(h, sizeof *h);
  coh.publish(&h->magic, kChannelMagic);  // last: an attacher never sees a half-written header
  return Channel(body, slots, coh);
}

Channel Channel::attach(void* region, size_t bytes) {
  if (reinterpret_cast<uintptr_t>(region) % format::kCacheLine)
    throw ArgumentError("rpc channel region must be 64-byte aligned");
  if (bytes < sizeof(ChannelHeader)) throw CorruptError("rpc channel region too small for its header");
  Coherence probe(Backend::flush);  // valid for any backend: drop stale copies, then read
  auto* shared = static_cast<ChannelHeader*>(region);
  if (probe.read(&shared->magic) != kChannelMagic) throw CorruptError("not an rpc channel (bad magic)");
  ChannelHeader h;
  std::memcpy(&h, shared, sizeof h);  // a private copy: later scribbles cannot steer us
  if (h.version != kChannelVersion)
    throw CorruptError("rpc channel version " + std::to_string(h.version) + " unknown");
  if (h.slots == 0 || h.slots > kMaxSlots)
    throw CorruptError("rpc channel slot count " + std::to_string(h.slots) + " out of range");
  if (h.backend != uint32_t(Backend::coherent) && h.backend != uint32_t(Backend::flush))
    throw CorruptError("rpc channel backend " + std::to_string(h.backend) + " unknown");
  if (bytes - sizeof(ChannelHeader) < body_bytes(h.slots))
    throw CorruptError("rpc channel of " + std::to_string(h.slots) + " slots does not fit its region");
  return Channel(static_cast<char*>(region) + sizeof(ChannelHeader), h.slots, Coherence(Backend(h.backend)));
}

Line* Channel::req(uint32_t i) const {
  if (i >= slots_) throw CorruptError("rpc slot " + std::to_string(i) + " out of range");
  return reinterpret_cast<Line*>(body_) + i;
}
Line* Channel::resp(uint32_t i) const {
  if (i >= slots_) throw CorruptError("rpc slot " + std::to_string(i) + " out of range");
  return reinterpret_cast<Line*>(body_) + slots_ + i;
}

void Channel::write_line(const Coherence& coh, Line* l, uint64_t seq, uint32_t op, const void* p,
                         uint32_t len) {
  if (len > kInlineBytes)
    throw ArgumentError("rpc payload of " + std::to_string(len) + " bytes exceeds " +
                        std::to_string(kInlineBytes));
  // Plain stores for the body, then the seq with release semantics and the line's write-back:
  // the seq is the last store to the line, so whatever copy of the line carries it carries all.
  l->op = op;
  l->len = len;
  if (len) std::memcpy(l->payload, p, len);
  coh.publish_deferred(&l->seq, seq);
}

Poll Channel::read_line(const Line* l, uint64_t* seq, uint32_t* op, void* out, uint32_t* len) const {
  // The caller invalidated the line (refresh_*); seq, a snapshot of the line, seq again: a line
  // replaced while we copied it (a restarted or misbehaving writer) is not accepted.
  uint64_t s1 = coh_.read_after_invalidate(&l->seq);
  Line c;
  const bool stable = coh_.snapshot_after_invalidate(&c, l, sizeof c, &l->seq, s1);
  if (c.len > kInlineBytes) {  // untrusted: never copy past the line; the seq lets a server answer it
    *seq = s1;
    return Poll::kBadLine;
  }
  if (!stable) return Poll::kEmpty;  // retry on the next poll
  std::memcpy(out, c.payload, c.len);
  *seq = s1;
  *op = c.op;
  *len = c.len;
  return Poll::kReady;
}

uint64_t Channel::resume_seq(uint32_t i) const {
  coh_.invalidate(req(i), sizeof(Line));
  coh_.invalidate(resp(i), sizeof(Line));
  uint64_t a = coh_.read_after_invalidate(&req(i)->seq), b = coh_.read_after_invalidate(&resp(i)->seq);
  uint64_t s = (a > b ? a : b) + 1;
  return s ? s : 1;
}

bool Channel::idle(uint32_t i) const {
  coh_.invalidate(resp(i), sizeof(Line));
  return coh_.read_after_invalidate(&resp(i)->seq) == coh_.read_after_invalidate(&req(i)->seq);
}

void Channel::post(uint32_t i, uint64_t seq, uint32_t op, const void* payload, uint32_t len) {
  if (seq == 0) throw ArgumentError("rpc seq 0 means 'never used'");
  write_line(coh_, req(i), seq, op, payload, len);
}

void Channel::refresh_responses(uint32_t first, uint32_t n) const {
  if (n == 0 || first >= slots_ || n > slots_ - first)
    throw ArgumentError("rpc response range out of bounds");
  coh_.invalidate(resp(first), size_t(n) * sizeof(Line));
}

Poll Channel::poll_response(uint32_t i, uint64_t seq, uint32_t* status, void* out, uint32_t* len) const {
  const Line* l = resp(i);
  if (coh_.read_after_invalidate(&l->seq) != seq) return Poll::kEmpty;
  uint64_t s;
  Poll p = read_line(l, &s, status, out, len);
  if (p == Poll::kReady && s != seq) return Poll::kEmpty;
  return p;
}

void Channel::refresh_requests(uint32_t first, uint32_t n) const {
  if (n == 0 || first >= slots_ || n > slots_ - first) throw ArgumentError("rpc request range out of bounds");
  coh_.invalidate(req(first), size_t(n) * sizeof(Line));
}

Poll Channel::poll_request(uint32_t i, uint64_t answered, uint64_t* seq, uint32_t* op, void* out,
                           uint32_t* len) const {
  const Line* l = req(i);
  uint64_t s = coh_.read_after_invalidate(&l->seq);
  if (s == 0 || s == answered) return Poll::kEmpty;
  Poll p = read_line(l, seq, op, out, len);
  if (p == Poll::kReady && (*seq == 0 || *seq == answered)) return Poll::kEmpty;
  return p;
}

void Channel::respond(uint32_t i, uint64_t seq, uint32_t status, const void* payload, uint32_t len) {
  write_line(coh_, resp(i), seq, status, payload, len);
}

uint64_t Channel::answered_seq(uint32_t i) const {
  coh_.invalidate(resp(i), sizeof(Line));
  return coh_.read_after_invalidate(&resp(i)->seq);
}

void Backoff::wait() {
  if (n_ < spins_) {
    ++n_;
#if defined(__x86_64__)
    _mm_pause();
#endif
    return;
  }
  ::sched_yield();
}

}  // namespace cxlkv::rpc
