"""The pure pieces of the text servers (trainer/deploy/serve_text.py, serve_generate.py): the length
bins and their padding bound, the server's tokenizer against training's encoding (truncation
included), the batch loop that groups waiting requests by length, and generation one token at a
time against `generate` without the cache."""

from __future__ import annotations

from queue import Empty

import numpy as np
import pytest
import torch

from trainer.deploy.serve_generate import cached_tokens
from trainer.deploy.serve_text import LengthBinnedLoop, TextTokenizer, length_bin, padded_width

pytest.importorskip("tokenizers")


@pytest.mark.parametrize("max_length", [128, 100, 512])
def test_no_text_is_padded_beyond_twice_its_length_in_its_bin(max_length):
    for tokens in range(1, max_length + 1):
        width = length_bin(tokens, max_length)
        assert tokens <= width <= max_length
        assert width <= max(8, 2 * tokens), (tokens, width)
        # the longest text of a bin, padded as a batch is, stays within the bin's width
        assert padded_width(tokens, max_length) <= width
    assert sorted({length_bin(n, 128) for n in range(1, 129)}) == [8, 16, 32, 64, 128]
    assert padded_width(9, 128) == 16 and padded_width(127, 128) == 128 and padded_width(3, 5) == 5


def test_the_servers_tokenizer_encodes_as_training_did_and_says_what_it_cut(tmp_path):
    from trainer.data.labelled_corpus import as_served, encode_texts, special_ids, train_wordpiece

    texts = ["import asyncio", "def f(x): return x + 1", " ".join(f"word{i}" for i in range(200))]
    tokenizer = train_wordpiece(texts * 5, 300)
    ids = special_ids(tokenizer, "test")
    rows, lengths, truncated = encode_texts(tokenizer, texts, ids, 32, np.dtype(np.int32))
    as_served(tokenizer, ids, 32).save(str(tmp_path / "tokenizer.json"))
    served = TextTokenizer(tmp_path / "tokenizer.json", 32, ids["[SEP]"])
    answers = [served(text) for text in texts]
    for row, length, (got, whole, cut) in zip(rows, lengths, answers):
        assert got == row[:length].tolist()
        assert cut == (whole > 32)
    assert truncated == 1 and answers[2][2] and len(answers[2][0]) == 32 and answers[2][1] > 200
    assert answers[0][1] == len(answers[0][0]) and not answers[0][2]


class _Queue:
    """The request queue as LitServe's worker sees it: get(timeout) and get_nowait."""

    def __init__(self, items):
        self.items = list(items)

    def get(self, timeout=None):
        return self.get_nowait()

    def get_nowait(self):
        if not self.items:
            raise Empty
        return self.items.pop(0)


class _API:
    max_batch_size, batch_timeout, request_timeout = 4, 0.0, -1


def _request(uid, bin_):
    return ("queue", uid, 0.0, {"bin": bin_})


def test_the_loop_answers_the_oldest_first_with_the_requests_of_its_bin():
    loop = LengthBinnedLoop()
    queue = _Queue([_request("a", 8), _request("b", 64), _request("c", 8), _request("d", 64), _request("e", 8),
                    _request("f", 8), _request("g", 64)])
    served = []
    for _ in range(6):
        batch, timed_out = loop.get_batch_requests(_API(), queue, None)
        assert not timed_out and len(loop._held) <= _API.max_batch_size
        if batch:
            assert len({payload["bin"] for _, _, payload in batch}) == 1
            served.append([uid for _, uid, _ in batch])
    # a, b, c, d held first (at most 4): a's bin (a, c); then b's, topped up with e, f (b, d); then e, f
    # topped up with g; g last: every request waits behind at most max_batch_size batches
    assert served == [["a", "c"], ["b", "d"], ["e", "f"], ["g"]]
    assert loop.get_batch_requests(_API(), queue, None) == ([], [])


def test_generation_one_token_at_a_time_equals_generate_without_the_cache():
    from trainer.models.gpt import GPT, generate

    pytest.importorskip("transformers")
    torch.manual_seed(0)
    net = GPT(vocab_size=50, max_positions=16, layers=2, heads=2, width=32).eval()
    prompt = torch.tensor([[1, 7, 3, 9, 4]])
    # 20 tokens: past the 16-position window, where the cache is refilled from the last window
    uncached = generate(net, prompt, 20, greedy=True, cache=False)[0, 5:].tolist()
    streamed = list(cached_tokens(net, prompt, 20, 0.0, None, torch.Generator().manual_seed(0)))
    assert streamed == uncached
    sampled = [list(cached_tokens(net, prompt, 12, 0.9, 5, torch.Generator().manual_seed(seed))) for seed in (1, 1, 2)]
    expected = generate(net, prompt, 12, temperature=0.9, top_k=5, generator=torch.Generator().manual_seed(1))
    assert sampled[0] == sampled[1] == expected[0, 5:].tolist() and sampled[2] != sampled[0]


def test_the_export_lines_name_conv_bn_folding_only_where_a_pair_was_folded(tmp_path):
    """An encoder or a GPT has no Conv-BN pair: its export says nothing of folding (it printed
    "Conv-BN folding: N modules -> N"); an image model whose pairs folded still says how many."""
    from trainer.deploy.export import Exported

    def lines(before: int, after: int) -> str:
        return "\n".join(Exported(tmp_path, tmp_path / "best.ckpt", {"onnx": tmp_path / "model.onnx"}, {"onnx": 1e-6},
                                  8, (before, after)).lines())

    assert "Conv-BN" not in lines(40, 40)
    assert "Conv-BN folding: 40 modules -> 34" in lines(40, 34)
