"""A response's output items, built from the pieces of its output text (content and tool-call
deltas, as the tool-call parser writes them), and the Responses API's stream events that
building them emits, numbered by `sequence_number`. A whole response is built the same way
(its events left unsent), so a stream always assembles into the non-streamed answer."""

from __future__ import annotations

from typing import Any

from replaylm.entrypoints.openai_chat_protocol import ChatMessage, FunctionCall, ToolCall
from replaylm.entrypoints.responses_output import (
    FunctionCallItem,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
)
from replaylm.entrypoints.tool_call_parser import Delta

Event = dict[str, Any]


class OutputBuilder:
    """`feed(piece) -> events` for each piece of output text, then `close(status) -> events`."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._seq = 0

    def event(self, kind: str, **fields: Any) -> Event:
        """The next event of the stream."""
        out = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return out

    def feed(self, piece: Delta) -> list[Event]:
        events: list[Event] = []
        if piece.get("content"):
            if not isinstance(self._open, OutputMessage):
                events += self._close("completed") + self._open_message()
            message = self._current(OutputMessage)
            message.content[0].text += piece["content"]
            events.append(
                self._item_event(
                    "response.output_text.delta",
                    content_index=0,
                    delta=piece["content"],
                    logprobs=[],
                )
            )
        for entry in piece.get("tool_calls", []):
            if "id" in entry:  # a new call: its id and name come first, then its arguments
                events += self._close("completed")
                call = FunctionCallItem(call_id=entry["id"], name=entry["function"]["name"])
                events.append(self._add(call))
            delta = entry["function"].get("arguments")
            if delta:
                self._current(FunctionCallItem).arguments += delta
                events.append(
                    self._item_event("response.function_call_arguments.delta", delta=delta)
                )
        return events

    def close(self, status: ItemStatus) -> list[Event]:
        """The events closing the output; an output with nothing in it is one empty message."""
        events = [] if self.items else self._open_message()
        return events + self._close(status)

    def chat_message(self) -> ChatMessage:
        """The output as the assistant's message of a later turn's conversation."""
        text = "".join(
            part.text
            for item in self.items
            if isinstance(item, OutputMessage)
            for part in item.content
        )
        calls = [
            ToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            for item in self.items
            if isinstance(item, FunctionCallItem)
        ]
        return ChatMessage(
            role="assistant", content=text if text or not calls else None, tool_calls=calls or None
        )

    def _current(self, kind: type[OutputItem]) -> Any:
        assert isinstance(self._open, kind), "the parser's deltas come in order"
        return self._open

    def _item_event(self, kind: str, **fields: Any) -> Event:
        assert self._open is not None
        return self.event(kind, item_id=self._open.id, output_index=len(self.items) - 1, **fields)

    def _add(self, item: OutputItem) -> Event:
        self.items.append(item)
        self._open = item
        return self.event(
            "response.output_item.added", output_index=len(self.items) - 1, item=item.model_dump()
        )

    def _open_message(self) -> list[Event]:
        message = OutputMessage()
        added = self._add(message)  # the item as added has no content part yet
        message.content.append(OutputText())
        part = self._item_event(
            "response.content_part.added", content_index=0, part=OutputText().model_dump()
        )
        return [added, part]

    def _close(self, status: ItemStatus) -> list[Event]:
        item = self._open
        if item is None:
            return []
        events: list[Event] = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events.append(
                self._item_event(
                    "response.output_text.done", content_index=0, text=part.text, logprobs=[]
                )
            )
            events.append(
                self._item_event(
                    "response.content_part.done", content_index=0, part=part.model_dump()
                )
            )
            item.status = status
        else:
            events.append(
                self._item_event("response.function_call_arguments.done", arguments=item.arguments)
            )
            item.status = "completed"  # a call in the output is whole (the parser checked it)
        events.append(
            self.event(
                "response.output_item.done",
                output_index=len(self.items) - 1,
                item=item.model_dump(),
            )
        )
        self._open = None
        return events
