"""`relaytune` command line: a thin shell over the Python API.

Exit codes (the contract): 0 finished or already finished; 75 stopped early on
purpose with a checkpoint committed; 2 bad configuration or data; 1 anything else.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from .errors import StoppedEarly, UserError

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_STOPPED = 0, 1, 2, 75


def _config_epilog() -> str:
    from .config_loader import field_help

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
    d = sub.add_parser("demo", help="fine-tune the built-in model on the built-in data and show before/after")
    d.add_argument("--output-dir", default="runs/demo", help="where the demo run goes (default: runs/demo)")
    d.add_argument("overrides", nargs="*", metavar="key=value", help="override demo config keys")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            from .train import train

            train(args.config, fresh=args.fresh, **_overrides(args.overrides))
        elif args.command == "demo":
            from .demo import run_demo

            run_demo(args.output_dir, args.overrides)
        return EXIT_OK
    except UserError as e:
        print(f"relaytune: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except StoppedEarly as e:
        print(f"relaytune: {e}; run the same command again to continue", file=sys.stderr)
        return EXIT_STOPPED


def _overrides(items: list[str]) -> dict:
    from .config_loader import parse_overrides

    return parse_overrides(items)


if __name__ == "__main__":
    sys.exit(main())
