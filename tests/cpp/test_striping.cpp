// Striped pools (format.h "Striped pools"): stripe arithmetic, the mapping checked against the
// bytes of the device files themselves, the one-line refusals of a wrong device list (order,
// missing, foreign, truncated, forged label), device placement, destroy, and that a single-file
// pool is unchanged.
#include <sys/stat.h>
#include <unistd.h>

#include "test_util.h"

namespace cxlkv::test {
namespace {

using format::StripeTable;

TEST(Striping, ArithmeticByTable) {
  StripeGeometry g{3, 1 * MiB, 4096};
  struct Row {
    uint64_t off;
    uint32_t device;
    uint64_t device_off;
  } rows[] = {
      {0, 0, 0},                                 // stripe 0: device 0 from its start (the header)
      {MiB + 5, 1, 4096 + 5},                    // stripe 1: device 1 after its label
      {2 * MiB, 2, 4096},                        // stripe 2
      {3 * MiB + 7, 0, MiB + 7},                 // stripe 3: device 0's second stripe
      {7 * MiB + 100, 1, 4096 + 2 * MiB + 100},  // stripe 7: device 1's third stripe
  };
  for (const Row& r : rows) {
    EXPECT_EQ(stripe_device(g, r.off), r.device) << r.off;
    EXPECT_EQ(device_offset(g, r.off), r.device_off) << r.off;
  }
  EXPECT_EQ(range_device(g, MiB, MiB), 1);
  EXPECT_EQ(range_device(g, MiB - 64, 128), -1);  // crosses into the next stripe
  EXPECT_EQ(range_device(g, 2 * MiB - 64, 64), 1);
  EXPECT_EQ(device_stripes(g, 8 * MiB, 0), 3u);
  EXPECT_EQ(device_stripes(g, 8 * MiB, 2), 2u);
  StripeGeometry one{};
  EXPECT_EQ(device_offset(one, 12345), 12345u);
  EXPECT_EQ(range_device(one, 0, 1ull << 40), 0);
}

// The numbers ARCHITECTURE.md gives: a 64 GiB pool at 2 MiB stripes takes 32768 maps whatever
// the device count, which fits the default vm.max_map_count (65530); 128 GiB does not.
TEST(Striping, MapBudget) {
  const uint64_t kDefaultLimit = 65530;
  StripeGeometry four{4, 2 * MiB, 2 * MiB};
  const uint64_t gib64 = 64ull << 30;
  uint64_t maps = 0;
  for (uint32_t d = 0; d < 4; ++d) maps += device_stripes(four, gib64, d);
  EXPECT_EQ(maps, 32768u);
  EXPECT_EQ(device_stripes(four, gib64, 3), 8192u);
  EXPECT_EQ(map_budget_problem(maps, 1000, kDefaultLimit, "p"), "");
  std::string err = map_budget_problem(2 * maps, 1000, kDefaultLimit, "pool p");
  EXPECT_NE(err.find("pool p needs 65536 memory maps"), std::string::npos) << err;
  EXPECT_NE(err.find("larger stripe size"), std::string::npos) << err;
  EXPECT_NE(map_budget_problem(maps, kDefaultLimit - 100, kDefaultLimit, "p"), "");  // already full
}

TEST(Striping, DeviceListSyntax) {
  EXPECT_EQ(split_device_list("/a").size(), 1u);
  auto v = split_device_list("/a,/b,/c");
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v[2], "/c");
  EXPECT_THROW(split_device_list("/a,,/b"), ArgumentError);
  EXPECT_THROW(split_device_list("/a,"), ArgumentError);
  EXPECT_THROW(split_device_list("/a,/a"), ArgumentError);
  std::string many = "/d0";
  for (int i = 1; i <= int(format::kMaxDevices); ++i) many += ",/d" + std::to_string(i);
  EXPECT_THROW(split_device_list(many), ArgumentError);
}

class StripedPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string base = unique_pool_path();
    for (int i = 0; i < 3; ++i) dev_.push_back(base + "-d" + std::to_string(i));
  }
  void TearDown() override {
    for (auto& d : dev_) ::unlink(d.c_str());
    for (auto& d : other_) ::unlink(d.c_str());
  }
  static std::string spec(const std::vector<std::string>& v) {
    std::string s;
    for (auto& x : v) s += (s.empty() ? "" : ",") + x;
    return s;
  }
  std::unique_ptr<Pool> create(uint32_t n, uint64_t size = 24 * MiB, uint64_t stripe = 256 * KiB) {
    CreateOptions o;
    o.size = size;
    o.stripe_bytes = stripe;
    return Pool::create(spec({dev_.begin(), dev_.begin() + n}), o, false);
  }
  // What `open` says about a device list, or "" if it opens.
  static std::string open_error(const std::string& s) {
    try {
      Pool::open(s);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
  static std::vector<char> pread_file(const std::string& path, uint64_t off, uint64_t len) {
    std::vector<char> v(len);
    int fd = ::open(path.c_str(), O_RDONLY);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::pread(fd, v.data(), len, off_t(off)), ssize_t(len));
    ::close(fd);
    return v;
  }
  std::vector<std::string> dev_, other_;
};

