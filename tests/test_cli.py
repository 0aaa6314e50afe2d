"""The `streamgr` command, run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest

from streamgr.config import load_spec


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "streamgr", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_demo_prints_its_table():
    p = run("demo", "--requests", "40", "--users", "8", "--set", "engine.device=cpu")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0].split()[:4] == ["spec", "device", "mode", "requests"]
    row = lines[2].split()
    assert row[0] == "rank-small" and row[1] == "cpu/float32" and row[3] == "40"
    assert float(row[4]) > 0 and float(row[6]) > 0  # mean latency, throughput
    assert "demo [" in p.stderr  # progress shown


@pytest.mark.slow
def test_init_model_then_serve_from_checkpoint(tmp_path):
    out = tmp_path / "model"
    p = run("init-model", "--spec", "rank-small", "--out", str(out), "--seed", "5",
            "--set", "model.num_layers=1")
    assert p.returncode == 0, p.stderr
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    spec = load_spec(out / "spec.toml")
    assert spec.model.checkpoint == str(out.resolve()) and spec.model.num_layers == 1
    p = run("demo", "--spec", str(out / "spec.toml"), "--requests", "10", "--users", "3",
            "--set", "engine.device=cpu")
    assert p.returncode == 0, p.stderr


async def test_a_rank_engine_names_a_wrong_checkpoint(tmp_path):
    """A live update pointed at the checkpoint's config.json, or at a generate (T5)
    checkpoint, says so (they read "no config.json" and "unknown field `model_type`"), and
    the engine serves on with its weights."""
    from streamgr import Engine, RankRequest
    from streamgr.errors import CheckpointError
    from streamgr.models.checkpoint import read_config
    from streamgr.cli import main
    assert main(["init-model", "--spec", "gen-small", "--out", str(tmp_path / "g")]) == 0
    files = [tmp_path / "g" / f for f in ("config.json", "model.safetensors", "catalog.csv")]
    assert len({f.stat().st_mode for f in files}) == 1  # the weights not 0600 (safetensors')
    with pytest.raises(CheckpointError, match="a file; give the checkpoint's directory"):
        read_config(tmp_path / "g" / "config.json")
    req = RankRequest(user_id=1, items=[5, 17], actions=[1, 0], candidates=[8, 9])
    async with Engine.from_spec("rank-small", {"engine.device": "cpu"}) as eng:
        before = (await eng.rank(req)).scores
        with pytest.raises(CheckpointError, match="a 't5' checkpoint .*not an HSTU"):
            await eng.update(weights=str(tmp_path / "g"))
        after = (await eng.rank(req)).scores  # (a cache hit: fp32 rounding apart)
        assert all(abs(x - y) <= 1e-5 * (1 + abs(y)) for x, y in zip(after, before))


def test_bad_set_is_a_clean_error():
    p = run("demo", "--set", "engine.max_batch=zero")
    assert p.returncode == 2
    assert "engine.max_batch" in p.stderr and "Traceback" not in p.stderr


def test_demo_runs_a_generate_spec():
    p = run("demo", "--spec", "gen-small", "--requests", "12", "--set", "engine.device=cpu")
    assert p.returncode == 0, p.stderr
    row = p.stdout.strip().splitlines()[2].split()
    assert row[0] == "gen-small" and row[2] == "generate" and row[3] == "12"


def test_demo_refuses_zero_requests_and_concurrency(capsys):
    from streamgr.cli import main  # (in-process: three interpreters' start-ups were 8 s of CI)
    for flag in ("--requests", "--concurrency", "--users"):
        assert main(["demo", flag, "0", "--set", "engine.device=cpu"]) == 2
        assert f"{flag} must be at least 1" in capsys.readouterr().err


def test_demo_on_a_spec_too_large_for_the_machine_names_the_keys():
    p = run("demo", "--set", "engine.device=cpu", "--set", "cache.mode=hierarchical",
            "--set", "cache.host_chunks=100000000", timeout=60)
    assert p.returncode == 2 and "cache.host_chunks" in p.stderr and "GiB" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("kw,says", [({"replicas": 0}, "--replicas must be at least 1"),
                                     ({"gpus": -1.0}, "--gpus must be")])
def test_ray_config_refuses_what_the_cluster_would(kw, says):
    """``streamgr ray-config --replicas 0`` printed a config Ray refuses only at deploy."""
    pytest.importorskip("ray")  # the optional extra streamgr[ray]
    from streamgr.deploy.ray_serve import serve_config
    from streamgr.errors import StreamgrError
    with pytest.raises(StreamgrError, match=says):
        serve_config("rank-small", **kw)
