"""Admin requests over the socket (server/admin.py, admin_cli.py): only a connection greeted
with the admin token may update, roll back or list versions; a client-token connection gets
UNAUTHORIZED and keeps serving; a contract violation comes back typed with the field named;
Prometheus shows the versions and update counts; the CLI drives a real server process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamgr import Engine
from streamgr.api import GenerateRequest
from streamgr.client import AsyncClient
from streamgr.errors import ContractError, Unauthorized
from streamgr.server import Server

GEN = {"engine.device": "cpu", "model.dtype": "float32"}
REQ = GenerateRequest(user_id=5, history=[1, 2, 3], top_k=6)


async def test_admin_token_gates_updates_and_clients_keep_serving():
    async with Engine.from_spec("gen-small", GEN) as eng:
        srv = Server(eng, token="client-secret", admin_token="admin-secret")
        addr = (await srv.start("127.0.0.1", 0))[0]
        async with AsyncClient(addr, "client-secret") as user, \
                AsyncClient(addr, "admin-secret") as admin:
            assert "admin" in admin.server_info.capabilities
            assert "admin" not in user.server_info.capabilities
            before = await user.generate(REQ)
            for call in (user.versions(), user.rollback(), user.update(seed=3)):
                with pytest.raises(Unauthorized, match="admin token"):
                    await call
            assert (await user.generate(REQ)).items == before.items  # same connection serves
            v1 = (await admin.versions())["generate"]["active"]["version"]
            vs = await admin.update(seed=3, policy={"top_k": 4})
            v2 = vs["generate"]["active"]["version"]
            assert v2 != v1 and vs["generate"]["previous"]["version"] == v1
            after = await user.generate(REQ)
            assert after.stats.version == v2 and after.items != before.items
            with pytest.raises(ContractError, match="policy.beam_widths"):
                await admin.update(policy={"beam_widths": [4]})
            with pytest.raises(ContractError, match="catalog.remove"):
                await admin.update(catalog_remove=[10**9])
            assert (await user.generate(REQ)).stats.version == v2  # still the active one
            vs = await admin.rollback()
            assert vs["generate"]["active"]["version"] == v1
            assert (await user.generate(REQ)).items == before.items
            text = srv.prometheus()
            assert "streamgr_generate_updates_total 1" in text
            assert "streamgr_generate_rollbacks_total 1" in text
            assert f'streamgr_version_info{{kind="generate",version="{v1}"}} 1' in text
        await srv.shutdown(1.0)


def test_admin_token_must_differ_from_the_client_token():
    with pytest.raises(ValueError, match="differ"):
        Server(object(), token="same", admin_token="same")


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "streamgr", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_cli_update_rollback_versions_against_a_served_process(tmp_path: Path):
    admin = tmp_path / "admin.token"
    admin.write_text("s3cret-admin\n")
    policy = tmp_path / "policy.toml"
    policy.write_text("[policy]\nbeam_widths = [8, 8, 8]\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "streamgr", "serve", "gen-small", "--set",
                             "engine.device=cpu", "--port", "0", "--admin-token-file",
                             str(admin)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line, t_end = "", time.monotonic() + 120
        while "serving" not in line and time.monotonic() < t_end:
            line = proc.stdout.readline()
        addr = re.search(r"on (\S+:\d+)", line).group(1)
        out = _cli("update", "--server", addr, "--admin-token-file", str(admin), "--policy",
                   str(policy), "--catalog-remove", "1,2")
        assert out.returncode == 0, out.stderr
        vs = json.loads(out.stdout)
        assert vs["generate"]["active"]["beam_widths"] == [8, 8, 8]
        assert vs["generate"]["active"]["catalog_items"] == 498
        bad = _cli("update", "--server", addr, "--admin-token-file", str(admin),
                   "--catalog-remove", "1")  # already gone
        assert bad.returncode == 2 and "catalog.remove" in bad.stderr
        wrong = tmp_path / "wrong.token"
        wrong.write_text("nope")
        denied = _cli("versions", "--server", addr, "--admin-token-file", str(wrong))
        assert denied.returncode == 2 and "token" in denied.stderr
        back = json.loads(_cli("rollback", "--server", addr, "--admin-token-file",
                               str(admin)).stdout)
        assert back["generate"]["active"]["catalog_items"] == 500
        now = json.loads(_cli("versions", "--server", addr, "--admin-token-file",
                              str(admin)).stdout)
        assert now == back
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_catalog_add_csv_naming_an_item_twice_is_refused_before_sending(tmp_path: Path):
    """Before, the later row silently replaced the earlier (a dict); an item has one SID."""
    from streamgr.admin_cli import _catalog_add
    from streamgr.errors import StreamgrError
    path = tmp_path / "add.csv"
    path.write_text("item_id,s1,s2,s3\n900,1,2,3\n901,1,2,4\n900,4,5,6\n")
    with pytest.raises(StreamgrError, match=r"add.csv:4: item 900 again \(line 2\)"):
        _catalog_add(str(path))
    path.write_text("item_id,s1,s2,s3\n900,1,2,3\n901,1,2,4\n")
    assert _catalog_add(str(path)) == {900: [1, 2, 3], 901: [1, 2, 4]}


# A sample line of the text format: name, optional labels (escapes inside quotes), value.
_SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-z_]+="([^"\\\n]|\\[\\"n])*",?)*\})? '
                     r'[-+0-9.eE]+(inf|nan)?$')


async def test_a_version_naming_a_path_with_a_line_feed_keeps_the_scrape_parseable(tmp_path):
    """Before: the raw line feed split ``streamgr_version_info``'s sample in two lines, and
    Prometheus rejects the whole scrape for one bad line."""
    from streamgr.cli import main
    from streamgr.server.metrics import label_value
    assert label_value('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    ckpt = tmp_path / 'odd "dir"\nv2'
    assert main(["init-model", "--spec", "rank-small", "--out", str(ckpt)]) == 0
    async with Engine.from_spec("rank-small", {"engine.device": "cpu"}) as eng:
        await eng.update(weights=str(ckpt))
        text = Server(eng).prometheus()
    lines = [x for x in text.splitlines() if not x.startswith("#")]
    assert lines and all(_SAMPLE.match(x) for x in lines), [x for x in lines
                                                              if not _SAMPLE.match(x)]
    want = label_value(eng.stats()["weights_version"])
    assert f'streamgr_version_info{{kind="rank",version="{want}"}} 1' in lines
    assert "\\n" in want and '\\"dir\\"' in want


def test_update_paths_that_exist_here_are_sent_absolute(tmp_path: Path, monkeypatch):
    """The server reads ``--weights`` / ``--catalog`` from its own working directory: a
    relative path the user sees here would name another path there (before: sent as typed,
    and the server answered "no config.json" for a checkpoint sitting in the user's folder).
    A path that does not exist here goes as given (it may be the server host's)."""
    from streamgr.admin_cli import _here
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    assert _here("ckpt") == str(tmp_path.resolve() / "ckpt")
    assert _here("only/on/the/server") == "only/on/the/server"
    assert _here("/abs/path") == "/abs/path" and _here(None) is None