// Every block's bytes, found through the pool's offsets, are in the device file the stripe
// arithmetic names, at the offset it names: the mapping is the format, not an accident.
TEST_F(StripedPoolTest, BytesLieOnTheDevicesTheStripesName) {
  const uint64_t bb = 40 * KiB;
  {
    auto p = create(3);
    EXPECT_EQ(p->header().minor, 3);
    EXPECT_EQ(p->header().incompat, format::kIncompatStriped);
    EXPECT_EQ(p->stripes().devices, 3u);
    auto ns = p->open_namespace(layout("s", bb));
    for (uint64_t id = 0; id < 200; ++id) {
      auto data = payload(id, bb);
      Piece pc{data.data(), bb};
      ASSERT_TRUE(p->put(ns, key_of(id), &pc, 1, 0)) << id;
    }
  }
  auto p = Pool::open(spec(dev_));
  auto ns = p->open_namespace(layout("s", bb));
  std::vector<uint32_t> per_device(3, 0);
  for (uint64_t id = 0; id < 200; ++id) {
    uint64_t off = 0, len = 0;
    ASSERT_TRUE(p->locate(ns, key_of(id), &off, &len)) << id;
    ASSERT_EQ(len, bb);
    auto want = payload(id, bb);
    std::vector<char> got(bb), back(bb);
    // Reassemble the block from the files, stripe piece by stripe piece.
    for (uint64_t done = 0; done < bb;) {
      uint64_t o = off + done;
      uint64_t take = std::min(bb - done, p->stripes().stripe - o % p->stripes().stripe);
      uint32_t d = stripe_device(p->stripes(), o);
      ++per_device[d];
      auto part = pread_file(dev_[d], device_offset(p->stripes(), o), take);
      std::memcpy(got.data() + done, part.data(), take);
      done += take;
    }
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), bb))
        << "block " << id << " is not where the stripes say";
    Piece pc{back.data(), bb};
    uint64_t n = 0;
    ASSERT_TRUE(p->get(ns, key_of(id), &pc, 1, &n));
    ASSERT_EQ(0, std::memcmp(back.data(), want.data(), bb));
  }
  for (uint32_t d = 0; d < 3; ++d) EXPECT_GT(per_device[d], 20u) << "device " << d << " holds too few blocks";
  // The header is on device 0 at offset 0, where an older build looks for it.
  auto head = pread_file(dev_[0], 0, sizeof(format::PoolHeader));
  EXPECT_EQ(0, std::memcmp(head.data(), format::kMagic, 8));
  EXPECT_TRUE(p->check().ok);
}

TEST_F(StripedPoolTest, WrongDeviceListsAreRefusedInOneLine) {
  create(3).reset();
  auto has = [](const std::string& err, const std::string& what) {
    EXPECT_NE(err.find(what), std::string::npos) << "error: " << err << "\nexpected: " << what;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  };
  EXPECT_EQ(open_error(spec(dev_)), "");
  has(open_error(spec({dev_[0], dev_[2], dev_[1]})), "is device 2 of this pool, given as device 1");
  has(open_error(spec({dev_[1], dev_[0], dev_[2]})), "not its first device");
  has(open_error(spec({dev_[0], dev_[1]})), "striped over 3 devices, 2 given");
  has(open_error(spec({dev_[0], dev_[1], dev_[2], dev_[0] + "x"})), "does not exist");
  has(open_error(dev_[0]), "name every device");
  // A device of another striped pool in place of device 1.
  other_ = {dev_[0] + "-o0", dev_[0] + "-o1"};
  {
    CreateOptions o;
    o.size = 8 * MiB, o.stripe_bytes = 256 * KiB;
    Pool::create(spec(other_), o, false).reset();
  }
  has(open_error(spec({dev_[0], other_[1], dev_[2]})), "belongs to another pool");
  // A single-device pool listed as a device.
  {
    CreateOptions o;
    o.size = 8 * MiB;
    other_.push_back(dev_[0] + "-single");
    Pool::create(other_.back(), o, false).reset();
  }
  has(open_error(spec({other_.back(), dev_[1]})), "single-device pool");
  has(open_error(spec({dev_[0], other_.back(), dev_[2]})), "so it is a first device");
  // A truncated device.
  struct stat st;
  ASSERT_EQ(::stat(dev_[2].c_str(), &st), 0);
  ASSERT_EQ(::truncate(dev_[2].c_str(), st.st_size - 4096), 0);
  has(open_error(spec(dev_)), "is truncated");
  ASSERT_EQ(::truncate(dev_[2].c_str(), st.st_size), 0);
  EXPECT_EQ(open_error(spec(dev_)), "");
  // A forged label: wrong index, re-sealed with a valid checksum.
  {
    RawMap raw(dev_[1]);
    auto* l = reinterpret_cast<format::DeviceLabel*>(raw.base());
    l->device_index = 2;
    l->checksum = device_label_checksum(*l);
  }
  has(open_error(spec(dev_)), "is device 2 of this pool, given as device 1");
  {
    RawMap raw(dev_[1]);
    auto* l = reinterpret_cast<format::DeviceLabel*>(raw.base());
    l->device_index = 1;  // checksum now stale
  }
  has(open_error(spec(dev_)), "no valid label");
}

