#include "hub/engine/mapped_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <utility>

#include <spdlog/spdlog.h>

namespace weightfs {
namespace {

// The registry of guarded maps: fixed slots the signal handler reads without locks. A slot is
// free while `end` is 0; Claim takes one with a compare-and-swap on `end` (then sets `start`),
// Release clears `start` first, then `end`. The handler only trusts a slot whose `start` and
// `end` it read as a non-empty range containing the fault.
struct Slot {
  std::atomic<uintptr_t> start{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<uint32_t> faults{0};
};
constexpr int kSlots = 4096;
Slot g_slots[kSlots];
std::atomic<uint64_t> g_total_faults{0};
uintptr_t g_page = 4096;  // set before the handler is installed (sysconf is not signal-safe)
struct sigaction g_previous {};
std::once_flag g_installed;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  const uintptr_t page = g_page;
  for (Slot& s : g_slots) {
    const uintptr_t start = s.start.load(std::memory_order_acquire);
    const uintptr_t end = s.end.load(std::memory_order_acquire);
    if (start == 0 || addr < start || addr >= end) continue;
    // Everything from the faulting page to the end of the map is past the file's end now.
    const uintptr_t from = addr & ~(page - 1);
    void* p = ::mmap(reinterpret_cast<void*>(from), end - from, PROT_READ,
                     MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) {
      s.faults.fetch_add(1, std::memory_order_relaxed);
      g_total_faults.fetch_add(1, std::memory_order_relaxed);
      return;  // the read is retried and finds a zero page
    }
    break;
  }
  // Not one of ours (or the replacement failed): whoever handled SIGBUS before us.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) {
      g_previous.sa_sigaction(sig, info, context);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // Default action: restore it; returning re-runs the access, which faults again and ends the
  // process the way it would have ended without us.
  ::signal(SIGBUS, SIG_DFL);
}

void InstallHandler() {
  std::call_once(g_installed, [] {
    g_page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    struct sigaction sa {};
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    ::sigemptyset(&sa.sa_mask);
    if (::sigaction(SIGBUS, &sa, &g_previous) != 0) {
      spdlog::warn("cannot install the SIGBUS handler: {} (a file truncated while it is mapped would end the "
                   "process)", std::strerror(errno));
    }
  });
}

int Claim(const void* data, uint64_t size) {
  InstallHandler();
  for (int i = 0; i < kSlots; ++i) {
    uintptr_t expected = 0;
    const uintptr_t end = reinterpret_cast<uintptr_t>(data) + size;
    if (g_slots[i].end.compare_exchange_strong(expected, end, std::memory_order_acq_rel)) {
      g_slots[i].faults.store(0, std::memory_order_relaxed);
      g_slots[i].start.store(reinterpret_cast<uintptr_t>(data), std::memory_order_release);
      return i;
    }
  }
  static std::once_flag logged;
  std::call_once(logged, [] { spdlog::warn("more than {} files mapped at once: some are not guarded", kSlots); });
  return -1;
}

void Unclaim(int slot) {
  if (slot < 0) return;
  g_slots[slot].start.store(0, std::memory_order_release);
  g_slots[slot].end.store(0, std::memory_order_release);
}

}  // namespace

Expected<MappedFile> MappedFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return StatusOfErrno(errno, "cannot open " + path);
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + " is not a regular file");
  }
  MappedFile f;
  f.size_ = static_cast<uint64_t>(st.st_size);
  if (f.size_ > 0) {
    void* p = ::mmap(nullptr, f.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      return StatusOfErrno(err, "cannot map " + path);
    }
    f.data_ = static_cast<const uint8_t*>(p);
    f.slot_ = Claim(p, f.size_);
    ::madvise(p, f.size_, MADV_WILLNEED);
  }
  ::close(fd);
  return f;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      slot_(std::exchange(other.slot_, -1)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    slot_ = std::exchange(other.slot_, -1);
  }
  return *this;
}

MappedFile::~MappedFile() { Release(); }

void MappedFile::Release() {
  // Unregistered before it is unmapped: the handler must never map over a range that is
  // someone else's by then.
  Unclaim(std::exchange(slot_, -1));
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

bool MappedFile::faulted() const {
  return slot_ >= 0 && g_slots[slot_].faults.load(std::memory_order_acquire) != 0;
}

uint64_t MappedFile::total_faults() { return g_total_faults.load(); }

void MappedFile::Prefault() const {
  volatile uint8_t sink = 0;
  for (uint64_t off = 0; off < size_; off += 4096) sink = sink + data_[off];
}

}  // namespace weightfs
