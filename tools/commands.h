// Entry points of the subcommands. Each takes argv with argv[0] = the subcommand's name and
// returns the process exit code (0 ok, 1 failure, 2 usage error).
#pragma once

namespace weightfs::cli {

int GenMain(int argc, char** argv);         // weightfs gen
int BenchCodecMain(int argc, char** argv);  // weightfs bench codec

}  // namespace weightfs::cli
