"""The typed run configuration: schema (fields, validation) and loader (YAML, overrides, errors)."""

from relaytune.config.checks import parse_duration, parse_timestamp
from relaytune.config.loader import field_help, load_config, parse_overrides
from relaytune.config.paths import saved_config_view
from relaytune.config.schema import BUILTIN_MODEL, TrainConfig

__all__ = ["BUILTIN_MODEL", "TrainConfig", "field_help", "load_config", "parse_duration",
           "parse_overrides", "parse_timestamp", "saved_config_view"]
