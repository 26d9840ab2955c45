"""`relaytune compare RUN_DIR --prompts FILE`: the same prompts through the base model and
each chosen checkpoint, side by side, plus a Markdown report.

Reproducible by construction: greedy decoding unless a temperature is given, and
with sampling the RNG is re-seeded before every (model, prompt) pair, so adding a
checkpoint or a prompt does not change the other outputs. Every decoding setting
is written into the report. Prompts go through the model's chat template, as the
training rows did.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import shutil
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from relaytune import atomic
from relaytune.atomic import MANIFEST
from relaytune.commands.run_folder import run_folder
from relaytune.errors import UserError
from relaytune.log import warn
from relaytune.run_dir import RunDir, load_adapter_slot, put_adapter, run_config, select

DESCRIPTION = ("Generate from the base model and each chosen checkpoint on the same prompts, with the run's "
               "chat template; side by side in the terminal and in a Markdown report. Greedy unless "
               "--temperature is given; rows with a `reference` are scored (exact match, contains).")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("compare", help="generate from the base model and checkpoints on the same prompts",
                              description=DESCRIPTION)
    p.add_argument("run_dir", help="the run's output_dir")
    p.add_argument("--prompts", required=True,
                   help="jsonl with `prompt` (or `messages`) and optional `reference`, or a text file, one per line")
    p.add_argument("--checkpoints", help="comma list of step-N, final, best, latest (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per answer (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above 0: sampling")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0 (default): none")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, reset before every model x prompt")
    p.add_argument("--report", help="Markdown report path (default: RUN_DIR/compare-TIME.md)")
    p.add_argument("--config", help="the run's config file, if no checkpoint holds it")
    return p


def run(args: argparse.Namespace) -> None:
    d = Decoding(args.max_new_tokens, args.temperature, args.top_p, args.repetition_penalty, args.seed)
    result = compare_run(args.run_dir, args.prompts, args.checkpoints, d, args.report, args.config)
    print(side_by_side(result))
    print(f"report: {result.report}" if result.report else "report: not written (see the warning above)")


@dataclass
class Decoding:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError("--max-new-tokens must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.repetition_penalty <= 0:
            raise UserError("decoding: --temperature >= 0, 0 < --top-p <= 1 and --repetition-penalty > 0")


@dataclass
class Prompt:
    messages: list[dict]
    reference: str | None = None

    @property
    def text(self) -> str:
        return self.messages[-1]["content"]


@dataclass
class Comparison:
    prompts: list[Prompt]
    outputs: dict[str, list[str]]  # model name -> one output per prompt
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> {exact, contains}
    report: Path | None = None  # None: not written (an unwritable place); the results were printed


def read_prompts(path: str | Path) -> list[Prompt]:
    """.jsonl rows with `prompt` (or `messages`) and optional `reference`; or plain text, one per line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--prompts: {p} not found")
    lines = [ln for ln in _read_text(p).splitlines() if ln.strip()]
    if p.suffix not in (".jsonl", ".json"):
        return [Prompt([{"role": "user", "content": ln}]) for ln in lines]
    prompts = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError as e:
            raise UserError(f"{p}:{i}: not JSON ({e})") from None
        ref = row.get("reference") if isinstance(row, dict) else None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else [])
            messages.append({"role": "user", "content": row["prompt"]})
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            messages = list(row["messages"])
            if messages[-1].get("role") == "assistant":  # a training row: its answer is the reference
                ref = ref if ref is not None else messages[-1].get("content")
                messages = messages[:-1]
        else:
            messages = []
        if not messages:
            raise UserError(f"{p}:{i}: a row needs `prompt` (text) or `messages` (a list)")
        if ref is not None and not isinstance(ref, str):
            raise UserError(f"{p}:{i}: `reference` must be text")
        prompts.append(Prompt(messages, ref))
    if not prompts:
        raise UserError(f"--prompts: {p} holds no prompts")
    return prompts


