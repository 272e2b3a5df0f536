// Entry points of the subcommands. Each takes argv with argv[0] = the subcommand's name and
// returns the process exit code (0 ok, 1 failure, 2 usage error).
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace weightfs::cli {

int GenMain(int argc, char** argv);         // weightfs gen
int BenchCodecMain(int argc, char** argv);  // weightfs bench codec
int BenchScaleMain(int argc, char** argv);  // weightfs bench scale
// weightfs mount and unmount; `quiet`: nothing on stdout when they succeed (as mount helpers).
int MountMain(int argc, char** argv, bool quiet = false);
int UnmountMain(int argc, char** argv, bool quiet = false);
// mount.fuse.weightfs and umount.fuse.weightfs, the helpers of mount(8) and umount(8)
// (argv[0]: the helper's name; tools/mount_helper.cc).
int MountHelperMain(int argc, char** argv);
int UmountHelperMain(int argc, char** argv);
int WaitMain(int argc, char** argv);        // weightfs wait
int CommitMain(int argc, char** argv);      // weightfs commit
int StatusMain(int argc, char** argv);      // weightfs status
int DiscardMain(int argc, char** argv);     // weightfs discard
int SetParentMain(int argc, char** argv);   // weightfs set-parent
int ImportMain(int argc, char** argv);      // weightfs import (a TRL delta-sync bucket)
int PatchMain(int argc, char** argv);       // weightfs patch (hub/engine/weight_patcher.h)
// Publishes every draft of the mount at `mountpoint` (progress on a TTY, errors on stderr);
// 0 or the errno of the failure.
int PublishDrafts(const std::string& mountpoint);
// Prints versions staged in parts (hub/engine/staged_version.h's StagedJson): parts in and expected,
// and which (host, id, bytes, since when).
void PrintStaged(const nlohmann::json& staged);
// The drafts report of the mount at `root` (its user.weightfs.status), or nullopt if it does
// not answer.
std::optional<nlohmann::json> MountStatus(const std::string& root);
// init, push, pull, cat, log, verify, gc; returns -1 if `command` is none of them.
int BucketMain(const std::string& command, int argc, char** argv);

}  // namespace weightfs::cli
