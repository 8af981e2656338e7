// Shared-memory RPC (Beluga §6.2, "CXL-RPC"): request/response slots in shared memory, a
// sequence number as the ready flag, busy polling, one producer per cache line, batched fences.
//
// A channel of N slots is two arrays of 64-byte lines (offsets from the channel base, never
// pointers): req[N] written ONLY by the client, then resp[N] written ONLY by the server. Keeping
// each side's lines contiguous lets a reader drop a whole batch of lines with one invalidate and
// one fence, and a writer write back a batch with one fence (the coherence layer's primitives,
// so the same code is right under the flush backend and the multihost emulator).
//
// Protocol of one slot i (see docs/ARCHITECTURE.md "Shared-memory RPC"):
//   client: wait until resp[i].seq == req[i].seq (slot idle); fill req[i].op/len/payload (plain
//           stores); publish req[i].seq = s (release store + write back, fence deferred); after
//           the batch, one fence.
//   server: invalidate req[] (one fence); a slot is pending when req[i].seq != the seq it last
//           answered there; copy the line out, re-read seq (torn/replaced: skip), validate len;
//           fill resp[i] (plain stores), publish resp[i].seq = s (deferred); after the sweep,
//           one fence.
//   client: invalidate resp[] of its batch (one fence); slot i done when resp[i].seq == s; copy
//           out, re-read seq, validate len.
// The seq shares the line with its payload and is stored last: any write-back of the line (an
// explicit clwb or a random eviction) that carries the new seq carries the whole payload, and a
// reader re-reads seq after copying, so it never accepts a torn line.
//
// Untrusted: everything read from the region (header, seq, len, op) is validated before it
// steers a copy or a loop: a bad line is reported as kBadLine, never trusted.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "coherence.h"
#include "format.h"

namespace cxlkv::rpc {

constexpr size_t kInlineBytes = 48;  // payload bytes per line: 64 - seq - op/len

// One request or response. Invariants: written by exactly one party (client for req, server for
// resp); seq is stored last with release semantics; len <= kInlineBytes; seq 0 = never used.
struct alignas(format::kCacheLine) Line {
  uint64_t seq;
  uint32_t op;   // request: operation code; response: status (0 ok) -- meaning is the caller's
  uint32_t len;  // payload bytes, <= kInlineBytes (validated by every reader)
  uint8_t payload[kInlineBytes];
};
static_assert(sizeof(Line) == 64);

// Header of a standalone channel (a mapped file of its own, e.g. the benchmark's). Written once by
// the creator before anyone attaches; attachers validate it and work from a private copy.
struct alignas(format::kCacheLine) ChannelHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t slots;    // 1..kMaxSlots
  uint32_t backend;  // Backend of the region
  uint32_t reserved;
  uint64_t pad[5];
};
static_assert(sizeof(ChannelHeader) == 64);
constexpr uint64_t kChannelMagic = 0x314C454E4E414843ull;  // "CHANNEL1"
constexpr uint32_t kChannelVersion = 1;
constexpr uint32_t kMaxSlots = 4096;

// Bytes a channel body (req[] + resp[]) of `slots` slots takes.
constexpr size_t body_bytes(uint32_t slots) { return size_t(slots) * 2 * sizeof(Line); }

// What a reader concluded about one line.
enum class Poll { kEmpty, kReady, kBadLine };

// A view of one channel: base points at req[0]; resp[] follows. Copyable; owns nothing.
class Channel {
 public:
  Channel() = default;
  Channel(char* body, uint32_t slots, Coherence coh) : body_(body), slots_(slots), coh_(coh) {}

  // Standalone channels over a mapped region of `bytes` bytes.
  static Channel format(void* region, size_t bytes, uint32_t slots, Backend b);  // creator
  static Channel attach(void* region, size_t bytes);  // validates the header; throws CorruptError

  uint32_t slots() const { return slots_; }
  const Coherence& coherence() const { return coh_; }

  // ---- client side (the only writer of req[]) ----
  // Next seq for slot i after a restart: larger than anything seen there, never 0.
  uint64_t resume_seq(uint32_t i) const;
  // Is the slot idle (its last request answered)? Reads resp[i] and req[i].
  bool idle(uint32_t i) const;
  // Writes request `seq` into slot i; the fence is deferred: call end_batch() once after a batch.
  void post(uint32_t i, uint64_t seq, uint32_t op, const void* payload, uint32_t len);
  void end_batch() const { coh_.publish_fence(); }
  // Drops this side's cached copies of resp[first, first+n) (one fence); then poll_response.
  void refresh_responses(uint32_t first, uint32_t n) const;
  // kReady once resp[i].seq == seq: status/payload copied out (out holds kInlineBytes).
  Poll poll_response(uint32_t i, uint64_t seq, uint32_t* status, void* out, uint32_t* len) const;

  // ---- server side (the only writer of resp[]) ----
  void refresh_requests(uint32_t first, uint32_t n) const;
  // kReady when req[i].seq is neither 0 nor `answered`: seq/op/payload copied out.
  Poll poll_request(uint32_t i, uint64_t answered, uint64_t* seq, uint32_t* op, void* out,
                    uint32_t* len) const;
  void respond(uint32_t i, uint64_t seq, uint32_t status, const void* payload, uint32_t len);
  uint64_t answered_seq(uint32_t i) const;  // resp[i].seq as published (restart of a server)

  // Bounds-checked line access (i < slots()).
  Line* req(uint32_t i) const;
  Line* resp(uint32_t i) const;

 private:
  static void write_line(const Coherence& coh, Line* l, uint64_t seq, uint32_t op, const void* p,
                         uint32_t len);
  Poll read_line(const Line* l, uint64_t* seq, uint32_t* op, void* out, uint32_t* len) const;
  char* body_ = nullptr;
  uint32_t slots_ = 0;
  Coherence coh_;
};

// Busy wait with a bound: pause-spin `spins` times, then yield the CPU for each further round
// (the machine may have fewer cores than busy pollers).
class Backoff {
 public:
  explicit Backoff(uint32_t spins = 2000) : spins_(spins) {}
  void wait();
  void reset() { n_ = 0; }

 private:
  uint32_t spins_, n_ = 0;
};

}  // namespace cxlkv::rpc