TEST_F(StripedPoolTest, ForgedStripeTableIsRefused) {
  create(2).reset();
  {
    RawMap raw(dev_[0]);  // the first device's bytes start with the pool: header, then the table
    auto* t = reinterpret_cast<StripeTable*>(raw.base() + format::kStripeTableOff);
    t->stripe_bytes = 512 * KiB;  // consistent by itself (label and sizes to match), re-sealed
    t->label_bytes = format::label_bytes_for(t->stripe_bytes);
    for (uint32_t d = 0; d < 2; ++d) t->device_bytes[d] = device_need_bytes(stripe_geometry(*t), 24 * MiB, d);
    t->checksum = stripe_table_checksum(*t);
  }
  std::string err = open_error(spec({dev_[0], dev_[1]}));
  EXPECT_NE(err.find("disagrees with the pool's stripe table"), std::string::npos) << err;
  {
    RawMap raw(dev_[0]);
    auto* t = reinterpret_cast<StripeTable*>(raw.base() + format::kStripeTableOff);
    t->stripe_bytes = 384 * KiB;
    t->checksum = stripe_table_checksum(*t);
  }
  err = open_error(spec({dev_[0], dev_[1]}));
  EXPECT_NE(err.find("impossible stripe table (stripe size)"), std::string::npos) << err;
}

// A handle bound to a device gets blocks whose every byte is on that device, until that device's
// share is full; unbound handles of the same namespace keep using the rest.
TEST_F(StripedPoolTest, BoundNamespaceBlocksLandOnItsDevice) {
  const uint64_t bb = 24 * KiB;
  auto p = create(2, 16 * MiB, 128 * KiB);
  auto any = p->open_namespace(layout("placed", bb));
  EXPECT_THROW(p->bind_device(any, 2), ArgumentError);
  auto on1 = p->bind_device(any, 1);
  EXPECT_EQ(on1.device, 1);
  uint64_t stored = 0;
  for (uint64_t id = 0; id < 100; ++id) {
    auto data = payload(id, bb);
    Piece pc{data.data(), bb};
    ASSERT_TRUE(p->put(on1, key_of(id), &pc, 1, 0));
    uint64_t off = 0, len = 0;
    ASSERT_TRUE(p->locate(on1, key_of(id), &off, &len));
    ASSERT_EQ(range_device(p->stripes(), off, bb), 1) << "block of key " << id << " at " << off;
    ++stored;
  }
  auto use = p->device_usage();
  ASSERT_EQ(use.size(), 2u);
  EXPECT_GE(use[1].used_bytes, stored * bb);
  EXPECT_EQ(use[0].used_bytes, 0u);
  // The unbound handle of the same namespace may use device 0's blocks.
  bool on0 = false;
  for (uint64_t id = 1000; id < 1100; ++id) {
    auto data = payload(id, bb);
    Piece pc{data.data(), bb};
    ASSERT_TRUE(p->put(any, key_of(id), &pc, 1, 0));
    uint64_t off = 0, len = 0;
    ASSERT_TRUE(p->locate(any, key_of(id), &off, &len));
    on0 |= stripe_device(p->stripes(), off) == 0;
  }
  EXPECT_TRUE(on0);
  EXPECT_TRUE(p->check().ok);
  // Under pressure a bound handle evicts only blocks on its device: keep putting far past the
  // pool's size, every block still lands on device 1.
  for (uint64_t id = 5000; id < 5800; ++id) {
    auto data = payload(id, bb);
    Piece pc{data.data(), bb};
    if (!p->put(on1, key_of(id), &pc, 1, 0)) continue;
    uint64_t off = 0, len = 0;
    ASSERT_TRUE(p->locate(on1, key_of(id), &off, &len));
    ASSERT_EQ(range_device(p->stripes(), off, bb), 1) << "key " << id;
  }
  EXPECT_TRUE(p->check().ok);
}

