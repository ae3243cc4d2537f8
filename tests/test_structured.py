"""Structured outputs (`SamplingParams.structured`): greedy constrained tokens equal a reference loop (full Hugging
Face forwards, llguidance's own matcher and its own `apply_token_bitmask_inplace`, argmax); the outputs of the
trained checkpoint match their JSON schema, regex and choice; MTP on (K = 1..4 with oracle and head drafts, K per
step, lookahead on) emits exactly MTP-off's tokens for constrained requests batched with sampled, penalized,
logprob and unconstrained ones; a grammar that cannot be used is a `RequestError` at submit."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
from helpers import cpu_engine, load_hf, random_prompt, reference_lltokenizer, run_batch

from qwen_mtp import Engine, SamplingParams, StructuredOutput
from qwen_mtp.engine.grammar import Grammars, apply_token_mask, mask_words, token_masks
from qwen_mtp.errors import RequestError

MAX_NEW = 24
PROMPTS = [random_prompt(n, seed=700 + n) for n in (1, 6, 33, 3, 19, 9, 17, 4, 12, 2, 7, 5)]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
LARK = 'start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'
SHIPPED = Path(__file__).resolve().parents[1] / "models" / "qwen-mtp-small"


def mixed(i: int) -> SamplingParams:
    """Request i's parameters: constrained greedy, sampled, penalized and logprob requests beside unconstrained ones."""
    base = {"max_new_tokens": MAX_NEW}
    kinds = [
        {"structured": StructuredOutput(regex=r"[0-9]{2,4}-[a-z]+")},
        {},
        {"structured": StructuredOutput(json_schema=SCHEMA)},
        {"structured": StructuredOutput(choice=["yes", "no", "not sure"])},
        {"structured": StructuredOutput(regex=r"[a-z ]+"), "temperature": 0.9, "top_p": 0.9, "seed": 3},
        {"temperature": 0.8, "seed": 4, "ignore_eos": True},
        {"structured": StructuredOutput(grammar=LARK), "repetition_penalty": 1.3},
        {"structured": StructuredOutput(json_object=True), "logprobs": 2},
        {"structured": StructuredOutput(regex=r"[0-9a-f]+"), "temperature": 1.0, "top_k": 5, "seed": 5},
        {"ignore_eos": True, "frequency_penalty": 0.5},
        {"structured": StructuredOutput(regex=r"(ab|cd)+"), "stop": ("cdab",)},
        {"structured": StructuredOutput(json_schema={"type": "array", "items": {"type": "integer"}})},
    ]
    return SamplingParams(**base, **kinds[i % len(kinds)])


def run(engine: Engine, params, prompts=PROMPTS, oracles=None) -> list:
    """Every prompt with params(i), as one continuous batch: (tokens, finish reason, logprobs) per request."""
    return [(r.token_ids, r.finish_reason, r.logprobs) for r in run_batch(engine, params, prompts, oracles)]


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint()


@pytest.fixture(scope="module")
def plain(path):
    """MTP off, the whole batch at once."""
    return run(cpu_engine(path), mixed)


def reference_matcher(path):
    """(the checkpoint's tokenizer, the vocabulary, llguidance's matcher factory over them), built as llguidance's
    docs say (not by the engine)."""
    tokenizer, lltokenizer = reference_lltokenizer(path)
    return tokenizer, lltokenizer.vocab_size, lambda grammar: llguidance.LLMatcher(lltokenizer, grammar)


# ---- parameters and errors ------------------------------------------------------------------------------------
def test_bad_structured_outputs_are_request_errors():
    with pytest.raises(RequestError, match="exactly one of"):
        StructuredOutput()
    with pytest.raises(RequestError, match="exactly one of .* got regex, json_object"):
        StructuredOutput(regex="a", json_object=True)
    with pytest.raises(RequestError, match="json_schema is not valid JSON"):
        StructuredOutput(json_schema="{nope")
    with pytest.raises(RequestError, match="choice must be a non-empty list"):
        StructuredOutput(choice=[])
    with pytest.raises(RequestError, match="regex must be a non-empty string"):
        StructuredOutput(regex="")
    with pytest.raises(RequestError, match="structured must be a qwen_mtp.StructuredOutput"):
        SamplingParams(structured={"regex": "a"})
    with pytest.raises(RequestError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured=StructuredOutput(regex="a+"))
    assert StructuredOutput(json_schema='{"type": "integer"}').json_schema == {"type": "integer"}
    assert StructuredOutput(choice=["a", "b"]).kind == "choice"


