"""Test helper: one normalised sample -> (ids, labels) as lists, as the pipeline tokenizes it."""

from relaytune.data.formats import BadRow
from relaytune.data.templates import resolve
from relaytune.data.tokenize import tokenize_samples


def tokenize(sample: dict, tokenizer, train_on_inputs: bool = False, template: str | None = None):
    """Token ids and labels for one normalised row, with the tokenizer's own template unless
    `template` names another; a row the pipeline would quarantine raises its BadRow."""
    (result,) = tokenize_samples([sample], tokenizer, resolve(template, tokenizer), train_on_inputs)
    if isinstance(result, BadRow):
        raise result
    return result[0].tolist(), result[1].tolist()
