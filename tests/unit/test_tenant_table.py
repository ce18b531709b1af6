"""The API key table (``router/http/tenants/table.py``): ``--api-key-file`` lines and
``--api-key`` entries with a tenant and its limits; errors that name the line and never
the key; the table handed from ``pdserve up`` to its router in the environment only, and
split between ``--processes``."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cli.configs import edge_config
from pdserve.cli.parser import build_parser
from pdserve.launch.router_processes import child_argv
from pdserve.router.http.edge.config import EdgeConfig, read_api_key_file
from pdserve.router.http.tenants.table import (
    TenantLimits,
    TenantSpec,
    key_table,
    parse_key_entry,
)
from pdserve.router.server import RouterConfig

SECRET = "sk-Secret-0123456789"  # must never appear in an error
GOOD = f"""# ops keys
{SECRET} tenant=acme max_concurrent=8 tokens_per_s=2000 burst=20000
sk-acme-second-key  tenant=acme   # a second key: acme's limits
sk-lone-key-55555

sk-beta-key-777777 tenant=beta.team_1 tokens_per_s=0.5
"""


def table(text: str, tmp_path: Path) -> tuple[tuple[str, ...], tuple[TenantSpec, ...]]:
    path = tmp_path / "keys"
    path.write_text(text)
    return key_table(read_api_key_file(path))


def test_a_file_of_bare_keys_and_tenants_with_limits(tmp_path: Path) -> None:
    keys, tenants = table(GOOD, tmp_path)
    assert keys == (SECRET, "sk-acme-second-key", "sk-lone-key-55555", "sk-beta-key-777777")
    assert tenants == (
        TenantSpec("acme", (SECRET, "sk-acme-second-key"),
                   TenantLimits(max_concurrent=8, tokens_per_s=2000.0, burst=20000.0)),
        TenantSpec("beta.team_1", ("sk-beta-key-777777",), TenantLimits(tokens_per_s=0.5)))
    assert tenants[1].limits.capacity == 0.5  # burst: one second's worth by default
    # Limits may be repeated identically on another key of the tenant, and a key twice.
    again = GOOD + f"sk-acme-second-key tenant=acme burst=20000 max_concurrent=8 " \
                   f"tokens_per_s=2000\n{SECRET} tenant=acme\n"
    assert table(again, tmp_path) == (keys, tenants)


@pytest.mark.parametrize(("line", "error"), [
    (f"{SECRET} tenant=acme colour=blue", "field 3 is not one of tenant=, max_concurrent="),
    (f"{SECRET} tenant=acme {SECRET}", "field 3 is not one of"),
    (f"{SECRET} tenant=acme max_concurrent=two", "max_concurrent must be an integer"),
    (f"{SECRET} tenant=acme max_concurrent=0", "max_concurrent must be an integer >= 1"),
    (f"{SECRET} tenant=acme tokens_per_s=-3", "tokens_per_s must be a number > 0"),
    (f"{SECRET} tenant=acme tokens_per_s=nan", "tokens_per_s must be a number > 0"),
    (f"{SECRET} tenant=acme tokens_per_s=inf", "tokens_per_s must be a number > 0"),
    (f"{SECRET} tenant=acme burst=100", "burst needs tokens_per_s"),
    (f"{SECRET} tenant=acme tenant=beta", "tenant given twice"),
    (f"{SECRET} max_concurrent=3", "limits need tenant=<name>"),
    (f"{SECRET} tenant=bad/name", "a tenant name is 1 to 64 of"),
    (f"{SECRET} tenant={'a' * 65}", "a tenant name is 1 to 64 of"),
    (f"{SECRET} tenant=key-3", "reserved for keys without a tenant"),
    (f"tenant=acme {SECRET}", "the key comes first"),
    ("sk-shrt tenant=acme", "at least 8 printable ASCII"),
])
def test_a_bad_line_names_its_number_and_never_the_key(tmp_path: Path, line: str,
                                                        error: str) -> None:
    with pytest.raises(ValueError, match="line 3: ") as caught:
        table(f"# keys\n\n{line}\n", tmp_path)
    assert error in str(caught.value)
    assert SECRET not in str(caught.value) and "sk-Secret" not in str(caught.value)


@pytest.mark.parametrize(("lines", "error"), [
    ([f"{SECRET} tenant=acme max_concurrent=2", "sk-acme-two-2222 tenant=acme max_concurrent=3"],
     "line 2: tenant acme's limits differ from those of --api-key-file"),
    ([f"{SECRET} tenant=acme", f"{SECRET} tenant=beta"],
     "line 2: its key is also --api-key-file"),
    ([SECRET, f"{SECRET} tenant=beta"], "line 2: its key is also"),
])
def test_lines_that_disagree_are_refused(tmp_path: Path, lines: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error) as caught:
        table("\n".join(lines), tmp_path)
    assert SECRET not in str(caught.value)


def test_a_bad_entry_on_the_command_line_or_in_the_environment_is_not_echoed(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--api-key", f"{SECRET} tenant=a/b"])
    monkeypatch.setenv("PDSERVE_API_KEY", f"sk-good-key-1,{SECRET} max_concurrent=x")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router"])
    err = capsys.readouterr().err
    assert "a tenant name is 1 to 64" in err and "entry 2: max_concurrent must be" in err
    assert "PDSERVE_API_KEY" in err and "sk-Secret" not in err


def test_flags_entries_and_file_make_one_table(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(GOOD)
    args = build_parser().parse_args([
        "router", "--api-key", "sk-flag-key-0001 tenant=acme", "--api-key",
        "sk-flag-key-0002", "--api-key-file", str(path)])
    edge = edge_config(args)
    assert edge.api_keys[:3] == ("sk-flag-key-0001", "sk-flag-key-0002", SECRET)
    assert edge.tenants[0].keys == ("sk-flag-key-0001", SECRET, "sk-acme-second-key")
    assert edge.tenants[0].limits.max_concurrent == 8


def test_up_hands_the_table_to_its_router_in_the_environment_only(tmp_path: Path) -> None:
    from pdserve.cli.configs import up_config
    from pdserve.core.model import ResolvedModel
    from pdserve.launch.up import plan

    keys, tenants = table(GOOD, tmp_path)  # written to tmp_path / "keys"
    # An admin port of its own: with keys, up's probe reads /workers there.
    up = up_config(build_parser().parse_args([
        "up", "--simulated", "--api-key-file", str(tmp_path / "keys"), "--tenant-isolation",
        "key", "--admin-port", "9400"]), ResolvedModel(Path("/models/tiny"), "tiny"))
    edge = up.edge
    assert (edge.api_keys, edge.tenants, edge.tenant_isolation) == (keys, tenants, "key")
    router = plan(up, tmp_path)[-1]
    assert not any(key in arg for key in keys for arg in router.argv)  # not shown by ps
    assert router.env["PDSERVE_API_KEY_FILE"] == ""  # its router reads no file of its own
    argv = router.argv[router.argv.index("router"):]
    with pytest.MonkeyPatch.context() as env:
        for name, value in router.env.items():
            env.setenv(name, value)
        assert edge_config(build_parser().parse_args(argv)) == edge


@pytest.mark.parametrize("bad", [
    dict(tenants=(TenantSpec("acme", ("sk-not-a-configured-key",)),)),
    dict(tenants=(TenantSpec("acme", ("sk-key-one-111",)),
                  TenantSpec("acme", ("sk-key-two-222",)))),
    dict(tenants=(TenantSpec("a", ("sk-key-one-111",)), TenantSpec("b", ("sk-key-one-111",)))),
    dict(tenant_limits_share=0.0),
])
def test_edge_config_refuses_an_inconsistent_table(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        EdgeConfig(api_keys=("sk-key-one-111", "sk-key-two-222"), **bad)  # type: ignore[arg-type]


def test_replicas_split_each_tenants_limits_and_router_processes_share_them() -> None:
    limits = TenantLimits(max_concurrent=3, tokens_per_s=100.0, burst=400.0)
    assert limits.share(0.5) == TenantLimits(max_concurrent=2, tokens_per_s=50.0, burst=200.0)
    assert TenantLimits(max_concurrent=1).share(0.25).max_concurrent == 1
    assert limits.share(1.0) is limits
    cfg = RouterConfig("m", "m", ("p:1",), ("d:1",),
                       edge=EdgeConfig(tenant_limits_share=0.5))  # one of two replicas
    line = child_argv(["router"], cfg, 4, 1, Path("/dev/shm/ledger"))
    # Its processes keep the replica's share (given once, by the operator) and share
    # one ledger: the limits are not split again between them.
    assert "--tenant-limits-share" not in line and "--tenant-ledger" in line


def test_a_comment_or_blank_entry_is_nothing() -> None:
    assert parse_key_entry("   ") is None
    assert parse_key_entry("# sk-commented-out tenant=x") is None


def test_no_key_shows_in_a_configs_repr() -> None:
    """A logged config, or a traceback's locals, never carries a key."""
    from pdserve.router.http.edge.config import EdgeConfig
    from pdserve.router.http.tenants.table import KeyEntry, TenantSpec

    key = "sk-never-shown-0123"
    spec = TenantSpec("acme", (key,))
    admin = "sk-admin-never-shown-0123"
    edge = EdgeConfig(api_keys=(key,), admin_keys=(admin,), tenants=(spec,))
    assert key not in repr(edge) and key not in repr(spec) and admin not in repr(edge)
    assert key not in repr(KeyEntry(key, "acme"))
