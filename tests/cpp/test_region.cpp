// Region (region.h) on its own, without a Pool: it adopts a pool's header only after validating
// it, its accessors refuse every out-of-range number, and its snapshot of an index entry is
// believed only while the entry's state word is unchanged.
#include "region.h"

#include "errors.h"
#include "test_util.h"

using namespace cxlkv;
using namespace cxlkv::test;
using namespace cxlkv::format;

class RegionTest : public PoolTest {
 protected:
  void SetUp() override {
    PoolTest::SetUp();
    Pool::create(path_, opts(8 * MiB), false)->close();
  }
};

TEST_F(RegionTest, AdoptsAValidHeaderAndDerivesTheGeometry) {
  RawMap m(path_);
  Region r;
  EXPECT_EQ(r.base(), nullptr);
  r.adopt(m.base(), m.hdr().pool_bytes, path_, false, nullptr);
  ASSERT_NE(r.header(), nullptr);
  EXPECT_NE(static_cast<const void*>(r.header()), static_cast<const void*>(m.base()));  // a private copy
  EXPECT_EQ(r.header()->chunk_count, m.hdr().chunk_count);
  EXPECT_EQ(r.slot_mask(), m.hdr().index_slots - 1);
  EXPECT_EQ(r.desc_bytes(), m.desc_bytes());
  EXPECT_EQ(r.chunk_stride(), m.chunk_stride());
  EXPECT_EQ(r.coh().backend(), Backend::coherent);
  // A later scribble over the shared header does not reach the copy (F1).
  const uint64_t chunks = r.header()->chunk_count;
  reinterpret_cast<PoolHeader*>(m.base())->chunk_count = chunks * 1000;
  EXPECT_EQ(r.header()->chunk_count, chunks);
  r.reset();
  EXPECT_EQ(r.base(), nullptr);
  EXPECT_EQ(r.header(), nullptr);
}

TEST_F(RegionTest, RefusesACorruptHeaderAndAdoptsNothing) {
  RawMap m(path_);
  reinterpret_cast<PoolHeader*>(m.base())->index_slots ^= 1;  // the checksum no longer matches
  Region r;
  EXPECT_THROW(r.adopt(m.base(), m.hdr().pool_bytes, path_, false, nullptr), FormatError);
  EXPECT_EQ(r.base(), nullptr);
  EXPECT_EQ(r.header(), nullptr);
  Region shorter;  // a mapping shorter than the header says
  reinterpret_cast<PoolHeader*>(m.base())->index_slots ^= 1;
  EXPECT_THROW(shorter.adopt(m.base(), m.hdr().pool_bytes / 2, path_, false, nullptr), TruncatedError);
}

TEST_F(RegionTest, AccessorsRefuseOutOfRangeNumbers) {
  RawMap m(path_);
  Region r;
  r.adopt(m.base(), m.hdr().pool_bytes, path_, false, nullptr);
  const PoolHeader& h = *r.header();
  EXPECT_NO_THROW(r.node_slot(h.max_nodes - 1));
  EXPECT_THROW(r.node_slot(h.max_nodes), CorruptError);
  EXPECT_THROW(r.node_area(h.max_nodes), CorruptError);
  EXPECT_THROW(r.pins(h.max_nodes), CorruptError);
  EXPECT_THROW(r.ns_entry(0), CorruptError);  // ids are 1-based
  EXPECT_NO_THROW(r.ns_entry(h.max_namespaces));
  EXPECT_THROW(r.ns_entry(h.max_namespaces + 1), CorruptError);
  EXPECT_NO_THROW(r.chunk_word(h.chunk_count - 1));
  EXPECT_THROW(r.chunk_word(h.chunk_count), CorruptError);
  const uint32_t descs = uint32_t(r.desc_bytes() / 8);
  EXPECT_NO_THROW(r.block_desc(0, descs - 1));
  EXPECT_THROW(r.block_desc(0, descs), CorruptError);
  EXPECT_THROW(r.block_desc(h.chunk_count, 0), CorruptError);
  const ChunkGeometry geo = chunk_geometry(h.chunk_bytes, 16 * KiB);
  EXPECT_EQ(r.block_payload(geo, 0, 1), m.payload(0, 1, geo.block_stride));
  EXPECT_THROW(r.block_payload(geo, 0, geo.blocks), CorruptError);
  // Index slots wrap by the mask: any 64-bit value names a slot of the table.
  EXPECT_EQ(r.entry(r.slot_mask() + 3), m.entry(2));
  EXPECT_EQ(r.access(~0ull), r.access(r.slot_mask()));
}

TEST_F(RegionTest, SnapshotIsBelievedOnlyWhileTheStateWordIsUnchanged) {
  RawMap m(path_);
  Region r;
  r.adopt(m.base(), m.hdr().pool_bytes, path_, false, nullptr);
  IndexEntry* e = m.entry(5);
  const uint64_t ready = make_entry_word(kReady, 0, 7, 0x123);
  e->state = ready;
  e->ns_id = 3;
  e->chunk = 1;
  e->length = 4096;
  e->checksum = 0xfeed;
  IndexEntry out{};
  ASSERT_TRUE(r.snapshot(5, ready, &out));
  EXPECT_EQ(out.state, ready);
  EXPECT_EQ(out.ns_id, 3u);
  EXPECT_EQ(out.chunk, 1u);
  EXPECT_EQ(out.length, 4096u);
  EXPECT_EQ(out.checksum, 0xfeedu);
  // The caller's word is stale (a writer moved the entry since): the copy is not believed.
  EXPECT_FALSE(r.snapshot(5, make_entry_word(kReady, 0, 6, 0x123), &out));
  e->state = 0;
}
