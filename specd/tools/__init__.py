"""Tools above the daemon: sweep, load, replay and demo."""
