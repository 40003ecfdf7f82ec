"""The command palette's provider: every action of the app by name, whichever screen is showing."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

# (title, action, help): run with App.run_action, so the palette and the keys do the same thing
ACTIONS = [
    ("Rounds", "show_mode('rounds')", "the optimizer's rounds: start, pause, resume, stop, watch"),
    ("Memory", "show_mode('memory')", "deployments, rounds, candidates, mechanisms"),
    ("Server", "show_mode('server')", "a running server's live state and a streamed generation"),
    ("Start a round", "start_round", "run specpilot optimize on the chosen deployment (detached)"),
    ("Pause the round", "pause_round", "SIGSTOP the optimizer's process group"),
    ("Resume the round", "resume_round", "SIGCONT a paused optimizer; or start again with --resume"),
    ("Stop the round", "stop_round", "SIGTERM: the candidate being judged finishes, the round is marked paused"),
    ("Export the selection", "export", "the marked (or filtered) candidates to a JSON file"),
    ("Compare two deployments", "compare", "their best profiles and gaps side by side"),
    ("Toggle light / dark", "toggle_dark", "switch between the light and the dark theme"),
    ("Help", "help", "the key bindings"),
    ("Screenshot", "screenshot_svg", "save an SVG of the screen beside the database"),
    ("Quit", "quit", "leave the app; a running round goes on"),
]


class ActionsProvider(Provider):
    async def discover(self) -> Hits:
        for title, action, help_text in ACTIONS:
            yield DiscoveryHit(title, partial(self.app.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, action, help_text in ACTIONS:
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(self.app.run_action, action), help=help_text)
