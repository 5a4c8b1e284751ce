"""A checkpoint's chat template: found in its folder, rendered in jinja2's sandbox.

A chat template is code that came with the download. It is rendered only in jinja2's
immutable sandbox, the environment transformers' `apply_chat_template` uses, so a template
can read the messages it is given and nothing else: no attribute of a Python object that
leads out (`__class__`, `__globals__`, ...), no change to the objects it is handed. A
template is checked when its tokenizer loads: it must parse, and a trial conversation must
render without reaching outside the sandbox; either failure is one line naming the file.
"""

from __future__ import annotations

import datetime
import functools
import json
import os

import jinja2
from jinja2 import sandbox

from transformer_jax.pretrained import files

# Where transformers keeps a tokenizer's template, newest layout first.
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_JSON = "chat_template.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# The trial conversation of `check`: alternating turns, no system turn (some templates refuse
# one).
_TRIAL = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
          {"role": "user", "content": "Translate 'cat' into German."}]


def find(folder: str) -> tuple[str, str] | None:
  """(template text, the file it is in) of the tokenizer in `folder`, or None."""
  path = os.path.join(folder, TEMPLATE_FILE)
  if os.path.isfile(path):
    try:
      with open(path, encoding="utf-8") as f:
        return f.read(), path
    except UnicodeDecodeError:
      raise files.PretrainedError(f"{path} is not UTF-8 text: the file is damaged; re-download "
                                  "it from the model's repository.") from None
  for name in (TEMPLATE_JSON, TOKENIZER_CONFIG):
    path = os.path.join(folder, name)
    template = files.read_json(path).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
      template = {t.get("name"): t.get("template") for t in template
                  if isinstance(t, dict)}.get("default")
    if template is not None:
      if not isinstance(template, str):
        raise files.PretrainedError(f"{path}: chat_template is not a template string; "
                                    "re-download it from the model's repository.")
      return template, path
  return None


def _raise(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # jinja2's own tojson escapes HTML characters, which a prompt must keep as they are.
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def _environment() -> sandbox.ImmutableSandboxedEnvironment:
  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise
  # Llama 3's template writes today's date into its system turn.
  env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
  return env


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
           **variables) -> str:
  """The template's text for `messages` ({'role', 'content'} dicts); `variables` are what
  templates read besides them (bos_token, eos_token, tools, ...). Raises jinja2's errors:
  SecurityError for a template that reaches outside the sandbox, TemplateError for one that
  refuses the conversation."""
  return _environment().from_string(template).render(
      messages=messages, add_generation_prompt=add_generation_prompt, **variables)


def check(folder: str, shown: str | None = None, **variables) -> None:
  """Parses the template of `folder`'s tokenizer (if it has one) and renders a trial
  conversation in the sandbox. `shown` names the folder in messages (default: `folder`)."""
  found = find(folder)
  if found is None:
    return
  template, path = found
  if shown is not None:
    path = os.path.join(shown, os.path.basename(path))
  try:
    render(template, _TRIAL, **variables)
  except jinja2.exceptions.SecurityError as e:
    raise files.PretrainedError(
        f"{path}: the chat template reaches outside jinja2's sandbox ({e}); it is not safe to "
        "render: delete it, or take the template from the model's original repository.") from None
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise files.PretrainedError(f"{path}: the chat template does not parse (line {e.lineno}: "
                                f"{e.message}); re-download it from the model's "
                                "repository.") from None
  except Exception:  # pylint: disable=broad-except
    pass  # it refused the trial conversation (its raise_exception, a variable it needs)
