"""Where a traced training step spends its time: the device ops of a jax.profiler trace, summed.

  python -m transformer_jax.benchmark --config configs/wmt14_en_de.py --batch_size 128 \
      --seq_len 256 --decode=false --profile_dir /tmp/trace
  python benchmarks/trace_summary.py /tmp/trace [--steps 3] [--top 25]

Reads the newest perfetto_trace.json.gz under the folder (written by
`jax.profiler.trace(..., create_perfetto_trace=True)`), keeps the complete events of the
device processes ('/device:...'; on a CPU-only trace, of XLA's threads), and prints per
category (matmul, attention, elementwise fusion, random bits, copies, ...) and per op name the
time per step and the share of all device time. Needs nothing but the standard library, so it
runs on the GPU machine or on a laptop.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

# First match wins; matched against the lower-cased kernel or op name.
CATEGORIES = [
    ("attention", r"fmha|flash|cudnn|sdpa|attention"),
    ("matmul", r"gemm|cublas|cutlass|xmma|nvjet|dot|matmul|wgmma|triton_gemm|convolution"),
    ("random bits", r"rng|threefry|philox|random"),
    ("reduction", r"reduce|reduction|argmax|softmax"),
    ("copy / layout", r"copy|transpose|memcpy|memset|broadcast|dynamic.update.slice|concat"),
    ("elementwise fusion", r"fusion|loop_|input_|elementwise|convert|add|multiply|select"),
]


def newest_trace(folder: str) -> str:
  paths = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
  if not paths:
    raise SystemExit(f"no perfetto_trace.json.gz under {folder}: trace with "
                     "create_perfetto_trace=True (benchmark.py --profile_dir does)")
  return max(paths, key=os.path.getmtime)


def device_events(trace: dict) -> list[dict]:
  """Complete ('X') events of the device processes, else of XLA's CPU threads."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  processes, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      processes[e["pid"]] = e["args"]["name"]
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
  complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
  device = [e for e in complete if "/device:" in processes.get(e["pid"], "")]
  # A GPU's lines nest (XLA Modules > XLA Ops > the kernels on each Stream): keep the kernels.
  streams = [e for e in device if "stream" in threads.get((e["pid"], e.get("tid")), "").lower()]
  if streams or device:
    return streams or device
  return [e for e in complete if "XLA" in threads.get((e["pid"], e.get("tid")), "")
          and not e["name"].startswith(("$", "ThunkExecutor"))]


def category(name: str) -> str:
  lowered = name.lower()
  for label, pattern in CATEGORIES:
    if re.search(pattern, lowered):
      return label
  return "other"


def summarize(events: list[dict], steps: int, top: int) -> str:
  by_name = collections.Counter()
  counts = collections.Counter()
  by_category = collections.Counter()
  for e in events:
    # Kernels carry the HLO op they implement; the kernel's own name tells its kind.
    op = e.get("args", {}).get("hlo_op", "")
    name = f"{op} [{e['name']}]" if op and op != e["name"] else e["name"]
    by_name[name] += e["dur"]
    counts[name] += 1
    by_category[category(f"{e['name']} {op}")] += e["dur"]
  total = sum(by_name.values()) or 1.0
  lines = [f"device time {total / 1e3 / steps:.2f} ms per step over {steps} steps "
           f"({len(events)} events)", "", "category               ms/step   share"]
  for label, dur in by_category.most_common():
    lines.append(f"{label:20s} {dur / 1e3 / steps:9.2f} {100 * dur / total:6.1f}%")
  lines += ["", f"top {top} ops                                                   ms/step   "
            "share  calls/step"]
  for name, dur in by_name.most_common(top):
    lines.append(f"{name[:60]:60s} {dur / 1e3 / steps:8.2f} {100 * dur / total:6.1f}% "
                 f"{counts[name] / steps:8.1f}")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("folder")
  parser.add_argument("--steps", type=int, default=3, help="steps in the trace")
  parser.add_argument("--top", type=int, default=25)
  args = parser.parse_args()
  path = newest_trace(args.folder)
  with gzip.open(path, "rt") as f:
    trace = json.load(f)
  print(path)
  print(summarize(device_events(trace), args.steps, args.top))


if __name__ == "__main__":
  main()
