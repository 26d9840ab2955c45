#!/usr/bin/env python3
"""Generate the built-in demo data: dates written out in English -> ISO 8601 (YYYY-MM-DD).

SmolLM2-135M-Instruct, asked to do this, echoes the date, reformats it some other way
or rambles; it scores 0% exact match on the held-out prompts. A short LoRA run teaches
it the skill (month name -> number, zero padding, reordering) and the strict format
(the date alone, nothing else).

Deterministic: a fixed seed and no dependence on the clock or locale (month and weekday
names come from tables here, not strftime), so re-running rewrites identical bytes.
Held-out dates are drawn from a set disjoint from the training dates, so no held-out
prompt (nor its answer) occurs in training.

    python scripts/make_demo_data.py [OUT_DIR]   # default: src/relaytune/demo_data
"""

from __future__ import annotations

import datetime
import json
import random
import sys
from pathlib import Path

SEED = 20240305
N_TRAIN = 400
N_HELDOUT = 100
FIRST, LAST = datetime.date(1900, 1, 1), datetime.date(2099, 12, 31)

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
INSTRUCTIONS = [
    "Rewrite this date in ISO format (YYYY-MM-DD): {}",
    "Convert the date to YYYY-MM-DD: {}",
    "Write {} as an ISO 8601 date.",
]


def ordinal(n: int) -> str:
    suffix = "th" if 11 <= n % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def spell(d: datetime.date, style: int) -> str:
    """The date in one of several unambiguous English spellings."""
    m = MONTHS[d.month - 1]
    return [
        f"{m} {d.day}, {d.year}",                                # March 5, 2021
        f"{d.day} {m} {d.year}",                                 # 5 March 2021
        f"{m[:3]} {d.day}, {d.year}",                            # Mar 5, 2021
        f"{WEEKDAYS[d.weekday()]}, {m} {d.day}, {d.year}",       # Friday, March 5, 2021
        f"the {ordinal(d.day)} of {m} {d.year}",                 # the 5th of March 2021
    ][style]


def row(rng: random.Random, d: datetime.date) -> dict:
    prompt = rng.choice(INSTRUCTIONS).format(spell(d, rng.randrange(5)))
    return {"messages": [{"role": "user", "content": prompt},
                         {"role": "assistant", "content": d.isoformat()}]}


def make(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    span = (LAST - FIRST).days + 1
    days = rng.sample(range(span), N_TRAIN + N_HELDOUT)  # distinct dates: train and held-out never share one
    dates = [FIRST + datetime.timedelta(days=k) for k in days]
    return [row(rng, d) for d in dates[:N_TRAIN]], [row(rng, d) for d in dates[N_TRAIN:]]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "src" / "relaytune" / "demo_data"
    train, heldout = make()
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "heldout.jsonl", heldout)
    print(f"wrote {len(train)} training rows and {len(heldout)} held-out rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
