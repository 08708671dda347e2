"""core: the words every layer shares — typed errors and exit codes (errors), names from files as plain
identifiers (names), temporary model state: mode, buffers, seeds (state), the check protocol: tolerance, batch
sizes, the one output comparison (protocol), one thread for a small model's checks (threads).

May import: nothing else in graphgrow (the lowest layer; tests/test_architecture.py keeps the order).
"""
