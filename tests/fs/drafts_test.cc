// The drafts (fs/drafts/drafts.h) in process, without FUSE: a bucket in memory (test::MemStore
// behind a test::FaultStore), staging and journals in a temporary directory, every operation
// called the way the FUSE adapter calls it. Each test publishes through Drafts::Commit and
// reads the version back through the materializer, byte for byte and by SHA-256.
//
// Covered: a new model's files written out of order and in odd sizes; a child version that
// inherits its parent's files and copies up only the chunks a write touches; truncate, rename,
// unlink and rmdir; commit refused while a file is open for writing, and with a failed write;
// a restart (a new Drafts on the same state directory) that finds its draft and publishes it;
// a bucket that fails the uploads, then recovers; discard; and the mount's tree of names
// (fs/mount_tree.h): which of the published versions and the drafts answers for a name, and
// which changes are refused. The real mounts (write_test.cc,
// draft_safety_test.cc) cover the kernel's side: page cache, direct_io, permissions.
#include "fs/drafts/drafts.h"

#include <fcntl.h>
#include <sys/vfs.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/hash.h"
#include "fs/chunk_reader.h"
#include "fs/mount_tree.h"
#include "fs/namespace.h"
#include "hub/engine/bucket.h"
#include "hub/engine/materializer.h"
#include "tests/fs/test_bucket.h"
#include "tests/testing/fault_store.h"
#include "tests/testing/mem_store.h"

namespace weightfs {
namespace {

using testing::RandomBytes;

constexpr uint64_t kChunk = 64 << 10;
const Caller kWho{1000, 1000};

class DraftsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    state_ = std::filesystem::temp_directory_path() /
             ("wfs-drafts-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "-" +
              std::to_string(::getpid()));
    std::filesystem::remove_all(state_);
    std::filesystem::create_directories(state_);
    faults_ = std::make_shared<test::FaultStore>(std::make_shared<test::MemStore>());
    ASSERT_TRUE(Bucket::Init(*faults_).ok());
    auto b = Bucket::Open(faults_);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    bucket_ = std::move(b).value();
    materializer_ = std::make_unique<Materializer>(bucket_.get(), nullptr);
    ChunkReaderOptions ro;
    ro.readahead_bytes = 0;
    reader_ = std::make_unique<ChunkReader>(materializer_.get(), ro);
    Start();
  }
  void TearDown() override {
    drafts_.reset();
    std::filesystem::remove_all(state_);
  }

  // A Drafts on the state directory (again: a restart of the mount).
  void Start() {
    drafts_.reset();
    DraftsOptions o;
    o.state_dir = state_.string();
    o.push.chunk_bytes = kChunk;
    o.push.pack_bytes = 256 << 10;
    o.encode_threads = 2;
    o.uid = kWho.uid;
    o.gid = kWho.gid;
    o.on_published = [this](std::shared_ptr<const Manifest> m) { published_.push_back(std::move(m)); };
    drafts_ = std::make_unique<Drafts>(bucket_.get(), nullptr, materializer_.get(), reader_.get(), o);
    ASSERT_TRUE(drafts_->Load().ok());
    ASSERT_TRUE(drafts_->enabled());
  }

  // mkdir MODEL@VERSION in the root of the mount ("acme/m@v1": in the directory acme).
  uint64_t MakeDraft(const std::string& model, const std::string& version) {
    const size_t slash = model.rfind('/');
    NodeAttr attr;
    Status st = drafts_->MkdirIn(model.substr(0, slash), model.substr(slash + 1) + "@" + version, 0755, kWho, &attr);
    EXPECT_TRUE(st.ok()) << st.ToString();
    EXPECT_TRUE(Drafts::Owns(attr.ino));
    return attr.ino;
  }

