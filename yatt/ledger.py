"""The ledger: the one durable record of what happened to every group key.

Exactly-once rests on it. Every decision of the buffer (accepted, filtered with the
reason, stale-dropped, superseded, duplicate, trained at step k) is appended to an SQLite
database in WAL mode with ``synchronous=FULL`` (an fsync per commit) *before* the decision
is acknowledged, so a restarted process never forgets a group that a later training step
already used. It is copied whole into each checkpoint (SQLite's online backup), so a
resumed run continues from exactly the decisions the checkpoint had.

An fsync costs ~10 ms on this machine's disk, once per commit. With ``group_commit`` the
records since the last ``commit()`` share one transaction: the buffer decides every
message that has arrived, commits once, and only then acknowledges them all.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from protocols.messages import GroupKey

Status = Literal["accepted", "filtered", "stale", "superseded", "duplicate", "trained"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS decisions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    epoch INTEGER NOT NULL,
    shard INTEGER NOT NULL,
    prompt_index INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    status TEXT NOT NULL,
    reason TEXT NOT NULL,
    step INTEGER,
    policy_version INTEGER,
    time REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS by_key ON decisions (epoch, shard, prompt_index, attempt);
"""


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One row of the ledger."""

    key: GroupKey
    status: Status
    reason: str
    step: int | None
    policy_version: int | None


class Ledger:
    """An append-only log of group decisions in one SQLite file."""

    def __init__(self, path: str | Path, *, group_commit: bool = False) -> None:
        self.path = Path(path)
        self.group_commit = group_commit
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def record(
        self,
        key: GroupKey,
        status: Status,
        reason: str = "",
        *,
        step: int | None = None,
        policy_version: int | None = None,
    ) -> None:
        """Append one decision; durable when this returns, or with ``group_commit`` at the next ``commit()``."""
        if self.group_commit and not self._db.in_transaction:
            self._db.execute("BEGIN")
        self._db.execute(
            "INSERT INTO decisions (epoch, shard, prompt_index, attempt, status, reason, step, policy_version, time)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (key.epoch, key.shard, key.prompt_index, key.attempt, status, reason, step, policy_version, time.time()),
        )

    @property
    def pending(self) -> bool:
        """Records not yet committed (``group_commit`` only)."""
        return self._db.in_transaction

    def commit(self) -> None:
        """Make every record so far durable (one fsync); nothing to do without ``group_commit``."""
        if self._db.in_transaction:
            self._db.execute("COMMIT")

    def entries(self, status: Status | None = None) -> list[Entry]:
        """Every decision in the order it was made (optionally of one status)."""
        query = "SELECT epoch, shard, prompt_index, attempt, status, reason, step, policy_version FROM decisions"
        args: tuple[str, ...] = ()
        if status is not None:
            query += " WHERE status = ?"
            args = (status,)
        rows = self._db.execute(query + " ORDER BY seq", args).fetchall()
        return [
            Entry(
                key=GroupKey(epoch=r[0], shard=r[1], prompt_index=r[2], attempt=r[3]),
                status=r[4],
                reason=r[5],
                step=r[6],
                policy_version=r[7],
            )
            for r in rows
        ]

    def backup_to(self, path: str | Path) -> None:
        """Write a consistent copy of the whole ledger to ``path`` (for checkpoints)."""
        self.commit()
        target = sqlite3.connect(Path(path))
        try:
            self._db.backup(target)
        finally:
            target.close()

    def restore_from(self, path: str | Path) -> None:
        """Replace the ledger's contents with the copy at ``path`` (on resume)."""
        self.commit()
        source = sqlite3.connect(Path(path))
        try:
            source.backup(self._db)
        finally:
            source.close()

    def close(self) -> None:
        self.commit()
        self._db.close()
