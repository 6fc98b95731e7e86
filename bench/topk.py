"""topk.py: torch.topk on the scores bench-select wrote (issue 7, item 2).

Usage: topk.py SCORES.f32 ROWS N K MIN_MS

Reads ROWS x N float32 scores, and prints one line "torch TOPK SORTED": nanoseconds per score of
torch.topk(x, K, dim=-1, sorted=False) (the fastest form), and of topk followed by sorting each row's indices ascending (the
form of a plan), each the median of 5 measurements of at least MIN_MS milliseconds. One thread:
kvcd selects on one. Prints "skipped: no torch" when torch cannot be imported.
"""
import sys
import time

try:
    import torch
except Exception:  # ImportError, or a broken install
    print("skipped: no torch")
    sys.exit(0)


def measure(fn, scores, min_ms):
    fn()
    runs = []
    for _ in range(5):
        reps = 0
        t0 = time.perf_counter()
        while True:
            fn()
            reps += 1
            t = time.perf_counter()
            if (t - t0) * 1e3 >= min_ms:
                break
        runs.append((t - t0) / reps / scores * 1e9)
    runs.sort()
    return runs[2]


def main():
    path, rows, n, k, min_ms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    torch.set_num_threads(1)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    x = torch.frombuffer(data, dtype=torch.float32).reshape(rows, n)

    def topk():
        return torch.topk(x, k, dim=-1, sorted=False)

    def topk_sorted():
        return torch.sort(torch.topk(x, k, dim=-1, sorted=False).indices, dim=-1).values

    a = measure(topk, rows * n, min_ms)
    b = measure(topk_sorted, rows * n, min_ms)
    print("torch %.4f %.4f (torch %s, %d thread)" % (a, b, torch.__version__, torch.get_num_threads()))


main()