  // Creates (O_TRUNC) `name` in directory `dir` and writes `bytes` in pieces of odd sizes,
  // in the order `order` gives ("forward", "backward"), then closes it.
  void WriteFile(uint64_t dir, const std::string& name, const std::vector<uint8_t>& bytes,
                 const std::string& order = "forward") {
    NodeAttr attr;
    std::unique_ptr<DraftHandle> h;
    Status st = drafts_->Create(dir, name, 0644, O_WRONLY | O_CREAT | O_TRUNC, kWho, &attr, &h);
    ASSERT_TRUE(st.ok()) << st.ToString();
    std::vector<std::pair<uint64_t, size_t>> pieces;
    for (uint64_t off = 0, k = 0; off < bytes.size(); ++k) {
      const size_t n = std::min<uint64_t>(bytes.size() - off, 4096 * (1 + k % 7) + 123 * (k % 3));
      pieces.emplace_back(off, n);
      off += n;
    }
    if (order == "backward") std::reverse(pieces.begin(), pieces.end());
    for (const auto& [off, n] : pieces) {
      st = drafts_->Write(*h, off, std::span<const uint8_t>(bytes).subspan(off, n));
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
    drafts_->Release(std::move(h));
  }

  // Writes `bytes` at `offset` of an existing file of the draft (no O_TRUNC: copy-up).
  void Patch(uint64_t dir, const std::string& name, uint64_t offset, const std::vector<uint8_t>& bytes) {
    NodeAttr attr;
    ASSERT_TRUE(drafts_->Lookup(dir, name, &attr).ok());
    std::unique_ptr<DraftHandle> h;
    Status st = drafts_->Open(attr.ino, O_WRONLY, &h);
    ASSERT_TRUE(st.ok()) << st.ToString();
    st = drafts_->Write(*h, offset, bytes);
    ASSERT_TRUE(st.ok()) << st.ToString();
    drafts_->Release(std::move(h));
  }

  // The bytes of `name` in the draft, read as a reader of the mount would.
  std::vector<uint8_t> ReadDraft(uint64_t dir, const std::string& name) {
    NodeAttr attr;
    Status st = drafts_->Lookup(dir, name, &attr);
    EXPECT_TRUE(st.ok()) << st.ToString();
    std::unique_ptr<DraftHandle> h;
    st = drafts_->Open(attr.ino, O_RDONLY, &h);
    EXPECT_TRUE(st.ok()) << st.ToString();
    if (!st.ok()) return {};
    std::vector<uint8_t> out, piece;
    for (uint64_t off = 0;; off += piece.size()) {
      st = drafts_->Read(*h, off, 100000, &piece);
      EXPECT_TRUE(st.ok()) << st.ToString();
      if (!st.ok() || piece.empty()) break;
      out.insert(out.end(), piece.begin(), piece.end());
    }
    drafts_->Release(std::move(h));
    return out;
  }

  // The published version's files: path -> bytes, each checked against its SHA-256.
  std::map<std::string, std::vector<uint8_t>> ReadVersion(const std::string& model, const std::string& version) {
    std::map<std::string, std::vector<uint8_t>> files;
    auto m = bucket_->ReadManifest(model, version);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (!m.ok()) return files;
    for (const ManifestFile& head : (*m)->files) {
      auto rows = bucket_->File(*m, head);
      EXPECT_TRUE(rows.ok()) << rows.status().ToString();
      if (!rows.ok()) continue;
      std::vector<uint8_t>& bytes = files[head.path];
      for (size_t i = 0; i < (*rows)->chunks.size(); ++i) {
        auto chunk = materializer_->Chunk(**m, **rows, i);
        EXPECT_TRUE(chunk.ok()) << chunk.status().ToString();
        if (chunk.ok()) bytes.insert(bytes.end(), chunk->begin(), chunk->end());
      }
      EXPECT_EQ(bytes.size(), head.size) << head.path;
      EXPECT_EQ(Sha256Hex(bytes), head.sha256) << head.path;
    }
    return files;
  }

  std::filesystem::path state_;
  std::shared_ptr<test::FaultStore> faults_;
  std::unique_ptr<Bucket> bucket_;
  std::unique_ptr<Materializer> materializer_;
  std::unique_ptr<ChunkReader> reader_;
  std::unique_ptr<Drafts> drafts_;
  std::vector<std::shared_ptr<const Manifest>> published_;
};

TEST_F(DraftsTest, ANewModelsFilesWrittenInAnyOrderArePublishedBitExact) {
  const std::map<std::string, std::vector<uint8_t>> want = {
      {"big.bin", RandomBytes(5 * kChunk + 777, 1)},
      {"backward.bin", RandomBytes(3 * kChunk + 5, 2)},
      {"small.json", RandomBytes(300, 3)},
      {"empty.txt", {}},
  };
  const uint64_t d = MakeDraft("acme/m", "v0");
  for (const auto& [name, bytes] : want) WriteFile(d, name, bytes, name == "backward.bin" ? "backward" : "forward");
  // Before the commit, the draft reads back what was written.
  for (const auto& [name, bytes] : want) EXPECT_EQ(ReadDraft(d, name), bytes) << name;
  Status st = drafts_->Commit(d, "");
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(ReadVersion("acme/m", "v0"), want);
  ASSERT_EQ(published_.size(), 1u);
  EXPECT_EQ(published_[0]->version, "v0");
  // The draft is gone: the name is the published version's now.
  NodeAttr attr;
  EXPECT_FALSE(drafts_->LookupIn("acme", "m@v0", &attr).ok());
}

TEST_F(DraftsTest, AChildInheritsItsParentAndStoresOnlyTheChunksAWriteTouched) {
  const std::vector<uint8_t> weights = RandomBytes(8 * kChunk, 4);
  const std::vector<uint8_t> config = RandomBytes(500, 5);
  uint64_t d = MakeDraft("acme/m", "v0");
  WriteFile(d, "weights.bin", weights);
  WriteFile(d, "config.json", config);
  ASSERT_TRUE(drafts_->Commit(d, "").ok());

  d = MakeDraft("acme/m", "v1");
  std::vector<DirEntry> entries;
  ASSERT_TRUE(drafts_->ReadDir(d, &entries).ok());
  std::set<std::string> names;
  for (const DirEntry& e : entries) names.insert(e.name);
  EXPECT_TRUE(names.count("weights.bin") && names.count("config.json"));
  // 100 bytes inside chunk 2, and 10 bytes across the boundary of chunks 5 and 6.
  std::vector<uint8_t> expect = weights;
  const std::vector<uint8_t> p1 = RandomBytes(100, 6), p2 = RandomBytes(10, 7);
  Patch(d, "weights.bin", 2 * kChunk + 1000, p1);
  Patch(d, "weights.bin", 6 * kChunk - 5, p2);
  std::copy(p1.begin(), p1.end(), expect.begin() + 2 * kChunk + 1000);
  std::copy(p2.begin(), p2.end(), expect.begin() + 6 * kChunk - 5);
  EXPECT_EQ(ReadDraft(d, "weights.bin"), expect);
  EXPECT_EQ(ReadDraft(d, "config.json"), config);  // inherited, untouched
  ASSERT_TRUE(drafts_->Commit(d, "").ok());

  const auto files = ReadVersion("acme/m", "v1");
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files.at("weights.bin"), expect);
  EXPECT_EQ(files.at("config.json"), config);
  // Only chunks 2, 5 and 6 were stored again; the rest are the parent's.
  auto m = bucket_->ReadManifest("acme/m", "v1");
  ASSERT_TRUE(m.ok());
  auto rows = bucket_->File(*m, *(*m)->FindFile("weights.bin"));
  ASSERT_TRUE(rows.ok());
  std::vector<size_t> stored;
  for (size_t i = 0; i < (*rows)->chunks.size(); ++i) {
    if ((*rows)->chunks[i].origin == 0) stored.push_back(i);
  }
  EXPECT_EQ(stored, (std::vector<size_t>{2, 5, 6}));
}

