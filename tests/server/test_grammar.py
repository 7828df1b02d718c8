"""Constrained decoding in the shard: a grammar (llguidance's format, as the
router builds it) masks every token it forbids, so even a random model writes
valid JSON or matches a regex, then stops with EOS."""

import asyncio
import json
import logging
import re

import jsonschema
import llguidance
import pytest
from tokenizers import Tokenizer

from tgi_proto import pb
from tgi_proto.rpc import StatusCode
from tgi_router.scheduling.client import ShardClient, ShardError
from tgi_router.scheduling.sequence import FinishReason
from tgi_router.text.grammar import json_grammar
from tgi_server.sampling.grammar import GrammarCompiler
from tgi_server.sampling.grammar_budget import Budget
from tgi_server.sequences import StepError

from ..shard_harness import InProcessShard, run_prompts, save_tiny_model, save_tiny_served_model

EOS = 257  # the tiny served model's </s>; its tokenizer has one token per byte
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"type": "string", "enum": ["cat", "dog", "bird"]},
        "info": {"type": "object",
                 "properties": {"size": {"type": "integer", "minimum": 0, "maximum": 999},
                                "color": {"type": "string", "maxLength": 4}},
                 "required": ["size", "color"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 2},
    },
    "required": ["kind", "info", "tags"],
    "additionalProperties": False,
}
JSON_GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(
    SCHEMA, overrides={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
REGEX = r"[0-9]{3}-[a-z]{2}"
REGEX_GRAMMAR = llguidance.LLMatcher.grammar_from_regex(REGEX)
PROMPTS = [[256, 40 + i, 70 + 3 * i, 100 + i] for i in range(6)]
MAX_NEW = 160  # more than the longest text SCHEMA allows


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_served_model(tmp_path_factory.mktemp("grammar") / "model", seed=3)


@pytest.fixture(scope="module")
def shard(tmp_path_factory, model_path):
    with InProcessShard(tmp_path_factory.mktemp("shard"), str(model_path)) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return Tokenizer.from_file(str(model_path / "tokenizer.json"))


def greedy(grammar: str = "") -> pb.SamplingParameters:
    return pb.SamplingParameters(grammar=grammar)


def sampled(seed: int, grammar: str = "") -> pb.SamplingParameters:
    return pb.SamplingParameters(do_sample=True, temperature=1.0, seed=seed, grammar=grammar)


def generate(socket: str, prompts: list[list[int]], params: list[pb.SamplingParameters],
             **kw) -> list[list[int]]:
    seqs = asyncio.run(run_prompts(socket, prompts, MAX_NEW, params=params, stop_ids=(EOS,), **kw))
    return [s.generated_ids for s in seqs]


def text_before_eos(tokenizer: Tokenizer, tokens: list[int]) -> str:
    """The decoded text of a generation that must end with EOS."""
    assert tokens[-1] == EOS, f"no EOS within {MAX_NEW} tokens"
    return tokenizer.decode(tokens[:-1])


def step_alone(runner, seq_id: int, prompt: list[int], params: pb.SamplingParameters,
               generated: list[int] = ()) -> list[int]:
    """Drives one sequence directly on the runner until EOS (or its
    max_new_tokens): sent in full first (prompt, then `generated` as a
    preempted sequence is re-sent), then one token per step. Returns
    generated + the new tokens."""
    tokens = list(prompt) + list(generated)
    step = pb.StepRequest(new_sequences=[pb.NewSequence(
        id=seq_id, token_ids=tokens, prompt_length=len(prompt), num_scheduled_tokens=len(tokens),
        block_table=list(range(16)), parameters=params)])
    out = list(generated)
    while (not out or out[-1] != EOS) and len(out) < (params.max_new_tokens or MAX_NEW + 1):
        assert len(out) < MAX_NEW
        gen = runner.step(step).generations[0]
        out.append(gen.token_id)
        step = pb.StepRequest(running=[pb.RunningSequence(
            id=seq_id, num_scheduled_tokens=1)])
    runner.table.release([seq_id])
    return out


def warm(runner) -> None:
    runner.warmup(pb.WarmupRequest(max_batch_prefill_tokens=256, max_batch_size=8))


def test_json_schema_output_parses_and_validates(shard, tokenizer):
    params = [greedy(JSON_GRAMMAR)] + [sampled(seed, JSON_GRAMMAR) for seed in range(5)]
    for tokens in generate(shard.socket, PROMPTS, params):
        jsonschema.validate(json.loads(text_before_eos(tokenizer, tokens)), SCHEMA)


def test_regex_output_matches_exactly_and_ends_with_eos(shard, tokenizer):
    params = [greedy(REGEX_GRAMMAR)] + [sampled(seed, REGEX_GRAMMAR) for seed in range(5)]
    for tokens in generate(shard.socket, PROMPTS, params):
        assert re.fullmatch(REGEX, text_before_eos(tokenizer, tokens))


FREE = [greedy(), sampled(7), greedy()]
MIXED = [FREE[0], greedy(JSON_GRAMMAR), FREE[1], sampled(8, REGEX_GRAMMAR), FREE[2], sampled(9, JSON_GRAMMAR)]


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(shard):
    together = generate(shard.socket, PROMPTS, MIXED)
    assert together[0::2] == generate(shard.socket, PROMPTS[0::2], FREE)


def test_constrained_rows_among_unconstrained_ones_obey_their_grammars(shard, tokenizer):
    together = generate(shard.socket, PROMPTS, MIXED)
    jsonschema.validate(json.loads(text_before_eos(tokenizer, together[1])), SCHEMA)
    assert re.fullmatch(REGEX, text_before_eos(tokenizer, together[3]))
    jsonschema.validate(json.loads(text_before_eos(tokenizer, together[5])), SCHEMA)


@pytest.mark.parametrize("params", [greedy(JSON_GRAMMAR), sampled(11, JSON_GRAMMAR)],
                         ids=["greedy", "sampled"])
def test_resent_sequence_continues_its_grammar(shard, params):
    """A preempted sequence comes back in full, generated tokens appended to the
    prompt: its matcher consumes them and the text goes on as if uninterrupted."""
    warm(shard.runner)
    whole = step_alone(shard.runner, 1, PROMPTS[0], params)
    for cut in (1, 5, len(whole) // 2):
        assert step_alone(shard.runner, 2, PROMPTS[0], params, whole[:cut]) == whole


def test_preemption_under_a_small_kv_cache_keeps_grammars(tmp_path, shard, model_path):
    """20 blocks for 6 constrained sequences: the scheduler preempts and re-sends."""
    params = [sampled(seed, JSON_GRAMMAR) for seed in range(6)]
    stats = {}
    with InProcessShard(tmp_path, str(model_path), kv_cache_bytes=21 * 8192) as small:
        squeezed = generate(small.socket, PROMPTS, params, arrivals=list(range(6)), stats=stats)
    assert stats["preemptions"] > 0
    assert squeezed == generate(shard.socket, PROMPTS, params)


def test_tokens_outside_the_grammar_leave_only_eos(shard, tokenizer, caplog):
    """Should the matcher ever fail (here: re-sent tokens the grammar forbids), one
    warning is logged and the sequence ends with EOS."""
    warm(shard.runner)
    bad = tokenizer.encode("a", add_special_tokens=False).ids  # REGEX starts with a digit
    with caplog.at_level(logging.WARNING, logger="tgi_server"):
        assert step_alone(shard.runner, 3, PROMPTS[0], greedy(REGEX_GRAMMAR), bad) == bad + [EOS]
    assert len([r for r in caplog.records if "left its grammar" in r.message]) == 1


def test_invalid_grammar_is_a_step_error(shard):
    warm(shard.runner)
    step = pb.StepRequest(new_sequences=[pb.NewSequence(
        id=4, token_ids=PROMPTS[0], num_scheduled_tokens=4, block_table=[0],
        parameters=greedy(llguidance.LLMatcher.grammar_from_regex("[0-9")))])
    with pytest.raises(StepError, match="sequence 4: the grammar does not compile.*invalid regex"):
        shard.runner.step(step)
    assert len(shard.runner.table) == 0


def test_invalid_grammar_over_grpc_is_invalid_argument(shard):
    step = pb.StepRequest(new_sequences=[pb.NewSequence(
        id=5, token_ids=PROMPTS[0], num_scheduled_tokens=4, block_table=[0],
        parameters=greedy("not a grammar {"))])

    async def go():
        client = ShardClient([shard.socket], timeout=30)
        try:
            await client.warmup(256, 8)
            with pytest.raises(ShardError) as err:
                await client.step(step)
            return err.value
        finally:
            await client.close()

    err = asyncio.run(go())
    assert err.code is StatusCode.INVALID_ARGUMENT and "does not compile" in err.details


def test_shard_without_tokenizer_refuses_grammars(tmp_path):
    path = save_tiny_model("llama", tmp_path / "bare")
    step = pb.StepRequest(new_sequences=[pb.NewSequence(
        id=1, token_ids=[1, 5, 9], num_scheduled_tokens=3, block_table=[0],
        parameters=greedy(REGEX_GRAMMAR))])
    with InProcessShard(tmp_path, str(path)) as bare:
        warm(bare.runner)
        with pytest.raises(StepError, match="no tokenizer"):
            bare.runner.step(step)


def count_compilations(monkeypatch) -> list[str]:
    """The grammars llguidance compiles (LLMatcher constructions) from now on."""
    compiled = []
    real = llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *a, **kw: compiled.append(a[1]) or real(*a, **kw))
    return compiled


def test_a_grammar_compiles_once_for_many_sequences(shard, monkeypatch):
    grammar = llguidance.LLMatcher.grammar_from_regex("[a-c]{4}")  # used by no other test
    compiled = count_compilations(monkeypatch)
    warm(shard.runner)
    first = step_alone(shard.runner, 6, PROMPTS[1], greedy(grammar))
    second = step_alone(shard.runner, 7, PROMPTS[1], greedy(grammar))
    assert first == second and compiled == [grammar]


def test_the_template_cache_evicts_the_least_recently_used(model_path, monkeypatch):
    compiler = GrammarCompiler((model_path / "tokenizer.json").read_text(), 320, [EOS], cache_size=2)
    grammars = [llguidance.LLMatcher.grammar_from_regex(r) for r in ("a+", "b+", "c+")]
    compiled = count_compilations(monkeypatch)
    for i in (0, 1, 0, 2, 0, 1):  # "b+" is the least recently used when "c+" arrives
        compiler.start(i, grammars[i], [])
    assert compiled == [grammars[0], grammars[1], grammars[2], grammars[1]]


OPEN_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "nested": {"type": "object", "properties": {"deep": {"type": "array", "items": {"type": "integer"}}},
               "required": ["deep"]}},
    "required": ["name", "count", "ratio", "tags", "nested"]}


