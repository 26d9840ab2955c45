"""Training data, one door: `prepare_data(cfg, tokenizer)` reads, checks, tokenizes (cached), packs."""

from relaytune.data.prepare import IGNORE, Prepared, TokenRow, prepare_data

__all__ = ["IGNORE", "Prepared", "TokenRow", "prepare_data"]