TEST_F(StripedPoolTest, BlockLargerThanStripeCannotBeBound) {
  auto p = create(2, 16 * MiB, 64 * KiB);
  auto ns = p->open_namespace(layout("big", 100 * KiB));
  EXPECT_THROW(p->bind_device(ns, 0), ArgumentError);
  EXPECT_NO_THROW(p->bind_device(ns, -1));
}

TEST_F(StripedPoolTest, DestroyRemovesEveryDevice) {
  create(3).reset();
  Pool::destroy(spec(dev_));
  for (auto& d : dev_) EXPECT_NE(::access(d.c_str(), F_OK), 0) << d;
}

// A striped creator killed mid-way leaves `<device>.init-<pid>-<rand>` files; the next create of
// those devices removes the ones whose creator is gone (pid 999999999 exceeds any pid_max).
TEST_F(StripedPoolTest, CreateSweepsADeadCreatorsTemporaryFiles) {
  std::vector<std::string> stale;
  for (auto& d : dev_) {
    stale.push_back(d + ".init-999999999-0badf00d");
    int fd = ::open(stale.back().c_str(), O_CREAT | O_WRONLY, 0600);
    ASSERT_GE(fd, 0);
    ::close(fd);
  }
  create(3).reset();
  for (auto& s : stale) EXPECT_NE(::access(s.c_str(), F_OK), 0) << s << " was left behind";
  for (auto& s : stale) ::unlink(s.c_str());
}

TEST_F(StripedPoolTest, CreateRefusesALeftoverDevice) {
  {
    int fd = ::open(dev_[1].c_str(), O_CREAT | O_WRONLY, 0600);
    ::close(fd);
  }
  try {
    create(3);
    FAIL() << "created over a leftover device file";
  } catch (const OsError& e) {
    EXPECT_NE(std::string(e.what()).find("already exists"), std::string::npos) << e.what();
  }
  EXPECT_NE(::access(dev_[0].c_str(), F_OK), 0) << "a failed create left device 0 behind";
}

// The coherence backends are orthogonal to striping: a flush or multihost pool over three files
// stores, reads back after re-open, and checks clean.
TEST_F(StripedPoolTest, EveryBackendStripes) {
  for (Backend b : {Backend::flush, Backend::multihost}) {
    SCOPED_TRACE(int(b));
    CreateOptions o;
    o.size = 24 * MiB, o.stripe_bytes = 256 * KiB, o.backend = b;
    const uint64_t bb = 20 * KiB;
    {
      auto p = Pool::create(spec(dev_), o, false);
      auto ns = p->bind_device(p->open_namespace(layout("b", bb)), 1);
      for (uint64_t id = 0; id < 64; ++id) {
        auto data = payload(id, bb);
        Piece pc{data.data(), bb};
        ASSERT_TRUE(p->put(ns, key_of(id), &pc, 1, 0));
      }
    }
    auto p = Pool::open(spec(dev_));
    EXPECT_EQ(p->backend(), b);
    auto ns = p->open_namespace(layout("b", bb));
    for (uint64_t id = 0; id < 64; ++id) {
      std::vector<char> got(bb);
      Piece pc{got.data(), bb};
      uint64_t n = 0, off = 0, len = 0;
      ASSERT_TRUE(p->get(ns, key_of(id), &pc, 1, &n));
      ASSERT_EQ(0, std::memcmp(got.data(), payload(id, bb).data(), bb));
      ASSERT_TRUE(p->locate(ns, key_of(id), &off, &len));
      EXPECT_EQ(range_device(p->stripes(), off, bb), 1);
    }
    EXPECT_TRUE(p->check().ok);
    p.reset();
    Pool::destroy(spec(dev_));
  }
}

TEST(StripedSingleFile, SingleFilePoolIsUnchanged) {
  std::string path = unique_pool_path();
  CreateOptions o;
  o.size = 8 * MiB;
  {
    auto p = Pool::create(path, o, false);
    EXPECT_EQ(p->header().minor, 2);
    EXPECT_EQ(p->header().incompat, 0u);
    EXPECT_FALSE(p->stripes().striped());
    RawMap raw(path);
    char zero[sizeof(StripeTable)] = {};
    EXPECT_EQ(0, std::memcmp(raw.base() + format::kStripeTableOff, zero, sizeof zero));
    auto ns = p->open_namespace(layout("x", 4096));
    EXPECT_EQ(p->bind_device(ns, 0).device, -1);  // one device: every block is on it
    EXPECT_THROW(p->bind_device(ns, 1), ArgumentError);
  }
  ::unlink(path.c_str());
}

}  // namespace
}  // namespace cxlkv::test
