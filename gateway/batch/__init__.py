"""Files and batches: the SQLite store, the runner that replays lines through the routes, and their routes."""
