"""check_dequant.py DUMP GGUF: client/engine/qtype.c's dequantize against the gguf package's.

For one tensor of each type in the SmolLM2 file (token_embd.weight q8_0, Q4_1 matrices of the first
and last block, F32 norms), reads the tensor's type, element count and absolute data offset with
gguf.GGUFReader, runs DUMP (tests/engine/dequant-dump) on them, and compares its float32 output
with gguf.quants.dequantize bit for bit (as uint32: -0.0 and NaN payloads count). Both implement
ggml's dequantize_row_* with the same f32 operations in the same order, so any difference is a bug.

Exits 0 when every tensor matches, 1 naming the first differing element otherwise.
"""

import subprocess
import sys

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

TENSORS = {
    "token_embd.weight": GGMLQuantizationType.Q8_0,
    "blk.0.attn_q.weight": GGMLQuantizationType.Q4_1,
    "blk.0.ffn_down.weight": GGMLQuantizationType.Q4_1,
    "blk.29.ffn_gate.weight": GGMLQuantizationType.Q4_1,
    "blk.0.attn_norm.weight": GGMLQuantizationType.F32,
    "output_norm.weight": GGMLQuantizationType.F32,
}


def check(dump: str, path: str, reader: GGUFReader, name: str, want_type: GGMLQuantizationType) -> bool:
    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        print(f"{name}: not in {path}")
        return False
    if t.tensor_type != want_type:
        print(f"{name}: type {t.tensor_type.name}, expected {want_type.name}")
        return False
    with open(path, "rb") as f:
        f.seek(t.data_offset)
        if f.read(t.n_bytes) != t.data.tobytes():
            print(f"{name}: the bytes at offset {t.data_offset} are not the reader's tensor data")
            return False
    want = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(-1)
    out = subprocess.run(
        [dump, path, str(t.data_offset), str(int(t.tensor_type)), str(t.n_elements)],
        check=True, stdout=subprocess.PIPE).stdout
    got = np.frombuffer(out, dtype=np.float32)
    if got.size != want.size:
        print(f"{name}: {got.size} values from {dump}, {want.size} from gguf")
        return False
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    if diff.size:
        i = diff[0]
        print(f"{name}: {diff.size} of {want.size} values differ; first at {i}: {got[i]!r}, gguf {want[i]!r}")
        return False
    print(f"{name}: {t.tensor_type.name}, {want.size} values, identical")
    return True


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: check_dequant.py DUMP GGUF", file=sys.stderr)
        return 2
    dump, path = sys.argv[1], sys.argv[2]
    reader = GGUFReader(path)
    ok = all([check(dump, path, reader, name, want) for name, want in TENSORS.items()])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
