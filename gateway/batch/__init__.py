"""Files and batches: the SQLite store, the runner that answers lines through the operations, and their routes."""
