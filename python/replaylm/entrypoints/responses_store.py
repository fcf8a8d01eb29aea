"""The stored responses of `/v1/responses`, in memory: each with the conversation it closed
(input and output as chat messages), so that a later request can continue it. Bounded: past
`capacity`, the oldest is dropped (memory stays fixed however long the server runs)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

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
