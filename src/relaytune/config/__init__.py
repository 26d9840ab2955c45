"""The typed run configuration: schema (fields, validation) and loader (YAML, overrides, errors)."""

from relaytune.config.schema import BUILTIN_MODEL, HARMLESS_KEYS, TrainConfig, parse_duration, parse_timestamp
from relaytune.config.loader import field_help, load_config, parse_overrides

__all__ = ["BUILTIN_MODEL", "HARMLESS_KEYS", "TrainConfig", "field_help", "load_config", "parse_duration",
           "parse_overrides", "parse_timestamp"]
