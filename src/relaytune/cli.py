"""`relaytune` command line: a thin shell over the Python API.

Each command lives in `relaytune.commands.<module>` with `add_parser(subparsers)`, which
returns its sub-parser, and `run(args)`; this file only lists them. Command modules
import torch inside `run`, so `relaytune status` and every `--help` stay fast.

Exit codes (the contract, carried by the exceptions in errors.py): 0 finished or
already finished; 75 stopped early on purpose with a checkpoint committed; 2 bad
configuration or data; 1 anything else.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from relaytune.errors import StoppedEarly
from relaytune.training.stops import STOP_SIGNALS

# Modules of relaytune.commands, in the order `relaytune --help` lists them.
COMMANDS = ("plan", "train", "data", "evaluate", "compare", "export", "status", "demo")
# Commands still being written: left out of the CLI while they do not import.
OPTIONAL = frozenset({"plan"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relaytune",
        description="LoRA/QLoRA fine-tuning that continues exactly where it stopped.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"relaytune.commands.{name}")
        except Exception:
            if name in OPTIONAL:
                continue
            raise
        module.add_parser(sub).set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except KeyboardInterrupt:
        # Ctrl-C in a command other than train (whose signals stop the run with exit 75): one line and
        # the shell's code for an interrupt, not a traceback.
        print(f"relaytune: {args.command} interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        code = getattr(e, "exit_code", None)
        if not isinstance(code, int):
            raise
        if isinstance(e, StoppedEarly):
            # The checkpoint is committed: a late second signal must not turn exit 75 into 130 or 143.
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            print(f"relaytune: {e}; run the same command again to continue", file=sys.stderr)
        else:
            print(f"relaytune: error: {e}", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
