"""check_dequant.py DUMP GGUF [KQUANT_GGUF]: client/engine/qtype.c's dequantize against the gguf
package's.

For one tensor of each type in the SmolLM2 file (token_embd.weight q8_0, Q4_1 matrices of the first
and last block, F32 norms), reads the tensor's type, element count and absolute data offset with
gguf.GGUFReader, runs DUMP (tests/engine/dequant-dump) on them, and compares its float32 output
with gguf.quants.dequantize bit for bit (as uint32: -0.0 and NaN payloads count). Both implement
ggml's dequantize_row_* with the same f32 operations in the same order, so any difference is a bug.

The SmolLM2 file has no K-quant tensors, so with KQUANT_GGUF (a path under the build folder) the
script also writes a small GGUF there with gguf.GGUFWriter: a q4_K and a q6_K tensor of random
blocks (every bit random but the f16 scales, which are finite halves of magnitude 2^-10 to 2^2:
gguf 0.17.1 has no quantize for these types), generated from a fixed seed at test time, and checks
them the same way.

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


# name: (type, rows, columns, bytes per block of 256, offsets of the f16 scales in a block)
KQUANTS = {
    "test.q4_K": (GGMLQuantizationType.Q4_K, 8, 1024, 144, (0, 2)),
    "test.q6_K": (GGMLQuantizationType.Q6_K, 8, 1024, 210, (208,)),
}


def write_kquants(path: str) -> None:
    """The K-quant test file: random blocks with valid f16 scales (see the module's comment)."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(17)
    w = GGUFWriter(path, "llama")
    for name, (qtype, rows, cols, block_bytes, scale_offsets) in KQUANTS.items():
        blocks = rng.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
        for off in scale_offsets:
            mag = rng.uniform(2.0**-10, 4.0, size=blocks.shape[0]) * rng.choice([-1.0, 1.0], size=blocks.shape[0])
            blocks[:, off:off + 2] = mag.astype(np.float16).view(np.uint8).reshape(-1, 2)
        w.add_tensor(name, blocks.reshape(rows, cols // 256 * block_bytes), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    if len(sys.argv) not in (3, 4):
        print("usage: check_dequant.py DUMP GGUF [KQUANT_GGUF]", file=sys.stderr)
        return 2
    dump, path = sys.argv[1], sys.argv[2]
    reader = GGUFReader(path)
    ok = all([check(dump, path, reader, name, want) for name, want in TENSORS.items()])
    if len(sys.argv) == 4:
        kpath = sys.argv[3]
        write_kquants(kpath)
        kreader = GGUFReader(kpath)
        ok = all([check(dump, kpath, kreader, name, spec[0]) for name, spec in KQUANTS.items()]) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
