"""benchmarks/trace_summary.py on a small GPU-shaped trace: kernels only, no nested lines."""

import os
import sys

from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import trace_summary  # noqa: E402

GPU_TRACE = {"traceEvents": [
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "pid": 1, "tid": 10, "name": "thread_name", "args": {"name": "XLA Ops"}},
    {"ph": "M", "pid": 1, "tid": 11, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
    {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
    {"ph": "X", "pid": 1, "tid": 10, "name": "fusion.3", "dur": 900.0},  # the op line: nested
    {"ph": "X", "pid": 1, "tid": 11, "name": "sm90_xmma_gemm_bf16", "dur": 600.0,
     "args": {"hlo_op": "custom-call.1"}},
    {"ph": "X", "pid": 1, "tid": 11, "name": "loop_add_fusion", "dur": 300.0,
     "args": {"hlo_op": "fusion.3"}},
    {"ph": "X", "pid": 1, "tid": 11, "name": "cudnn_generated_fort_native_sdpa", "dur": 100.0},
    {"ph": "X", "pid": 2, "tid": 5, "name": "host work", "dur": 5000.0},
]}


def test_only_stream_kernels_are_summed_and_categorized():
  events = trace_summary.device_events(GPU_TRACE)
  assert sorted(e["dur"] for e in events) == [100.0, 300.0, 600.0]
  text = trace_summary.summarize(events, steps=2, top=5)
  assert "device time 0.50 ms per step" in text
  lines = {line.split()[0]: line for line in text.splitlines() if line}
  assert "60.0%" in lines["matmul"] and "10.0%" in lines["attention"]
  assert "custom-call.1 [sm90_xmma_gemm_bf16]" in text
