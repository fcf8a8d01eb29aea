"""Errors the memory pools raise when asked for more than is free (the scheduler sizes its
batches to what is free, by admission and retraction)."""


class OutOfKVCacheError(RuntimeError):
    """Raised when an allocation asks for more KV slots than are free."""

    def __init__(self, need: int, available: int) -> None:
        super().__init__(f"KV cache exhausted: need {need} token slots, {available} free")
        self.need = need
        self.available = available


class OutOfRequestSlotsError(RuntimeError):
    """Raised when every row of the request-to-token table is in use."""

    def __init__(self, need: int, available: int) -> None:
        super().__init__(f"request table full: need {need} rows, {available} free")
        self.need = need
        self.available = available
