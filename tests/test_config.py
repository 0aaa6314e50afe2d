"""Deployment specs: decoding, errors that name the key, dotted overrides."""

from __future__ import annotations

import pytest

from streamgr.config import BUILTIN_SPECS, decode_spec, load_spec
from streamgr.errors import SpecError


@pytest.mark.parametrize("name", BUILTIN_SPECS)
def test_builtin_specs_decode(name):
    spec = load_spec(name)
    assert spec.name == name
    assert spec.model.family == ("t5" if name.startswith("gen") else "hstu")


def test_rank_ref_matches_workloads_md():
    m = load_spec("rank-ref").model
    assert (m.num_layers, m.num_heads, m.head_dim, m.max_history, m.max_candidates) == \
        (8, 4, 128, 20000, 256)
    c = load_spec("rank-ref").cache
    assert (c.page_tokens, c.chunk_tokens, c.device_pages) == (32, 1024, 40960)


def write(tmp_path, text):
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


def test_unknown_key_is_named(tmp_path):
    p = write(tmp_path, "[model]\ninit_seed = 1\nnum_layer = 3\n")
    with pytest.raises(SpecError, match=r"unknown key `model.num_layer`"):
        load_spec(p)


def test_unknown_section_is_named(tmp_path):
    p = write(tmp_path, "[model]\ninit_seed = 1\n[cahce]\nmode = 'x'\n")
    with pytest.raises(SpecError, match=r"unknown key `cahce`"):
        load_spec(p)


def test_wrong_type_is_named(tmp_path):
    p = write(tmp_path, "[model]\ninit_seed = 1\n[engine]\nmax_batch = 'eight'\n")
    with pytest.raises(SpecError, match=r"`engine.max_batch`.*Expected `int`"):
        load_spec(p)


def test_bad_enum_value_is_named(tmp_path):
    p = write(tmp_path, "[model]\ninit_seed = 1\n[cache]\nmode = 'sometimes'\n")
    with pytest.raises(SpecError, match=r"`cache.mode`"):
        load_spec(p)


def test_missing_model_weights_source(tmp_path):
    p = write(tmp_path, "[model]\nnum_layers = 2\n")
    with pytest.raises(SpecError, match="checkpoint.*init_seed"):
        load_spec(p)


def test_not_toml(tmp_path):
    p = write(tmp_path, "[model\n")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_spec(p)


def test_overrides_from_code_and_cli_strings():
    spec = load_spec("rank-small", {"cache.mode": "gpu-only", "engine.max_batch": "4",
                                    "engine.max_wait_ms": 0.5, "model.init_seed": 9})
    assert spec.cache.mode == "gpu-only" and spec.engine.max_batch == 4
    assert spec.engine.max_wait_ms == 0.5 and spec.model.init_seed == 9


def test_bad_override_is_named():
    with pytest.raises(SpecError, match=r"unknown key `engine.max_bacth`"):
        load_spec("rank-small", {"engine.max_bacth": 3})
    with pytest.raises(SpecError, match=r"`engine.max_batch`"):
        load_spec("rank-small", {"engine.max_batch": "many"})
    with pytest.raises(SpecError, match=r"must be >= 1"):
        load_spec("rank-small", {"engine.max_batch": 0})


def test_no_such_spec():
    with pytest.raises(SpecError, match="not a built-in spec"):
        load_spec("rank-huge")


def test_a_misspelt_spec_name_and_a_directory_are_said_so(tmp_path):
    """A near miss of a built-in name is suggested; a directory (init-model writes one, its
    spec.toml inside) is called a directory, not "no such file"."""
    with pytest.raises(SpecError, match="did you mean rank-small"):
        load_spec("rank-smal")
    with pytest.raises(SpecError, match="is a directory, not a spec file$"):
        load_spec(tmp_path)
    (tmp_path / "spec.toml").write_text("")
    with pytest.raises(SpecError, match=r"is a directory, not a spec file; did you mean "
                                        r".*spec\.toml\?"):
        load_spec(tmp_path)


def test_gen_ref_matches_workloads_md():
    s = load_spec("gen-ref")
    m = s.model
    assert (m.num_layers, m.num_decoder_layers, m.model_dim, m.num_heads, m.head_dim, m.d_ff) == \
        (4, 4, 512, 8, 64, 2048)
    assert s.catalog.codebook_sizes == [8192] * 3 and s.catalog.random_items == 1_000_000
    assert s.policy.beam_widths == [256] * 3 and s.policy.max_context_items == 256


