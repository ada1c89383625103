"""No speculation: every step verifies the root alone (plain decoding)."""

from .base import Draft


class NoDrafter:
    name = "none"

    def begin(self, req: str, prompt_ids: list[int]) -> None:
        pass

    def propose(self, req: str, budget: int) -> Draft:
        return Draft()

    def observe(self, req: str, emitted_ids: list[int]) -> None:
        pass

    def end(self, req: str) -> None:
        pass