def _read_text(p: Path) -> str:
    """The file as text; a UserError naming the file, the line and the byte where it is not UTF-8."""
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise UserError(f"--prompts: cannot read {p} ({e.strerror or e})") from None
    bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        return raw.decode("utf-8-sig")  # an editor's UTF-8 byte order mark is not part of the first prompt
    except UnicodeDecodeError as e:
        at = bom + e.start
        line = raw.count(b"\n", 0, at) + 1
        utf16 = raw[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
        raise UserError(f"--prompts: {p}:{line}: not UTF-8 text (byte {raw[at]:#04x} at offset {at})"
                        + ("; it looks like UTF-16: save it as UTF-8" if utf16 else "")) from None


def compare_run(run: str | Path, prompts_file: str | Path, checkpoints: str | None = None,
                decoding: Decoding | None = None, report: str | Path | None = None,
                config: str | None = None) -> Comparison:
    from relaytune.data.templates import resolve

    out = run_folder(run, "compare", option="--checkpoints")
    cfg = run_config(out, config)
    decoding = decoding or Decoding()
    decoding.check()
    prompts = read_prompts(prompts_file)
    refs = select(out, checkpoints)
    # Checked before the model loads: minutes of generation must not end in a report that cannot be written.
    path = report_path(out, report)
    model, tokenizer, precision = load_adapter_slot(cfg)
    model.config.use_cache = True  # training turns the KV cache off; generation wants it
    template = resolve(cfg.chat_template, tokenizer)
    outputs: dict[str, list[str]] = {}
    with model.disable_adapter():
        outputs["base"] = [generate_answer(model, tokenizer, template, p, decoding, precision) for p in prompts]
    for ref in refs:
        put_adapter(model, ref)
        outputs[ref.name] = [generate_answer(model, tokenizer, template, p, decoding, precision) for p in prompts]
    result = Comparison(prompts, outputs, score(prompts, outputs))
    if path is not None:
        result.report = write_report(path, markdown(result, cfg, decoding, refs, template.name))
    return result


def report_path(out: Path, report: str | Path | None) -> Path | None:
    """Where the report will go. An explicit --report that cannot be written is refused (it was asked for);
    the default one in a run folder that cannot be written (Kaggle's read-only /kaggle/input) is skipped
    with a warning: the results are printed anyway. None: no report."""
    if report:
        path = Path(report).expanduser()
        problem = unwritable(path)
        if problem:
            raise UserError(f"--report {report}: {problem}")
        return path
    path = RunDir(out).compare_report(time.strftime("%Y%m%d-%H%M%S"))
    problem = unwritable(path)
    if problem:
        warn(f"no report: {problem}; the results are only printed (--report PATH writes one elsewhere)")
        return None
    return path


def unwritable(path: Path) -> str | None:
    """Why the file `path` could not be written, found without writing anything; None if it looks writable."""
    if path.is_dir():
        return f"{path} is a folder; give a file path such as {path / 'compare.md'}"
    parent = next(p for p in path.absolute().parents if p.exists())  # folders still missing are created
    if not parent.is_dir():
        return f"{parent} is a file, not a folder"
    # A file added to a committed folder is not in its manifest: the next resume would set it aside.
    if (path.parent / MANIFEST).is_file():
        return f"{path.parent} is a committed adapter folder (it holds {MANIFEST}); nothing may be added to it"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot write in {parent} (read-only or no permission)"
    return None


def write_report(path: Path, text: str) -> Path | None:
    """The report written, or None with a warning: a late failure (a full disk) must not lose the results."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.replace_file(path, text)
    except OSError as e:
        warn(f"cannot write the report {path} ({e.strerror or e}); the results are only printed")
        return None
    return path


def prompt_ids(tokenizer, template, messages: list[dict]) -> list[int]:
    """The generation prompt rendered as training rendered its rows (same template, same encoding)."""
    from relaytune.data.formats import BadRow
    from relaytune.data.templates import Renderer

    if template.text is not None:
        try:
            text = Renderer(template, tokenizer).render(messages, True)
        except BadRow as e:
            raise UserError(f"--prompts: {e}") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    # the plain format of relaytune.data.tokenize._plain, piece by piece as it encodes
    pieces = [p for m in messages for p in (f"### {m['role'].capitalize()}:\n", m["content"] + "\n\n")]
    pieces.append("### Assistant:\n")
    return [t for piece in pieces for t in tokenizer(piece, add_special_tokens=False)["input_ids"]]


def generate_answer(model, tokenizer, template, prompt: Prompt, d: Decoding, precision) -> str:
    """One model's answer to one prompt, decoded exactly as `d` says."""
    import torch
    from transformers import GenerationConfig

    ids = torch.tensor([prompt_ids(tokenizer, template, prompt.messages)], device=precision.device)
    eos = {tokenizer.eos_token_id} | _as_set(getattr(model.generation_config, "eos_token_id", None))
    # Every knob set explicitly, so the model's own generation_config cannot change the decoding.
    gen = GenerationConfig(
        max_new_tokens=d.max_new_tokens, do_sample=not d.greedy,
        temperature=d.temperature if not d.greedy else None, top_p=d.top_p if not d.greedy else None,
        top_k=None, repetition_penalty=d.repetition_penalty,
        eos_token_id=sorted(e for e in eos if e is not None), pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(d.seed)  # per (model, prompt): outputs do not depend on what ran before
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def _as_set(v) -> set:
    return set(v) if isinstance(v, (list, tuple)) else ({v} if v is not None else set())


def normalise(text: str) -> str:
    """Case, surrounding space and trailing punctuation do not count."""
    return " ".join(text.casefold().split()).strip(" .!?\"'")


def score(prompts: list[Prompt], outputs: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    """Exact match and contains rates over the prompts that carry a reference."""
    idx = [i for i, p in enumerate(prompts) if p.reference is not None]
    if not idx:
        return {}
    scores = {}
    for name, outs in outputs.items():
        exact = sum(normalise(outs[i]) == normalise(prompts[i].reference) for i in idx)
        contains = sum(normalise(prompts[i].reference) in normalise(outs[i]) for i in idx)
        scores[name] = {"exact": exact / len(idx), "contains": contains / len(idx), "n": len(idx)}
    return scores


def side_by_side(result: Comparison, width: int | None = None) -> str:
    """Terminal view: one column per model, or stacked when the terminal is too narrow."""
    width = width or shutil.get_terminal_size((120, 20)).columns
    names = list(result.outputs)
    col = (width - 3 * (len(names) - 1)) // len(names)
    lines = []
    for i, p in enumerate(result.prompts):
        lines.append("=" * min(width, 100))
        lines.append(f"[{i + 1}] {p.text}" + (f"   (reference: {p.reference})" if p.reference is not None else ""))
        if col < 24:
            for n in names:
                lines.append(f"--- {n}")
                lines += textwrap.wrap(result.outputs[n][i], width) or [""]
            continue
        cells = [[n, "-" * min(col, len(n) + 2)] + (textwrap.wrap(result.outputs[n][i], col) or [""])
                 for n in names]
        for row in range(max(len(c) for c in cells)):
            lines.append(" | ".join((c[row] if row < len(c) else "").ljust(col) for c in cells).rstrip())
    if result.scores:
        lines.append("=" * min(width, 100))
        lines.append("scores over prompts with a reference:")
        for n, s in result.scores.items():
            lines.append(f"  {n:<12} exact {s['exact']:.0%}   contains {s['contains']:.0%}   (n={s['n']})")
    return "\n".join(lines)


def markdown(result: Comparison, cfg, d: Decoding, refs, template_name: str) -> str:
    fence = "````"  # outputs may contain ``` themselves
    md = ["# relaytune compare", "",
          f"- run: `{cfg.output_dir}`", f"- base model: `{cfg.model}`",
          f"- generated: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", "",
          "## Decoding", "", "| setting | value |", "|---|---|",
          f"| strategy | {'greedy' if d.greedy else 'sampling'} |",
          f"| max_new_tokens | {d.max_new_tokens} |",
          f"| temperature | {d.temperature if not d.greedy else '- (greedy)'} |",
          f"| top_p | {d.top_p if not d.greedy else '- (greedy)'} |",
          f"| repetition_penalty | {d.repetition_penalty} |",
          f"| seed | {d.seed} (re-seeded before every model x prompt) |",
          f"| prompt format | chat template: {template_name} (as in training) |",
          "", "## Models", "", "| name | adapter | sha256 |", "|---|---|---|", "| base | none | - |"]
    md += [f"| {r.name} | `{r.path}` | {r.sha256[:12]} |" for r in refs]
    if result.scores:
        md += ["", "## Scores (prompts with a reference; case, spaces and end punctuation ignored)", "",
               "| model | exact match | contains | n |", "|---|---|---|---|"]
        md += [f"| {n} | {s['exact']:.1%} | {s['contains']:.1%} | {s['n']} |" for n, s in result.scores.items()]
    md += ["", "## Outputs"]
    for i, p in enumerate(result.prompts):
        md += ["", f"### Prompt {i + 1}", "", fence + "text", p.text, fence]
        if p.reference is not None:
            md += ["", f"Reference: `{p.reference}`"]
        for name, outs in result.outputs.items():
            md += ["", f"**{name}**", "", fence + "text", outs[i], fence]
    return "\n".join(md) + "\n"

