"""SqliteSessionStore on a real SQLite file: round trips, copy-on-write forks, deletion with
forks alive, retention (TTL, ephemeral, size caps in LRU order), concurrent writers, and a
SIGKILL in the middle of appends.

Time comes from an injected clock, so every created_at / updated_at and every retention
decision is exact.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from argosy.errors import ArgosyError, InvalidRequestError, NotFoundError
from argosy.sessions import (
    Finished,
    ForkPoint,
    MessageAppended,
    SessionEvent,
    SpanGenerated,
    SqliteSessionStore,
    ToolParseFailed,
    ToolUsed,
)
from argosy.sessions.events import encode_event
from argosy.sessions.sqlite_schema import SCHEMA_VERSION

DAY = 86400.0
T0 = 1_700_000_000.0
REPO_ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "sessions.db"


@pytest.fixture
def store(db_path: Path, clock: FakeClock):
    with SqliteSessionStore(db_path, clock=clock) as s:
        yield s


def msg(text: str, role: str = "user") -> MessageAppended:
    return MessageAppended(role=role, content=text)


def texts(store: SqliteSessionStore, session_id: str) -> list[str]:
    out = []
    for stored in store.read(session_id):
        assert isinstance(stored.event, MessageAppended)
        assert isinstance(stored.event.content, str)
        out.append(stored.event.content)
    return out


def seqs_and_owners(store: SqliteSessionStore, session_id: str) -> list[tuple[int, str]]:
    return [(e.seq, e.session_id) for e in store.read(session_id)]


def raw(db_path: Path, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(db_path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


EVERY_EVENT: list[SessionEvent] = [
    MessageAppended(role="system", content="You are terse."),
    MessageAppended(
        role="user",
        content=[
            {"type": "text", "text": "What is in this picture? ünïcødé ✓"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ],
        name="alice",
    ),
    SpanGenerated(channel="reasoning", text="The user wants a tool.", token_ids=[5, 6, 7]),
    SpanGenerated(channel="tool_call", text='<tool_call>{"name": "look"}</tool_call>', token_ids=[8, 9]),
    ToolUsed(call_id="call_1", name="look", arguments='{"zoom": 2}'),
    ToolParseFailed(raw_text="<tool_call>{broken", reason="unterminated JSON object"),
    MessageAppended(
        role="assistant",
        content=None,
        tool_calls=[{"id": "call_1", "type": "function", "function": {"name": "look", "arguments": "{}"}}],
        reasoning="The user wants a tool.",
    ),
    MessageAppended(role="tool", content="a cat", tool_call_id="call_1"),
    SpanGenerated(channel="text", text="A cat.", token_ids=[10, 11]),
    Finished(reason="stop", usage={"prompt_tokens": 12, "completion_tokens": 2, "cached_tokens": 0}),
]


# ---- round trips -------------------------------------------------------------------------


def test_create_append_read_round_trips_every_event_type(store: SqliteSessionStore, clock: FakeClock) -> None:
    session = store.create(metadata={"model": "tiny", "params": {"temperature": 0.5}}, events=EVERY_EVENT[:2])
    assert session.last_seq == 2
    assert (session.created_at, session.updated_at) == (T0, T0)
    assert session.parent is None and session.is_ephemeral is False

    clock.advance(5)
    assert store.append(session.id, EVERY_EVENT[2:5]) == [3, 4, 5]
    clock.advance(5)
    assert store.append(session.id, EVERY_EVENT[5:]) == [6, 7, 8, 9, 10]

    history = store.read(session.id)
    assert [e.event for e in history] == EVERY_EVENT
    assert [e.seq for e in history] == list(range(1, 11))
    assert [e.created_at for e in history] == [T0] * 2 + [T0 + 5] * 3 + [T0 + 10] * 5
    assert {e.session_id for e in history} == {session.id}
    assert {type(e.event) for e in history} == {
        MessageAppended,
        SpanGenerated,
        ToolUsed,
        ToolParseFailed,
        Finished,
    }

    info = store.get(session.id)
    assert info is not None
    assert info.metadata == {"model": "tiny", "params": {"temperature": 0.5}}
    assert (info.created_at, info.updated_at, info.last_seq) == (T0, T0 + 10, 10)


def test_events_are_stored_as_json_payloads_with_a_kind(store: SqliteSessionStore, db_path: Path) -> None:
    session = store.create(events=[SpanGenerated(channel="text", text="hi", token_ids=[1, 2])])
    rows = raw(db_path, "SELECT seq, kind, payload FROM events WHERE session_id = ?", (session.id,))
    assert rows == [(1, "span", '{"channel":"text","text":"hi","token_ids":[1,2]}')]


def test_empty_append_commits_nothing(store: SqliteSessionStore, clock: FakeClock) -> None:
    session = store.create()
    clock.advance(10)
    assert store.append(session.id, []) == []
    assert store.get(session.id) == session
    assert store.read(session.id) == []


def test_an_event_that_is_not_json_fails_the_whole_append(store: SqliteSessionStore) -> None:
    session = store.create(events=[msg("a")])
    with pytest.raises(InvalidRequestError, match="not JSON-serialisable"):
        store.append(session.id, [msg("b"), MessageAppended(role="user", content=[{"x": object()}])])
    assert texts(store, session.id) == ["a"]
    assert store.append(session.id, [msg("c")]) == [2]


def test_invalid_events_and_metadata_are_rejected(store: SqliteSessionStore) -> None:
    with pytest.raises(InvalidRequestError, match="channel"):
        SpanGenerated(channel="audio", text="")
    with pytest.raises(InvalidRequestError, match="role"):
        MessageAppended(role="")
    with pytest.raises(InvalidRequestError, match="metadata"):
        store.create(metadata={"when": object()})


def test_unknown_session_ids_raise_not_found(store: SqliteSessionStore) -> None:
    assert store.get("nope") is None
    for call in (
        lambda: store.append("nope", [msg("a")]),
        lambda: store.append("nope", []),
        lambda: store.read("nope"),
        lambda: store.fork("nope"),
        lambda: store.delete("nope"),
    ):
        with pytest.raises(NotFoundError, match="session 'nope' not found"):
            call()


# ---- forks -------------------------------------------------------------------------------


def test_fork_at_the_end_refers_to_the_parent_and_continues_its_numbering(
    store: SqliteSessionStore, db_path: Path
) -> None:
    parent = store.create(metadata={"model": "tiny"}, events=[msg("p1"), msg("p2")])
    child = store.fork(parent.id)
    assert child.parent == ForkPoint(parent.id, 2)
    assert child.last_seq == 2
    assert child.metadata == {"model": "tiny"}  # None copies the parent's
    assert seqs_and_owners(store, child.id) == [(1, parent.id), (2, parent.id)]
    # copy-on-write: the child holds no rows of its own yet
    assert raw(db_path, "SELECT COUNT(*) FROM events WHERE session_id = ?", (child.id,)) == [(0,)]

    assert store.append(child.id, [msg("c3")]) == [3]
    assert seqs_and_owners(store, child.id) == [(1, parent.id), (2, parent.id), (3, child.id)]
    assert texts(store, child.id) == ["p1", "p2", "c3"]
    assert texts(store, parent.id) == ["p1", "p2"]


def test_fork_at_a_middle_event(store: SqliteSessionStore) -> None:
    parent = store.create(events=[msg(f"p{i}") for i in range(1, 6)])
    child = store.fork(parent.id, at_event=2, metadata={"model": "other"}, ephemeral=True)
    assert (child.parent, child.last_seq, child.metadata, child.is_ephemeral) == (
        ForkPoint(parent.id, 2),
        2,
        {"model": "other"},
        True,
    )
    assert store.append(child.id, [msg("c3"), msg("c4")]) == [3, 4]
    assert texts(store, child.id) == ["p1", "p2", "c3", "c4"]
    assert [e.seq for e in store.read(child.id)] == [1, 2, 3, 4]
    assert texts(store, parent.id) == ["p1", "p2", "p3", "p4", "p5"]


def test_fork_at_zero_sees_nothing_and_out_of_range_is_rejected(store: SqliteSessionStore) -> None:
    parent = store.create(events=[msg("p1"), msg("p2")])
    empty = store.fork(parent.id, at_event=0)
    assert store.read(empty.id) == []
    assert store.append(empty.id, [msg("e1")]) == [1]
    assert texts(store, empty.id) == ["e1"]
    for at_event in (-1, 3):
        with pytest.raises(InvalidRequestError, match="at_event must be between 0 and 2") as info:
            store.fork(parent.id, at_event=at_event)
        assert info.value.param == "at_event"


def test_fork_with_events_adds_the_new_turn_in_one_call(store: SqliteSessionStore) -> None:
    # previous_response_id: fork at the previous response's end and add the new input
    previous = store.create(metadata={"model": "tiny"}, events=[msg("hi"), msg("hello", "assistant")])
    turn = store.fork(previous.id, metadata={"model": "tiny", "turn": 2}, events=[msg("again")])
    assert turn.last_seq == 3
    assert texts(store, turn.id) == ["hi", "hello", "again"]


def test_fork_of_a_fork_three_levels(store: SqliteSessionStore) -> None:
    a = store.create(events=[msg("a1"), msg("a2"), msg("a3")])
    b = store.fork(a.id, at_event=2, events=[msg("b3"), msg("b4")])
    c = store.fork(b.id, at_event=3, events=[msg("c4")])
    assert seqs_and_owners(store, c.id) == [(1, a.id), (2, a.id), (3, b.id), (4, c.id)]
    assert texts(store, c.id) == ["a1", "a2", "b3", "c4"]

    # a fork point inside b's inherited range reaches through b into a
    d = store.fork(c.id, at_event=1, events=[msg("d2")])
    assert seqs_and_owners(store, d.id) == [(1, a.id), (2, d.id)]
    assert texts(store, d.id) == ["a1", "d2"]

    # a deep chain, as a long previous_response_id conversation makes
    tip = c
    for i in range(5, 60):
        tip = store.fork(tip.id, events=[msg(f"t{i}")])
    assert texts(store, tip.id) == ["a1", "a2", "b3", "c4"] + [f"t{i}" for i in range(5, 60)]

    # nothing above changed the ancestors
    assert texts(store, a.id) == ["a1", "a2", "a3"]
    assert texts(store, b.id) == ["a1", "a2", "b3", "b4"]
    assert texts(store, c.id) == ["a1", "a2", "b3", "c4"]


def test_fork_isolation_in_both_directions(store: SqliteSessionStore) -> None:
    parent = store.create(events=[msg("p1")])
    child = store.fork(parent.id)
    assert store.append(parent.id, [msg("p2")]) == [2]
    assert store.append(child.id, [msg("c2")]) == [2]
    assert texts(store, parent.id) == ["p1", "p2"]
    assert texts(store, child.id) == ["p1", "c2"]
    assert store.append(parent.id, [msg("p3")]) == [3]
    assert texts(store, child.id) == ["p1", "c2"]
    assert texts(store, parent.id) == ["p1", "p2", "p3"]


def test_two_forks_of_one_session_are_independent(store: SqliteSessionStore) -> None:
    parent = store.create(events=[msg("p1"), msg("p2")])
    left = store.fork(parent.id)
    right = store.fork(parent.id)
    assert left.id != right.id
    store.append(left.id, [msg("l3"), msg("l4")])
    store.append(right.id, [msg("r3")])
    assert texts(store, left.id) == ["p1", "p2", "l3", "l4"]
    assert texts(store, right.id) == ["p1", "p2", "r3"]
    assert texts(store, parent.id) == ["p1", "p2"]
    store.delete(left.id)
    assert texts(store, right.id) == ["p1", "p2", "r3"]


# ---- delete ------------------------------------------------------------------------------


def test_delete_removes_the_session_and_its_rows(store: SqliteSessionStore, db_path: Path) -> None:
    session = store.create(events=[msg("a"), msg("b")])
    store.delete(session.id)
    assert store.get(session.id) is None
    with pytest.raises(NotFoundError):
        store.read(session.id)
    with pytest.raises(NotFoundError):
        store.append(session.id, [msg("c")])
    with pytest.raises(NotFoundError):
        store.delete(session.id)
    assert raw(db_path, "SELECT COUNT(*) FROM sessions") == [(0,)]
    assert raw(db_path, "SELECT COUNT(*) FROM events") == [(0,)]


def test_deleted_parent_is_hidden_until_its_last_fork_goes(store: SqliteSessionStore, db_path: Path) -> None:
    parent = store.create(events=[msg(f"p{i}") for i in range(1, 6)])
    early = store.fork(parent.id, at_event=2, events=[msg("e3")])
    late = store.fork(parent.id, at_event=3, events=[msg("l4")])

    store.delete(parent.id)
    assert store.get(parent.id) is None
    for call in (
        lambda: store.read(parent.id),
        lambda: store.fork(parent.id),
        lambda: store.append(parent.id, [msg("x")]),
        lambda: store.delete(parent.id),
    ):
        with pytest.raises(NotFoundError):
            call()
    assert texts(store, early.id) == ["p1", "p2", "e3"]
    assert texts(store, late.id) == ["p1", "p2", "p3", "l4"]
    # events past the furthest fork point are gone already
    assert raw(db_path, "SELECT seq FROM events WHERE session_id = ? ORDER BY seq", (parent.id,)) == [
        (1,),
        (2,),
        (3,),
    ]

    store.delete(late.id)
    assert texts(store, early.id) == ["p1", "p2", "e3"]
    assert raw(db_path, "SELECT seq FROM events WHERE session_id = ? ORDER BY seq", (parent.id,)) == [
        (1,),
        (2,),
    ]

    store.delete(early.id)
    assert raw(db_path, "SELECT COUNT(*) FROM sessions") == [(0,)]
    assert raw(db_path, "SELECT COUNT(*) FROM events") == [(0,)]
    assert store.total_bytes() == 0


def test_deleting_a_hidden_chain_purges_it_bottom_up(store: SqliteSessionStore, db_path: Path) -> None:
    a = store.create(events=[msg("a1"), msg("a2")])
    b = store.fork(a.id, events=[msg("b3")])
    c = store.fork(b.id, events=[msg("c4")])
    other = store.create(events=[msg("o1")])
    store.delete(a.id)
    store.delete(b.id)
    assert texts(store, c.id) == ["a1", "a2", "b3", "c4"]
    assert store.get(c.id) is not None and store.get(c.id).parent == ForkPoint(b.id, 3)  # type: ignore[union-attr]
    store.delete(c.id)
    assert raw(db_path, "SELECT id FROM sessions") == [(other.id,)]
    assert raw(db_path, "SELECT session_id, seq FROM events") == [(other.id, 1)]


# ---- retention ---------------------------------------------------------------------------


def test_sweep_deletes_sessions_not_updated_within_the_ttl(db_path: Path, clock: FakeClock) -> None:
    with SqliteSessionStore(db_path, ttl_seconds=30 * DAY, clock=clock) as store:
        old = store.create(events=[msg("o")])
        clock.advance(10 * DAY)
        stale = store.create(events=[msg("s")])
        clock.advance(10 * DAY)
        store.append(old.id, [msg("touched")])  # old is now updated at T0 + 20 days

        assert store.sweep(now=T0 + 39 * DAY) == 0
        assert store.sweep(now=T0 + 41 * DAY) == 1
        assert store.get(stale.id) is None
        assert texts(store, old.id) == ["o", "touched"]
        assert store.sweep(now=T0 + 51 * DAY) == 1
        assert store.get(old.id) is None


def test_sweep_keeps_what_live_forks_of_an_expired_parent_refer_to(db_path: Path, clock: FakeClock) -> None:
    with SqliteSessionStore(db_path, ttl_seconds=30 * DAY, clock=clock) as store:
        parent = store.create(events=[msg("p1"), msg("p2")])
        clock.advance(20 * DAY)
        child = store.fork(parent.id, events=[msg("c3")])
        assert store.sweep(now=T0 + 31 * DAY) == 1
        assert store.get(parent.id) is None
        assert texts(store, child.id) == ["p1", "p2", "c3"]
        assert store.sweep(now=T0 + 51 * DAY) == 1
        assert raw(db_path, "SELECT COUNT(*) FROM sessions") == [(0,)]


def test_ephemeral_sessions_go_after_their_short_ttl(db_path: Path, clock: FakeClock) -> None:
    with SqliteSessionStore(db_path, ephemeral_ttl_seconds=60, clock=clock) as store:
        ephemeral = store.create(ephemeral=True, events=[msg("e")])
        durable = store.create(events=[msg("d")])
        assert store.get(ephemeral.id).is_ephemeral is True  # type: ignore[union-attr]
        clock.advance(59)
        assert store.sweep() == 0
        clock.advance(2)
        assert store.sweep() == 1
        assert store.get(ephemeral.id) is None
        assert store.get(durable.id) is not None


def test_size_cap_on_sessions_deletes_least_recently_updated_first(db_path: Path, clock: FakeClock) -> None:
    with SqliteSessionStore(db_path, max_sessions=3, clock=clock) as store:
        ids = []
        for i in range(5):
            ids.append(store.create(events=[msg(f"s{i}")]).id)
            clock.advance(1)
        store.append(ids[0], [msg("touch")])  # s0 becomes the most recently updated
        assert store.sweep() == 2
        assert [store.get(i) is not None for i in ids] == [True, False, False, True, True]

        # ephemeral sessions go before durable ones, however recent
        clock.advance(1)
        newest_ephemeral = store.create(ephemeral=True)
        assert store.sweep() == 1
        assert store.get(newest_ephemeral.id) is None
        assert [store.get(i) is not None for i in ids] == [True, False, False, True, True]


def test_size_cap_on_bytes_deletes_least_recently_updated_first(db_path: Path, clock: FakeClock) -> None:
    size_one = len(encode_event(msg("0" * 100))[1].encode())
    size_touch = len(encode_event(msg("x"))[1].encode())
    with SqliteSessionStore(db_path, max_bytes=2 * size_one + size_touch, clock=clock) as store:
        ids = []
        for i in range(4):
            ids.append(store.create(events=[msg(f"{i}" * 100)]).id)
            clock.advance(1)
        store.append(ids[1], [msg("x")])  # s1 becomes the most recently updated
        assert store.total_bytes() == 4 * size_one + size_touch
        assert raw(db_path, "SELECT SUM(LENGTH(CAST(payload AS BLOB))) FROM events") == [
            (store.total_bytes(),)
        ]
        assert store.sweep() == 2
        assert [store.get(i) is not None for i in ids] == [False, True, False, True]
        assert store.total_bytes() == 2 * size_one + size_touch


def test_sweeper_thread_applies_retention_until_close(db_path: Path, clock: FakeClock) -> None:
    store = SqliteSessionStore(db_path, ephemeral_ttl_seconds=60, clock=clock)
    session = store.create(ephemeral=True)
    clock.advance(3600)
    sweeper = store.start_sweeper(interval_s=0.02)
    deadline = time.monotonic() + 10
    while store.get(session.id) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.get(session.id) is None
    later = store.create(ephemeral=True)
    clock.advance(3600)
    while store.get(later.id) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.get(later.id) is None
    assert sweeper.is_running
    store.close()
    assert not sweeper.is_running
    with pytest.raises(ArgosyError, match="closed"):
        store.get(session.id)


# ---- concurrency and durability ------------------------------------------------------------


def test_concurrent_writers_into_separate_and_shared_sessions(store: SqliteSessionStore) -> None:
    num_threads, num_appends = 8, 200
    shared = store.create()
    own = [store.create() for _ in range(num_threads)]
    returned: dict[str, list[int]] = {s.id: [] for s in [shared, *own]}
    returned_lock = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(num_threads + 1)
    is_writing = True

    def write(t: int) -> None:
        try:
            start.wait()
            for i in range(num_appends):
                target = shared.id if i % 2 else own[t].id
                seqs = store.append(target, [msg(f"{t}:{i}")])
                with returned_lock:
                    returned[target].extend(seqs)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def read_while_writing() -> None:
        try:
            start.wait()
            while is_writing:
                seqs = [e.seq for e in store.read(shared.id)]
                assert seqs == list(range(1, len(seqs) + 1))  # every snapshot gap-free
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(t,)) for t in range(num_threads)]
    reader = threading.Thread(target=read_while_writing)
    for thread in [*threads, reader]:
        thread.start()
    for thread in threads:
        thread.join()
    is_writing = False
    reader.join()
    assert errors == []

    shared_history = store.read(shared.id)
    num_shared = num_threads * num_appends // 2
    assert [e.seq for e in shared_history] == list(range(1, num_shared + 1))
    assert sorted(returned[shared.id]) == list(range(1, num_shared + 1))
    shared_texts = texts(store, shared.id)
    assert sorted(shared_texts) == sorted(
        f"{t}:{i}" for t in range(num_threads) for i in range(1, num_appends, 2)
    )
    for t in range(num_threads):  # each writer's own appends keep their order
        mine = [text for text in shared_texts if text.startswith(f"{t}:")]
        assert mine == [f"{t}:{i}" for i in range(1, num_appends, 2)]
    for t, session in enumerate(own):
        assert texts(store, session.id) == [f"{t}:{i}" for i in range(0, num_appends, 2)]
        assert returned[session.id] == list(range(1, num_appends // 2 + 1))
        assert store.get(session.id).last_seq == num_appends // 2  # type: ignore[union-attr]


_CRASHING_WRITER = textwrap.dedent(
    """
    import sys
    from argosy.sessions import MessageAppended, SpanGenerated, SqliteSessionStore

    store = SqliteSessionStore(sys.argv[1])
    session = store.create(metadata={"writer": "crash-test"})
    print("session", session.id, flush=True)
    i = 0
    while True:  # until killed
        batch = [
            MessageAppended(role="user", content=f"m{i}"),
            SpanGenerated(channel="text", text=f"s{i}" * 50, token_ids=list(range(20))),
            MessageAppended(role="assistant", content=f"a{i}"),
        ]
        seqs = store.append(session.id, batch)
        print("committed", *seqs, flush=True)  # only after COMMIT returned
        i += 1
    """
)


def test_events_committed_before_sigkill_survive_and_the_database_opens_cleanly(db_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    writer = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_WRITER, str(db_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )
    assert writer.stdout is not None
    reported: list[int] = []
    try:
        first = writer.stdout.readline().split()
        assert first[:1] == ["session"], writer.stderr.read() if writer.stderr else first
        session_id = first[1]
        while len(reported) < 300:
            line = writer.stdout.readline()
            assert line, "writer exited early"
            word, *seqs = line.split()
            assert word == "committed"
            reported.extend(int(s) for s in seqs)
        os.kill(writer.pid, signal.SIGKILL)  # mid-way: it keeps appending until this lands
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.wait(timeout=30)
        writer.stdout.close()
        if writer.stderr is not None:
            writer.stderr.close()
    assert writer.returncode == -signal.SIGKILL

    # the kill left the WAL unmerged: what follows reads the commits back through it
    assert db_path.with_name(db_path.name + "-wal").stat().st_size > 0
    assert raw(db_path, "PRAGMA integrity_check") == [("ok",)]
    with SqliteSessionStore(db_path) as store:
        history = store.read(session_id)
        committed = [e.seq for e in history]
        assert committed == list(range(1, len(committed) + 1))
        assert set(reported) <= set(committed)
        assert len(committed) % 3 == 0  # each 3-event append is all or nothing
        assert history[-1].event == MessageAppended(role="assistant", content=f"a{len(committed) // 3 - 1}")
        assert store.get(session_id).last_seq == len(committed)  # type: ignore[union-attr]
        assert store.append(session_id, [msg("after restart")]) == [len(committed) + 1]
    assert raw(db_path, "PRAGMA integrity_check") == [("ok",)]


def test_reopening_preserves_sessions_forks_and_hidden_parents(db_path: Path, clock: FakeClock) -> None:
    with SqliteSessionStore(db_path, clock=clock) as store:
        parent = store.create(metadata={"model": "tiny"}, events=EVERY_EVENT)
        child = store.fork(parent.id, at_event=4, ephemeral=True, events=[msg("c5")])
        store.delete(parent.id)
        child_history = store.read(child.id)
        child_info = store.get(child.id)
        kept = store.create(metadata={"k": [1, 2]}, events=[msg("k1")])

    with SqliteSessionStore(db_path, clock=clock) as store:
        assert store.get(parent.id) is None
        assert store.read(child.id) == child_history
        assert store.get(child.id) == child_info
        assert store.get(kept.id) == kept
        assert store.read(kept.id)[0].event == msg("k1")
        assert store.append(child.id, [msg("c6")]) == [6]


def test_schema_is_versioned_and_the_journal_is_wal(store: SqliteSessionStore, db_path: Path) -> None:
    assert raw(db_path, "SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
    assert raw(db_path, "PRAGMA journal_mode") == [("wal",)]


def test_a_newer_schema_or_a_foreign_file_refuses_to_open(tmp_path: Path) -> None:
    newer = tmp_path / "newer.db"
    SqliteSessionStore(newer).close()
    conn = sqlite3.connect(newer)
    conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(ArgosyError, match=f"schema version {SCHEMA_VERSION + 1}"):
        SqliteSessionStore(newer)

    foreign = tmp_path / "notes.txt"
    foreign.write_text("not a database, just text that is long enough to have a header " * 20)
    with pytest.raises(ArgosyError, match="cannot open session database"):
        SqliteSessionStore(foreign)


def test_retention_settings_are_validated(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="TTL"):
        SqliteSessionStore(tmp_path / "a.db", ttl_seconds=0)
    with pytest.raises(InvalidRequestError, match="max_sessions"):
        SqliteSessionStore(tmp_path / "a.db", max_sessions=-1)
    with pytest.raises(InvalidRequestError, match="file path"):
        SqliteSessionStore(":memory:")
