import sqlite3

import pytest

from supervisor.core.states import TERMINAL, TRANSITIONS, IllegalTransition, JobState
from supervisor.record.store import SCHEMA_VERSION, SchemaTooNew, Store


def make(tmp_path):
    return Store(tmp_path / "s.sqlite3")


def test_public_state_names_are_stable():
    assert [s.value for s in JobState] == ["queued", "running", "waiting_retry", "interrupted",
                                          "succeeded", "failed", "cancelled"]
    assert {s.value for s in TERMINAL} == {"succeeded", "failed", "cancelled"}
    assert set(TRANSITIONS) == set(JobState)


def test_transition_checks_table_and_records_event(tmp_path):
    st = make(tmp_path)
    j = st.add_job(name="a", kind="command", priority=0, policy=None, workdir="/", source="x", spool_key="k")
    st.transition(j, JobState.RUNNING, "attempt 1 started")
    with pytest.raises(IllegalTransition, match="running -> queued is not allowed"):
        st.transition(j, JobState.QUEUED, "nope")
    st.transition(j, JobState.SUCCEEDED, "done")
    with pytest.raises(IllegalTransition, match="terminal"):
        st.transition(j, JobState.RUNNING, "again")
    kinds = [(e.kind, e.message) for e in st.events(j)]
    assert kinds[0][0] == "state" and "queued" in kinds[0][1]
    assert ("state", "queued -> running: attempt 1 started") in kinds
    assert ("state", "running -> succeeded: done") in kinds
    assert st.job(j).state == JobState.SUCCEEDED


def test_failed_transition_leaves_no_trace(tmp_path):
    st = make(tmp_path)
    j = st.add_job(name="a", kind="command", priority=0, policy=None, workdir="/", source=None, spool_key=None)
    n = len(st.events(j))
    with pytest.raises(IllegalTransition):
        st.transition(j, JobState.SUCCEEDED, "skip running")
    assert len(st.events(j)) == n and st.job(j).state == JobState.QUEUED


def test_durability_pragmas_and_schema_version(tmp_path):
    st = make(tmp_path)
    assert st.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert st.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert st.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    st.close()
    Store(tmp_path / "s.sqlite3").close()  # reopening migrates nothing and keeps the data


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "s.sqlite3"
    Store(path).close()
    c = sqlite3.connect(path)
    c.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    c.commit()
    c.close()
    with pytest.raises(SchemaTooNew, match="Upgrade oom-supervisor"):
        Store(path)


def test_nested_transaction_rolls_back_whole(tmp_path):
    st = make(tmp_path)
    with pytest.raises(RuntimeError), st.tx():
        st.add_job(name="a", kind="command", priority=0, policy=None, workdir="/", source=None, spool_key=None)
        raise RuntimeError("crash before commit")
    assert st.jobs() == []


def test_concurrent_first_open_migrates_once(tmp_path):
    """The daemon and a CLI command may create the database at the same moment. Switching a new
    file to WAL takes an exclusive lock, and SQLite answers a second switch 'database is locked'
    at once, without its busy handler: 8 threads at once on a fresh file, 150 times (it failed
    ~1 round in 30 before the switch was retried; seen once in CI)."""
    import threading

    errors = []
    barrier = threading.Barrier(8)

    def open_it(path):
        try:
            barrier.wait()
            Store(path).close()
        except Exception as exc:  # noqa: BLE001 - the failure being tested for is any exception of another thread
            errors.append(exc)

    for round_ in range(150):
        path = tmp_path / f"race-{round_}.sqlite3"
        threads = [threading.Thread(target=open_it, args=(path,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], f"round {round_}"
        assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_state_file_from_before_owners_opens_and_its_jobs_have_none(tmp_path):
    """Schema 3 (no owner columns): migrated on open; its jobs ran as the daemon's user."""
    from supervisor.record.store import MIGRATIONS, _statements

    path = tmp_path / "old.sqlite3"
    c = sqlite3.connect(path)
    for script in MIGRATIONS[:3]:
        for stmt in _statements(script):
            c.execute(stmt)
    c.execute("INSERT INTO jobs(name, kind, state, workdir, submitted_at, updated_at) "
              "VALUES('old', 'command', 'succeeded', '/', 1, 1)")
    c.execute("PRAGMA user_version=3")
    c.commit()
    c.close()
    st = Store(path)
    job = st.job(1)
    assert (job.name, job.owner_uid, job.owner) == ("old", None, None)
    assert st.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    new = st.add_job(name="n", kind="command", priority=0, policy=None, workdir="/", source=None,
                     spool_key=None, owner_uid=1234, owner="alice")
    assert (st.job(new).owner_uid, st.job(new).owner) == (1234, "alice")
