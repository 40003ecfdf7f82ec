"""The app's screens: rounds, memory and server (its three modes), help, and the dialogs they open."""
