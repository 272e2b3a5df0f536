// weightfs: one CLI, one subcommand per job. Each subcommand lives in tools/<name>_command.cc.
#include <malloc.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "tools/commands.h"

namespace {

constexpr const char* kUsage = R"(weightfs - a FUSE filesystem for versioned model weights

usage: weightfs <command> [options]

commands:
  init         make a directory, WebDAV server, S3 bucket or Hugging Face Storage
               Bucket (hf://buckets/NS/NAME) a weightfs bucket
  push         encode files as a new version (deltas against its parent) and publish it
  pull         materialize a version into a directory (verified by SHA-256)
  cat          write a file of a version, or a byte range of it, to stdout
  log          list versions: parent, size, stored bytes, ratio, % changed
  verify       re-derive every chunk of a version from the bucket and check every hash
  gc           remove unreferenced packs; retire old versions
  upgrade      convert a bucket to format 2 in place (small heads, binary chunk tables)
  patch        sparse weight patches OLD -> NEW (NAME.idx/NAME.val safetensors) for inference engines
  import       turn a TRL delta-sync bucket's steps into weightfs versions (shows the size difference)
  mount        show every version of a bucket as directories (FUSE); mkdir writes new ones
  unmount      publish a mount's drafts, unmount it and wait for its daemon to exit
  commit       publish a draft (a new version directory written on a mount)
  status       a mount's drafts: files to encode and upload, errors
  discard      abandon a draft (nothing of it is published)
  set-parent   choose the version a draft is a delta of (before writing into it)
  wait         block until a version is published (by any node) and visible in a mount
  gen          generate a realistic checkpoint sequence (safetensors shards) for tests and demos
  bench codec  measure the delta codec against zstd, zstd --patch-from and the entropy floor
  bench scale  metadata costs of a simulated huge model with many versions (real mount, real format)

Run 'weightfs <command> --help' for the options of one command.
)";

}  // namespace

int main(int argc, char** argv) {
  // Chunk buffers are a few MiB each and come and go at a high rate. Above glibc's mmap
  // threshold every one of them would be a fresh mmap, page-faulted and zeroed by the kernel
  // (measured as the largest cost of serving cached chunks). Serving them from the heap lets
  // freed buffers be reused; the trim threshold keeps that memory from bouncing back to the OS.
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  // Run as the helper of mount(8) or umount(8) (symbolic links to this binary).
  const char* slash = std::strrchr(argv[0], '/');
  const std::string self = slash != nullptr ? slash + 1 : argv[0];
  if (self == "mount.fuse.weightfs") return weightfs::cli::MountHelperMain(argc, argv);
  if (self == "umount.fuse.weightfs") return weightfs::cli::UmountHelperMain(argc, argv);
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string cmd = argv[1];
  if (cmd == "--version") {
    std::puts("weightfs 0.1.0");
    return 0;
  }
  if (int rc = weightfs::cli::BucketMain(cmd, argc - 1, argv + 1); rc >= 0) return rc;
  if (cmd == "patch") return weightfs::cli::PatchMain(argc - 1, argv + 1);
  if (cmd == "import") return weightfs::cli::ImportMain(argc - 1, argv + 1);
  if (cmd == "gen") return weightfs::cli::GenMain(argc - 1, argv + 1);
  if (cmd == "mount") return weightfs::cli::MountMain(argc - 1, argv + 1);
  if (cmd == "unmount" || cmd == "umount") return weightfs::cli::UnmountMain(argc - 1, argv + 1);
  if (cmd == "wait") return weightfs::cli::WaitMain(argc - 1, argv + 1);
  if (cmd == "commit") return weightfs::cli::CommitMain(argc - 1, argv + 1);
  if (cmd == "status") return weightfs::cli::StatusMain(argc - 1, argv + 1);
  if (cmd == "discard") return weightfs::cli::DiscardMain(argc - 1, argv + 1);
  if (cmd == "set-parent") return weightfs::cli::SetParentMain(argc - 1, argv + 1);
  if (cmd == "bench") {
    if (argc >= 3 && std::string(argv[2]) == "codec") {
      return weightfs::cli::BenchCodecMain(argc - 2, argv + 2);
    }
    if (argc >= 3 && std::string(argv[2]) == "scale") {
      return weightfs::cli::BenchScaleMain(argc - 2, argv + 2);
    }
    std::fprintf(stderr, "weightfs: usage: weightfs bench codec OLD NEW | --generate, or weightfs bench scale (see --help)\n");
    return 2;
  }
  std::fprintf(stderr, "weightfs: unknown command '%s'\n\n%s", cmd.c_str(), kUsage);
  return 2;
}