def test_gbnf_grammars_are_taken_as_lark(path):
    """A GBNF grammar (llama.cpp's and xgrammar's form, `root ::= ...`) constrains as its Lark equivalent."""
    engine = cpu_engine(path)
    gbnf = 'root ::= "x=" num ("," num)*\nnum ::= [0-9] [0-9]? [0-9]?'
    (ours,) = engine.generate(
        [PROMPTS[6]], SamplingParams(max_new_tokens=MAX_NEW, structured=StructuredOutput(grammar=gbnf))
    )
    (lark,) = engine.generate(
        [PROMPTS[6]], SamplingParams(max_new_tokens=MAX_NEW, structured=StructuredOutput(grammar=LARK))
    )
    assert ours.token_ids == lark.token_ids and re.fullmatch(
        r"x=[0-9]{1,3}(,[0-9]{1,3})*,?", engine.tokenizer.decode(ours.token_ids, skip_special_tokens=True)
    )
    with pytest.raises(RequestError, match="GBNF"):
        engine.submit([1, 2], SamplingParams(structured=StructuredOutput(grammar="root ::= (")))


def test_grammars_that_cannot_be_used_fail_at_submit_and_the_engine_serves_on(path, tmp_path):
    engine = cpu_engine(path)
    running = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=4))
    for bad, message in ((StructuredOutput(grammar="start: foo"), "unknown name"),
                         (StructuredOutput(regex="[0-9"), "regex"),
                         (StructuredOutput(json_schema={"type": "nonsense"}), "json_schema")):  # fmt: skip
        with pytest.raises(RequestError, match=message):
            engine.submit(PROMPTS[1], SamplingParams(structured=bad))
    assert engine.stats()["waiting"] + engine.stats()["running"] <= 1
    while engine.has_unfinished():
        engine.step()
    assert len(engine.result(running).token_ids) == 4
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(path, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    with pytest.raises(RequestError, match="structured outputs need the checkpoint's tokenizer"):
        cpu_engine(bare).submit([1, 2], SamplingParams(structured=StructuredOutput(regex="a")))


# ---- the mask and its application ----------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [512, 509, 64])
def test_apply_token_mask_equals_llguidance(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator)
    words = mask_words(vocab)
    allowed = torch.randint(-(2**31), 2**31 - 1, (6, words), generator=generator, dtype=torch.int64).to(torch.int32)
    allowed[0] = -1  # every token
    allowed[1] = 0  # none
    expected = logits.clone()
    llguidance.torch.apply_token_bitmask_inplace(expected, allowed)
    assert torch.equal(apply_token_mask(logits, allowed), expected)
    assert torch.equal(apply_token_mask(logits.bfloat16(), allowed), expected.bfloat16())


def test_token_masks_follow_the_drafts_and_leave_the_matcher_as_it_was(path):
    """Position i's mask is a fresh matcher's after the drafts before it; past the first draft the grammar refuses,
    every token is allowed; the request's matcher is where it was. The engine's masks (llguidance's thread pool)
    equal the one-matcher-at-a-time reference."""
    tokenizer, vocab, make = reference_matcher(path)
    grammar = Grammars(tokenizer, vocab, [tokenizer.eos_token_id])
    structured = StructuredOutput(regex=r"[0-9]+-[a-z]+")

    class Row:  # what token_masks reads of a request
        def __init__(self, matcher):
            self.grammar = matcher

    digits, dash, letter = (tokenizer.encode(t, add_special_tokens=False) for t in ("12", "-", "q"))
    drafts = [digits + dash + letter + digits, digits + letter + dash]  # the second: a letter where "-" must come
    rows = [Row(grammar.matcher(structured)), Row(grammar.matcher(structured)), Row(None)]
    width = max(len(d) for d in drafts)
    drafts = [d + [0] * (width - len(d)) for d in drafts] + [[0] * width]
    masks = token_masks(rows, mask_words(vocab), drafts)
    assert masks.shape == (3, width + 1, mask_words(vocab))
    assert torch.equal(grammar.masks(rows, drafts), masks)
    for b in range(2):
        reference = make(llguidance.LLMatcher.grammar_from_regex(structured.regex))
        for i in range(width + 1):
            expected = llguidance.torch.allocate_token_bitmask(1, vocab)
            if reference.is_error():
                expected[:] = -1
            else:
                llguidance.torch.fill_next_token_bitmask(reference, expected)
            assert torch.equal(masks[b, i], expected[0]), (b, i)
            if i < width and not reference.is_error():
                reference.consume_token(drafts[b][i])
    assert (masks[2] == -1).all()
    again = token_masks(rows[:1], mask_words(vocab), [[0] * width])
    assert torch.equal(again[0, 0], masks[0, 0]) and torch.equal(grammar.masks(rows[:1])[0, 0], masks[0, 0])


# ---- against references ---------------------------------------------------------------------------------------
@torch.inference_mode()
@pytest.mark.parametrize("kind", [0, 2, 3, 11])
def test_greedy_constrained_tokens_match_a_reference_loop(path, plain, kind):
    """Each token: the argmax of a full HF forward's last logits after llguidance's own mask application, its
    matcher advanced by the chosen token, until the grammar completes (then the request ends) or max_new_tokens."""
    hf = load_hf(path, torch.float32)
    _, vocab, make = reference_matcher(path)
    from qwen_mtp.engine.grammar import grammar_text

    matcher = make(grammar_text(mixed(kind).structured))
    tokens = list(PROMPTS[kind])
    for _ in range(MAX_NEW):
        logits = hf(torch.tensor([tokens])).logits[0, -1:].float().clone()
        mask = llguidance.torch.allocate_token_bitmask(1, vocab)
        llguidance.torch.fill_next_token_bitmask(matcher, mask)
        llguidance.torch.apply_token_bitmask_inplace(logits, mask)
        token = int(logits.argmax())
        tokens.append(token)
        assert matcher.consume_token(token)
        if matcher.is_stopped():
            break
    output, reason, _ = plain[kind]
    assert output == tokens[len(PROMPTS[kind]) :]
    assert reason == ("stop" if matcher.is_stopped() else "length")


def test_trained_model_outputs_match_their_structure():
    """On the shipped trained checkpoint, greedy and sampled: the outputs parse and obey their schema, regex and
    choice, ending with finish_reason "stop" (JSON on one line: with whitespace anywhere this small model may spend
    every token on it); MTP on gives MTP-off's tokens."""
    recipe = {"model": {"path": str(SHIPPED), "dtype": "float32", "device": "cpu"}}
    plain = Engine.from_recipe(recipe, log=lambda _: None)
    mtp = Engine.from_recipe({**recipe, "mtp": {"enabled": True, "k": 3}}, log=lambda _: None)
    prompt = plain.encode("Once upon a time, a girl named")
    cases = [
        (StructuredOutput(json_schema=SCHEMA, any_whitespace=False),
         lambda text: set(json.loads(text)) == {"name", "age"}),
        (StructuredOutput(json_object=True), lambda text: isinstance(json.loads(text), dict)),
        (StructuredOutput(regex=r"(Monday|Tuesday|Friday) at [0-9]{1,2}"),
         lambda text: re.fullmatch(r"(Monday|Tuesday|Friday) at [0-9]{1,2}", text)),
        (StructuredOutput(choice=["red", "green", "blue"]), lambda text: text in ("red", "green", "blue")),
    ]  # fmt: skip
    for structured, valid in cases:
        sampled = structured.json_object is False  # any object may hold a string as long as max_new_tokens
        for extra in ({}, {"temperature": 0.8, "seed": 7}) if sampled else ({},):
            params = SamplingParams(max_new_tokens=60, structured=structured, **extra)
            (result,) = plain.generate([prompt], params)
            assert result.finish_reason == "stop" and valid(result.text), (structured, result.text)
            person = json.loads(result.text) if structured.json_schema else None
            assert person is None or (isinstance(person["age"], int) and len(person["name"]) <= 12)
            assert mtp.generate([prompt], params)[0].token_ids == result.token_ids


# ---- MTP on == MTP off -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_constrained_mtp_equals_plain_batched_and_alone(path, plain, k):
    engine = cpu_engine(path, k, draft="oracle", oracle_accept=0.8)
    oracles = [tokens for tokens, _, _ in plain]
    assert run(engine, mixed, oracles=oracles) == plain
    assert engine.stats()["acceptance_length"] > 1 + k / 3  # drafts accepted: the verify's masks mattered
    for i in (0, 2, 6):  # alone
        assert run(engine, lambda _, i=i: mixed(i), [PROMPTS[i]], [oracles[i]]) == [plain[i]]


def test_a_draft_chain_computes_no_mask(path):
    """The host computes a constrained request's masks for the positions a step chooses: its first token, then each
    verify's K+1; the draft chain after its prompt (which applies none: `Mode.for_drafts`) asks for none."""
    engine = cpu_engine(path, 2)  # head drafts (oracle drafts would come from an MTP-off run of the same request)
    calls, masks = [], engine.runner.grammars.masks
    engine.runner.grammars.masks = lambda requests, drafts=None: calls.append(len(requests)) or masks(requests, drafts)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, structured=StructuredOutput(regex=r"[ -~]+"))
    prompt = PROMPTS[2]  # 33 tokens: three prefill chunks of 16, the last with the first token
    (result,) = engine.generate([prompt], params)
    assert result.spec is not None and calls == [1] * (1 + result.spec.verify_steps)


