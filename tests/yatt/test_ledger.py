"""The ledger's group commit: records are invisible to other readers (and to a restarted
process) until ``commit()``, and durable after it; without group commit every record is."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from protocols.messages import GroupKey
from yatt.ledger import Ledger


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
    ledger.backup_to(tmp_path / "copy.db")  # a checkpoint commits first
    assert _count(tmp_path / "copy.db") == 3
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
