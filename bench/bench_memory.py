"""Resident memory of loading the default model, each way in a fresh process:

    python bench/bench_memory.py

For float32 and ``quantized=True``: the process's resident memory before ``kvcandle.load``
(after the import), its peak during the load (VmHWM) and after it (VmRSS), against the
bytes of weights the engine holds (``model.weight_bytes``); and the same for the engine
alone (the Rust model built, no tokenizer), in another process. Linux only (reads /proc).
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys, kvcandle

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

before = status("VmRSS")
if sys.argv[2] == "engine":
    from kvcandle._default import default_model_path
    model = kvcandle._core.Model.load(str(default_model_path()), "float32", "cpu", None, sys.argv[1] == "1")
else:
    model = kvcandle.load(quantized=sys.argv[1] == "1")
print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS"), "weights": model.weight_bytes}))
"""


def main() -> None:
    from kvcandle._platform import cpu_description

    print(f"cpu: {cpu_description()}\n")
    print("| load | weights held MB | RSS before MB | peak during load MB | after MB | (peak - before) / weights |")
    print("|---|---|---|---|---|---|")
    runs = [(f"{name}{', engine only' if part == 'engine' else ''}", flag, part) for name, flag in (("float32", "0"), ("quantized=True", "1")) for part in ("load", "engine")]
    for name, flag, part in runs:
        out = subprocess.run([sys.executable, "-c", CHILD, flag, part], capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        mb = lambda v: f"{v / 1e6:.0f}"  # noqa: E731
        print(f"| {name} | {mb(r['weights'])} | {mb(r['before'])} | {mb(r['peak'])} | {mb(r['after'])} | {(r['peak'] - r['before']) / r['weights']:.2f} |")


if __name__ == "__main__":
    main()
