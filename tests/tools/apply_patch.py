#!/usr/bin/python3
"""Applies a `weightfs patch` file to OLD's weights as an inference engine does, and checks the
result against NEW's weights bit for bit.

usage: apply_patch.py OLD.safetensors PATCH.safetensors NEW.safetensors

Applying (hub/engine/weight_patcher.h has the format): start from OLD's tensors; drop those the metadata's
"removed" lists; replace those "dense" lists with the patch's tensor of that name; for every
NAME.idx / NAME.val pair, flat = NAME.reshape(-1); flat[idx] = val. The indices must be strictly
ascending, in range, of the dtype the format says (I32, or I64 above 2^31 elements), and every
listed element must change. Then every tensor (name, dtype, shape, SHA-256 of its bytes) must
equal NEW's.

Written with the standard library only (the scatter is a loop over the changed elements), so
that it runs where numpy is not installed; with numpy the same scatter is
np.frombuffer(...).copy()[idx] = val on the tensors' bit patterns.

Prints "ok: T tensors equal NEW's (S sparse, D dense, R removed, C elements changed)"; exits 1
with the first difference otherwise.
"""
import hashlib
import json
import struct
import sys

SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "I16": 2, "I32": 4, "I64": 8,
         "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def read(path):
    """({name: (dtype, shape, bytearray)}, metadata)"""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, t in header.items():
        b, e = t["data_offsets"]
        out[name] = (t["dtype"], list(t["shape"]), bytearray(data[base + b:base + e]))
    return out, meta


def fail(msg):
    print("apply_patch: " + msg)
    sys.exit(1)


def elements(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    old, _ = read(sys.argv[1])
    patch, meta = read(sys.argv[2])
    new, _ = read(sys.argv[3])
    if meta.get("sparse_weight_patch") != "1":
        fail("not a sparse weight patch of format 1: %r" % meta)
    removed = json.loads(meta["removed"])
    dense = json.loads(meta["dense"])
    for name in removed:
        if name not in old:
            fail("removes %s, which OLD lacks" % name)
        del old[name]
    for name in dense:
        if name not in patch:
            fail("lists %s as dense but does not hold it" % name)
        old[name] = patch[name]
    sparse = 0
    changed = 0
    for key, (idx_dtype, idx_shape, idx_bytes) in patch.items():
        if not key.endswith(".idx"):
            if not key.endswith(".val") and key not in dense:
                fail("tensor %s is neither a pair nor dense" % key)
            continue
        name = key[:-4]
        if name not in old:
            fail("patches %s, which OLD lacks" % name)
        dtype, shape, buf = old[name]
        val_dtype, val_shape, val = patch[name + ".val"]
        numel = elements(shape)
        want_idx = "I64" if numel > 2 ** 31 else "I32"
        if idx_dtype != want_idx or val_dtype != dtype or idx_shape != val_shape or len(idx_shape) != 1:
            fail("%s: idx %s %s, val %s %s for a %s tensor of %d elements" %
                 (name, idx_dtype, idx_shape, val_dtype, val_shape, dtype, numel))
        w = SIZES[dtype]
        count = idx_shape[0]
        fmt = "<%d%s" % (count, "q" if idx_dtype == "I64" else "i")
        positions = struct.unpack(fmt, bytes(idx_bytes))
        prev = -1
        for k, i in enumerate(positions):
            if i <= prev or i >= numel:
                fail("%s: index %d at %d is out of order or range" % (name, i, k))
            prev = i
            new_value = val[k * w:(k + 1) * w]
            if buf[i * w:(i + 1) * w] == new_value:
                fail("%s: element %d is listed but does not change" % (name, i))
            buf[i * w:(i + 1) * w] = new_value
        sparse += 1
        changed += count
    if sorted(old) != sorted(new):
        fail("tensors %s after applying, NEW has %s" % (sorted(old), sorted(new)))
    for name, (dtype, shape, buf) in new.items():
        got = old[name]
        if got[0] != dtype or got[1] != shape:
            fail("%s: %s %s after applying, NEW has %s %s" % (name, got[0], got[1], dtype, shape))
        if hashlib.sha256(got[2]).hexdigest() != hashlib.sha256(buf).hexdigest():
            fail("%s: bytes differ from NEW's after applying" % name)
    print("ok: %d tensors equal NEW's (%d sparse, %d dense, %d removed, %d elements changed)" %
          (len(new), sparse, len(dense), len(removed), changed))


if __name__ == "__main__":
    main()