TEST_F(DraftsTest, TruncateRenameAndUnlinkArePublishedAsTheyWereLeft) {
  const std::vector<uint8_t> a = RandomBytes(3 * kChunk + 10, 8), b = RandomBytes(1000, 9), c = RandomBytes(2000, 10);
  uint64_t d = MakeDraft("acme/m", "v0");
  WriteFile(d, "a.bin", a);
  WriteFile(d, "b.bin", b);
  WriteFile(d, "c.bin", c);
  ASSERT_TRUE(drafts_->Commit(d, "").ok());

  d = MakeDraft("acme/m", "v1");
  // a.bin (inherited) cut inside its second chunk, then grown by a write past its end.
  NodeAttr attr;
  ASSERT_TRUE(drafts_->Lookup(d, "a.bin", &attr).ok());
  AttrChange cut;
  cut.size = kChunk + 100;
  ASSERT_TRUE(drafts_->SetAttr(attr.ino, cut, nullptr, &attr).ok());
  EXPECT_EQ(static_cast<uint64_t>(attr.st.st_size), kChunk + 100);
  const std::vector<uint8_t> tail = RandomBytes(50, 11);
  Patch(d, "a.bin", kChunk + 200, tail);
  std::vector<uint8_t> a1(a.begin(), a.begin() + kChunk + 100);
  a1.resize(kChunk + 200, 0);  // the hole reads as zeros
  a1.insert(a1.end(), tail.begin(), tail.end());
  // b.bin renamed to sub/b2.bin (a new directory), c.bin removed.
  ASSERT_TRUE(drafts_->Mkdir(d, "sub", 0755, kWho, &attr).ok());
  const uint64_t sub = attr.ino;
  ASSERT_TRUE(drafts_->Rename(d, "b.bin", sub, "b2.bin", 0).ok());
  ASSERT_TRUE(drafts_->Unlink(d, "c.bin").ok());
  EXPECT_EQ(drafts_->Lookup(d, "c.bin", &attr).kind(), ErrorKind::kNotFound);
  // A directory with a file in it is not removed.
  EXPECT_EQ(drafts_->Rmdir(d, "sub").kind(), ErrorKind::kNotEmpty);
  ASSERT_TRUE(drafts_->Commit(d, "").ok());

  const auto files = ReadVersion("acme/m", "v1");
  EXPECT_EQ(files, (std::map<std::string, std::vector<uint8_t>>{{"a.bin", a1}, {"sub/b2.bin", b}}));
}

