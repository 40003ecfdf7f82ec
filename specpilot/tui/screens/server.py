"""Server: a running `specpilot serve` (or any SGLang-compatible server) polled once a second: throughput,
accept length and its histogram, running and queued requests, and the step's time split (draft / verify /
other, per poll) as sparklines; a prompt box streams a generation with every token coloured by how it came.
A server that goes away is shown as such and polled until it answers again."""

from __future__ import annotations

from collections import deque

import httpx
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Input, Label, Sparkline

from specpilot.tui.screens.closing import while_shown
from specpilot.tui.client import ServerClient, ServerState
from specpilot.tui.widgets import Histogram, TokenView

POLL_S = 1.0
HISTORY = 120  # polls each sparkline keeps
SERIES = {"throughput": "throughput (tok/s)", "accept": "accept length (tok/pass)", "running": "running requests",
          "waiting": "queued requests", "draft": "draft share of step", "verify": "verify share of step",
          "other": "host share of step"}


class ServerScreen(Screen):
    AUTO_FOCUS = ""  # nothing: printable keys reach the bindings until an input is clicked (or ctrl+g)
    BINDINGS = [("ctrl+g", "focus_prompt", "Prompt"), ("escape", "blur", "Leave the input")]

    def __init__(self) -> None:
        super().__init__()
        self.url = ""  # the app's --server until the user connects elsewhere
        self.client: ServerClient | None = None
        self.connected: bool | None = None  # None: never polled
        self.series: dict[str, deque[float]] = {k: deque(maxlen=HISTORY) for k in SERIES}
        self._last_time: dict[str, float] | None = None

    def compose(self) -> ComposeResult:
        self.url = self.app.server_url
        yield Header()
        with Horizontal(id="server-bar"):
            yield Input(self.url, placeholder="http://127.0.0.1:30000", id="url")
            yield Button("Connect", id="connect", variant="primary")
            yield Label("", id="server-state")
        with Horizontal(id="server-body"):
            with Grid(id="sparks"):
                for key, title in SERIES.items():
                    with Vertical(classes="spark"):
                        yield Label(title, id=f"label-{key}")
                        yield Sparkline([], id=f"spark-{key}")
            with Vertical(id="histogram-box"):
                yield Label("accept length histogram", classes="section")
                yield Histogram(id="histogram")
        with Vertical(id="generate-box"):
            yield Input(placeholder="a prompt: Enter streams a generation (ctrl+g)", id="prompt")
            yield Label("", id="legend")
            yield VerticalScroll(TokenView(id="tokens"))
        yield Footer()

    def on_mount(self) -> None:
        self.connect(self.url)
        self.set_interval(POLL_S, self.poll)

    def connect(self, url: str) -> None:
        if self.client is not None:
            self.client.close()
        self.url, self.client, self.connected, self._last_time = url, ServerClient(url), None, None
        for values in self.series.values():
            values.clear()
        self.poll()

    @on(Button.Pressed, "#connect")
    @on(Input.Submitted, "#url")
    def _connect(self) -> None:
        self.connect(self.query_one("#url", Input).value.strip())

    def action_blur(self) -> None:
        self.set_focus(None)

    def action_focus_prompt(self) -> None:
        self.query_one("#prompt", Input).focus()

    @work(thread=True, exclusive=True, group="server-poll", exit_on_error=False)
    def poll(self) -> None:
        client = self.client
        if client is None:
            return
        try:
            state: ServerState | Exception = client.state()
        except (httpx.HTTPError, ValueError) as err:
            state = err
        self.app.call_from_thread(self._apply, client, state)

    @while_shown
    def _apply(self, client: ServerClient, state: ServerState | Exception) -> None:
        if client is not self.client:  # a poll of the server before a reconnect
            return
        label = self.query_one("#server-state", Label)
        if isinstance(state, Exception):
            if self.connected is not False:
                self.notify(f"{self.url}: not answering ({type(state).__name__}); retrying every {POLL_S:.0f} s",
                            severity="warning" if self.connected is None else "error", title="server")
            self.connected = False
            label.update(f"[red]● disconnected from {self.url}: retrying[/]")
            return
        if self.connected is False:
            self.notify(f"{self.url} is back", title="server")
        self.connected = True
        label.update(f"[green]● {state.model} · {state.algorithm or 'AR'}[/]")
        split = self._split(state.time_s)
        values = {"throughput": state.throughput, "accept": state.accept_length, "running": float(state.running),
                  "waiting": float(state.waiting), **split}
        for key, value in values.items():
            self.series[key].append(value)
            self.query_one(f"#spark-{key}", Sparkline).data = list(self.series[key])
            shown = f"{value:.0%}" if key in ("draft", "verify", "other") else f"{value:.2f}"
            self.query_one(f"#label-{key}", Label).update(f"{SERIES[key]}: [b]{shown}[/]")
        self.query_one(Histogram).show(state.histogram)

    def _split(self, time_s: dict[str, float]) -> dict[str, float]:
        """Each part's share of the step time spent since the last poll (zeros while idle)."""
        last, self._last_time = self._last_time, dict(time_s)
        delta = {k: time_s.get(k, 0.0) - (last or {}).get(k, 0.0) for k in ("draft", "verify", "other")}
        total = sum(delta.values())
        if last is None or total <= 0:
            return dict.fromkeys(delta, 0.0)
        return {k: v / total for k, v in delta.items()}

    @on(Input.Submitted, "#prompt")
    def _prompt(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.generate(event.value, 128)

    @work(thread=True, exclusive=True, group="server-generate", exit_on_error=False)
    def generate(self, prompt: str, max_new_tokens: int) -> None:
        client = ServerClient(self.url, timeout=30.0)
        try:
            for chunk in client.stream(prompt, max_new_tokens):
                self.app.call_from_thread(self._show_chunk, chunk.texts, chunk.origins, chunk.text)
        except (httpx.HTTPError, RuntimeError, ValueError) as err:
            self.app.call_from_thread(self.app.report, err, "generate")
        finally:
            client.close()

    @while_shown
    def _show_chunk(self, texts: list[str], origins: list[str], text: str) -> None:
        self.query_one(TokenView).show(texts, origins, text)
        legend = TokenView.legend(origins) if origins else Text("this server gives no token origins", style="dim")
        self.query_one("#legend", Label).update(legend)
