"""Entry point: train (default), evaluate a checkpoint, answer inputs, draw attention, export
a fine-tuned model to Hugging Face's format, or serve a model over HTTP (OpenAI's API).

  python -m transformer_jax.main --config configs/demo.py --workdir runs/demo
  python -m transformer_jax.main --workdir runs/demo --mode evaluate
  python -m transformer_jax.main --workdir runs/demo --mode predict --input in.txt --output -
  python -m transformer_jax.main --workdir runs/demo --mode attention --text "..." --output a.png
  python -m transformer_jax.main --workdir runs/ft --mode export --output hf_folder
  python -m transformer_jax.main --pretrained google/flan-t5-small --mode predict --input -
  python -m transformer_jax.main --workdir runs/demo --mode serve --port 8000

Several hosts (see launch/): add --multihost on Cloud TPU VMs and under SLURM, or
--coordinator_address=HOST0:PORT --num_processes=N --process_id=I everywhere else.
"""

import json
import logging as std_logging
import os
import sys

# Before anything reads them: gs:// through fsspec, the GCS emulator variable mapped.
from transformer_jax import workdir as _workdir  # noqa: F401  pylint: disable=unused-import
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs, tokenizer and config.")
flags.DEFINE_enum("mode", "train", ["train", "evaluate", "predict", "attention", "export",
                                    "serve"],
                  "What to do: train, score a split, answer inputs, draw attention heatmaps, "
                  "write a model trained from a pretrained checkpoint as a Hugging Face "
                  "folder (--output DIR), or serve it over HTTP (OpenAI's API).")
flags.DEFINE_string("host", "127.0.0.1", "serve: the address to listen on (0.0.0.0: every "
                    "interface; then set --api_key).")
flags.DEFINE_integer("port", 8000, "serve: the port to listen on.", lower_bound=1,
                     upper_bound=65535)
flags.DEFINE_string("api_key", None, "serve: requests must send 'Authorization: Bearer KEY' "
                    "(default: $TRANSFORMER_JAX_API_KEY; none: no key needed).")
flags.DEFINE_string("compilation_cache", None, "serve: JAX's persistent compilation cache "
                    "folder, so that a second start compiles nothing (default: "
                    "$JAX_COMPILATION_CACHE_DIR, else ~/.cache/transformer_jax/jax or "
                    "$XDG_CACHE_HOME's; 'none': off).")
flags.DEFINE_string("pretrained", None, "evaluate / predict / serve: serve this Hugging Face "
                    "checkpoint (a folder or hub name) as it is, without a workdir. To "
                    "fine-tune one, train with --config.pretrained=PATH.")
flags.DEFINE_multi_string("adapter", None, "with --pretrained (predict, evaluate, serve): a "
                          "PEFT LoRA adapter folder made for that checkpoint, merged into its "
                          "weights at load. serve: NAME=DIR, repeatable, serves each adapter "
                          "unmerged beside the base; a request's model names its adapter.")
flags.DEFINE_enum("export_format", "hf", ["hf", "peft"], "export: 'hf' = the whole model as a "
                  "Hugging Face folder (LoRA adapters merged), 'peft' = a LoRA run's adapters as "
                  "a PEFT adapter folder.")
flags.DEFINE_integer("checkpoint_step", None, "evaluate / predict / attention: this step, not "
                     "the latest.")
flags.DEFINE_enum("checkpoint", "latest", ["latest", "best"], "evaluate / predict: 'latest' "
                  "(or --checkpoint_step), or 'best': the best evaluation's, kept when training "
                  "with config.checkpoint_best_metric.")
flags.DEFINE_integer("average_last", 1, "evaluate / predict: average the parameters of the last "
                     "N checkpoints (up to --checkpoint_step), as the paper does with 5 or 20.")
flags.DEFINE_string("input", "-", "predict: a file with one source text per line, - = stdin.")
flags.DEFINE_string("output", "-", "predict: where outputs go, one per line, - = stdout. "
                    "attention: the PNG to write.")
flags.DEFINE_string("text", None, "attention: the source text whose attention (with the "
                    "model's output) is drawn; config.attention_images picks layers and heads.")
flags.DEFINE_string("split", "test", "evaluate: the split to score (validation, test, or any "
                    "key of config.splits).")
flags.DEFINE_integer("nbest", 1, "predict: outputs per input, best first (beam search: up to "
                     "decoding.beam_size; sampling: that many samples).")
flags.DEFINE_enum("output_format", "text", ["text", "jsonl"], "predict: 'text' = the best "
                  "output per line (its line breaks as spaces); 'jsonl' = one JSON object per "
                  "input line with every output, exactly, and its score (log-probability).")