TEST_F(DraftsTest, CommitWaitsForNoWriterAndRefusesAFileWhoseWriteFailed) {
  const uint64_t d = MakeDraft("acme/m", "v0");
  NodeAttr attr;
  std::unique_ptr<DraftHandle> h;
  ASSERT_TRUE(drafts_->Create(d, "w.bin", 0644, O_WRONLY | O_CREAT | O_TRUNC, kWho, &attr, &h).ok());
  const std::vector<uint8_t> bytes = RandomBytes(kChunk + 3, 12);
  ASSERT_TRUE(drafts_->Write(*h, 0, bytes).ok());
  // Open for writing: Busy (EBUSY), and the draft stays as it is.
  Status st = drafts_->Commit(d, "");
  EXPECT_EQ(st.kind(), ErrorKind::kBusy) << st.ToString();
  drafts_->Release(std::move(h));
  st = drafts_->Commit(d, "");
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(ReadVersion("acme/m", "v0").at("w.bin"), bytes);
}

TEST_F(DraftsTest, ARestartedMountFindsItsDraftAndPublishesIt) {
  const std::vector<uint8_t> a = RandomBytes(4 * kChunk + 1, 13), b = RandomBytes(777, 14);
  uint64_t d = MakeDraft("acme/m", "v0");
  WriteFile(d, "a.bin", a);
  WriteFile(d, "b.json", b);
  // The mount goes away without committing, and a new one loads the draft from its journal.
  Start();
  NodeAttr attr;
  Status st = drafts_->LookupIn("acme", "m@v0", &attr);
  ASSERT_TRUE(st.ok()) << st.ToString();
  d = attr.ino;
  EXPECT_EQ(ReadDraft(d, "a.bin"), a);
  EXPECT_EQ(ReadDraft(d, "b.json"), b);
  st = drafts_->Commit(d, "");
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(ReadVersion("acme/m", "v0"), (std::map<std::string, std::vector<uint8_t>>{{"a.bin", a}, {"b.json", b}}));
}

TEST_F(DraftsTest, ABucketThatFailsTheUploadsLeavesTheDraftToCommitAgain) {
  const std::vector<uint8_t> a = RandomBytes(3 * kChunk, 15);
  const uint64_t d = MakeDraft("acme/m", "v0");
  faults_->Fail(test::FaultStore::On(test::StoreOp::kPut, "packs/"), Status::IOError("injected: the bucket is down"));
  WriteFile(d, "a.bin", a);
  Status st = drafts_->Commit(d, "");
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("injected"), std::string::npos) << st.ToString();
  // Nothing is published, and nothing is lost: the draft still reads its bytes.
  EXPECT_EQ(bucket_->ReadManifest("acme/m", "v0").status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(ReadDraft(d, "a.bin"), a);
  std::string error;
  EXPECT_TRUE(drafts_->GetXattr(d, "user.weightfs.error", &error).ok());
  EXPECT_NE(error.find("injected"), std::string::npos) << error;
  faults_->Clear();
  st = drafts_->Commit(d, "");
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(ReadVersion("acme/m", "v0").at("a.bin"), a);
}

