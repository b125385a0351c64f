"""Text to token ids and back: the tokenizer with its chat template, and the detokenizer."""

from segkv.tokenizer.detokenizer import IncrementalDetokenizer, StopChecker
from segkv.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopChecker", "Tokenizer"]
