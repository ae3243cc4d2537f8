"""The text a client sees, without a server: incremental detokenization never splits a UTF-8 character, a
stop string is cut (and held back while it may still be forming), and log-probabilities take the OpenAI
shapes (the completions API's parallel lists, chat's content list)."""

from __future__ import annotations

import pytest

from qwen_mtp.engine.update import TokenLogprob
from qwen_mtp.serve.responses import chat_logprobs, legacy_logprobs
from qwen_mtp.serve.text import TextAssembler
from qwen_mtp.testing import build_checkpoint


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_checkpoint(tmp_path_factory.mktemp("tok"))))


def stream(tokenizer, text: str, stop: tuple[str, ...] = ()) -> list[str]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assembler = TextAssembler(tokenizer.decode, stop)
    return [assembler.push([t]) for t in ids] + [assembler.finish()]


def test_streamed_pieces_join_to_the_text_and_never_split_a_character(tokenizer):
    text = "héllo wörld 😀 done"
    pieces = stream(tokenizer, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


@pytest.mark.parametrize(
    ("text", "stop", "want"),
    [
        ("Hello world! How are you", ("How",), "Hello world! "),
        ("Hello world! How are you", ("zzz", "world"), "Hello "),
        ("Hello world! How are you", ("you!",), "Hello world! How are you"),  # never completed: all of it
    ],
)
def test_stop_strings_are_cut_and_held_back_while_forming(tokenizer, text, stop, want):
    pieces = stream(tokenizer, text, stop)
    assert "".join(pieces) == want
    emitted = ""
    for piece in pieces[:-1]:
        emitted += piece
        assert not any(s in emitted for s in stop)  # a stop string never reaches the client, even in part-chunks


def test_logprob_shapes(tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    entries = [None, TokenLogprob(ids[1], -0.5, ((ids[1], -0.5), (ids[0], -1.5)))]
    legacy = legacy_logprobs(entries, ids, tokenizer.decode)
    assert legacy["tokens"] == [tokenizer.decode([t]) for t in ids[:2]]
    assert legacy["token_logprobs"] == [None, -0.5] and legacy["top_logprobs"][0] is None
    assert legacy["top_logprobs"][1] == {tokenizer.decode([ids[1]]): -0.5, tokenizer.decode([ids[0]]): -1.5}
    assert legacy["text_offset"] == [0, len(tokenizer.decode([ids[0]]))]
    chat = chat_logprobs([entries[1]], tokenizer.decode)["content"][0]
    assert chat["logprob"] == -0.5 and [t["logprob"] for t in chat["top_logprobs"]] == [-0.5, -1.5]
    assert bytes(chat["bytes"]).decode() == chat["token"]
