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

Chat data may also come as whole conversations (a `messages` field of {role, content} turns,
the shape of public SFT sets: `conversation_example`): the template renders the conversation,
and every assistant turn carries loss, the last one being what evaluation generates.

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


def conversation_example(messages, where: str) -> dict:
  """An example of a `messages` field: the turns, the last user turn as its source (shown in
  evaluation samples) and the last assistant turn as its target (the reference). Raises a
  one-line ValueError naming `where` for anything but {role, content} string turns that end
  with an assistant turn."""
  well_formed = isinstance(messages, list) and messages and all(
      isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
      for m in messages)
  if not well_formed or messages[-1]["role"] != "assistant":
    raise ValueError(f"{where}: a messages field must be a list of {{'role', 'content'}} turns "
                     f"(strings) ending with an assistant turn; got {str(messages)[:120]}.")
  users = [m["content"] for m in messages if m["role"] == "user"]
  return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages],
          "source": users[-1] if users else "", "target": messages[-1]["content"]}


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

  def encode_conversation(self, messages: list[dict]
                          ) -> tuple[list[int], list[float], list[int]]:
    """A whole conversation (`conversation_example`'s messages) in the chat format: (the ids
    up to its last reply, their loss weights: 1 on each earlier reply and its end token, the
    last reply's ids). Each turn is tokenized apart, as single-turn chats are."""
    if self.format != "chat":
      raise PromptFormatError("Data with a messages field trains in config.prompt_format="
                              "'chat'; set it.")
    render = self.tokenizer.render_chat
    whole = render(messages, add_generation_prompt=False)
    texts, weighted, done = [], [], 0
    for i, message in enumerate(messages):
      if message["role"] != "assistant":
        continue
      context = render(messages[:i], add_generation_prompt=True)
      through = render(messages[:i + 1], add_generation_prompt=False)
      if not (whole.startswith(context) and whole.startswith(through)
              and done <= len(context) <= len(through)):
        raise PromptFormatError(
            "The chat template renders earlier turns of a conversation differently once later "
            "ones follow (some drop earlier reasoning), so replies cannot be told apart in "
            "it: train on single-turn source / target pairs instead.")
      texts += [whole[done:len(context)], whole[len(context):len(through)]]
      weighted += [False, True]
      done = len(through)
    pieces = self.tokenizer.encode_batch(texts, add_special_tokens=False)
    ids, weights = [], []
    for piece, is_reply in zip(pieces[:-1], weighted):
      # A reply weighs through its end token; what follows (a line break before the next
      # turn) is the template's, not the model's to write.
      end = self._end(piece) if is_reply else 0
      ids += piece
      weights += [1.0] * end + [0.0] * (len(piece) - end)
    return ids, weights, self._up_to_end(pieces[-1])

  def _end(self, ids: list[int]) -> int:
    """How many of a reply's ids run through its first end token (all if it has none)."""
    return next((i + 1 for i, token in enumerate(ids) if token in self.end_ids), len(ids))

  def _up_to_end(self, ids: list[int]) -> list[int]:
    """A reply's ids through its first end token (what follows it, such as a line break
    before the next turn, is not the model's to write); EOS added where there is none."""
    end = self._end(ids)
    return ids[:end] if end and ids[end - 1] in self.end_ids else ids + [tokenizer_lib.EOS_ID]
