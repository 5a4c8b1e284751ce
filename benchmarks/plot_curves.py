"""Training curves of one or more workdirs in one PNG: train (solid) and eval (dashed, dots).

  python benchmarks/plot_curves.py runs/demo [runs/other ...] --output curves.png \
      [--tags loss,bleu] [--labels demo,other]

Reads the TensorBoard runs WORKDIR/train and WORKDIR/eval that training writes (local
folders), one panel per tag. Default tags: loss, then the first task metric the eval run
has (bleu, rougeL, macro_f1, accuracy). Needs tensorboard and matplotlib, both in
requirements.txt.
"""

from __future__ import annotations

import argparse
import os
import sys

from matplotlib import figure
from tensorboard.backend.event_processing import event_accumulator

TASK_METRICS = ("bleu", "rougeL", "macro_f1", "accuracy")
RUNS = {"train": "-", "eval": "--"}


def curves(workdir: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
  """{run: {tag: [(step, value), ...]}} of the workdir's train and eval runs (absent runs:
  empty)."""
  result = {}
  for run in RUNS:
    folder = os.path.join(workdir, run)
    if not os.path.isdir(folder):
      result[run] = {}
      continue
    accumulator = event_accumulator.EventAccumulator(
        folder, size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    result[run] = {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
                   for tag in accumulator.Tags()["scalars"]}
  return result


def default_tags(all_curves: list[dict]) -> list[str]:
  eval_tags = {tag for c in all_curves for tag in c["eval"]}
  metric = next((t for t in TASK_METRICS if t in eval_tags), None)
  return ["loss"] + ([metric] if metric else [])


def draw(all_curves: list[dict], labels: list[str], tags: list[str]) -> figure.Figure:
  fig = figure.Figure(figsize=(5.5 * len(tags), 4), dpi=100, layout="constrained")
  for i, tag in enumerate(tags):
    axes = fig.add_subplot(1, len(tags), i + 1)
    for j, (run_curves, label) in enumerate(zip(all_curves, labels)):
      color = f"C{j}"
      for run, style in RUNS.items():
        points = run_curves[run].get(tag)
        if points:
          steps, values = zip(*points)
          axes.plot(steps, values, style, color=color, marker="o" if run == "eval" else None,
                    markersize=3, label=f"{label} {run}")
    axes.set_title(tag)
    axes.set_xlabel("step")
    axes.grid(alpha=0.3)
    if tag in ("loss", "perplexity"):
      axes.set_yscale("log")
    axes.legend(fontsize=8)
  return fig


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdirs", nargs="+")
  parser.add_argument("--output", required=True, help="the PNG to write")
  parser.add_argument("--tags", default="", help="comma-separated scalar tags; default: loss "
                      "and the task metric")
  parser.add_argument("--labels", default="", help="comma-separated legend names; default: "
                      "the workdirs' folder names")
  args = parser.parse_args(argv)
  labels = args.labels.split(",") if args.labels else [
      os.path.basename(os.path.normpath(w)) for w in args.workdirs]
  if len(labels) != len(args.workdirs):
    print(f"error: {len(labels)} labels for {len(args.workdirs)} workdirs", file=sys.stderr)
    return 2
  all_curves = [curves(w) for w in args.workdirs]
  if not any(c["train"] or c["eval"] for c in all_curves):
    print(f"error: no TensorBoard runs (train/, eval/) under {', '.join(args.workdirs)}",
          file=sys.stderr)
    return 1
  tags = args.tags.split(",") if args.tags else default_tags(all_curves)
  draw(all_curves, labels, tags).savefig(args.output)
  print(f"{', '.join(tags)} of {len(args.workdirs)} workdir(s) drawn in {args.output}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
