"""Converters on small fixture files written here (same columns and quirks as the real ones)."""

from __future__ import annotations

import pytest

from streamgr.trace.convert import (KUAIRAND_COLUMNS, ConvertError, convert_kuairand,
                                    convert_movielens, convert_sequences)
from streamgr.trace.format import TraceError, read_header, read_trace


def kuairand_row(user, video, t_ms, click=0, like=0, long_view=0, hate=0, tab=1):
    vals = {c: 0 for c in KUAIRAND_COLUMNS}
    vals.update(user_id=user, video_id=video, date=20220408, hourmin=1000, time_ms=t_ms,
                is_click=click, is_like=like, long_view=long_view, is_hate=hate, tab=tab,
                play_time_ms=1234, duration_ms=5678)
    return ",".join(str(vals[c]) for c in KUAIRAND_COLUMNS)


def test_kuairand_two_files_cut_at_60s(tmp_path):
    a, b = tmp_path / "log_standard_1.csv", tmp_path / "log_standard_2.csv"
    head = ",".join(KUAIRAND_COLUMNS)
    # user 7: two events 10 s apart, then one 61 s later; user 3 in the other file, interleaved.
    a.write_text("\n".join([head, kuairand_row(7, 900, 1_000_000, click=1, like=1),
                            kuairand_row(7, 901, 1_010_000, long_view=1),
                            kuairand_row(3, 901, 1_005_000, hate=1)]) + "\n")
    b.write_text("\n".join([head, kuairand_row(7, 902, 1_071_000, click=1),
                            kuairand_row(3, 500, 999_000)]) + "\n")
    h = convert_kuairand([a, b], tmp_path / "k.trace", candidates=4, seed=1, progress=False)
    assert (h.users, h.num_items, h.num_actions, h.records) == (2, 4, 256, 3)
    recs = list(read_trace(tmp_path / "k.trace"))
    assert [r.time for r in recs] == sorted(r.time for r in recs)  # arrival order
    by_user = {}
    for r in recs:
        by_user.setdefault(r.user, []).append(r)
    assert [len(r.items) for r in by_user[7]] == [2, 1]
    assert by_user[7][0].actions == [0b11, 0b1000000] and by_user[7][1].actions == [1]
    assert by_user[3][0].actions == [0, 0b100000]  # user 3 in time order across files
    assert all(len(r.candidates) == 4 for r in recs)
    id_map = (tmp_path / h.item_map).read_text().splitlines()
    assert id_map[0] == "dense_id\traw_id" and id_map[1] == "0\t900"


def test_kuairand_bad_rows_name_file_and_line(tmp_path):
    head = ",".join(KUAIRAND_COLUMNS)
    p = tmp_path / "log.csv"
    p.write_text(head + "\n" + kuairand_row(1, 2, 3) + "\n" + "1,2,3\n")
    with pytest.raises(ConvertError, match=r"log.csv:3: 3 fields"):
        convert_kuairand([p], tmp_path / "x.trace", progress=False)
    p.write_text(head + "\n" + kuairand_row(1, 2, "soon") + "\n")
    with pytest.raises(ConvertError, match=r"log.csv:2: `time_ms` is not an integer"):
        convert_kuairand([p], tmp_path / "x.trace", progress=False)
    p.write_text("user,video\n1,2\n")
    with pytest.raises(ConvertError, match=r"log.csv:1: not a KuaiRand log"):
        convert_kuairand([p], tmp_path / "x.trace", progress=False)


@pytest.mark.parametrize("header", [None, "userId,movieId,rating,timestamp",
                                    "user_id,item_id,rating,timestamp"])
def test_movielens_formats(tmp_path, header):
    rows = [("1", "31", "2.5", "100"), ("1", "1029", "3.0", "130"), ("2", "31", "4", "50"),
            ("1", "1061", "5.0", "400")]
    if header is None:
        p = tmp_path / "u.data"
        p.write_text("".join("\t".join(r) + "\n" for r in rows))
    else:
        p = tmp_path / "ratings.csv"
        p.write_text(header + "\n" + "".join(",".join(r) + "\n" for r in rows))
    h = convert_movielens(p, tmp_path / "m.trace", progress=False)
    recs = list(read_trace(tmp_path / "m.trace"))
    assert h.records == 3 and h.num_items == 3
    user1 = [r for r in recs if r.user == 1]
    assert [r.items for r in user1] == [[0, 1], [2]]  # 100 and 130 s together; 400 s alone
    assert user1[0].actions == [5, 6]  # half stars


