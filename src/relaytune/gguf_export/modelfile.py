"""`write_modelfile`: an Ollama Modelfile beside a GGUF, so `ollama create NAME -f Modelfile` works.

Ollama renders prompts with Go templates, not Jinja, so the chat template is translated
for the families we know by their markers: ChatML (SmolLM2, Qwen2), the Llama 3 header
format, and Mistral's [INST]. A default system prompt that the Jinja template inserts
when none is given (SmolLM2, Qwen2.5) becomes the Modelfile's SYSTEM, so Ollama sends
the prompt the model was trained with. Other templates get FROM and the stop lines,
and a comment saying the TEMPLATE must be written by hand.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CHATML = """{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ if $last }}<|im_start|>assistant
{{ end }}
{{- else if eq .Role "assistant" }}<|im_start|>assistant
{{ .Content }}{{ if not $last }}<|im_end|>
{{ end }}
{{- end }}
{{- end }}"""

LLAMA3 = """{{- if .System }}<|start_header_id|>system<|end_header_id|>

{{ .System }}<|eot_id|>
{{- end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- if $last }}<|start_header_id|>assistant<|end_header_id|>

{{ end }}
{{- else if eq .Role "assistant" }}<|start_header_id|>assistant<|end_header_id|>

{{ .Content }}{{ if not $last }}<|eot_id|>{{ end }}
{{- end }}
{{- end }}"""

MISTRAL = """{{- range $i, $_ := .Messages }}
{{- if eq .Role "user" }}
{{- if and $.System (eq (len (slice $.Messages $i)) 1) }}[INST] {{ $.System }}

{{ .Content }}[/INST]
{{- else }}[INST] {{ .Content }}[/INST]
{{- end }}
{{- else if eq .Role "assistant" }} {{ .Content }}</s>
{{- end }}
{{- end }}"""

# family -> (marker in the Jinja template, Go template, stops, regex of a rendered default system prompt)
FAMILIES = {
    "chatml": ("<|im_start|>", CHATML, ["<|im_start|>", "<|im_end|>"],
               r"<\|im_start\|>system\n(.*?)<\|im_end\|>"),
    "llama3": ("<|start_header_id|>", LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               r"<\|start_header_id\|>system<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>"),
    "mistral": ("[INST]", MISTRAL, ["[INST]", "[/INST]"], None),
}
PROBE = "relaytune-probe-user-message"


def write_modelfile(gguf_file: Path, chat_template: str | None, stop_tokens: list[str],
                    out_dir: Path) -> Path:
    """Write `out_dir/Modelfile` for `gguf_file` (FROM is relative to out_dir); returns its path."""
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    family = template_family(chat_template)
    lines = [f"FROM ./{Path(os.path.relpath(gguf_file, out_dir)).as_posix()}", ""]
    stops = list(FAMILIES[family][2]) if family else []
    stops += [s for s in stop_tokens if s and s not in stops]
    if family:
        lines += [f'TEMPLATE """{FAMILIES[family][1]}"""', ""]
        system = default_system_prompt(chat_template, FAMILIES[family][3])
        if system:
            lines += [f'SYSTEM """{system}"""', ""]
    else:
        lines += ["# The chat template of this model is not one relaytune can translate to Ollama's",
                  "# Go template syntax (ChatML, Llama 3, Mistral [INST]); add a TEMPLATE \"\"\"...\"\"\"",
                  "# block by hand, following the model's tokenizer_config.json chat_template.", ""]
    lines += [f"PARAMETER stop {_quote(s)}" for s in stops]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "Modelfile"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def template_family(chat_template: str | None) -> str | None:
    if not isinstance(chat_template, str):
        return None
    for family, (marker, *_rest) in FAMILIES.items():
        if marker in chat_template:
            return family
    return None


def default_system_prompt(chat_template: str, pattern: str | None) -> str | None:
    """The system prompt the Jinja template adds when the conversation has none, if any."""
    if not pattern:
        return None
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(ValueError(message))
        env.globals["strftime_now"] = lambda fmt: "26 Jul 2024"
        text = env.from_string(chat_template).render(
            messages=[{"role": "user", "content": PROBE}], add_generation_prompt=True,
            bos_token="", eos_token="")
    except (TemplateError, ValueError, TypeError, LookupError, AttributeError):
        # A template that needs tools, dates or other inputs we do not give has no default to report.
        return None
    head = text.split(PROBE, 1)[0]
    found = re.search(pattern, head, re.DOTALL)
    return found.group(1) if found else None


def _quote(stop: str) -> str:
    return '"' + stop.replace("\\", "\\\\").replace('"', '\\"') + '"'
