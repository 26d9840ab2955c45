"""Chat templates: which one applies, how it renders, and which characters are targets.

`chat_template` unset uses the tokenizer's own template, or the plain
"### Role:" format for a base model without one. A name picks a built-in
template below; a path reads a Jinja file. Rendering goes through the same
compiled Jinja that `apply_chat_template` uses, with the same variables, so the
text is identical; calling it directly saves a fixed overhead per row.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from relaytune.data.formats import BadRow
from relaytune.errors import UserError
from relaytune.log import warn

# Built-in templates for base models without one. Each ends an assistant turn with
# its end-of-turn marker right after the content, so that marker becomes a target.
NAMED = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "llama3": (
        "{% if bos_token %}{{ bos_token }}{% endif %}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "gemma": (  # gemma has no system role: the system text opens the first user turn
        "{% if bos_token %}{{ bos_token }}{% endif %}{% set ns = namespace(system='') %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
        "{% else %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n'"
        " + (ns.system if message['role'] == 'user' else '') + message['content'] + '<end_of_turn>\n' }}"
        "{% if message['role'] == 'user' %}{% set ns.system = '' %}{% endif %}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
    "phi3": (
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"),
    "zephyr": (
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"),
    "mistral": (  # [INST] ... [/INST] answer</s>; a system prompt opens the first instruction
        "{% if bos_token %}{{ bos_token }}{% endif %}{% set ns = namespace(system='') %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
        "{% elif message['role'] == 'user' %}{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
        "{% set ns.system = '' %}"
        "{% else %}{{ message['content'] + eos_token }}{% endif %}"
        "{% endfor %}"),
}
MARKERS = {"chatml": ["<|im_start|>", "<|im_end|>"],
           "llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
           "gemma": ["<start_of_turn>", "<end_of_turn>"],
           "phi3": ["<|user|>", "<|assistant|>", "<|end|>"]}
CHOICES = sorted(NAMED) + ["plain", "tokenizer"]


@dataclass(frozen=True)
class Template:
    name: str  # "tokenizer", a built-in name, a file path, or "plain"
    text: str | None  # Jinja source; None for the plain format

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.name if self.text is None else ''}\0{self.text}".encode()).hexdigest()


def resolve(setting: str | None, tokenizer) -> Template:
    """The template the `chat_template` setting names, checked before any row is rendered."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one trains chat
        own = own.get("default")
    if setting is None:
        return Template("tokenizer", own) if own else Template("plain", None)
    if setting == "tokenizer":
        if not own:
            raise UserError("`chat_template: tokenizer`: this tokenizer has no chat template; "
                            f"choose one of {', '.join(CHOICES[:-1])} or give a .jinja file")
        return Template("tokenizer", own)
    if setting == "plain":
        return Template("plain", None)
    if setting in NAMED:
        missing = [m for m in MARKERS.get(setting, []) if _token_id(tokenizer, m) is None]
        if missing:
            warn(f"`chat_template: {setting}`: {', '.join(missing)} are not single tokens of this "
                 "tokenizer, so they are learned as text pieces; stop generation on that text")
        return Template(setting, NAMED[setting])
    path = Path(setting).expanduser()
    if not path.is_file():
        raise UserError(f"`chat_template`: {setting!r} is neither a template name "
                        f"({', '.join(CHOICES)}) nor an existing .jinja file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"`chat_template`: cannot read {path}: {e}") from None
    _compile(text, str(path))
    return Template(str(path), text)


def _token_id(tokenizer, token: str):
    tid = tokenizer.convert_tokens_to_ids(token)
    return None if tid is None or tid == tokenizer.unk_token_id else tid


def _compile(text: str, where: str):
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
        return _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"`chat_template`: {where}:{e.lineno}: {e.message}") from None
    except ImportError:  # a transformers without this helper: render through the tokenizer
        return None


class Renderer:
    """Renders conversations exactly as `tokenizer.apply_chat_template(..., tokenize=False)`."""

    def __init__(self, template: Template, tokenizer):
        self.template, self.tokenizer = template, tokenizer
        self.compiled = _compile(template.text, template.name)
        self.variables = dict(tokenizer.special_tokens_map)

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        import jinja2

        try:
            if self.compiled is None:
                return self.tokenizer.apply_chat_template(
                    messages, chat_template=self.template.text, tokenize=False,
                    add_generation_prompt=generation_prompt)
            return self.compiled.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=generation_prompt, **self.variables)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            # The template's own checks (e.g. raise_exception on role order) end up here.
            raise BadRow(f"the chat template refuses this conversation: {e}") from None

    def render_with_spans(self, messages: list[dict], train: list[bool] | None = None):
        """The rendered text and the (start, end) character spans that are targets.

        A target span runs from the end of the prompt that asks for the turn
        (the text rendered with add_generation_prompt) to the end of the turn,
        so it includes what the template writes after the content (e.g.
        <|im_end|>) but not trailing whitespace.
        """
        train = train or [m["role"] == "assistant" for m in messages]
        full = self.render(messages, False)
        spans, cursor = [], 0
        for i, m in enumerate(messages):
            if not train[i]:
                continue
            before = self._prompt_before(messages, i)
            through = full.rstrip() if i == len(messages) - 1 else self.render(messages[: i + 1], False).rstrip()
            if full.startswith(through) and through.startswith(before) and len(through) > len(before):
                spans.append((len(before), len(through)))
            else:  # a template that rewrites earlier turns: find the reply text itself
                start = full.find(m["content"], cursor)
                if start < 0:
                    raise BadRow(f"`messages[{i}]`: the chat template drops this assistant turn")
                spans.append((start, start + len(m["content"])))
            cursor = spans[-1][1]
        return full, spans

    def _prompt_before(self, messages: list[dict], i: int) -> str:
        if i:
            return self.render(messages[:i], True)
        try:  # an assistant turn first: some templates cannot render an empty conversation
            return self.render([], True)
        except BadRow:
            return ""
