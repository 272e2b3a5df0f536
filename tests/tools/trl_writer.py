#!/usr/bin/python3
"""Writes a TRL "delta weight sync" bucket layout from a `weightfs gen` checkpoint sequence.

Faithful to TRL's writer (huggingface/trl trl/experimental/async_grpo: weight_transfer.py
upload_weights, delta_engine.encode_patch, weight_diff.PatchMetadata; notes in
hub/trl/trl_bucket.h), with torch replaced by numpy and safetensors written by hand:

  SRC/v000, SRC/v001, ...   (weightfs gen: sharded bf16 safetensors per version)
  ->
  OUT/anchors/step_000001.safetensors   v000, every parameter (the initial sync)
  OUT/deltas/step_000002.safetensors    v001 vs v000: per changed parameter P
                                          P.idx  gap_delta: gap[k] = idx[k] - idx[k-1] - 1 with
                                                 idx[-1] = -1, U16 when every gap <= 0xFFFF else
                                                 U32, chosen per parameter (--encoding raw: I32)
                                          P.val  the new values (BF16, absolute)
  ...
  step N is an anchor when N == 1 or N % --anchor-every == 0 (TRL's rule); a periodic anchor
  holds every parameter, or with --anchor-omit-unchanged only those that changed since the
  previous step (what TRL V2's streaming iterator does when a change detector is active).
  A step where nothing changed gets no file (TRL uploads nothing).

Every file's __metadata__ is TRL's PatchMetadata, flat str -> str: format=sparse_weight_patch,
version=1, sparse=True|False, model_version=N, num_changed_params, total_changed_elements,
total_elements, sparsity (Python float repr), encoding (V2) or changed_params (JSON list, --v1).
--v1 writes TRL's older key names: P.indices (I32, absolute) and P.values.

Parameters: every tensor of every *.safetensors file of a version, under its tensor name
(shards flattened). Indices are flat, row-major, local to the parameter.

--freeze REGEX makes the matching parameters frozen (the trainer does not update them): they
keep their v000 values at every step, so deltas never touch them and --anchor-omit-unchanged
anchors leave them out.

usage: trl_writer.py SRC OUT [--anchor-every K] [--anchor-omit-unchanged] [--encoding gap_delta|raw]
                      [--v1] [--versions N] [--freeze REGEX]
Prints one line per step written: "step N anchor|delta FILE BYTES".
"""
import argparse
import json
import os
import re
import struct
import sys

import numpy as np

DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "I32": np.int32,
          "U16": np.uint16, "U32": np.uint32, "U8": np.uint8}