def test_generate_spec_needs_a_catalog():
    with pytest.raises(SpecError, match="catalog"):
        load_spec({"model": {"family": "t5", "init_seed": 1}})


# -- issue 11: the newcomer's and the attacker's spec findings ---------------------------------

def test_checkpoint_override_replaces_a_builtin_init_seed(tmp_path):
    s = load_spec("rank-small", {"model.checkpoint": str(tmp_path)})
    assert s.model.checkpoint == str(tmp_path) and s.model.init_seed is None
    s = load_spec("rank-small", {"model.init_seed": "none", "model.checkpoint": str(tmp_path)})
    assert s.model.init_seed is None
    with pytest.raises(SpecError, match="one of `checkpoint` or `init_seed`"):
        load_spec("rank-small", {"model.init_seed": "none"})


def test_catalog_path_and_random_items_say_they_exclude_each_other():
    with pytest.raises(SpecError, match="exclude each other"):
        decode_spec({"model": {"family": "t5", "init_seed": 1},
                     "catalog": {"path": "x.csv", "random_items": 5}})
    # overriding one of them on a spec holding the other replaces it
    s = load_spec("gen-small", {"catalog.path": "/tmp/items.csv"})
    assert s.catalog.path == "/tmp/items.csv" and s.catalog.random_items == 0


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_max_wait_ms_must_be_finite(value):
    with pytest.raises(SpecError, match="max_wait_ms"):
        load_spec("rank-small", {"engine.max_wait_ms": value})


@pytest.mark.parametrize("value", ["nan", "inf", "-0.5"])
def test_stall_timeout_must_be_finite_and_not_negative(value):
    with pytest.raises(SpecError, match="stall_timeout_s"):
        load_spec("rank-small", {"engine.stall_timeout_s": value})
    assert load_spec("rank-small", {"engine.stall_timeout_s": "0"}).engine.stall_timeout_s == 0


def test_offload_quota_below_a_chunk_is_refused():
    with pytest.raises(SpecError, match="offload_quota_tokens"):
        load_spec("rank-small", {"cache.mode": "hierarchical", "cache.chunk_tokens": 64,
                                 "cache.offload_quota_tokens": 32})


def test_unknown_key_suggests_the_nearest_and_names_set():
    with pytest.raises(SpecError, match=r"--set: unknown key `cache.device_page` \(did you mean "
                                        r"`cache.device_pages`\?\)"):
        load_spec("rank-small", {"cache.device_page": 5})
    with pytest.raises(SpecError, match=r"^--set engine.max_batch=x: "):
        load_spec("rank-small", {"engine.max_batch": "x"})


def test_cache_sizes_the_machine_cannot_hold_are_refused():
    from streamgr.engine import Engine
    with pytest.raises(SpecError, match=r"GiB.*lower cache.device_pages"):
        Engine.from_spec("rank-small", {"engine.device": "cpu", "cache.mode": "gpu-only",
                                        "cache.device_pages": 10**12})
    with pytest.raises(SpecError, match=r"cache.host_chunks"):
        Engine.from_spec("rank-small", {"engine.device": "cpu", "cache.mode": "hierarchical",
                                        "cache.host_chunks": 10**8})


def test_spec_reference_is_complete_and_in_sync():
    from pathlib import Path

    from streamgr.spec_doc import MEANING, keys, render
    assert [k for k in keys() if k not in MEANING] == []  # every key has a meaning
    assert set(MEANING) == set(keys())  # and no meaning outlives its key
    doc = Path(__file__).resolve().parents[1] / "docs" / "specs.md"
    assert doc.read_text() == render() + "\n", "docs/specs.md is stale: streamgr spec-doc > docs/specs.md"


@pytest.mark.parametrize("key,value", [("policy.beam_widths", [16, 1025, 16]),
                                       ("policy.beam_widths", [0, 16, 16]),
                                       ("policy.max_top_k", 2048), ("policy.top_k", 1025)])
def test_policy_stays_within_the_selections_beams(key, value):
    """A step keeps at most MAX_BEAMS beams (the selection kernels' largest k), and the answer
    is the last step's beams: a wider policy is refused at load, not at its first batch."""
    from streamgr.config import MAX_BEAMS
    with pytest.raises(SpecError, match=rf"`{key.split('.')[1]}` must be in 1\.\.(max_top_k \()?{MAX_BEAMS}"):
        load_spec("gen-small", {key: value})
