"""Data: tasks (synthetic arithmetic, JSONL math), tokenizers, answer checking, and Grain pipelines."""

from jopd.data.answers import extract_answer, is_correct, parse_number
from jopd.data.arithmetic import ArithmeticConfig, ArithmeticTrain, heldout_problems
from jopd.data.chat import prompt_ids, prompt_response_ids
from jopd.data.math_jsonl import load_math_jsonl
from jopd.data.pipeline import (DataConfig, encode_problem, heldout_dataset, load_problems, train_dataset,
                                train_iterator)
from jopd.data.problem import Problem
from jopd.data.toy_tokenizer import build_toy_tokenizer, special_token_ids

__all__ = [
    "ArithmeticConfig", "ArithmeticTrain", "DataConfig", "Problem", "build_toy_tokenizer", "encode_problem",
    "extract_answer", "heldout_dataset", "heldout_problems", "is_correct", "load_math_jsonl", "load_problems",
    "parse_number", "prompt_ids", "prompt_response_ids", "special_token_ids", "train_dataset", "train_iterator",
]