def test_movielens_bad_row(tmp_path):
    p = tmp_path / "u.data"
    p.write_text("1\t2\t3\t100\n1\t2\tthree\t200\n")
    with pytest.raises(ConvertError, match=r"u.data:2: `rating` is not a number"):
        convert_movielens(p, tmp_path / "m.trace", progress=False)


def test_negative_candidates_are_refused_before_the_log_is_read(tmp_path):
    src = tmp_path / "u.data"
    src.write_text("1\t2\t5\t100\n")
    with pytest.raises(ConvertError, match="--candidates must be >= 0"):
        convert_movielens(src, tmp_path / "m.trace", candidates=-1)
    assert not (tmp_path / "m.trace").exists()


def test_sequences(tmp_path):
    p = tmp_path / "Beauty.txt"
    p.write_text("1 10 11 12\n2 11 13\n")
    h = convert_sequences(p, tmp_path / "s.trace", progress=False)
    recs = list(read_trace(tmp_path / "s.trace"))
    assert h.users == 2 and h.num_items == 4 and h.records == 5
    assert [r.items for r in recs if r.user == 1] == [[0], [1], [2]]
    p.write_text("1 10\n2\n")
    with pytest.raises(ConvertError, match=r"Beauty.txt:2: a user with no items"):
        convert_sequences(p, tmp_path / "s.trace", progress=False)


def test_not_a_trace(tmp_path):
    p = tmp_path / "junk.trace"
    p.write_bytes(b"\x00\x00\x00\x02\x92\x01")
    with pytest.raises(TraceError, match="not a streamgr trace"):
        read_header(p)


def test_a_cut_trace_names_the_file_and_the_frame(tmp_path):
    """A text file read as a trace fails at its header (its first bytes as a length too large to
    read), a short file there too, a trace cut mid-record at that record:
    each error names the file (the CLI prints it), not just "truncated record"."""
    junk = tmp_path / "junk.trace"
    junk.write_text("garbage\n")  # its first four bytes read as a length: ~1.7 GB, not read
    with pytest.raises(TraceError, match=r"junk\.trace: the header \(not a streamgr trace\?\) "
                                         r"claims \d+ bytes"):
        read_header(junk)
    junk.write_bytes(b"\x00\x00\x00\x09\x92")
    with pytest.raises(TraceError, match=r"junk\.trace: the header .* is cut short"):
        read_header(junk)
    from streamgr.trace.synth import write_synth
    whole = tmp_path / "t.trace"
    write_synth("tiny", whole, users=3, seed=1)
    cut = tmp_path / "cut.trace"
    cut.write_bytes(whole.read_bytes()[:-3])
    n = sum(1 for _ in read_trace(whole))
    with pytest.raises(TraceError, match=rf"cut\.trace: record {n - 1} is cut short"):
        list(read_trace(cut))


def test_an_interrupted_write_leaves_no_cut_trace(tmp_path, monkeypatch):
    """Ctrl-C (or a full disk) while a trace is written: before, a cut trace stayed at the
    output path (its next reader failed at the cut record); now the path keeps what it held
    (here an earlier trace, read whole afterwards) and no temporary file stays."""
    from streamgr.trace.format import TraceWriter
    src = tmp_path / "u.data"
    src.write_text("".join(f"{u}\t{i}\t5\t{100 + i}\n" for u in range(1, 4) for i in range(6)))
    out = tmp_path / "m.trace"
    convert_movielens(src, out, progress=False)
    earlier = [r.items for r in read_trace(out)]
    item_map = (tmp_path / "m.trace.items.tsv").read_text()
    src.write_text(src.read_text() + "9\t77\t5\t999\n")  # a new item: another map
    real_write = TraceWriter.write

    def write(self, record):
        if self.count == 2:
            raise KeyboardInterrupt
        real_write(self, record)
    monkeypatch.setattr(TraceWriter, "write", write)
    with pytest.raises(KeyboardInterrupt):
        convert_movielens(src, out, progress=False)
    assert [r.items for r in read_trace(out)] == earlier
    assert (tmp_path / "m.trace.items.tsv").read_text() == item_map  # the map of that trace
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.trace", "m.trace.items.tsv",
                                                          "u.data"]
    monkeypatch.setattr(TraceWriter, "write", real_write)
    convert_movielens(src, out, progress=False)  # whole: both replaced
    assert "77" in (tmp_path / "m.trace.items.tsv").read_text()
    assert len(list(read_trace(out))) > len(earlier)
