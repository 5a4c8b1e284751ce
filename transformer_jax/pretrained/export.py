"""A model trained from a pretrained checkpoint, written back as a Hugging Face folder:
config.json, model.safetensors, generation_config.json and the tokenizer files, which
`transformers` loads (in PyTorch or anything else that reads the format). A classifier is
written as a ...ForSequenceClassification with the run's label names."""

from __future__ import annotations

import json
from typing import Sequence

from transformer_jax import workdir as workdir_lib
from transformer_jax.model import schema as model_schema
from transformer_jax.pretrained import architecture
from transformer_jax.pretrained import checkpoint as checkpoint_lib
from transformer_jax.pretrained import mapping
from transformer_jax.pretrained import run_files


def export(params, model_config: model_schema.TransformerConfig, workdir: str, output: str,
           label_names: Sequence[str] = ()) -> list[str]:
  """Writes the HF folder `output` for `params` of a workdir trained from a checkpoint (a
  classifier's `label_names` in class order); returns the names written."""
  files = run_files.files_dir(workdir)
  if not run_files.saved(workdir):
    raise ValueError(f"{workdir} was not trained from a pretrained checkpoint (no "
                     f"{run_files.FILES_DIR}/config.json): only those export to Hugging Face.")
  from safetensors.numpy import save  # pylint: disable=g-import-not-at-top
  hf_config = run_files.saved_json(workdir)
  module = architecture.ARCHITECTURES[hf_config["model_type"]]
  vocab = checkpoint_lib.vocab_map(hf_config)
  fields = model_schema.as_dict(model_config)
  shapes = mapping.Shapes.of(fields, vocab)
  tensors = mapping.state_dict(module.weight_table(hf_config, fields), params, shapes)
  target = workdir_lib.path(output)  # a local folder or a bucket URL
  target.mkdir(parents=True, exist_ok=True)
  workdir_lib.write_atomic(target / checkpoint_lib.WEIGHTS,
                           save(tensors, metadata={"format": "pt"}))
  written = [checkpoint_lib.WEIGHTS]
  for path in files.iterdir():
    data = path.read_bytes()
    if path.name == "config.json" and hasattr(module, "export_config"):
      data = json.dumps(module.export_config(hf_config, label_names), indent=2).encode()
    workdir_lib.write_atomic(target / path.name, data)
    written.append(path.name)
  return sorted(written)

