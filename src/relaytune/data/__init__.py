"""Training data, one door: `prepare_data(cfg, tokenizer)` reads, checks, tokenizes (cached), packs."""

from relaytune.data.assemble import Prepared, TokenRows
from relaytune.data.prepare import prepare_data
from relaytune.data.rows import IGNORE, TokenRow

__all__ = ["IGNORE", "Prepared", "TokenRow", "TokenRows", "prepare_data"]