def test_constrained_mtp_with_head_drafts_k_per_step_and_lookahead_equals_plain(path, plain):
    """Head drafts (which the grammar often refuses), K changing every step (K = 0 and fillers), and the lookahead
    on: it never launches a step with a constrained request ahead, and still runs for the others."""
    from test_k_auto import Scripted

    assert run(cpu_engine(path, 3), mixed) == plain
    engine = cpu_engine(path, "auto", max_k=3, draft="oracle", oracle_accept=0.8)
    engine.speculator.policy = Scripted([3, 1, 0, 2, 0, 3])
    oracles = [tokens for tokens, _, _ in plain]
    assert run(engine, mixed, oracles=oracles) == plain
    recipe = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"},
              "cache": {"prefill_chunk": 16, "lookahead": True},
              "mtp": {"enabled": True, "k": 2, "draft": "oracle", "oracle_accept": 0.8}}  # fmt: skip
    ahead = Engine.from_recipe(recipe, log=lambda _: None)
    assert run(ahead, mixed, oracles=oracles) == plain
    constrained = [i for i in range(len(PROMPTS)) if mixed(i).structured is not None]
    alone = Engine.from_recipe(recipe, log=lambda _: None)
    subset = [PROMPTS[i] for i in constrained]
    assert run(alone, lambda j: mixed(constrained[j]), subset, [oracles[i] for i in constrained]) == [
        plain[i] for i in constrained
    ]
    assert alone.lookahead_steps == 0
    free = Engine.from_recipe({**recipe, "mtp": {"enabled": False}}, log=lambda _: None)
    free_prompts = [PROMPTS[i] for i in range(len(PROMPTS)) if i not in constrained]
    run(free, lambda j: SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True), free_prompts)
    assert free.lookahead_steps > 0


