"""Constrained decoding on real (tiny, random) transformer models with a real JSON-schema grammar
(llguidance, cluster/models/grammar.py): greedy outputs of every constrained strategy equal constrained
autoregressive decoding token for token, alone and batched with other requests; sampled outputs validate
against the schema; a drafter worker samples only tokens the grammar allows (its q is masked)."""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from cluster.config.schema import MagSpec, load_config
from cluster.core.constraint import valid_prefix
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.models.grammar import json_grammar
from tests.support.built import engine_for

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "kind": {"enum": ["list", "dict", "set"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "kind", "size", "tags"], "additionalProperties": False}
PROMPT = "# user: describe the container as JSON\n# assistant:\n"
STRATEGIES = [("speculative", {}), ("speculative", {"verify": "block", "k": 6}), ("mag", {}),
              ("cs_drafting", {}), ("cs_drafting", {"drafters": "drafter-large,drafter-small,mag", "lenience": 3.0})]


@pytest.fixture(scope="module")
def engine():
    cfg = load_config("configs/tiny.yaml")
    return engine_for(dataclasses.replace(cfg, mag=MagSpec()))


def _req(engine, strategy, options, sampling=SamplingParams(0.0), seed=0):
    return GenerationRequest(prompt=PROMPT, max_new_tokens=120, sampling=sampling, seed=seed, strategy=strategy,
                             options=options, grammar=json_grammar(SCHEMA, engine.tokenizer))


def test_greedy_equals_constrained_autoregressive_alone_and_batched(engine):
    plain = engine.generate(_req(engine, "autoregressive", {}))
    assert plain.finish_reason == "eos"
    jsonschema.validate(json.loads(plain.text), SCHEMA)
    free = engine.generate(GenerationRequest(prompt=PROMPT, max_new_tokens=40, sampling=SamplingParams(0.0)))
    assert free.text != plain.text[:len(free.text)]        # the grammar changed the output
    for strategy, options in STRATEGIES:
        got = engine.generate(_req(engine, strategy, options))
        assert got.token_ids == plain.token_ids, (strategy, options, got.text)
    batch = engine.generate_many([_req(engine, s, o) for s, o in STRATEGIES] +
                                 [GenerationRequest(prompt=PROMPT, max_new_tokens=40, sampling=SamplingParams(0.0))])
    assert all(r.token_ids == plain.token_ids for r in batch[:-1]) and batch[-1].token_ids == free.token_ids


@pytest.mark.parametrize("strategy,options", [("autoregressive", {})] + STRATEGIES)
def test_sampled_outputs_validate(engine, strategy, options):
    for seed in range(3):
        r = engine.generate(_req(engine, strategy, options, SamplingParams(1.0), seed=seed))
        assert r.finish_reason == "eos", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_a_drafter_samples_only_allowed_tokens(engine):
    grammar = json_grammar(SCHEMA, engine.tokenizer)
    prompt = engine.tokenizer.encode(PROMPT)
    drafter = engine.models["drafter-small"]
    for seed in range(4):
        constraint = grammar.start(len(prompt))
        drafter.prefill("probe", prompt, SamplingParams(1.0, constraint=constraint), seed)
        toks, logits = drafter.propose("probe", 24)
        drafter.release("probe")
        assert valid_prefix(constraint, prompt, toks) == 24
        assert all(bool((logits[i] > float("-inf")).sum() == constraint.allowed(prompt + toks[:i]).sum())
                   for i in range(24))                     # the logits handed on are the masked ones
