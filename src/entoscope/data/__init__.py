"""Prompt sets, counterfactual pairs, labels and answer tokens; built-in tasks; tokenising and batching."""

from .examples import Dataset, Example
from .loading import DataSpec, load_data, read_records
from .tokenized import Batch, TokenizedData, make_batches, tokenize_data

__all__ = ["Batch", "DataSpec", "Dataset", "Example", "TokenizedData", "load_data", "make_batches",
           "read_records", "tokenize_data"]
