"""`relaytune` command line: a thin shell over the Python API.

Exit codes (the contract): 0 finished or already finished; 75 stopped early on
purpose with a checkpoint committed; 2 bad configuration or data; 1 anything else.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from relaytune.errors import StoppedEarly, TrainingDiverged, UserError

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_STOPPED = 0, 1, 2, 75


def _config_epilog() -> str:
    from relaytune.config.loader import field_help

    lines = ["configuration keys (YAML, or key=value after the config path):", ""]
    for key, default, doc in field_help():
        lines.append(f"  {key}  (default: {default})")
        lines += textwrap.wrap(doc, width=88, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relaytune",
        description="LoRA/QLoRA fine-tuning that continues exactly where it stopped.")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train", help="train, or continue the run in output_dir",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_config_epilog(),
        description="Train, or continue the run in the config's output_dir. Re-running after any "
                    "interruption continues from the newest valid checkpoint; re-running a "
                    "finished run does nothing.")
    t.add_argument("config", help="YAML config file")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    t.add_argument("--fresh", action="store_true",
                   help="start a new run; refused if output_dir already holds checkpoints")
    c = sub.add_parser(
        "data", help="check the data and print statistics, without loading the model",
        description="Read, check and tokenize the training data exactly as `train` would (tokenizer "
                    "only, no model), write bad rows to output_dir/quarantine.jsonl, fill the "
                    "tokenization cache, and print statistics. Exit 2 if the data is unusable.")
    c.add_argument("config", help="YAML config file")
    c.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    e = sub.add_parser("eval", help="eval loss and perplexity of each checkpoint (cached)",
                       description="Eval loss and perplexity of each committed checkpoint and final/, on "
                                   "the run's eval split or a given file, with training's own data "
                                   "pipeline and masks. Cached in RUN_DIR/eval_cache.json by adapter "
                                   "content, so a re-run evaluates only new checkpoints.")
    e.add_argument("run_dir", help="the run's output_dir")
    e.add_argument("--checkpoints", help="comma list of step-N, final, best, latest (default: all)")
    e.add_argument("--data", help="a data file to evaluate on instead of the run's eval split")
    e.add_argument("--config", help="the run's config file, if no checkpoint holds it")
    e.add_argument("--no-base", action="store_true", help="leave out the base model (no adapter) row")
    g = sub.add_parser("compare", help="generate from the base model and checkpoints on the same prompts",
                       description="Generate from the base model and each chosen checkpoint on the same "
                                   "prompts, with the run's chat template; side by side in the terminal "
                                   "and in a Markdown report. Greedy unless --temperature is given; "
                                   "rows with a `reference` are scored (exact match, contains).")
    g.add_argument("run_dir", help="the run's output_dir")
    g.add_argument("--prompts", required=True,
                   help="jsonl with `prompt` (or `messages`) and optional `reference`, or a text file, one per line")
    g.add_argument("--checkpoints", help="comma list of step-N, final, best, latest (default: all)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per answer (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above 0: sampling")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0 (default): none")
    g.add_argument("--seed", type=int, default=0, help="sampling seed, reset before every model x prompt")
    g.add_argument("--report", help="Markdown report path (default: RUN_DIR/compare-TIME.md)")
    g.add_argument("--config", help="the run's config file, if no checkpoint holds it")
    x = sub.add_parser("export", help="export an adapter, or a merged model, ready to load",
                       description="Write a checkpoint as a PEFT adapter folder with the tokenizer and "
                                   "chat template, or with --merge as a full model (adapter merged into "
                                   "the full-precision base, sharded safetensors) for "
                                   "AutoModelForCausalLM.from_pretrained.")
    x.add_argument("run_dir", help="the run's output_dir")
    x.add_argument("--out", required=True, help="new folder to write")
    x.add_argument("--checkpoint", help="step-N, final, best or latest (default: final, else latest)")
    x.add_argument("--merge", action="store_true", help="merge into the base and write a full model")
    x.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard of a merged model (default 5GB)")
    x.add_argument("--dtype", default="auto", help="merged weights: auto (the base's), float32, bfloat16, float16")
    x.add_argument("--base", help="full-precision base model to merge into (default: the run's model)")
    x.add_argument("--config", help="the run's config file, if no checkpoint holds it")
    s = sub.add_parser("status", help="progress, ETA, checkpoints, sessions and a plot; works while training",
                       description="Where a run stands, from any shell, also while it trains: steps and "
                                   "ETA, checkpoints (size, age, eval loss, verified), sessions and how "
                                   "each ended, mirror state; writes a loss/learning-rate plot PNG.")
    s.add_argument("run_dir", help="the run's output_dir")
    s.add_argument("--no-verify", action="store_true", help="skip re-hashing checkpoint files (faster)")
    s.add_argument("--no-plot", action="store_true", help="do not write the plot PNG")
    d = sub.add_parser("demo", help="fine-tune the built-in model on the built-in data and show before/after")
    d.add_argument("--output-dir", default="runs/demo", help="where the demo run goes (default: runs/demo)")
    d.add_argument("overrides", nargs="*", metavar="key=value", help="override demo config keys")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            from relaytune.training.recipe import train

            train(args.config, fresh=args.fresh, **_overrides(args.overrides))
        elif args.command == "data":
            from relaytune.commands.data import check_data

            check_data(args.config, _overrides(args.overrides))
        elif args.command == "eval":
            from relaytune.commands.evaluate import main as eval_main

            eval_main(args)
        elif args.command == "compare":
            from relaytune.commands.compare import main as compare_main

            compare_main(args)
        elif args.command == "export":
            from relaytune.commands.export import main as export_main

            export_main(args)
        elif args.command == "status":
            from relaytune.commands.status import main as status_main

            status_main(args)
        elif args.command == "demo":
            from relaytune.commands.demo import run_demo

            run_demo(args.output_dir, args.overrides)
        return EXIT_OK
    except UserError as e:
        print(f"relaytune: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except StoppedEarly as e:
        print(f"relaytune: {e}; run the same command again to continue", file=sys.stderr)
        return EXIT_STOPPED
    except TrainingDiverged as e:
        print(f"relaytune: error: {e}", file=sys.stderr)
        return EXIT_FAIL


def _overrides(items: list[str]) -> dict:
    from relaytune.config.loader import parse_overrides

    return parse_overrides(items)


if __name__ == "__main__":
    sys.exit(main())
