"""How source and target texts become token ids: `config.prompt_format`.

  task  this project's own format: the source's ids and the target's, each of which the
        family ends with EOS (a decoder-only model reads `SOURCE <eos> TARGET <eos>`).
  raw   a decoder-only model continues the source as text (through `config.prompt_template`
        where one is set), tokenized exactly as the checkpoint's tokenizer does it (its own
        BOS where it adds one, no separator); a target follows directly and ends with EOS.
        What transformers' `generate` reads.
  chat  the source, through `config.prompt_template` (its `{source}` replaced by the text),
        is a user message, after `config.system_prompt` where one is set; the checkpoint's
        chat template renders them with its generation prompt. A target is the assistant's
        reply as the template renders it, up to and including its end token.

Raw and chat prompts are tokenized as `apply_chat_template` does (the rendered text, no
special tokens added: the template writes its own). Nothing here runs the model.
"""

from __future__ import annotations

from typing import Sequence

import ml_collections

from transformer_jax import tokenizer as tokenizer_lib

FORMATS = ("task", "raw", "chat")
SOURCE_FIELD = "{source}"  # where config.prompt_template puts the source text


class PromptFormatError(ValueError):
  """A prompt the format cannot make (no chat template, a template that refuses)."""


class TextEncoder:
  """Source and target texts -> token ids in the format `config.prompt_format` names."""

  def __init__(self, config: ml_collections.ConfigDict, tokenizer):
    self.format = config.get("prompt_format", "task")
    self.tokenizer = tokenizer
    self.template = config.get("prompt_template", SOURCE_FIELD)
    self.system_prompt = config.get("system_prompt", "")
    # Where a reply ends: EOS and the checkpoint's other end tokens (Qwen's <|im_end|>).
    self.end_ids = {tokenizer_lib.EOS_ID, *config.decoding.get("end_ids", ())}
    if self.format == "chat" and not getattr(tokenizer, "has_chat_template", False):
      raise PromptFormatError(
          "config.prompt_format='chat' needs the checkpoint's chat template, and its "
          "tokenizer has none: use prompt_format 'raw' or 'task', or add the model's "
          "chat_template.jinja to the checkpoint folder.")

  def encode(self, sources: Sequence[str], targets: Sequence[str] | None = None
             ) -> tuple[list[list[int]], list[list[int]]]:
    """(source ids, target ids) per example; no targets: empty lists."""
    if self.format == "chat":
      return self._chat(sources, targets)
    if self.format == "raw":
      sources = [self.template.replace(SOURCE_FIELD, s) for s in sources]
    source_ids = self.tokenizer.encode_batch(list(sources))
    if targets is None:
      return source_ids, [[] for _ in sources]
    if self.format == "task":  # the target-side tokenizer (Marian has one of its own)
      return source_ids, self.tokenizer.encode_target_batch(list(targets))
    plain = self.tokenizer.encode_batch(list(targets), add_special_tokens=False)
    return source_ids, [ids + [tokenizer_lib.EOS_ID] for ids in plain]

  def messages(self, source: str) -> list[dict]:
    """The chat a source becomes: the system prompt (if any), then the user's message."""
    system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
    return system + [{"role": "user", "content": self.template.replace(SOURCE_FIELD, source)}]

  def _chat(self, sources, targets):
    prompts = [self.tokenizer.render_chat(self.messages(s), add_generation_prompt=True)
               for s in sources]
    source_ids = self.tokenizer.encode_batch(prompts, add_special_tokens=False)
    if targets is None:
      return source_ids, [[] for _ in sources]
    replies = []
    for source, prompt, target in zip(sources, prompts, targets):
      whole = self.tokenizer.render_chat(
          self.messages(source) + [{"role": "assistant", "content": target}],
          add_generation_prompt=False)
      if not whole.startswith(prompt):
        raise PromptFormatError(
            "The chat template renders a conversation with the reply differently from its "
            "generation prompt, so the reply cannot be told apart: use prompt_format 'raw'.")
      replies.append(whole[len(prompt):])
    return source_ids, [self._up_to_end(ids) for ids in
                        self.tokenizer.encode_batch(replies, add_special_tokens=False)]

  def _up_to_end(self, ids: list[int]) -> list[int]:
    """A reply's ids through its first end token (what follows it, such as a line break
    before the next turn, is not the model's to write); EOS added where there is none."""
    for i, token in enumerate(ids):
      if token in self.end_ids:
        return ids[:i + 1]
    return ids + [tokenizer_lib.EOS_ID]