TEST_F(DraftsTest, DiscardForgetsTheDraftAndItsStagingFiles) {
  const uint64_t d = MakeDraft("acme/m", "v0");
  WriteFile(d, "a.bin", RandomBytes(2 * kChunk, 16));
  auto staged_bytes = [&] {
    uint64_t n = 0;
    for (const auto& e : std::filesystem::recursive_directory_iterator(state_)) {
      if (e.is_regular_file() && e.path().parent_path().filename() == "files") n += e.file_size();
    }
    return n;
  };
  EXPECT_GE(staged_bytes(), 2 * kChunk);
  Status st = drafts_->Discard(d);
  ASSERT_TRUE(st.ok()) << st.ToString();
  NodeAttr attr;
  EXPECT_FALSE(drafts_->LookupIn("acme", "m@v0", &attr).ok());
  EXPECT_EQ(staged_bytes(), 0u);
  // And it stays gone after a restart.
  Start();
  EXPECT_FALSE(drafts_->LookupIn("acme", "m@v0", &attr).ok());
}

TEST_F(DraftsTest, TheTreeShowsDraftsBesideVersionsAndRefusesChangesToVersions) {
  const std::vector<uint8_t> a = RandomBytes(2 * kChunk + 9, 17);
  uint64_t d = MakeDraft("acme/m", "v0");
  WriteFile(d, "a.bin", a);
  ASSERT_TRUE(drafts_->Commit(d, "").ok());
  NamespaceOptions no;
  no.writable_dirs = true;
  Namespace names(bucket_.get(), no);
  MountTree tree(&names, drafts_.get(), nullptr, false);
  auto is_draft = [&](const Expected<NodeAttr>& n) { return n.ok() && tree.IsDraft(n->ino); };

  const Expected<NodeAttr> acme = tree.Lookup(Namespace::kRootIno, "acme");
  ASSERT_TRUE(acme.ok()) << acme.status().ToString();
  EXPECT_FALSE(tree.IsDraft(acme->ino));
  // mkdir of the published name is refused; of the next version, a draft.
  EXPECT_EQ(tree.Mkdir(acme->ino, "m@v0", 0755, kWho).status().kind(), ErrorKind::kConflict);
  const Expected<NodeAttr> v1 = tree.Mkdir(acme->ino, "m@v1", 0755, kWho);
  ASSERT_TRUE(is_draft(v1)) << v1.status().ToString();
  // The listing has both; lookups find the draft and the version.
  const Expected<MountTree::Listing> listing = tree.ReadDir(acme->ino);
  ASSERT_TRUE(listing.ok());
  EXPECT_FALSE(listing->immutable);
  std::map<std::string, uint64_t> entries;
  for (const DirEntry& e : listing->entries) entries[e.name] = e.ino;
  ASSERT_TRUE(entries.count("m@v0") && entries.count("m@v1"));
  EXPECT_EQ(entries["m@v1"], v1->ino);
  // Their attributes at once (readdirplus), from both owners.
  std::set<uint64_t> got;
  for (const NodeAttr& na : tree.GetAttrs({entries["m@v0"], entries["m@v1"], acme->ino})) got.insert(na.ino);
  EXPECT_EQ(got, (std::set<uint64_t>{entries["m@v0"], v1->ino, acme->ino}));
  EXPECT_TRUE(is_draft(tree.Lookup(acme->ino, "m@v1")));
  const Expected<NodeAttr> v0 = tree.Lookup(acme->ino, "m@v0");
  ASSERT_TRUE(v0.ok());
  EXPECT_FALSE(tree.IsDraft(v0->ino));
  // A version's listing never changes; the draft inherits its file.
  const Expected<MountTree::Listing> in_v0 = tree.ReadDir(v0->ino);
  ASSERT_TRUE(in_v0.ok());
  EXPECT_TRUE(in_v0->immutable);
  EXPECT_TRUE(is_draft(tree.Lookup(v1->ino, "a.bin")));
  // Changes to the published version are refused; across a version and a draft, EXDEV.
  EXPECT_EQ(tree.Unlink(v0->ino, "a.bin").kind(), ErrorKind::kReadOnly);
  EXPECT_EQ(tree.Mkdir(v0->ino, "sub", 0755, kWho).status().kind(), ErrorKind::kReadOnly);
  EXPECT_EQ(tree.Rmdir(acme->ino, "m@v0").kind(), ErrorKind::kReadOnly);
  EXPECT_EQ(tree.Rename(v1->ino, "a.bin", v0->ino, "b.bin", 0).kind(), ErrorKind::kCrossDevice);
  EXPECT_TRUE(tree.Rename(v1->ino, "a.bin", v1->ino, "b.bin", 0).ok());
  EXPECT_EQ(tree.Lookup(v1->ino, "a.bin").status().kind(), ErrorKind::kNotFound);
  // A new model directory above the versions belongs to the drafts until a version is in it.
  const Expected<NodeAttr> newco = tree.Mkdir(Namespace::kRootIno, "newco", 0755, kWho);
  ASSERT_TRUE(is_draft(newco)) << newco.status().ToString();
  EXPECT_TRUE(is_draft(tree.Lookup(Namespace::kRootIno, "newco")));
  EXPECT_EQ(tree.DirPath(newco->ino), std::optional<std::string>("newco"));
  EXPECT_TRUE(tree.Rmdir(Namespace::kRootIno, "newco").ok());
  EXPECT_EQ(tree.Lookup(Namespace::kRootIno, "newco").status().kind(), ErrorKind::kNotFound);
  // A read-only mount refuses every change.
  MountTree read_only(&names, nullptr, nullptr, false);
  EXPECT_EQ(read_only.Mkdir(acme->ino, "m@v2", 0755, kWho).status().kind(), ErrorKind::kReadOnly);
  EXPECT_FALSE(read_only.IsDraft(v1->ino));
}

