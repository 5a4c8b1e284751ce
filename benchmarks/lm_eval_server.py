"""lm-evaluation-harness against `--mode serve`: the same local tasks through the harness's
`local-completions` model (this project's server) and its own `hf` model (transformers, on
the same checkpoint folder), compared example by example.

  pip install "lm_eval[api,hf]==0.4.13"   # not a project requirement: a reference, run by hand
  python benchmarks/lm_eval_server.py [--pretrained DIR]

Two tasks written here as local files: a `multiple_choice` one (log-likelihoods of each
choice: `echo`, `max_tokens` 1, `logprobs` 1, token-id prompts) and a `generate_until` one
(greedy text up to a newline). Without --pretrained a tiny random Llama is built
(tests/hf_fixtures.py). Prints each task's metric from both sides, the largest difference of
the per-choice log-likelihoods, and how many answers and generations agree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

import serve_load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBJECTS = ["The girl", "A brave mouse", "Our big children", "My teacher", "The old man",
            "A young dog", "Their neighbour", "The lazy cats"]
VERBS = ["sees", "likes", "brings", "watches"]
OBJECTS = [" a red cup.", " the small horse.", " our tired friend.", " young apples."]

MULTIPLE_CHOICE = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

GENERATION = """task: tiny_generation
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: str) -> None:
  """The two tasks' YAML and data in `folder` (the harness's --include_path)."""
  choice_rows, generation_rows = [], []
  for i, subject in enumerate(SUBJECTS):
    verb = VERBS[i % len(VERBS)]
    choice_rows.append({"question": f"{subject} {verb}", "choices": OBJECTS,
                        "answer": i % len(OBJECTS)})
    generation_rows.append({"prompt": f"{subject} {verb}", "target": OBJECTS[i % 4]})
  for name, rows, template in (("choice", choice_rows, MULTIPLE_CHOICE),
                               ("generation", generation_rows, GENERATION)):
    data = os.path.join(folder, f"{name}.jsonl")
    with open(data, "w") as f:
      f.writelines(json.dumps(row) + "\n" for row in rows)
    with open(os.path.join(folder, f"tiny_{name}.yaml"), "w") as f:
      f.write(template.format(data=data))


def evaluate(model: str, model_args: dict, task_folder: str) -> dict:
  import lm_eval  # pylint: disable=g-import-not-at-top
  from lm_eval import tasks  # pylint: disable=g-import-not-at-top
  return lm_eval.simple_evaluate(
      model=model, model_args=model_args, tasks=["tiny_choice", "tiny_generation"],
      task_manager=tasks.TaskManager(include_path=task_folder), log_samples=True,
      batch_size=4, random_seed=0, numpy_random_seed=0, torch_random_seed=0)


def compare(ours: dict, theirs: dict) -> None:
  print("| task | metric | server (local-completions) | transformers (hf) | agreement |")
  print("|---|---|---|---|---|")
  for task in ("tiny_choice", "tiny_generation"):
    metric = "acc,none" if task == "tiny_choice" else "exact_match,none"
    a, b = ours["samples"][task], theirs["samples"][task]
    if task == "tiny_choice":
      ll = lambda s: np.array([r[0][0] for r in s["resps"]], np.float64)
      differences = [np.abs(ll(x) - ll(y)).max() for x, y in zip(a, b)]
      same = sum(int(np.argmax(ll(x)) == np.argmax(ll(y))) for x, y in zip(a, b))
      agreement = (f"answers {same}/{len(a)}; per-choice log-likelihoods within "
                   f"{max(differences):.2e}")
    else:
      same = sum(x["resps"][0][0] == y["resps"][0][0] for x, y in zip(a, b))
      agreement = f"generations equal {same}/{len(a)}"
    print(f"| {task} | {metric.split(',')[0]} | {ours['results'][task][metric]:.4f} | "
          f"{theirs['results'][task][metric]:.4f} | {agreement} |")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--pretrained", help="a Hugging Face decoder-only folder")
  parser.add_argument("--start_timeout", type=float, default=1800)
  args = parser.parse_args()
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  with tempfile.TemporaryDirectory(prefix="lm_eval_server_") as work:
    if args.pretrained is None:
      sys.path.insert(0, ROOT)
      from tests import hf_fixtures  # pylint: disable=g-import-not-at-top
      args.pretrained = hf_fixtures.tiny_model("llama", work)
    task_folder = os.path.join(work, "tasks")
    os.makedirs(task_folder)
    write_tasks(task_folder)
    args.workdir, args.fixed_length, args.server_args = None, False, []
    port = serve_load.free_port()
    with open(os.path.join(work, "server.log"), "w+") as log:
      server = serve_load.start_server(args, port, log, [
          "--config.max_source_length=64", "--config.max_target_length=16"])
      try:
        name = os.path.basename(os.path.normpath(args.pretrained))
        ours = evaluate("local-completions", {
            "model": name, "base_url": f"http://127.0.0.1:{port}/v1/completions",
            "tokenizer": args.pretrained, "tokenizer_backend": "huggingface",
            # As the hf model reads a Llama's texts: BOS first.
            "add_bos_token": True, "num_concurrent": 1, "max_retries": 1}, task_folder)
      finally:
        server.terminate()
        server.wait(120)
    theirs = evaluate("hf", {"pretrained": args.pretrained, "dtype": "float32",
                             "device": "cpu"}, task_folder)
    compare(ours, theirs)


if __name__ == "__main__":
  main()
