"""Grammars compiled for the default model's tokenizer: the cache, the token mask, and drafts walked
through a matcher and rolled back."""

from __future__ import annotations

import pytest
import torch
import xgrammar

from segkv.layers.sampler import apply_logit_bias, apply_token_bitmask, mask_by_bits
from segkv.models.default_models import resolve_model_dir
from segkv.sampling_params import SamplingParams, StructuredOutput
from segkv.structured.grammar import GrammarCache, tokenizer_info
from segkv.structured.matcher import GrammarState, fill_bitmask, new_bitmask
from segkv.tokenizer.tokenizer import Tokenizer

VOCAB = 8192 + 64  # wider logits than the tokenizer's vocabulary, as padded embeddings are


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(resolve_model_dir("default"))


def test_tokenizer_info_is_byte_level_with_eos_stops(tokenizer):
    info = tokenizer_info(tokenizer, VOCAB)
    assert info.vocab_type == xgrammar.VocabType.BYTE_LEVEL and info.vocab_size == VOCAB
    assert set(info.stop_token_ids) == set(tokenizer.eos_token_ids)


def sentencepiece_tokenizer(directory) -> Tokenizer:
    """A tiny Llama/Mistral-style tokenizer: BPE over "▁"-joined words with byte fallback."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, trainers

    backend = Backend(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"]
    backend.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog"] * 50,
                                trainer=trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                            show_progress=False))
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}')
    return Tokenizer.from_dir(directory)


def test_sentencepiece_vocabulary_is_byte_fallback_with_a_prefix_space(tmp_path):
    tokenizer = sentencepiece_tokenizer(tmp_path)
    info = tokenizer_info(tokenizer, tokenizer.vocab_size)
    assert info.vocab_type == xgrammar.VocabType.BYTE_FALLBACK and info.add_prefix_space
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert info.decoded_vocab[ids[0]].startswith(b" hello")  # "\u2581" reads as a space
    assert info.decoded_vocab[tokenizer.bos_token_id] == b""  # special tokens never match text
    state = GrammarState(GrammarCache(tokenizer, tokenizer.vocab_size), StructuredOutput(regex=" hello [a-z]+"))
    assert all(state.accept(t) for t in ids) and state.accept(tokenizer.eos_token_ids[0]) and state.terminated


def test_cache_compiles_each_constraint_once_and_evicts_the_oldest(tokenizer):
    cache = GrammarCache(tokenizer, VOCAB, capacity=2)
    a, b, c = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
    first = cache.compile(a)
    assert cache.compile(StructuredOutput(regex="a+")) is first
    assert cache.stats() == {"hits": 1, "misses": 1, "size": 1}
    cache.compile(b)
    cache.compile(c)  # evicts a, the least recently used
    assert len(cache) == 2 and cache.compile(a) is not first and cache.misses == 4


def test_mask_allows_exactly_the_grammar_and_sampler_applies_it(tokenizer):
    cache = GrammarCache(tokenizer, VOCAB)
    state = GrammarState(cache, StructuredOutput(choice=["yes", "no"]))
    bitmask = fill_bitmask([state, None], VOCAB)
    logits = torch.randn(2, VOCAB)
    masked = apply_token_bitmask(logits, bitmask)
    bits = ((bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().reshape(2, -1)[:, :VOCAB]
    assert torch.equal(masked, logits.masked_fill(~bits, float("-inf"))) and torch.equal(masked[1], logits[1])
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    texts = {tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert fill_bitmask([None, None], VOCAB) is None


def test_logit_bias_adds_to_the_named_entries_only():
    logits = torch.randn(3, 50)
    params = [SamplingParams(logit_bias={4: 2.5, 7: -100}), SamplingParams(), SamplingParams(logit_bias={49: 1})]
    out = apply_logit_bias(logits, params)
    delta = out - logits
    assert delta[0, 4].item() == pytest.approx(2.5) and delta[0, 7].item() == pytest.approx(-100)
    assert delta[2, 49].item() == pytest.approx(1.0)
    assert torch.count_nonzero(delta) == 3
    assert apply_logit_bias(logits, [SamplingParams()] * 3) is logits


def test_drafts_stop_at_the_first_the_grammar_rejects_and_the_state_rolls_back(tokenizer):
    cache = GrammarCache(tokenizer, VOCAB)
    state = GrammarState(cache, StructuredOutput(regex="[0-9]{4}"))
    digits = [tokenizer.token_to_id(d) for d in "0123456789"]
    letter = tokenizer.token_to_id("x")
    bitmask = new_bitmask(4, VOCAB)
    assert state.draft_masks([digits[1], digits[2], letter], bitmask, 0) == 2
    reference = new_bitmask(1, VOCAB)
    state.fill(reference, 0)
    assert torch.equal(bitmask[0], reference[0])  # the state is where it was
    assert state.accept(digits[1]) and state.accept(digits[2])
    state.fill(reference, 0)
    assert torch.equal(bitmask[2], reference[0])  # row 2: after the two drafts taken
    assert not state.accept(letter)
    assert state.accept(digits[3]) and state.accept(digits[4])
    assert not state.terminated
    assert state.accept(tokenizer.eos_token_ids[0]) and state.terminated


def test_torch_unpacking_matches_xgrammar_on_every_bit():
    """The torch path (every device but the CPU) allows exactly the tokens xgrammar's CPU kernel
    does, bit 31 (the int32 sign bit) included, and its power: a mask shifted by one token differs."""
    logits = torch.randn(3, VOCAB)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (VOCAB + 31) // 32), dtype=torch.int32)
    bitmask[0] = -1  # everything allowed
    bitmask[1, 0] = -(2**31)  # only token 31 of the first word
    reference = apply_token_bitmask(logits, bitmask)  # the CPU: xgrammar's kernel
    out = mask_by_bits(logits, bitmask)
    assert torch.equal(out, reference) and torch.equal(out[0], logits[0])
    assert torch.isfinite(out[1, :32]).nonzero().flatten().tolist() == [31]
    shifted = mask_by_bits(logits, bitmask << 1)
    assert not torch.equal(shifted, reference)


@pytest.mark.gpu
def test_mask_on_cuda_matches_the_cpu_one():
    """On CUDA the bits are unpacked by torch operations: the same tokens stay allowed."""
    logits = torch.randn(4, VOCAB)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, (VOCAB + 31) // 32), dtype=torch.int32)
    on_cpu = apply_token_bitmask(logits, bitmask)
    assert torch.equal(apply_token_bitmask(logits.cuda(), bitmask).cpu(), on_cpu)
    assert torch.equal(apply_token_bitmask(logits.cuda(), bitmask.cuda()).cpu(), on_cpu)
