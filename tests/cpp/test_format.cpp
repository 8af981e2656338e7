// On-pool format: creation/opening, header round trip, chunk geometry invariants, and the exact
// exception type for each kind of bad pool (corrupted, newer, truncated, half-initialized, not a
// file, missing).
#include <sys/stat.h>

#include <cerrno>
#include <cstddef>
#include <functional>

#include "test_util.h"

namespace cxlkv::test {
namespace {

using format::PoolHeader;

class FormatTest : public PoolTest {
 protected:
  // Creates a small pool and closes it, leaving the file for corruption tests.
  void make_pool() {
    auto p = create(opts(4 * MiB, 64 * KiB));
    p->close();
  }
  PoolHeader read_header() {
    PoolHeader h;
    int fd = ::open(path_.c_str(), O_RDONLY);
    EXPECT_EQ(::pread(fd, &h, sizeof h, 0), ssize_t(sizeof h));
    ::close(fd);
    return h;
  }
  void write_at(const void* p, size_t n, off_t off) {
    int fd = ::open(path_.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, p, n, off), ssize_t(n));
    ::close(fd);
  }
  // Edits the header; with rechecksum the checksum is made valid again, so only the edit counts.
  void patch_header(const std::function<void(PoolHeader&)>& edit, bool rechecksum) {
    PoolHeader h = read_header();
    edit(h);
    if (rechecksum) h.checksum = cxlkv::xxh3(&h, offsetof(PoolHeader, checksum));
    write_at(&h, sizeof h, 0);
  }
  void set_init_word(uint64_t v) { write_at(&v, sizeof v, format::kSharedWordsOff); }
};

TEST_F(FormatTest, CreateThenOpen) {
  auto a = create(opts(4 * MiB, 64 * KiB));
  EXPECT_FALSE(a->closed());
  EXPECT_GE(a->node_id(), 1u);
  auto b = Pool::open(path_);
  EXPECT_NE(a->node_id(), b->node_id());
  EXPECT_EQ(std::memcmp(&a->header(), &b->header(), sizeof(PoolHeader)), 0);
  EXPECT_EQ(b->size(), 4 * MiB);
  b->close();
  EXPECT_TRUE(b->closed());
  a->close();
  auto c = Pool::open(path_, /*populate=*/true);  // reopen after everyone closed, pre-faulted
  EXPECT_TRUE(c->check().ok);
}

TEST_F(FormatTest, HeaderRoundTrip) {
  CreateOptions o = opts(8 * MiB, 256 * KiB, 2048);
  o.max_nodes = 17;
  o.pin_slots = 100;
  o.max_namespaces = 9;
  o.backend = Backend::flush;
  create(o)->close();

  auto p = Pool::open(path_);
  const PoolHeader& h = p->header();
  EXPECT_EQ(std::memcmp(h.magic, format::kMagic, 8), 0);
  EXPECT_EQ(h.major, format::kFormatMajor);
  EXPECT_EQ(h.minor, format::pool_minor(false));  // a single-file pool records 2.2
  EXPECT_EQ(h.header_bytes, sizeof(PoolHeader));
  EXPECT_EQ(h.pool_bytes, 8 * MiB);
  EXPECT_EQ(h.chunk_bytes, 256 * KiB);
  EXPECT_EQ(h.index_slots, 2048u);
  EXPECT_EQ(h.max_nodes, 17u);
  EXPECT_EQ(h.pin_slots, 100u);
  EXPECT_EQ(h.max_namespaces, 9u);
  EXPECT_EQ(h.backend, uint32_t(Backend::flush));
  EXPECT_EQ(p->backend(), Backend::flush);
  EXPECT_EQ(h.incompat, 0u);
  EXPECT_EQ(h.stamp_index_entry, sizeof(format::IndexEntry));
  EXPECT_EQ(h.stamp_namespace, sizeof(format::NamespaceEntry));
  EXPECT_EQ(h.checksum, cxlkv::xxh3(&h, offsetof(PoolHeader, checksum)));

  // Geometry: areas in order, aligned, inside the pool.
  EXPECT_EQ(h.node_table_off % format::kMetaAlign, 0u);
  EXPECT_GE(h.node_table_off, format::kSharedWordsOff + format::kMetaAlign);
  EXPECT_GE(h.node_area_off, h.node_table_off + h.max_nodes * sizeof(format::NodeSlot));
  EXPECT_GE(h.ns_table_off, h.node_area_off + h.max_nodes * h.node_area_bytes);
  EXPECT_GE(h.index_off, h.ns_table_off + h.max_namespaces * sizeof(format::NamespaceEntry));
  EXPECT_GE(h.access_off, h.index_off + h.index_slots * sizeof(format::IndexEntry));
  EXPECT_GE(h.chunk_map_off, h.access_off + h.index_slots * 8);
  EXPECT_GE(h.arena_off, h.chunk_map_off + h.chunk_count * 8);
  EXPECT_EQ(h.arena_off % 65536, 0u);
  EXPECT_GT(h.chunk_count, 0u);
  EXPECT_LE(h.arena_off + h.chunk_count * (format::chunk_desc_bytes(h.chunk_bytes) + h.chunk_bytes),
            h.pool_bytes);

  // The header in the file is byte-identical to what the pool reports.
  PoolHeader f = read_header();
  EXPECT_EQ(std::memcmp(&f, &h, sizeof f), 0);
  // A flush-backend pool works.
  auto ns = p->open_namespace(layout("f", 4096));
  auto v = payload(1, 4096);
  Piece in{v.data(), v.size()};
  ASSERT_TRUE(p->put(ns, key_of(1), &in, 1, 0));
  std::vector<char> out(4096);
  Piece o2{out.data(), out.size()};
  ASSERT_TRUE(p->get(ns, key_of(1), &o2, 1, nullptr));
  EXPECT_EQ(out, v);
}

TEST(ChunkGeometry, Invariants) {
  const uint64_t chunks[] = {64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB};
  std::vector<uint64_t> blocks = {1,           2,       63,       64,       65,        100,     127,
                                  128,         1000,    1023,     1024,     1025,      4095,    4096,
                                  4097,        12345,   16 * KiB, 64 * KiB, 100 * KiB, 1 * MiB, 2 * MiB,
                                  2 * MiB + 1, 3 * MiB, 16 * MiB, 64 * MiB};
  for (uint64_t b = 8; b < 70000; b = b * 3 / 2 + 7) blocks.push_back(b);
  for (uint64_t cb : chunks) {
    const uint64_t desc = format::chunk_desc_bytes(cb);
    EXPECT_EQ(desc % format::kMetaAlign, 0u);
    for (uint64_t bb : blocks) {
      SCOPED_TRACE("chunk " + std::to_string(cb) + " block " + std::to_string(bb));
      auto g = format::chunk_geometry(cb, bb);
      EXPECT_EQ(g.block_stride % 64, 0u);
      EXPECT_GE(g.block_stride, bb);
      EXPECT_LT(g.block_stride - bb, 64u);
      EXPECT_LE(uint64_t(g.blocks) * g.block_stride, cb);
      EXPECT_LE(uint64_t(g.blocks) * 8, desc);
      EXPECT_LE(g.blocks, format::kMaxBlocksPerChunk);
      // Maximal: one more block would break one of the limits.
      uint64_t more = uint64_t(g.blocks) + 1;
      EXPECT_TRUE(more * g.block_stride > cb || more * 8 > desc || more > format::kMaxBlocksPerChunk);
      if (bb > cb) EXPECT_EQ(g.blocks, 0u);
    }
  }
  // Large blocks pack the payload exactly.
  auto g = format::chunk_geometry(16 * MiB, 2 * MiB);
  EXPECT_EQ(g.blocks, 8u);
  EXPECT_EQ(g.block_stride, 2 * MiB);
  EXPECT_EQ(format::chunk_geometry(64 * MiB, 2 * MiB).blocks, 32u);
  EXPECT_EQ(format::chunk_geometry(16 * MiB, 16 * MiB).blocks, 1u);
  EXPECT_EQ(format::chunk_geometry(16 * MiB, 16 * MiB + 1).blocks, 0u);
}

// F5: round_up of a value read from a corrupt pool must not wrap to 0 (a divisor downstream).
TEST(ChunkGeometry, F5RoundUpAndGeometryOverflowSafe) {
  EXPECT_EQ(format::round_up(~0ull, 64), 0u);
  EXPECT_EQ(format::round_up(~0ull - 62, 64), 0u);
  EXPECT_EQ(format::round_up(~0ull - 63, 64), ~0ull - 63);
  EXPECT_EQ(format::round_up(65, 64), 128u);
  for (uint64_t bb : {0ull, ~0ull, ~0ull - 62, 1ull << 63}) {
    auto g = format::chunk_geometry(16 * MiB, bb);  // pre-fix: SIGFPE (division by 0)
    EXPECT_EQ(g.blocks, 0u) << bb;
  }
}

template <class E>
void expect_open_throws(const std::string& path) {
  try {
    auto p = Pool::open(path);
    ADD_FAILURE() << "open succeeded, expected " << typeid(E).name();
  } catch (const E&) {
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception " << typeid(e).name() << ": " << e.what();
  }
}

int open_errno(const std::string& path) {
  try {
    Pool::open(path);
  } catch (const OsError& e) {
    return e.err;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception " << typeid(e).name() << ": " << e.what();
    return -1;
  }
  ADD_FAILURE() << "open succeeded";
  return 0;
}

TEST_F(FormatTest, BadMagicIsFormatError) {
  make_pool();
  write_at("NOTAPOOL", 8, 0);
  expect_open_throws<FormatError>(path_);
}

TEST_F(FormatTest, NewerMajorIsVersionError) {
  make_pool();
  patch_header([](PoolHeader& h) { h.major += 1; }, false);
  expect_open_throws<VersionError>(path_);
  patch_header([](PoolHeader&) {}, true);  // same with a valid checksum
  expect_open_throws<VersionError>(path_);
}

TEST_F(FormatTest, OlderMajorIsVersionError) {
  make_pool();
  patch_header([](PoolHeader& h) { h.major = format::kFormatMajor - 1; }, true);
  expect_open_throws<VersionError>(path_);
}

TEST_F(FormatTest, NewerMinorAndUnknownCompatBitsStillOpen) {
  make_pool();
  patch_header(
      [](PoolHeader& h) {
        h.minor += 1;
        h.compat |= 1ull << 40;
      },
      true);
  auto p = Pool::open(path_);
  EXPECT_TRUE(p->check().ok);
}

TEST_F(FormatTest, HeaderChecksumMismatchIsFormatError) {
  make_pool();
  patch_header([](PoolHeader& h) { h.created_unix_ns ^= 1; }, false);
  expect_open_throws<FormatError>(path_);
}

TEST_F(FormatTest, ImpossibleGeometryIsFormatError) {
  make_pool();
  patch_header([](PoolHeader& h) { h.index_slots = 1000; }, true);  // not a power of two
  expect_open_throws<FormatError>(path_);
  ::unlink(path_.c_str());
  make_pool();
  patch_header([](PoolHeader& h) { h.chunk_count = h.chunk_count * 4; }, true);  // arena past the end
  expect_open_throws<FormatError>(path_);
}

// F6: a forged header (checksum re-sealed) whose max_nodes * node_area_bytes wraps to 0.
TEST_F(FormatTest, F6ForgedNodeAreaBytesIsFormatError) {
  for (uint64_t nab : {1ull << 58, 1ull << 63, ~0ull & ~4095ull}) {
    make_pool();
    patch_header(
        [&](PoolHeader& h) {
          h.max_nodes = 64;
          h.node_area_bytes = nab;
        },
        true);
    expect_open_throws<FormatError>(path_);
    ::unlink(path_.c_str());
  }
}

// F1: the header is copied at open; a later scribble over the shared header changes nothing.
TEST_F(FormatTest, F1HeaderScribbleAfterOpenIsIgnored) {
  auto p = create(opts(4 * MiB, 64 * KiB));
  auto ns = p->open_namespace(layout("ns", 4096));
  for (size_t off : {offsetof(PoolHeader, arena_off), offsetof(PoolHeader, chunk_count),
                     offsetof(PoolHeader, node_area_off), offsetof(PoolHeader, max_nodes)}) {
    uint64_t bad = 1ull << 62;
    write_at(&bad, off == offsetof(PoolHeader, max_nodes) ? 4 : 8, off);
    Key k{};
    k[0] = uint8_t(off);
    std::vector<char> buf(4096, 'x');
    Piece src{buf.data(), buf.size()};
    EXPECT_TRUE(p->put(ns, k, &src, 1, 0));
    uint64_t len = 0;
    std::vector<char> out(4096);
    Piece dst{out.data(), out.size()};
    EXPECT_TRUE(p->get(ns, k, &dst, 1, &len));
    EXPECT_EQ(out, buf);
    EXPECT_EQ(p->header().arena_off % 65536, 0u);
  }
  EXPECT_TRUE(p->check().ok);
}

TEST_F(FormatTest, F11SymlinkIsRefused) {
  make_pool();
  std::string link = path_ + ".link";
  ASSERT_EQ(::symlink(path_.c_str(), link.c_str()), 0);
  EXPECT_EQ(open_errno(link), ELOOP);
  ::unlink(link.c_str());
}

TEST_F(FormatTest, F11WorldWritablePoolIsRefusedUnlessAllowed) {
  make_pool();
  ASSERT_EQ(::chmod(path_.c_str(), 0666), 0);
  EXPECT_EQ(open_errno(path_), EPERM);
  OpenOptions o;
  o.allow_foreign_owner = true;
  EXPECT_NO_THROW(Pool::open(path_, o));
}

TEST_F(FormatTest, TruncatedFileIsTruncatedError) {
  make_pool();
  ASSERT_EQ(::truncate(path_.c_str(), 4 * MiB - 64 * KiB), 0);
  expect_open_throws<TruncatedError>(path_);
  ASSERT_EQ(::truncate(path_.c_str(), 100), 0);  // smaller than a header
  expect_open_throws<TruncatedError>(path_);
  ASSERT_EQ(::truncate(path_.c_str(), 0), 0);
  expect_open_throws<TruncatedError>(path_);
}

TEST_F(FormatTest, UnknownIncompatBitIsVersionError) {
  make_pool();
  patch_header([](PoolHeader& h) { h.incompat |= 1ull << 3; }, true);
  expect_open_throws<VersionError>(path_);
}

TEST_F(FormatTest, BuildStampMismatchIsVersionError) {
  make_pool();
  patch_header([](PoolHeader& h) { h.stamp_index_entry = 128; }, true);
  expect_open_throws<VersionError>(path_);
}

TEST_F(FormatTest, InitWordNotReadyIsNotReadyError) {
  make_pool();
  set_init_word(0);
  expect_open_throws<NotReadyError>(path_);
  set_init_word(format::kInitBusy);
  expect_open_throws<NotReadyError>(path_);
  // A creator that died before writing the header: zero magic, init BUSY.
  char zero[sizeof(PoolHeader)] = {};
  write_at(zero, sizeof zero, 0);
  expect_open_throws<NotReadyError>(path_);
  // Zero magic with a zero init word is just not a pool.
  set_init_word(0);
  expect_open_throws<FormatError>(path_);
}

TEST_F(FormatTest, DirectoryIsOsErrorEISDIR) {
  ASSERT_EQ(::mkdir(path_.c_str(), 0700), 0);
  EXPECT_EQ(open_errno(path_), EISDIR);
  ::rmdir(path_.c_str());
}

TEST_F(FormatTest, MissingFileIsOsErrorENOENT) {
  EXPECT_EQ(open_errno(path_), ENOENT);
  EXPECT_EQ(open_errno("/dev/dax9.9"), ENOENT);
}

TEST_F(FormatTest, CreateExistingIsEEXISTUnlessExistOk) {
  auto a = create(opts(4 * MiB, 64 * KiB));
  try {
    Pool::create(path_, opts(4 * MiB, 64 * KiB), false);
    ADD_FAILURE() << "create over an existing pool succeeded";
  } catch (const OsError& e) {
    EXPECT_EQ(e.err, EEXIST);
  }
  auto b = Pool::create(path_, opts(8 * MiB), true);  // opens the existing pool
  EXPECT_EQ(std::memcmp(&a->header(), &b->header(), sizeof(PoolHeader)), 0);
  EXPECT_EQ(b->size(), 4 * MiB);
  // exist_ok on something that is not a pool opens it and refuses it.
  b.reset();
  a.reset();
  write_at("garbage!", 8, 0);
  EXPECT_THROW(Pool::create(path_, opts(4 * MiB), true), FormatError);
}

TEST_F(FormatTest, DestroyRemovesPoolsOnly) {
  make_pool();
  Pool::destroy(path_);
  struct stat st;
  EXPECT_NE(::stat(path_.c_str(), &st), 0);
  std::vector<char> junk(16 * KiB, 'x');
  int fd = ::open(path_.c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_EQ(::write(fd, junk.data(), junk.size()), ssize_t(junk.size()));
  ::close(fd);
  EXPECT_THROW(Pool::destroy(path_), FormatError);
  EXPECT_EQ(::stat(path_.c_str(), &st), 0);
}

TEST_F(FormatTest, CreateRejectsBadOptions) {
  EXPECT_THROW(create(opts(4 * MiB, 64 * KiB + 1)), ArgumentError);
  EXPECT_THROW(create(opts(4 * MiB, 64 * KiB, 1000)), ArgumentError);
  EXPECT_THROW(create(opts(64 * KiB)), ArgumentError);
  struct stat st;
  EXPECT_NE(::stat(path_.c_str(), &st), 0);  // nothing left behind
}

}  // namespace
}  // namespace cxlkv::test
