"""The grammar's bitmask in the sampler: unpacked bit for bit as llguidance packs it, applied
to the constrained rows only, on whatever device the logits are."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine.grammar_mask import GrammarMask, unpack
from pdserve.engine.sampler import Sampler, SamplingRequest
from pdserve.text.grammar import GrammarCompiler
from pdserve.text.tokenizer import Tokenizer
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.structured_output import StructuredOutput
from tests.utils.tiny_tokenizer import write_tiny_tokenizer

VOCAB = 333  # not a multiple of 32: the last word is partly past the vocabulary
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path, vocab_size=300)
    return Tokenizer.from_pretrained(path)


def test_unpack_reads_bit_t_of_word_t_over_32():
    allowed = torch.rand(3, VOCAB, generator=torch.Generator().manual_seed(0)) < 0.3
    packed = torch.zeros(3, (VOCAB + 31) // 32, dtype=torch.int64)
    for row, token in allowed.nonzero().tolist():
        packed[row, token // 32] |= 1 << (token % 32)
    bitmask = (packed - (packed >= 2**31) * 2**32).to(torch.int32)  # two's complement, as in memory
    assert torch.equal(unpack(bitmask, VOCAB), allowed)


@pytest.mark.parametrize("device", DEVICES)
def test_only_the_constrained_rows_are_masked(tokenizer, device):
    compiler = GrammarCompiler(tokenizer, VOCAB, [1])
    spec = StructuredOutput(choice=("yes", "no"))
    matcher = compiler.matcher(spec)
    allowed = unpack(torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)[None], VOCAB)[0]
    assert 0 < int(allowed.sum()) < 10
    logits = torch.randn(3, VOCAB, device=device)
    masked = logits.clone()
    GrammarMask().apply(masked, [(1, matcher)])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert torch.equal(masked[1].isfinite().cpu(), allowed)
    # The sampler picks among the allowed tokens only, greedy or not; the free rows are untouched.
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
    rows = [
        SamplingRequest(p, [5], [], None, matcher=m) for p, m in zip(params, [None, matcher, compiler.matcher(spec)])
    ]
    sampled = Sampler()(logits, rows).token_ids
    assert sampled[0] == int(logits[0].argmax()) and allowed[sampled[1]] and allowed[sampled[2]]


def test_each_spec_is_compiled_once_within_the_cache(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, [1], cache_size=2)
    specs = [StructuredOutput(json_schema=json.dumps({"enum": [i]})) for i in range(3)]
    for spec in [specs[0], specs[0], specs[1], specs[0]]:
        compiler.matcher(spec)
    assert compiler.num_compiled == 2
    compiler.matcher(specs[2])  # evicts specs[1], the least recently used
    compiler.matcher(specs[0])
    assert compiler.num_compiled == 3
    compiler.matcher(specs[1])
    assert compiler.num_compiled == 4
