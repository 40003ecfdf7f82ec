"""`specpilot tui`: the Textual terminal app over the optimizer's memory, its rounds and a server."""
