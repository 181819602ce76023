"""The API key file: parsed once into typed tenants, hashes only, precise errors
that never echo a key; the key headers; ``llmesh keys``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import timeit
from types import SimpleNamespace

import pytest

from services.cli.main import _forward_to_router
from services.cli.main import main as llmesh
from services.router.api_keys import (
    KeyFileError,
    TenantLimits,
    hash_key,
    key_from_headers,
    load_key_table,
    mint_key,
    parse_key_table,
)

KEY_A, KEY_B = "lmk_alpha-key-0123456789", "lmk_beta-key-9876543210"


def table_text(**tenant_overrides: object) -> str:
    acme = {"id": "acme", "keys": [hash_key(KEY_A)], "models": ["*"],
            "limits": {"requests_per_minute": 600, "tokens_per_minute": 200000,
                       "max_concurrent": 16}}
    acme.update(tenant_overrides)
    return json.dumps({"tenants": [acme, {"id": "beta", "keys": [hash_key(KEY_B)],
                                           "models": ["m1"]}]})


def test_keys_map_to_their_tenant_with_models_and_limits() -> None:
    table = parse_key_table(table_text())
    acme, beta = table.authenticate(KEY_A), table.authenticate(KEY_B)
    assert acme is not None and acme.id == "acme"
    assert acme.limits == TenantLimits(600, 200000, 16)
    assert acme.may_use("anything")
    assert beta is not None and beta.id == "beta" and beta.limits == TenantLimits()
    assert beta.may_use("m1") and not beta.may_use("m2")
    assert table.authenticate("lmk_wrong") is None and table.authenticate("") is None
    assert table.num_keys == 2 and sorted(table.tenants) == ["acme", "beta"]


def test_a_tenant_opts_into_a_cache_group_explicitly() -> None:
    table = parse_key_table(table_text(cache_group="acme-org"))
    assert table.authenticate(KEY_A).cache_group == "acme-org"  # type: ignore[union-attr]
    assert table.authenticate(KEY_B).cache_group == ""  # type: ignore[union-attr]


def test_yaml_is_accepted_like_json(tmp_path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"tenants:\n  - id: acme\n    keys: ['{hash_key(KEY_A)}']\n")
    table = load_key_table(path)
    assert table.authenticate(KEY_A).id == "acme"  # type: ignore[union-attr]


@pytest.mark.parametrize("overrides, where", [
    ({"keys": [KEY_A]}, "tenants[0].keys[0]: not a 'sha256:<64 hex digits>' hash"),
    ({"keys": ["sha256:abc"]}, "tenants[0].keys[0]"),
    ({"id": "has space"}, "tenants[0].id"),
    ({"models": []}, "tenants[0].models"),
    ({"limits": {"tokens_per_minute": -1}}, "tenants[0].limits.tokens_per_minute"),
    ({"limits": {"rpm": 5}}, "unknown limit(s) ['rpm']"),
    ({"secret": 1}, "unknown field(s) ['secret']"),
    ({"keys": [hash_key(KEY_B)]}, "tenants[1].keys[0]: the same key hash is already"),
    ({"id": "beta"}, "tenant 'beta' appears twice"),
    ({"cache_group": "has space"}, "tenants[0].cache_group"),
    ({"cache_group": 7}, "tenants[0].cache_group"),
    ({"cache_group": ""}, "tenants[0].cache_group: must be 1..128"),
    ({"cache_group": None}, "tenants[0].cache_group"),
])
def test_a_bad_file_names_the_place_and_never_echoes_a_key(overrides, where) -> None:
    with pytest.raises(KeyFileError) as info:
        parse_key_table(table_text(**overrides), source="keys.json")
    assert where in str(info.value) and str(info.value).startswith("keys.json: ")
    assert KEY_A not in str(info.value) and KEY_B not in str(info.value)


def test_unparsable_or_missing_files_are_one_line(tmp_path) -> None:
    with pytest.raises(KeyFileError, match=r"not valid YAML or JSON \(line 2\)"):
        parse_key_table("tenants:\n  - id: [lmk_secret", source="k")
    with pytest.raises(KeyFileError, match="top level"):
        parse_key_table("[]")
    with pytest.raises(KeyFileError, match="cannot read the API key file"):
        load_key_table(tmp_path / "none.yaml")


@pytest.mark.parametrize("authorization, api_key, key", [
    ("Bearer k1", None, "k1"), ("bearer  k1 ", None, "k1"), (None, "k2", "k2"),
    ("Basic abc", "k2", "k2"), ("Basic abc", None, None), ("Bearer ", None, None),
    (None, None, None),
])
def test_the_key_comes_from_bearer_or_x_api_key(authorization, api_key, key) -> None:
    assert key_from_headers(authorization, api_key) == key


def test_the_check_costs_microseconds() -> None:
    """The number behind checking in the router (docs/api-keys.md): SHA-256
    of a key + dict lookup, here against a 1,000-key table."""
    table = parse_key_table(json.dumps({"tenants": [
        {"id": f"t{i}", "keys": [hash_key(f"lmk_{i}")]} for i in range(1_000)]}))
    key = mint_key()
    runs = 5_000
    per_call_s = min(timeit.repeat(lambda: table.authenticate(key), number=runs, repeat=3)) / runs
    assert per_call_s < 50e-6  # measured ~0.5 µs here; generous for a busy CI box


def test_llmesh_keys_new_prints_the_key_once_and_its_hash_entry(capsys) -> None:
    assert llmesh(["keys", "new", "--tenant", "acme"]) == 0
    out = capsys.readouterr().out
    key = out.splitlines()[0]
    assert key.startswith("lmk_") and out.count(key) == 1
    entry = out[out.index("  - id: acme"):]
    table = parse_key_table("tenants:\n" + entry)
    assert table.authenticate(key).id == "acme"  # type: ignore[union-attr]
    hashed = subprocess.run([sys.executable, "-m", "services.cli", "keys", "hash"],
                            input=key + "\n", capture_output=True, text=True, check=True)
    assert hashed.stdout.strip() == hash_key(key)


def test_llmesh_up_checks_the_key_file_and_forwards_sighup_to_the_router(tmp_path) -> None:
    assert llmesh(["up", "--api-keys", str(tmp_path / "none.yaml")]) == 2
    # the stand-in router dies of the forwarded SIGHUP whatever disposition the
    # suite's process passes on (a run under nohup, or one that ignores SIGHUP,
    # hands children SIG_IGN; the real router installs its own handler)
    router = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                              preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    mesh = SimpleNamespace(services={"router": SimpleNamespace(process=router, pid=router.pid)})
    _forward_to_router(mesh, signal.SIGHUP)
    assert router.wait(timeout=10) == -signal.SIGHUP
    _forward_to_router(SimpleNamespace(services={}), signal.SIGHUP)  # not started yet: nothing


def test_a_tenants_cascade_mode_is_parsed_and_checked() -> None:
    from services.router.cascade.policy import CascadeMode

    entry = '{"tenants": [{"id": "t", "keys": [], "cascade": "%s"}]}'
    assert parse_key_table(entry % "large").tenants["t"].cascade is CascadeMode.LARGE
    assert parse_key_table('{"tenants": [{"id": "t"}]}').tenants["t"].cascade is None
    with pytest.raises(KeyFileError, match=r"tenants\[0\]\.cascade: must be one of auto"):
        parse_key_table(entry % "huge")