def test_constraints_change_only_their_requests(path, plain):
    """The unconstrained requests of the batch get their tokens alone; a constrained one differs from itself free;
    its logprobs are those of the model's own distribution."""
    free = run(cpu_engine(path), lambda i: SamplingParams(**{**mixed(i).__dict__, "structured": None}))
    for i in (1, 5, 9):
        assert plain[i] == free[i]
    assert plain[0][0] != free[0][0]
    tokens, _, logprobs = plain[7]
    hf = load_hf(path, torch.float32)
    with torch.inference_mode():
        full = hf(torch.tensor([PROMPTS[7] + tokens])).logits[0, len(PROMPTS[7]) - 1 : -1].float()
    expected = torch.log_softmax(full, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([entry.logprob for entry in logprobs]), expected, atol=1e-5)


def test_forced_tokens_are_verified_as_drafts(path):
    """Where the grammar allows one continuation, its tokens replace the head's drafts: a one-string choice is
    accepted K at a time (the tiny head's own drafts almost never), and the tokens are MTP-off's."""
    params = SamplingParams(max_new_tokens=40, structured=StructuredOutput(choice=["the quick brown fox jumps over"]))
    (expected,) = cpu_engine(path).generate([PROMPTS[3]], params)
    engine = cpu_engine(path, 3)
    (result,) = engine.generate([PROMPTS[3]], params)
    assert result.token_ids == expected.token_ids and result.finish_reason == "stop"
    assert result.spec.acceptance_length > 3.0, result.spec.accept_lengths
