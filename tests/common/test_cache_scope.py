"""Cache scopes (services/common/cache_scope.py): one opaque scope per owner and
salt, the shared scope only for neither, owners namespaced, bounds checked."""

from __future__ import annotations

import grpc
import pytest

from services.common.cache_scope import (
    MAX_CACHE_SCOPE_BYTES,
    SHARED,
    check_salt,
    check_scope,
    owner,
    resolve,
)
from services.common.sampling import InvalidRequestError


def test_only_no_owner_and_no_salt_is_the_shared_scope() -> None:
    assert resolve("", "") == SHARED == ""
    assert resolve(owner("acme")) != SHARED
    assert resolve("", "salt") != SHARED


def test_owners_are_namespaced_and_a_salt_narrows_without_replacing() -> None:
    assert owner("acme") == "tenant:acme" and owner("acme", "org") == "group:org"
    assert owner("") == ""
    # a group named like a tenant is not that tenant
    assert resolve(owner("org")) != resolve(owner("someone", "org"))
    # the same salt in two tenants: two scopes; salt and owner never run together
    assert resolve(owner("a"), "s") != resolve(owner("b"), "s")
    assert resolve(owner("a"), "s") != resolve(owner("a"))
    assert resolve("tenant:ab", "c") != resolve("tenant:a", "bc")
    assert resolve(owner("a"), "s") == resolve(owner("a"), "s")
    assert len(resolve(owner("a"), "s").encode()) <= MAX_CACHE_SCOPE_BYTES


@pytest.mark.parametrize("salt, words", [("", "non-empty"), ("x" * 257, "at most 256")])
def test_a_bad_salt_is_invalid_argument_naming_the_field(salt: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_salt(salt)
    assert info.value.field == "cache_salt" and words in str(info.value)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_scope_over_the_bound_is_refused_at_the_engine_and_cache_edges() -> None:
    assert check_scope("f" * 64) == "f" * 64
    with pytest.raises(InvalidRequestError) as info:
        check_scope("f" * (MAX_CACHE_SCOPE_BYTES + 1), "key.cache_scope")
    assert info.value.field == "key.cache_scope"


@pytest.mark.parametrize("scope, shown", [
    ("ab cd", "' ' at index 2"), ("ab\ncd", "'\\n' at index 2"), ("\x00", "'\\x00' at index 0"),
    ("caf\u00e9", "'\u00e9' at index 3"),
])
def test_a_scope_with_a_space_control_or_non_ascii_character_is_refused(
        scope: str, shown: str) -> None:
    """QA: such scopes were accepted, though the router only ever sends hex."""
    with pytest.raises(InvalidRequestError) as info:
        check_scope(scope, "key.cache_scope")
    assert info.value.field == "key.cache_scope" and shown in str(info.value)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_every_scope_the_router_resolves_is_accepted() -> None:
    for scope in (resolve(owner("acme")), resolve(owner("a b", "g\u00e9"), "s\x00"), SHARED,
                  "scope-a", "tenant:acme"):
        assert check_scope(scope) == scope
