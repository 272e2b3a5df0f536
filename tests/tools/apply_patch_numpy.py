#!/usr/bin/python3
"""Applies a `weightfs patch` file with numpy, as an inference engine does (vLLM's
SparseWeightPatch: flat = tensor.reshape(-1); flat[idx] = val), and checks the result against
NEW's file bit for bit. The independent, standard-library reader is apply_patch.py; this one is
what an engine's code looks like.

usage: apply_patch_numpy.py OLD.safetensors PATCH.safetensors NEW.safetensors
"""
import json
import struct
import sys

import numpy as np

# Bit patterns of each width: applying a patch moves bits, it never does arithmetic.
BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "I16": 2, "I32": 4, "I64": 8,
         "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    body = memoryview(data)[8 + n:]
    tensors = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        tensors[name] = (t["dtype"], t["shape"], np.frombuffer(body[begin:end], dtype=BITS[SIZES[t["dtype"]]]))
    return meta, tensors


def main():
    _, old = load(sys.argv[1])
    meta, patch = load(sys.argv[2])
    _, new = load(sys.argv[3])
    assert meta.get("sparse_weight_patch") == "1", meta
    weights = {name: (d, s, a.copy()) for name, (d, s, a) in old.items()}
    for name in json.loads(meta.get("removed", "[]")):
        del weights[name]
    for name in json.loads(meta.get("dense", "[]")):
        weights[name] = patch[name]
    sparse = [n[:-4] for n in patch if n.endswith(".idx") and n[:-4] + ".val" in patch]
    for name in sparse:
        idx = patch[name + ".idx"]
        idx = idx[2].view(np.int32 if idx[0] == "I32" else np.int64)
        flat = weights[name][2]
        flat[idx] = patch[name + ".val"][2]
    assert set(weights) == set(new), (sorted(set(weights) ^ set(new)))
    for name, (dtype, shape, bits) in new.items():
        got = weights[name]
        assert got[0] == dtype and list(got[1]) == list(shape), name
        assert np.array_equal(got[2], bits), "tensor %s differs" % name
    print("ok: %d tensors equal NEW's with numpy (%d sparse)" % (len(new), len(sparse)))


if __name__ == "__main__":
    main()
