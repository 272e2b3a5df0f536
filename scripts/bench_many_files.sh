#!/usr/bin/env bash
# Many small files in a draft (issue 26 item 5): the same create loop (open O_CREAT|O_TRUNC, one
# write, close; python3's os calls) into a draft of a mount and into a directory on the local
# disk of the cache directory, then `weightfs commit`, and what the draft cost:
#
#   create rate       files/s into the draft vs local disk (and the rate of each tenth, to show
#                     that it does not fall as the draft grows)
#   commit            seconds from `weightfs commit` to published
#   journal           bytes of the draft's journal (journal.json + journal.log) before commit
#   packs             packs in the bucket after the commit
#   read back         every file read through a fresh mount (empty cache) and compared by hash
#
# Environment: FILES (100000), BYTES (4096 per file), WORK (/tmp/wfs-bench-many), KEEP=1
# keeps WORK, WEIGHTFS=path uses a prebuilt binary. Needs root or FUSE access.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
files=${FILES:-100000}
bytes=${BYTES:-4096}
work=${WORK:-/tmp/wfs-bench-many}

"$root/scripts/setup.sh" >/dev/null
if [[ -n "${WEIGHTFS:-}" ]]; then
  wfs=$WEIGHTFS
else
  TARGET=weightfs "$root/scripts/build.sh" >/dev/null
  wfs="$root/build/tools/weightfs"
fi

now() { date +%s.%N; }
secs() { awk "BEGIN { printf \"%.2f\", $2 - $1 }"; }

bucket="$work/bucket"
mnt="$work/mnt"
fresh="$work/fresh"
mounted() { awk -v m="$1" '$5 == m { found = 1 } END { exit !found }' /proc/self/mountinfo; }
cleanup() {
  for m in "$mnt" "$fresh"; do
    if mounted "$m"; then "$wfs" unmount --keep-drafts "$m" >/dev/null 2>&1 || umount -l "$m" || true; fi
  done
  [[ "${KEEP:-0}" == 1 ]] || rm -rf "$work"
}
trap cleanup EXIT
rm -rf "$work"
mkdir -p "$work" "$mnt" "$fresh"

# The loop: FILES files of BYTES bytes (distinct contents) into DIR, 8 subdirectories; prints
# the rate of each tenth and of the whole, and writes the files' SHA-256 to SUMS.
cat > "$work/create.py" <<'EOF'
import hashlib, os, sys, time
d, n, size, sums = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
for k in range(8):
    os.makedirs(os.path.join(d, 'd%d' % k), exist_ok=True)
base = os.urandom(size + 8)
names, digests, tenths = [], [], []
t0 = t = time.time()
for i in range(n):
    b = i.to_bytes(8, 'little') + base[8:size] if size >= 8 else base[:size]
    name = 'd%d/f%07d.bin' % (i % 8, i)
    fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b)
    os.close(fd)
    names.append(name)
    if (i + 1) % max(1, n // 10) == 0:
        now = time.time()
        tenths.append('%.0f' % (max(1, n // 10) / (now - t)))
        t = now
dt = time.time() - t0
with open(sums, 'w') as out:
    for i, name in enumerate(names):
        b = i.to_bytes(8, 'little') + base[8:size] if size >= 8 else base[:size]
        out.write('%s  %s\n' % (hashlib.sha256(b).hexdigest(), name))
print('%.0f %.2f %s' % (n / dt, dt, ' '.join(tenths)))
EOF

"$wfs" init "$bucket" >/dev/null
"$wfs" mount "$bucket" "$mnt" --cache-dir "$work/cache" --log-file "$work/mount.log" >/dev/null
mkdir -p "$mnt/bench"
mkdir "$mnt/bench/many@v1"

echo "== $files files of $bytes bytes"
read -r local_rate local_s local_tenths < <(python3 "$work/create.py" "$work/cache/local" "$files" "$bytes" "$work/local.sha256")
sync -f "$work/cache/local"
rm -rf "$work/cache/local"
read -r draft_rate draft_s draft_tenths < <(python3 "$work/create.py" "$mnt/bench/many@v1" "$files" "$bytes" "$work/draft.sha256")
journal=$(find "$work/cache/drafts" \( -name journal.json -o -name journal.log \) -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')

t0=$(now); "$wfs" commit "$mnt/bench/many@v1" >/dev/null; t1=$(now)
commit_s=$(secs "$t0" "$t1")
packs=$(find "$bucket/packs" -type f | wc -l)
pack_bytes=$(du -sb "$bucket/packs" | cut -f1)
"$wfs" unmount "$mnt" >/dev/null

# Every file through a fresh mount with an empty cache.
"$wfs" mount "$bucket" "$fresh" --cache-dir "$work/cache-fresh" --log-file "$work/fresh.log" >/dev/null
t0=$(now)
(cd "$fresh/bench/many@v1" && sha256sum --quiet -c "$work/draft.sha256")
t1=$(now)
read_s=$(secs "$t0" "$t1")
"$wfs" unmount "$fresh" >/dev/null

echo
printf 'create, local disk     %8s files/s  (%s s; per tenth: %s)\n' "$local_rate" "$local_s" "$local_tenths"
printf 'create, draft          %8s files/s  (%s s; per tenth: %s)\n' "$draft_rate" "$draft_s" "$draft_tenths"
printf 'draft / local          %8s\n' "$(awk "BEGIN { printf \"%.2f\", $draft_rate / $local_rate }")"
printf 'commit                 %8s s\n' "$commit_s"
printf 'journal before commit  %8s bytes (%s per file)\n' "$journal" "$((journal / files))"
printf 'packs                  %8s (%s bytes)\n' "$packs" "$pack_bytes"
printf 'read back (fresh mount)%8s s, every file bit-exact\n' "$read_s"
