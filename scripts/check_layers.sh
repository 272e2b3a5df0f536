#!/usr/bin/env bash
# Checks that every #include "..." points down the layers (or within its own folder):
#   core <- hub/store <- hub/engine <- {fs, hub/hf, hub/trl} ; hub/hf, hub/trl <- hub ; {fs, hub} <- tools
# fs never sees hub/hf, hub/trl or hub's entry point; hf and trl never see each other. Folders under core/
# (core/codec/sparse) are part of core, both as includer and as included. Prints each include
# that points the wrong way and exits 1; ctest runs it (LayerArrows). Run from anywhere.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
layer() {  # the layer folder $1 belongs to: itself, or core for a folder under core/
  case $1 in
    core/*) echo "core" ;;
    *) echo "$1" ;;
  esac
}
allowed() {  # the folders a file in folder $1 may include from
  case $1 in
    core) echo "core" ;;
    hub/store) echo "core hub/store" ;;
    hub/engine) echo "core hub/store hub/engine" ;;
    fs) echo "core hub/store hub/engine fs fs/drafts" ;;
    # The drafts are the write path inside the FUSE layer (one library): they use its read path
    # (chunk_reader.h) and node types (namespace.h); the server calls them.
    fs/drafts) echo "core hub/store hub/engine fs fs/drafts" ;;
    hub/hf) echo "core hub/store hub/engine hub/hf" ;;
    hub/trl) echo "core hub/store hub/engine hub/trl" ;;
    hub) echo "core hub/store hub/engine hub hub/hf hub/trl" ;;
    tools) echo "core hub/store hub/engine fs fs/drafts hub hub/hf hub/trl tools" ;;
    *) return 1 ;;
  esac
}
bad=0
checked=0
while IFS= read -r file; do
  dir=$(layer "$(dirname "$file")")
  ok=$(allowed "$dir") || { echo "check_layers: $file is in no known layer (add its folder to scripts/check_layers.sh)"; bad=1; continue; }
  checked=$((checked + 1))
  while IFS= read -r line; do
    inc=${line#*\"}
    inc=${inc%%\"*}
    [[ $inc == */* ]] || continue  # a system or same-directory include
    target=$(layer "$(dirname "$inc")")
    if ! [[ " $ok " == *" $target "* ]]; then
      echo "check_layers: $file includes $inc ($dir may include only: $ok)"
      bad=1
    fi
  done < <(grep -E '^#include "' "$file" || true)
done < <(find core hub fs tools -name '*.h' -o -name '*.cc' | sort)
if ((bad)); then exit 1; fi
echo "check_layers: $checked files, every include points down"
