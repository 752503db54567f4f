"""The ledger: the one durable record of what happened to every group key, and the
buffer's source of truth.

Exactly-once rests on it. Every decision of the buffer (accepted, filtered with the
reason, stale-dropped, superseded, duplicate, trained at step k) is appended to an SQLite
database in WAL mode with ``synchronous=FULL`` (an fsync per commit) *before* the decision
is acknowledged, so a restarted process never forgets a group that a later training step
already used. The buffer's inputs are in it too: every accepted or filtered group with
its payload (the encoded ``ScoredGroup``), and every policy version the trainer published
(``version`` rows). The buffer's decisions are a function of those inputs in order, so a
restarted buffer rebuilds its whole state by replaying them (``events``).

Rows are never rewritten. Going back to a checkpoint appends a ``rewind`` row that voids
every row after the checkpoint's ``mark`` (the last row it saw): ``entries`` and
``events`` show the run as it now stands, ``history`` everything that happened, the
rolled-back steps included.

A checkpoint's mark can carry a **snapshot**: the buffer's state at that row (a few keys
and counters, no payloads). A replay starts from the newest snapshot no rewind voided and
reads only the rows after it, so a restart or a rewind costs what happened since the last
checkpoint, not the whole run (``snapshot``, ``standing(after=)``).

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
from yatt.errors import StorageError, storage_error

Status = Literal[
    "accepted", "filtered", "stale", "superseded", "duplicate", "trained", "rolled_back", "version", "rewind"
]
GROUP_STATUSES = ("accepted", "filtered", "stale", "superseded", "duplicate", "trained", "rolled_back")
EVENT_STATUSES = ("accepted", "filtered", "rolled_back", "version", "rewind")
NO_KEY = GroupKey(epoch=-1, shard=-1, prompt_index=-1, attempt=-1)  # version and rewind rows

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
    time REAL NOT NULL,
    payload BLOB,
    mark INTEGER
);
CREATE INDEX IF NOT EXISTS by_key ON decisions (epoch, shard, prompt_index, attempt);
CREATE INDEX IF NOT EXISTS rewinds ON decisions (seq) WHERE status = 'rewind';
CREATE TABLE IF NOT EXISTS snapshots (
    seq INTEGER PRIMARY KEY,  -- the last row the state had seen (a checkpoint's mark)
    state BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS turns (  -- the finished turns of episodes in flight (yatt.rl.agents)
    epoch INTEGER NOT NULL,
    shard INTEGER NOT NULL,
    prompt_index INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    sample INTEGER NOT NULL,
    turn INTEGER NOT NULL,
    payload BLOB NOT NULL,
    PRIMARY KEY (epoch, shard, prompt_index, attempt, sample, turn)
);
"""


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One row of the ledger."""

    key: GroupKey
    status: Status
    reason: str
    step: int | None
    policy_version: int | None
    seq: int = 0
    payload: bytes | None = None
    mark: int | None = None


_COLUMNS = "seq, epoch, shard, prompt_index, attempt, status, reason, step, policy_version, payload, mark"


def _entry(r: tuple[object, ...]) -> Entry:
    return Entry(
        seq=r[0],  # type: ignore[arg-type]
        key=GroupKey(epoch=r[1], shard=r[2], prompt_index=r[3], attempt=r[4]),  # type: ignore[arg-type]
        status=r[5],  # type: ignore[arg-type]
        reason=r[6],  # type: ignore[arg-type]
        step=r[7],  # type: ignore[arg-type]
        policy_version=r[8],  # type: ignore[arg-type]
        payload=r[9],  # type: ignore[arg-type]
        mark=r[10],  # type: ignore[arg-type]
    )


def live(rows: list[Entry]) -> list[Entry]:
    """The rows not voided by a later ``rewind`` row (rewind rows themselves stay)."""
    voided: list[tuple[int, int]] = [(r.mark or 0, r.seq) for r in rows if r.status == "rewind"]
    return [r for r in rows if not _voided(r.seq, voided)]


def _voided(seq: int, rewinds: list[tuple[int, int]]) -> bool:
    """Whether a rewind ``(mark, its own seq)`` voided row ``seq``."""
    return any(mark < seq < at for mark, at in rewinds)


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
        payload: bytes | None = None,
        mark: int | None = None,
    ) -> None:
        """Append one row; durable when this returns, or with ``group_commit`` at the next ``commit()``."""
        try:
            if self.group_commit and not self._db.in_transaction:
                self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO decisions (epoch, shard, prompt_index, attempt, status, reason, step, policy_version,"
                " time, payload, mark) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (key.epoch, key.shard, key.prompt_index, key.attempt, status, reason, step, policy_version,
                 time.time(), payload, mark),
            )  # fmt: skip
        except sqlite3.Error as e:
            raise storage_error(self.path, e) from e

    def version(self, version: int) -> None:
        """The trainer published the weights of ``version`` (an input of the buffer's decisions)."""
        self.record(NO_KEY, "version", policy_version=version)

    def mark(self, snapshot: bytes | None = None) -> int:
        """The last row so far: what a checkpoint records to come back to; with ``snapshot``,
        the buffer's state at that row, kept for a later replay to start from. Committed
        (with every record before it) when this returns."""
        try:
            mark = int(self._db.execute("SELECT MAX(seq) FROM decisions").fetchone()[0] or 0)
            if snapshot is not None and mark:
                if self.group_commit and not self._db.in_transaction:
                    self._db.execute("BEGIN")
                self._db.execute("INSERT OR REPLACE INTO snapshots (seq, state) VALUES (?, ?)", (mark, snapshot))
        except sqlite3.Error as e:
            raise storage_error(self.path, e) from e
        self.commit()
        return mark

    def _rewinds(self) -> list[tuple[int, int]]:
        rows = self._db.execute("SELECT mark, seq FROM decisions WHERE status = 'rewind'").fetchall()
        return [(int(mark or 0), int(seq)) for mark, seq in rows]

    def snapshot(self) -> tuple[int, bytes] | None:
        """The newest snapshot that stands (its row not voided by a rewind): ``(seq, state)``."""
        rewinds = self._rewinds()
        for seq, state in self._db.execute("SELECT seq, state FROM snapshots ORDER BY seq DESC"):
            if not _voided(seq, rewinds):
                return int(seq), bytes(state)
        return None

    def decided(self, keys: list[GroupKey], upto: int) -> dict[GroupKey, Entry]:
        """For each key, its newest ``accepted`` or ``filtered`` row (with its payload) at or
        before row ``upto``, a snapshot's row: the groups the snapshot names by key. That row
        stands: an older one of the same key a rewind voided was decided again after it."""
        found: dict[GroupKey, Entry] = {}
        for key in keys:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM decisions WHERE epoch = ? AND shard = ? AND prompt_index = ? AND attempt = ?"
                " AND seq <= ? AND status IN ('accepted', 'filtered') ORDER BY seq DESC LIMIT 1",
                (key.epoch, key.shard, key.prompt_index, key.attempt, upto),
            ).fetchone()
            if row is not None:
                found[key] = _entry(row)
        return found

    def rewind(self, mark: int, reason: str) -> None:
        """Void every row after ``mark`` (going back to a checkpoint); durable at once. The
        episodes' recorded turns go too: some were sampled by weights the rewind discards."""
        self.record(NO_KEY, "rewind", reason, mark=mark)
        self._write("DELETE FROM turns", ())
        self.commit()

    # ------------------------------------------------------------ episodes' turns

    def record_turn(self, key: GroupKey, sample: int, turn: int, payload: bytes) -> None:
        """Keep one finished turn of an episode in flight (the encoded ``TurnRecord``); a
        record of the same turn replaces it (an episode run again from its start, its
        environment not replaying the same). Durable when this returns, or with
        ``group_commit`` at the next ``commit()``."""
        self._write(
            "INSERT OR REPLACE INTO turns (epoch, shard, prompt_index, attempt, sample, turn, payload)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (key.epoch, key.shard, key.prompt_index, key.attempt, sample, turn, payload),
        )

    def turns(self, key: GroupKey) -> list[bytes]:
        """The recorded turns of ``key``'s episodes, by sample then turn."""
        rows = self._db.execute(
            "SELECT payload FROM turns WHERE epoch = ? AND shard = ? AND prompt_index = ? AND attempt = ?"
            " ORDER BY sample, turn",
            (key.epoch, key.shard, key.prompt_index, key.attempt),
        ).fetchall()
        return [bytes(payload) for (payload,) in rows]

    def turn_keys(self) -> list[GroupKey]:
        """The keys whose episodes have recorded turns."""
        rows = self._db.execute("SELECT DISTINCT epoch, shard, prompt_index, attempt FROM turns").fetchall()
        return [GroupKey(epoch=e, shard=s, prompt_index=p, attempt=a) for e, s, p, a in rows]

    def drop_turns(self, key: GroupKey, sample: int | None = None) -> None:
        """Forget ``key``'s turns (its group is decided, its episodes are in its payload), or
        one ``sample``'s (its episode runs again from the start)."""
        where = "epoch = ? AND shard = ? AND prompt_index = ? AND attempt = ?"
        args: tuple[int, ...] = (key.epoch, key.shard, key.prompt_index, key.attempt)
        if sample is not None:
            where, args = f"{where} AND sample = ?", (*args, sample)
        self._write(f"DELETE FROM turns WHERE {where}", args)

    def _write(self, sql: str, args: tuple[object, ...]) -> int:
        """One write in the current transaction (``group_commit``) or on its own; the rows it changed."""
        try:
            if self.group_commit and not self._db.in_transaction:
                self._db.execute("BEGIN")
            return int(self._db.execute(sql, args).rowcount)
        except sqlite3.Error as e:
            raise storage_error(self.path, e) from e

    def empty(self) -> bool:
        return int(self._db.execute("SELECT COUNT(*) FROM decisions").fetchone()[0]) == 0

    @property
    def pending(self) -> bool:
        """Records not yet committed (``group_commit`` only)."""
        return self._db.in_transaction

    def commit(self) -> None:
        """Make every record so far durable (one fsync); nothing to do without ``group_commit``."""
        if self._db.in_transaction:
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as e:  # what was not committed is not decided: the process must go
                raise storage_error(self.path, e) from e

    def history(self) -> list[Entry]:
        """Every row in order, voided ones included (payloads left out)."""
        rows = self._db.execute(f"SELECT {_COLUMNS.replace('payload', 'NULL')} FROM decisions ORDER BY seq").fetchall()
        return [_entry(r) for r in rows]

    def entries(self, status: Status | None = None) -> list[Entry]:
        """The decisions on groups that stand (none a rewind voided), in the order they were
        made; optionally of one status."""
        rows = live(self.history())
        return [r for r in rows if r.status in GROUP_STATUSES and (status is None or r.status == status)]

    def events(self) -> list[Entry]:
        """The buffer's inputs that stand, in order: the groups it decided on (accepted,
        filtered, rolled back) with their payload, published versions and rewinds."""
        return [r for r in self.standing() if r.status in EVENT_STATUSES]

    def standing(self, after: int = 0) -> list[Entry]:
        """Every row no rewind voided, in order, payloads included (one read for a replay's
        events and its counts); only those after row ``after``, a row that stands (a
        snapshot's): a rewind before it voided nothing after it."""
        rows = self._db.execute(f"SELECT {_COLUMNS} FROM decisions WHERE seq > ? ORDER BY seq", (after,)).fetchall()
        return live([_entry(r) for r in rows])

    def close(self) -> None:
        """Commit and close; what cannot be committed (a full disk) is rolled back."""
        try:
            self.commit()
        except StorageError:
            self._db.rollback()
        finally:
            self._db.close()