def read_safetensors(path):
    """{name: (dtype_str, shape, raw numpy array of the bit patterns)} and the metadata."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    base = 8 + n
    for name, t in header.items():
        b, e = t["data_offsets"]
        arr = np.frombuffer(data, dtype=DTYPES[t["dtype"]], count=(e - b) // np.dtype(DTYPES[t["dtype"]]).itemsize,
                            offset=base + b)
        out[name] = (t["dtype"], list(t["shape"]), arr)
    return out, meta


def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, dtype_str, shape, numpy array); written in the given order."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    blobs = []
    for name, dtype, shape, arr in tensors:
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * ((8 - len(js) % 8) % 8)  # the reference writer pads the header to 8 bytes
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(js)))
        f.write(js)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)


def load_version(directory):
    params = {}
    for fn in sorted(os.listdir(directory)):
        if not fn.endswith(".safetensors"):
            continue
        tensors, _ = read_safetensors(os.path.join(directory, fn))
        for name, (dtype, shape, arr) in tensors.items():
            if dtype != "BF16":
                sys.exit("trl_writer: %s/%s tensor %s is %s; TRL syncs bf16" % (directory, fn, name, dtype))
            if name in params:
                sys.exit("trl_writer: tensor %s appears in two shards" % name)
            params[name] = (shape, arr)
    return params


def metadata(step, sparse, num_params, changed_elements, total_elements, encoding, v1, names):
    md = {
        "format": "sparse_weight_patch",
        "version": "1",
        "sparse": str(bool(sparse)),
        "model_version": str(step),
        "num_changed_params": str(num_params),
        "total_changed_elements": str(changed_elements),
        "total_elements": str(total_elements),
        "sparsity": repr(1.0 - changed_elements / total_elements if total_elements else 0.0),
    }
    if v1:
        md["changed_params"] = json.dumps(names)
    else:
        md["encoding"] = encoding
    return md


def encode_indices(idx, encoding):
    """TRL delta_codec: (dtype string, array)."""
    if encoding == "raw":
        return "I32", idx.astype(np.int32)
    if idx.size == 0:
        return "U16", np.zeros(0, dtype=np.uint16)
    gaps = np.diff(idx.astype(np.int64), prepend=-1) - 1
    if gaps.max() <= 0xFFFF:
        return "U16", gaps.astype(np.uint16)
    return "U32", gaps.astype(np.uint32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--anchor-every", type=int, default=10)
    ap.add_argument("--anchor-omit-unchanged", action="store_true")
    ap.add_argument("--encoding", choices=["gap_delta", "raw"], default="gap_delta")
    ap.add_argument("--v1", action="store_true", help="TRL's older .indices/.values keys")
    ap.add_argument("--versions", type=int, default=0, help="only the first N+1 versions (0: all)")
    ap.add_argument("--freeze", default="", help="parameters (regex) that keep their v000 values")
    a = ap.parse_args()

    versions = sorted(d for d in os.listdir(a.src) if d.startswith("v") and d[1:].isdigit())
    if a.versions:
        versions = versions[:a.versions + 1]
    os.makedirs(os.path.join(a.out, "anchors"), exist_ok=True)
    os.makedirs(os.path.join(a.out, "deltas"), exist_ok=True)
    prev = None
    for k, vdir in enumerate(versions):
        step = k + 1  # step 1 is the initial sync (the base, before any optimizer step)
        cur = load_version(os.path.join(a.src, vdir))
        if a.freeze and prev is not None:
            for n in cur:
                if re.search(a.freeze, n) and n in first:
                    cur[n] = first[n]
        if prev is None:
            first = cur
        is_anchor = step == 1 or step % a.anchor_every == 0
        total = sum(arr.size for _, arr in cur.values())
        if is_anchor:
            names = sorted(cur)
            if prev is not None and a.anchor_omit_unchanged:
                names = [n for n in names if n not in prev or not np.array_equal(prev[n][1], cur[n][1])]
            tensors = [(n, "BF16", cur[n][0], cur[n][1]) for n in names]
            elems = sum(cur[n][1].size for n in names)
            md = metadata(step, False, len(names), elems, elems, a.encoding, a.v1, names)
            key = "anchors/step_%06d.safetensors" % step
        else:
            tensors = []
            names = []
            changed_total = 0
            for n in sorted(cur):
                shape, arr = cur[n]
                old = prev[n][1]
                changed = np.flatnonzero(arr != old)  # bit patterns: exact
                if changed.size == 0:
                    continue
                names.append(n)
                changed_total += changed.size
                if a.v1:
                    tensors.append((n + ".indices", "I32", [changed.size], changed.astype(np.int32)))
                    tensors.append((n + ".values", "BF16", [changed.size], arr[changed]))
                else:
                    dt, enc = encode_indices(changed, a.encoding)
                    tensors.append((n + ".idx", dt, [changed.size], enc))
                    tensors.append((n + ".val", "BF16", [changed.size], arr[changed]))
            prev = cur
            if not names:
                continue  # nothing changed: TRL uploads nothing for this step
            elems = sum(cur[n][1].size for n in names)
            md = metadata(step, True, len(names), changed_total, elems, a.encoding, a.v1, names)
            key = "deltas/step_%06d.safetensors" % step
        prev = cur
        path = os.path.join(a.out, key)
        write_safetensors(path, tensors, md)
        print("step %d %s %s %d" % (step, "anchor" if is_anchor else "delta", key, os.path.getsize(path)))


if __name__ == "__main__":
    main()
