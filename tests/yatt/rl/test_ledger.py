"""The ledger's group commit: records are invisible to other readers (and to a restarted
process) until ``commit()``, and durable after it; without group commit every record is."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from protocols.messages import GroupKey
from yatt.errors import StorageError
from yatt.rl.ledger import Ledger


def _count(path: Path) -> int:
    """What another process would read from the file."""
    db = sqlite3.connect(path)
    try:
        return int(db.execute("SELECT COUNT(*) FROM decisions").fetchone()[0])
    finally:
        db.close()


def _key(i: int) -> GroupKey:
    return GroupKey(epoch=0, shard=0, prompt_index=i, attempt=0)


def test_group_commit_makes_records_durable_together(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(path, group_commit=True)
    assert not ledger.pending
    ledger.record(_key(0), "accepted")
    ledger.record(_key(1), "filtered", "all rewards equal")
    assert ledger.pending
    assert _count(path) == 0  # not on disk yet: nobody may be told of them
    assert [e.key.prompt_index for e in ledger.entries()] == [0, 1]  # the buffer itself sees them
    ledger.commit()
    assert not ledger.pending
    assert _count(path) == 2
    ledger.commit()  # nothing pending: a no-op
    ledger.record(_key(2), "accepted")
    assert ledger.mark() == 3  # a checkpoint's mark commits first
    assert _count(path) == 3
    ledger.record(_key(3), "accepted")
    ledger.close()  # and so does closing
    assert _count(path) == 4


def test_without_group_commit_every_record_is_durable_at_once(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = Ledger(path)
    ledger.record(_key(0), "accepted")
    assert not ledger.pending
    assert _count(path) == 1
    ledger.close()


def test_a_rewind_voids_the_rows_after_the_mark_and_keeps_them_in_the_history(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.db")
    ledger.record(_key(0), "trained", step=0)
    mark = ledger.mark()
    ledger.record(_key(1), "trained", step=1)
    ledger.rewind(mark, "resumed from step_1")
    ledger.record(_key(2), "trained", step=1)
    assert [e.key.prompt_index for e in ledger.entries("trained")] == [0, 2]
    assert [e.status for e in ledger.history()] == ["trained", "trained", "rewind", "trained"]
    assert [e.status for e in ledger.events()] == ["rewind"]
    ledger.close()


def test_a_full_disk_is_a_storage_error_that_says_so(tmp_path: Path) -> None:
    """SQLite's own limit stands in for a full disk: the same SQLITE_FULL error."""
    ledger = Ledger(tmp_path / "ledger.db", group_commit=True)
    ledger.record(_key(0), "accepted")
    ledger.commit()
    pages = ledger._db.execute("PRAGMA page_count").fetchone()[0]
    ledger._db.execute(f"PRAGMA max_page_count = {pages}")
    with pytest.raises(StorageError, match="no space left on device writing .*ledger.db"):
        for i in range(1, 1000):
            ledger.record(_key(i), "accepted", payload=bytes(4096))
        ledger.commit()