flags.DEFINE_bool("multihost", False, "Join a multi-process run with jax.distributed.initialize: "
                  "on Cloud TPU VMs and under SLURM the other flags are found automatically.")
flags.DEFINE_bool("verbose", False, "Show the full traceback of errors that are otherwise "
                  "reported in one line.")
flags.DEFINE_string("coordinator_address", None, "multihost: host:port of process 0.")
flags.DEFINE_integer("num_processes", None, "multihost: how many processes in all.")
flags.DEFINE_integer("process_id", None, "multihost: this process's index, 0 .. N-1.")
config_flags.DEFINE_config_file("config", None, "Config file (training; evaluate and predict "
                                "default to the workdir's saved config).", lock_config=True)


class _QuietLibraries(std_logging.Filter):
  """Drops the INFO chatter of checkpointing internals; their warnings and errors still show,
  without tracebacks (the error reaches the user as one line from train.py)."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if "/orbax/" not in record.pathname:
      return True
    if not flags.FLAGS.verbose:
      record.exc_info, record.exc_text, record.stack_info = None, None, None
    return record.levelno >= std_logging.WARNING


# XLA:CPU's default scheduler runs independent work early and keeps its results: while a
# training state is created, every float32 weight beside its quantized copy; in the step, the
# rematerialised layers and a quantized base's dequantized kernels. Scheduled for memory, LoRA
# over an int4 base (int8 embedding) at Qwen2.5-1.5B's sizes peaks at 6.2 GB instead of 19 GB
# (compare_lora.py), and a 0.5B-size one through this command at 6.3 instead of 9.5 GB, at the
# same step time (benchmarks/RESULTS.md). Only the CPU backend reads the flag; a user's own
# XLA_FLAGS setting of it wins.
CPU_MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def schedule_cpu_for_memory(environ=os.environ) -> None:
  """Adds CPU_MEMORY_SCHEDULER to XLA_FLAGS (before JAX starts its backend) unless they set
  that flag already."""
  current = environ.get("XLA_FLAGS", "")
  if CPU_MEMORY_SCHEDULER.split("=")[0] not in current:
    environ["XLA_FLAGS"] = f"{current} {CPU_MEMORY_SCHEDULER}".strip()


def _initialize_distributed() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  # CPU processes reduce across each other through gloo; accelerators ignore this setting.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(flags.FLAGS.coordinator_address, flags.FLAGS.num_processes,
                             flags.FLAGS.process_id)
  logging.info("Process %d of %d; %d local and %d global devices.", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_QuietLibraries())
  try:
    _run()
  except KeyboardInterrupt:
    _fail("interrupted; nothing was saved after the last checkpoint.", 130)
  except BrokenPipeError:
    # The reader went away (predict piped into `head`): nothing to report.
    sys.stderr.close()
    os._exit(0)  # pylint: disable=protected-access
  except Exception as e:  # pylint: disable=broad-except
    code = _user_error_code(e)
    if code is None or flags.FLAGS.verbose:
      raise
    _fail(_one_line(e), code)


def _fail(message: str, code: int) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(code)


def _one_line(error: Exception) -> str:
  if isinstance(error, OSError) and error.strerror:
    resume = "; then re-run the same command to resume" if flags.FLAGS.mode == "train" else ""
    return (f"{error.strerror}: {error.filename or ''} (check the path, its permissions and "
            f"free space{resume})")
  return " ".join(str(error).split())


def _user_error_code(error: Exception) -> int | None:
  """The exit code of an error the user can act on from its one-line message (None: a bug,
  shown with its traceback)."""
  # Imported here so --help stays fast and flag errors come before JAX starts.
  from transformer_jax import checkpoints
  from transformer_jax import config_validation
  from transformer_jax import run_lock
  from transformer_jax import workdir as workdir_lib
  if isinstance(error, config_validation.ConfigError):
    return 2
  if isinstance(error, run_lock.WorkdirBusyError):
    return 75  # EX_TEMPFAIL: a restart loop should not retry at once
  if isinstance(error, (checkpoints.CheckpointError, workdir_lib.WorkdirError, ValueError,
                        OSError)):
    return 1
  # Only a run that imported train.py can raise its error: looked up, not imported, so that
  # evaluate and predict never load the training code.
  policy = sys.modules.get("transformer_jax.checkpoint_policy")
  if policy is not None and isinstance(error, policy.NonFiniteLossError):
    return 1
  return None


def _inference_config():
  """The saved config with this command's overrides, refused if they touch the model or its
  data (the checkpoint fixes those)."""
  from transformer_jax import config_validation  # pylint: disable=g-import-not-at-top
  from transformer_jax import saved_config  # pylint: disable=g-import-not-at-top
  from transformer_jax import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  config = flags.FLAGS.config
  changes = saved_config.fixed_key_changes(workdir_lib.load_config(flags.FLAGS.workdir), config)
  if changes:
    raise config_validation.ConfigError(
        f"--mode {flags.FLAGS.mode} cannot change what the checkpoint was trained with: "
        f"{'; '.join(changes)}. Override only decoding.* and run settings.")
  config_validation.validate(config)
  return config


def _checkpoint() -> int | str | None:
  """The checkpoint evaluate / predict restore: a step, 'best', or None (the latest)."""
  if flags.FLAGS.checkpoint == "best":
    if flags.FLAGS.checkpoint_step is not None:
      raise app.UsageError("Pass --checkpoint best or --checkpoint_step, not both.")
    return "best"
  return flags.FLAGS.checkpoint_step


def _given_config_keys() -> list[str]:
  """Config keys set on the command line (--config.model.num_layers=2 -> 'model.num_layers')."""
  return [arg.split("=", 1)[0][len("--config."):] for arg in sys.argv[1:]
          if arg.startswith("--config.")]


def _check_pretrained_overrides(config) -> None:
  """Training from config.pretrained: command-line keys that contradict the checkpoint are
  refused before anything is read or written."""
  from transformer_jax import config_validation  # pylint: disable=g-import-not-at-top
  from transformer_jax import pretrained_run  # pylint: disable=g-import-not-at-top
  checkpoint = pretrained_run.run_checkpoint(config, flags.FLAGS.workdir)
  refused = pretrained_run.refused_overrides(checkpoint, config, _given_config_keys())
  if refused:
    raise config_validation.ConfigError(
        f"--config.pretrained fixes the model and tokenizer: {'; '.join(refused)}. Drop these "
        "overrides.")


def _pretrained_predictor():
  """The --pretrained checkpoint served with this command's config (decoding keys given on
  the command line win over its generation_config.json)."""
  from transformer_jax import predict  # pylint: disable=g-import-not-at-top
  given = [k for k in _given_config_keys() if k.startswith("decoding.") or k == "prompt_format"]
  merged, named = _adapters()
  if named:
    raise ValueError(f"--adapter {next(iter(named))}=DIR names an adapter for --mode serve "
                     "(several side by side); --mode predict and evaluate take one, merged: "
                     "--adapter DIR.")
  return predict.Predictor.from_pretrained(flags.FLAGS.pretrained, flags.FLAGS.config,
                                           given_keys=given, adapter=merged)


def _adapters() -> tuple[str | None, dict[str, str]]:
  """--adapter: (the folder merged into the weights, or None; {name: folder} served per
  row)."""
  from transformer_jax.serving import adapters  # pylint: disable=g-import-not-at-top
  return adapters.parse(flags.FLAGS.adapter)


def _run() -> None:
  from transformer_jax import commands  # pylint: disable=g-import-not-at-top
  workdir = flags.FLAGS.workdir
  serving = flags.FLAGS.pretrained is not None
  if serving and flags.FLAGS.mode not in ("evaluate", "predict", "serve"):
    raise app.UsageError("--pretrained serves a checkpoint with --mode predict, evaluate or "
                         "serve; to fine-tune it, train with --config.pretrained=PATH.")
  if flags.FLAGS.adapter and not serving:
    raise ValueError("--adapter adds a PEFT adapter to --pretrained BASE; a workdir keeps its "
                     "own adapters (train with --config.lora.rank, or --config.lora.init=DIR).")
  if workdir is None and not serving:
    raise app.UsageError("--workdir is required (or --pretrained PATH with --mode predict / "
                         "evaluate / serve).")
  if flags.FLAGS.mode == "train" and flags.FLAGS.config is None:
    raise app.UsageError("Training needs --config, e.g. --config configs/demo.py.")
  if flags.FLAGS.mode == "export" and flags.FLAGS.output == "-":
    raise app.UsageError("--mode export needs --output DIR, the Hugging Face folder to write.")
  if flags.FLAGS.mode == "train":
    schedule_cpu_for_memory()
  if flags.FLAGS.multihost or flags.FLAGS.coordinator_address:
    _initialize_distributed()
  if flags.FLAGS.mode == "train":
    from transformer_jax import train  # pylint: disable=g-import-not-at-top
    if flags.FLAGS.config.pretrained:
      _check_pretrained_overrides(flags.FLAGS.config)
    result = train.train_and_evaluate(flags.FLAGS.config, workdir)
    if result.get("preempted"):
      print(f"Stopped at step {result['step']}; checkpoint saved in {result['checkpoint_dir']}. "
            "Re-run the same command to resume.", file=sys.stderr)
  elif flags.FLAGS.mode == "evaluate":
    if serving:
      result = commands.run_evaluate(workdir, split=flags.FLAGS.split,
                                     predictor=_pretrained_predictor())
    else:
      result = commands.run_evaluate(workdir, _checkpoint(), flags.FLAGS.split,
                                     average_last=flags.FLAGS.average_last,
                                     config=_inference_config())
    print(json.dumps(result), flush=True)
  elif flags.FLAGS.mode == "export":
    written = commands.run_export(workdir, flags.FLAGS.output, _checkpoint(),
                                  flags.FLAGS.average_last, config=_inference_config(),
                                  export_format=flags.FLAGS.export_format)
    kind = "PEFT adapter" if flags.FLAGS.export_format == "peft" else "Hugging Face"
    print(f"Wrote a {kind} folder {flags.FLAGS.output}: {', '.join(written)}", flush=True)
  elif flags.FLAGS.mode == "serve":
    _serve(workdir, serving)
  elif flags.FLAGS.mode == "attention":
    if not flags.FLAGS.text or flags.FLAGS.output == "-":
      raise app.UsageError('--mode attention needs --text "a source sentence" and --output '
                           "FILE.png.")
    output = commands.run_attention(workdir, flags.FLAGS.text, flags.FLAGS.output, _checkpoint(),
                                    config=_inference_config())
    print(f"Attention over the output {output!r} drawn in {flags.FLAGS.output}", flush=True)
  else:
    commands.run_predict(workdir, flags.FLAGS.input, flags.FLAGS.output,
                         _checkpoint(), flags.FLAGS.average_last,
                         config=None if serving else _inference_config(),
                         nbest=flags.FLAGS.nbest, output_format=flags.FLAGS.output_format,
                         predictor=_pretrained_predictor() if serving else None)


def _serve(workdir: str | None, serving: bool) -> None:
  from transformer_jax.serving import adapters  # pylint: disable=g-import-not-at-top
  from transformer_jax.serving import server  # pylint: disable=g-import-not-at-top
  merged, named = _adapters()
  name = server.model_name(workdir, flags.FLAGS.pretrained)
  adapters.check_names(named, name)
  server.check_address(flags.FLAGS.host, flags.FLAGS.port)  # before the minutes of loading
  server.use_compilation_cache(flags.FLAGS.compilation_cache)
  given = [k for k in _given_config_keys() if k.startswith("decoding.") or k == "prompt_format"]
  predictor = server.load_model(
      workdir, flags.FLAGS.pretrained, None if serving else _checkpoint(),
      flags.FLAGS.average_last, flags.FLAGS.config if serving else _inference_config(),
      given_keys=given if serving else None, adapter=merged)
  served = adapters.load(predictor, named, name) if named else None
  server.run_serve(predictor, name, flags.FLAGS.host, flags.FLAGS.port, flags.FLAGS.api_key,
                   adapters=served)


def _flag_value(argv: list[str], name: str) -> str | None:
  for i, arg in enumerate(argv):
    if arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith((f"--{name}=", f"-{name}=")):
      return arg.split("=", 1)[1]
  return None


def with_saved_config(argv: list[str]) -> list[str]:
  """Evaluate / predict without --config read the workdir's saved config (so that
  --config.decoding.* overrides apply to it)."""
  if (_flag_value(argv, "mode") in ("evaluate", "predict", "attention", "export", "serve")
      and _flag_value(argv, "config") is None):
    workdir = _flag_value(argv, "workdir")
    if _flag_value(argv, "pretrained"):
      # Serving a checkpoint: the defaults, which the checkpoint and the overrides then change.
      defaults = os.path.join(os.path.dirname(__file__), "default_config.py")
      return [argv[0], f"--config={defaults}", *argv[1:]]
    if workdir:
      # Before the overrides: absl defines --config.* flags when it parses --config.
      saved = os.path.join(os.path.dirname(__file__), "saved_config.py")
      return [argv[0], f"--config={saved}:{workdir}", *argv[1:]]
  return argv


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad --config (missing or broken file, misspelt key, saved
  config missing) reported in one line instead of a traceback."""
  try:
    remaining = flags.FLAGS(with_saved_config(argv))
    if flags.FLAGS.config is not None:  # a file that failed to load fails here, not mid-run
      flags.FLAGS.config.to_dict()
    return remaining
  except flags.Error as e:
    print(f"error: {e}\nPass --help for the flags.", file=sys.stderr)
  except Exception as e:  # pylint: disable=broad-except
    if "--verbose" in argv:
      raise
    from transformer_jax import config_validation  # pylint: disable=g-import-not-at-top
    print(f"error: --config: {config_validation.override_error(e)}", file=sys.stderr)
  sys.exit(2)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
