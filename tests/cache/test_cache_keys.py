"""Response-cache keys: stable, canonical, and sensitive to every output-relevant field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from llmesh.v1 import cache_pb2, common_pb2

from services.cache.keys import (
    MAX_TOKEN_ID, NAMESPACE, canonical_bytes, entry_key, response_key,
)
from services.common.sampling import GREEDY_TEMPERATURE_EPSILON, InvalidRequestError
from tests.cache.helpers import make_key

ROOT = Path(__file__).resolve().parents[2]

# Pinned: a change here changes every key in every deployed cache, so it must
# come with a new NAMESPACE version.
GOLDEN_KEY = make_key((1, 2, 3), model="m")
GOLDEN_VALUE = "llmesh:v2:resp:715726826bb7c56c5eb0ea1ec9f22614e2cabf7a4230085c7182795f9c514553"

FIELDS = ("cache_scope", "model", "prompt", "temperature", "top_p", "top_k", "seed", "max_tokens", "stop",
          "stop_token_ids", "ignore_eos")
# Fields that cannot change a greedy (temperature 0) output.
IGNORED_WHEN_GREEDY = {"top_p", "top_k", "seed"}

STRATEGIES = {
    "cache_scope": st.sampled_from(["", "a" * 64, "b" * 64, "scope"]),
    "model": st.sampled_from(["smollm2", "smollm2-360m", "m", "qwen"]),
    "prompt": st.lists(st.integers(0, MAX_TOKEN_ID), min_size=1, max_size=8),
    "temperature": st.none() | st.just(0.0) | st.floats(0.0, 2.0, width=32),
    "top_p": st.none() | st.floats(0.0, 1.0, width=32, exclude_min=True),
    "top_k": st.none() | st.integers(0, 100),
    "seed": st.none() | st.integers(0, 2**64 - 1),
    "max_tokens": st.none() | st.integers(1, 4096),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 50), max_size=4),
    "ignore_eos": st.booleans(),
}


def build(fields: dict[str, object]) -> cache_pb2.CacheKey:
    sampling = common_pb2.SamplingParams(
        stop=fields["stop"], stop_token_ids=fields["stop_token_ids"],
        ignore_eos=fields["ignore_eos"])
    for name in ("temperature", "top_p", "top_k", "seed", "max_tokens"):
        if fields[name] is not None:
            setattr(sampling, name, fields[name])
    return cache_pb2.CacheKey(model=fields["model"], prompt_token_ids=fields["prompt"],
                              sampling=sampling, cache_scope=fields["cache_scope"])


def effective(key: cache_pb2.CacheKey, name: str) -> object:
    """What the server makes of field ``name`` (unset read as its default)."""
    s = key.sampling
    return {
        "cache_scope": key.cache_scope,
        "model": key.model,
        "prompt": list(key.prompt_token_ids),
        # Below GREEDY_TEMPERATURE_EPSILON a temperature means greedy (stored as 0).
        "temperature": (s.temperature if s.HasField("temperature")
                        and s.temperature >= GREEDY_TEMPERATURE_EPSILON else 0.0),
        "top_p": s.top_p if s.HasField("top_p") else 1.0,
        "top_k": s.top_k if s.HasField("top_k") else 0,
        "seed": s.seed if s.HasField("seed") else None,
        "max_tokens": s.max_tokens if s.HasField("max_tokens") else None,
        "stop": list(s.stop),
        "stop_token_ids": set(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
    }[name]


@settings(max_examples=300, deadline=None)
@given(base=st.fixed_dictionaries(STRATEGIES), field=st.sampled_from(FIELDS), data=st.data())
def test_changing_any_output_relevant_field_changes_the_key(
        base: dict[str, object], field: str, data: st.DataObject) -> None:
    changed = dict(base, **{field: data.draw(STRATEGIES[field], label=field)})
    before, after = build(base), build(changed)
    assume(effective(before, field) != effective(after, field))
    greedy = effective(before, "temperature") == 0.0
    if greedy and field in IGNORED_WHEN_GREEDY:
        assert response_key(after) == response_key(before)
    else:
        assert response_key(after) != response_key(before)


@settings(max_examples=100, deadline=None)
@given(base=st.fixed_dictionaries(STRATEGIES))
def test_unset_fields_equal_their_server_defaults(base: dict[str, object]) -> None:
    key = build(base)
    explicit = cache_pb2.CacheKey()
    explicit.CopyFrom(key)
    s = explicit.sampling
    if not s.HasField("temperature"):
        s.temperature = 0.0
    if not s.HasField("top_p"):
        s.top_p = 1.0
    if not s.HasField("top_k"):
        s.top_k = 0
    assert response_key(explicit) == response_key(key)


def test_unset_temperature_is_zero_temperature_and_minus_zero_too() -> None:
    unset = response_key(make_key())
    assert response_key(make_key(temperature=0.0)) == unset
    assert response_key(make_key(temperature=-0.0)) == unset
    assert response_key(make_key(temperature=0.5, seed=1)) != unset


def test_greedy_ignores_seed_top_p_top_k_but_sampled_does_not() -> None:
    greedy = response_key(make_key())
    assert response_key(make_key(seed=7, top_p=0.5, top_k=3)) == greedy
    sampled = response_key(make_key(temperature=0.8, seed=7))
    assert response_key(make_key(temperature=0.8, seed=8)) != sampled
    assert response_key(make_key(temperature=0.8, seed=7, top_p=0.9)) != sampled
    assert response_key(make_key(temperature=0.8, seed=7, top_k=40)) != sampled


def test_stop_token_ids_are_a_set_but_stop_strings_keep_order() -> None:
    assert (response_key(make_key(stop_token_ids=[3, 1, 3]))
            == response_key(make_key(stop_token_ids=[1, 3])))
    assert response_key(make_key(stop=["a", "b"])) != response_key(make_key(stop=["b", "a"]))


def test_unset_max_tokens_differs_from_any_value() -> None:
    unset = response_key(make_key())
    assert response_key(make_key(max_tokens=256)) != unset
    assert response_key(make_key(max_tokens=1)) != unset


def test_length_prefixes_keep_field_boundaries_apart() -> None:
    assert response_key(make_key(stop=["ab", "c"])) != response_key(make_key(stop=["a", "bc"]))
    assert (response_key(make_key(model="m1", prompt=(2,)))
            != response_key(make_key(model="m", prompt=(2,))))


def test_the_cache_scope_keeps_entries_apart() -> None:
    shared = make_key()
    scoped = cache_pb2.CacheKey()
    scoped.CopyFrom(shared)
    scoped.cache_scope = "a" * 64
    other = cache_pb2.CacheKey()
    other.CopyFrom(scoped)
    other.cache_scope = "b" * 64
    assert len({response_key(shared), response_key(scoped), response_key(other)}) == 3
    # a scope's bytes never run into the model's: length-prefixed
    assert (response_key(cache_pb2.CacheKey(cache_scope="ab", model="c", prompt_token_ids=[1]))
            != response_key(cache_pb2.CacheKey(cache_scope="a", model="bc",
                                               prompt_token_ids=[1])))


def test_key_has_the_versioned_namespace_and_a_sha256() -> None:
    key = response_key(make_key())
    assert key.startswith(NAMESPACE) and NAMESPACE == "llmesh:v2:resp:"
    digest = key[len(NAMESPACE):]
    assert len(digest) == 64 and int(digest, 16) >= 0


def test_golden_key_is_pinned() -> None:
    assert response_key(GOLDEN_KEY) == GOLDEN_VALUE
    assert canonical_bytes(GOLDEN_KEY).startswith(b"llmesh.response-cache.v2\x00")


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_same_key_in_another_process(hash_seed: str) -> None:
    code = ("from tests.cache.helpers import make_key;"
            "from services.cache.keys import response_key;"
            "print(response_key(make_key((5, 6, 7), model='m', temperature=0.7, seed=3,"
            " stop=['x', 'y'], stop_token_ids=[2])))")
    env = dict(os.environ, PYTHONHASHSEED=hash_seed,
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "services" / "gen")]))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout.strip()
    here = response_key(make_key((5, 6, 7), model="m", temperature=0.7, seed=3,
                                 stop=["x", "y"], stop_token_ids=[2]))
    assert out == here


@pytest.mark.parametrize(("key", "field"), [
    (make_key(prompt=()), "key.prompt_token_ids"),
    (make_key(temperature=-0.1), "key.sampling.temperature"),
    (make_key(temperature=float("nan")), "key.sampling.temperature"),
    (make_key(top_p=0.0), "key.sampling.top_p"),
    (make_key(top_k=-1), "key.sampling.top_k"),
    (make_key(max_tokens=0), "key.sampling.max_tokens"),
    (make_key(stop=[""]), "key.sampling.stop"),
    (cache_pb2.CacheKey(prompt_token_ids=[1], cache_scope="s" * 129), "key.cache_scope"),
    (make_key(n=0), "key.sampling.n"),
    (make_key(stop_token_ids=[-1]), "key.sampling.stop_token_ids"),
    # QA: these were accepted (hashed, stored and looked up) before.
    (make_key(model=""), "key.model"),
    (make_key(model="m" * 257), "key.model"),
    (make_key(prompt=(1, -5, 2)), "key.prompt_token_ids"),
    (make_key(prompt=(1, MAX_TOKEN_ID + 1)), "key.prompt_token_ids"),
    (cache_pb2.CacheKey(model="m", prompt_token_ids=[1], cache_scope="a b"), "key.cache_scope"),
    (cache_pb2.CacheKey(model="m", prompt_token_ids=[1], cache_scope="\x00"), "key.cache_scope"),
])
def test_invalid_keys_name_the_field(key: cache_pb2.CacheKey, field: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        response_key(key)
    assert raised.value.field == field
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_bad_token_id_is_named_with_its_index() -> None:
    with pytest.raises(InvalidRequestError, match=r"token id -5 at index 1 is outside"):
        response_key(make_key(prompt=(1, -5, -6)))


@pytest.mark.parametrize("key", [
    make_key(prompt=(0, MAX_TOKEN_ID)),
    make_key(model="m" * 256),
    cache_pb2.CacheKey(model="m", prompt_token_ids=[1], cache_scope="0123456789abcdef" * 4),
    cache_pb2.CacheKey(model="m", prompt_token_ids=[1], cache_scope="~!" * 64),
])
def test_keys_at_the_bounds_and_the_routers_scopes_are_valid(key: cache_pb2.CacheKey) -> None:
    assert response_key(key).startswith(NAMESPACE)


@pytest.mark.parametrize(("sampling", "cacheable"), [
    ({}, True),
    ({"temperature": 0.0}, True),
    ({"temperature": 0.0, "seed": 0}, True),
    ({"temperature": 0.9, "seed": 0}, True),
    ({"temperature": 0.9}, False),
    ({"temperature": 0.9, "top_k": 1}, False),
    # Below GREEDY_TEMPERATURE_EPSILON the engine samples greedily: deterministic,
    # and the same entry as temperature 0.
    ({"temperature": 1e-7}, True),
])
def test_only_deterministic_requests_are_cacheable(sampling: dict, cacheable: bool) -> None:
    key = cache_pb2.CacheKey(model="m", prompt_token_ids=[1, 2],
                             sampling=common_pb2.SamplingParams(**sampling))
    assert entry_key(key).deterministic is cacheable
    assert entry_key(key).store_key == response_key(key)


def test_a_tiny_temperature_shares_the_greedy_entry() -> None:
    def key(**sampling) -> cache_pb2.CacheKey:
        return cache_pb2.CacheKey(model="m", prompt_token_ids=[1, 2],
                                  sampling=common_pb2.SamplingParams(**sampling))

    assert response_key(key(temperature=1e-7)) == response_key(key())
