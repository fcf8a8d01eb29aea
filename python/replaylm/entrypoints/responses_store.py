"""The stored responses of `/v1/responses`: each with the conversation it closed (input and
output as chat messages), so that a later request can continue it. In memory, or with several
front ends (`--api-server-count`) in an SQLite file they share, since a conversation's next
request may reach another front end. Bounded: past `capacity`, the oldest is dropped (memory
stays fixed however long the server runs)."""

from __future__ import annotations

import contextlib
import pickle
import sqlite3
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from replaylm.entrypoints.openai_chat_protocol import ChatMessage
from replaylm.entrypoints.responses_output import ResponseObject

DEFAULT_CAPACITY = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[ChatMessage]  # every earlier turn's input and output, then this one's


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.response.id] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


class SharedResponseStore:
    """ResponseStore's interface over an SQLite file at `path`, which every front end opens
    once `create` has made it (before they start: they would race for its schema's lock)."""

    def __init__(self, path: Path, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        # autocommit; several processes write: wait for each other's locks
        self._db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)

    @staticmethod
    def create(path: Path) -> None:
        """Make the store's file, its table and its write-ahead log (readers never wait)."""
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS responses "
                "(seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, item BLOB)"
            )

    def put(self, stored: StoredResponse) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO responses (id, item) VALUES (?, ?)",
            (stored.response.id, pickle.dumps(stored)),
        )
        self._db.execute(
            "DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM responses) - ?",
            (self.capacity,),
        )

    def get(self, response_id: str) -> StoredResponse | None:
        row = self._db.execute("SELECT item FROM responses WHERE id = ?", (response_id,)).fetchone()
        return pickle.loads(row[0]) if row else None

    def delete(self, response_id: str) -> bool:
        cursor = self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        return cursor.rowcount > 0