@pytest.mark.parametrize("extra", [0, 3, 17])
def test_a_budget_ends_an_unbounded_schema_complete(shard, tokenizer, extra):
    """A random model writes digits and letters for ever; with max_new_tokens
    at the shortest output (one token per byte here) plus `extra`, every
    answer is a complete, valid document, whether or not EOS fitted."""
    grammar = json_grammar(OPEN_SCHEMA)
    budget = len(grammar.shortest.encode()) + extra
    params = [pb.SamplingParameters(grammar=grammar.text, max_new_tokens=budget)] + [
        pb.SamplingParameters(do_sample=True, temperature=1.0, seed=seed, grammar=grammar.text,
                              max_new_tokens=budget) for seed in range(5)]
    seqs = asyncio.run(run_prompts(shard.socket, PROMPTS, budget, params=params, stop_ids=(EOS,)))
    for seq in seqs:
        tokens = seq.generated_ids
        assert len(tokens) <= budget
        text = tokenizer.decode(tokens[:-1] if tokens[-1] == EOS else tokens)
        jsonschema.validate(json.loads(text), OPEN_SCHEMA)
        assert seq.finish_reason is FinishReason.EOS_TOKEN


def test_resent_sequence_keeps_its_budget(shard, tokenizer):
    """A preempted sequence re-sent with its generated tokens replays its budget
    too: the same tokens follow, and the text is complete at max_new_tokens."""
    warm(shard.runner)
    grammar = json_grammar(OPEN_SCHEMA)
    params = pb.SamplingParameters(do_sample=True, temperature=1.0, seed=5, grammar=grammar.text,
                                   max_new_tokens=len(grammar.shortest.encode()) + 5)
    whole = step_alone(shard.runner, 1, PROMPTS[0], params)
    jsonschema.validate(json.loads(tokenizer.decode([t for t in whole if t != EOS])), OPEN_SCHEMA)
    for cut in (1, len(whole) // 2, len(whole) - 2):
        assert step_alone(shard.runner, 2, PROMPTS[0], params, whole[:cut]) == whole


OPTIONAL_SCHEMA = {"type": "object", "properties": {
    "a": {"enum": ["x"]},
    "opt": {"type": "object", "properties": {k: {"type": "string"} for k in ("p", "q", "r", "s", "t")},
            "required": ["p", "q", "r", "s", "t"]}},
    "required": ["a"], "additionalProperties": False}


def test_a_sampled_key_that_would_overrun_the_budget_is_replaced(shard, tokenizer, monkeypatch):
    """After the forced '{"a": "x"' the draw is ',' (committing to "opt", ~50
    bytes, tokens here, of required value at once) or '}', with 21 tokens
    left: a ',' is replaced by the plan's '}', so every answer is complete."""
    replaced = []
    settle = Budget.settle

    def counting(self, maker, token):
        kept = settle(self, maker, token)
        replaced.extend([token] if kept != token else [])
        return kept

    monkeypatch.setattr(Budget, "settle", counting)
    grammar = json_grammar(OPTIONAL_SCHEMA)
    budget = len(grammar.shortest.encode()) + 20
    seeds = range(24)
    params = [pb.SamplingParameters(do_sample=True, temperature=1.5, seed=seed, grammar=grammar.text,
                                    max_new_tokens=budget) for seed in seeds]
    seqs = asyncio.run(run_prompts(shard.socket, [PROMPTS[s % len(PROMPTS)] for s in seeds], budget,
                                   params=params, stop_ids=(EOS,)))
    for seq in seqs:
        tokens = seq.generated_ids
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1] if tokens[-1] == EOS else tokens)),
                            OPTIONAL_SCHEMA)
    assert replaced  # the rule was needed, not just present