// A save (a write-only handle, as cp's) keeps little of its staging file in the page cache
// (hub/store/direct_file.h: StreamedWrites), and the encode reads the file back around the
// cache: what it publishes is still the bytes written, and so is a child encoded against it.
TEST_F(DraftsTest, ASaveLeavesLittleOfItsStagingFileCachedAndPublishesItsBytes) {
  const std::vector<uint8_t> bytes = RandomBytes((48 << 20) + 12345, 21);
  auto save = [&](uint64_t dir, const std::vector<uint8_t>& data) {
    NodeAttr attr;
    std::unique_ptr<DraftHandle> h;
    Status st = drafts_->Create(dir, "w.bin", 0644, O_WRONLY | O_CREAT | O_TRUNC, kWho, &attr, &h);
    ASSERT_TRUE(st.ok()) << st.ToString();
    for (uint64_t off = 0; off < data.size(); off += 1 << 20) {
      const uint64_t n = std::min<uint64_t>(1 << 20, data.size() - off);
      st = drafts_->Write(*h, off, std::span<const uint8_t>(data).subspan(off, n));
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
    drafts_->Release(std::move(h));
  };
  // The page-cache pages of the largest staging file under the state directory (mincore).
  auto cached_staging_bytes = [&]() -> uint64_t {
    std::string largest;
    uint64_t size = 0;
    for (const auto& e : std::filesystem::recursive_directory_iterator(state_)) {
      if (e.is_regular_file() && e.path().parent_path().filename() == "files" && e.file_size() > size) {
        size = e.file_size();
        largest = e.path().string();
      }
    }
    if (largest.empty()) return UINT64_MAX;
    const int fd = ::open(largest.c_str(), O_RDONLY | O_CLOEXEC);
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (map == MAP_FAILED) return UINT64_MAX;
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> in((size + page - 1) / page);
    uint64_t cached = 0;
    if (::mincore(map, size, in.data()) == 0) {
      for (unsigned char c : in) cached += (c & 1) * page;
    }
    ::munmap(map, size);
    return cached;
  };
  const uint64_t d = MakeDraft("acme/m", "v0");
  save(d, bytes);
  struct statfs sfs {};
  ASSERT_EQ(::statfs(state_.c_str(), &sfs), 0);
  if (sfs.f_type != 0x01021994) {  // (tmpfs: its pages are the file, nothing is dropped)
    EXPECT_LE(cached_staging_bytes(), uint64_t{32} << 20) << "of a 48 MiB save";
  }
  Status st = drafts_->Commit(d, "");
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(ReadVersion("acme/m", "v0").at("w.bin"), bytes);
  // The next step, saved the same way: its deltas are against the bytes read around the cache.
  std::vector<uint8_t> next = bytes;
  for (size_t i = 100; i < next.size(); i += 4099) next[i] ^= 0x10;
  const uint64_t d1 = MakeDraft("acme/m", "v1");
  save(d1, next);
  st = drafts_->Commit(d1, "");
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(ReadVersion("acme/m", "v1").at("w.bin"), next);
}

}  // namespace
}  // namespace weightfs
