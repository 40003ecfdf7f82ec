"""A streamed generation with each token coloured by how it came: an accepted draft, the bonus token that
ends a verify pass, n-gram assist's lookup, or the target alone (prefill, plain decoding)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

ORIGIN_STYLES = {"draft": "bold green", "bonus": "bold yellow", "ngram": "bold magenta", "target": "bold blue"}


class TokenView(Static):
    texts: list[str] = []  # what is shown: each token's text and origin
    origins: list[str] = []

    def show(self, texts: list[str], origins: list[str], fallback: str = "") -> None:
        """`texts` and `origins` per token; where the server gives no per-token texts, `fallback` uncoloured."""
        self.texts, self.origins = texts, origins
        text = Text()
        if texts:
            for piece, origin in zip(texts, origins + ["target"] * (len(texts) - len(origins))):
                text.append(piece, style=ORIGIN_STYLES.get(origin, ""))
        else:
            text.append(fallback)
        self.update(text)

    @staticmethod
    def legend(origins: list[str]) -> Text:
        """Each origin's colour with its count in this generation."""
        text = Text()
        for origin, style in ORIGIN_STYLES.items():
            text.append(f" {origin} ", style=f"reverse {style}")
            text.append(f" {origins.count(origin)}  ")
        return text
