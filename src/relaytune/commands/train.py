"""`relaytune train CONFIG [key=value ...]`: train, or continue the run in output_dir."""

from __future__ import annotations

import argparse
import textwrap

DESCRIPTION = ("Train, or continue the run in the config's output_dir. Re-running after any interruption "
               "continues from the newest valid checkpoint; re-running a finished run does nothing.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train, or continue the run in output_dir",
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=config_epilog(),
                              description=DESCRIPTION)
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    p.add_argument("--fresh", action="store_true",
                   help="start a new run; refused if output_dir already holds checkpoints")
    return p


def config_epilog() -> str:
    """Every configuration key with its default and docstring, for `relaytune train --help`."""
    from relaytune.config import field_help

    lines = ["configuration keys (YAML, or key=value after the config path):", ""]
    for key, default, doc in field_help():
        lines.append(f"  {key}  (default: {default})")
        lines += textwrap.wrap(doc, width=88, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> None:
    from relaytune.training import stops

    with stops.exit_follows(), stops.leave_setup_at_once():
        from relaytune.config import parse_overrides
        from relaytune.training.recipe import train  # torch: imported only to train

        train(args.config, fresh=args.fresh, **parse_overrides(args.overrides))
